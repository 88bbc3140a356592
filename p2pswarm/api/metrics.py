"""``GET /metrics``: the node's status documents as Prometheus text exposition (``prometheus_client``).

Nothing is counted twice: every figure is read, at scrape time, from the JSON documents the node
already serves (``/api/stats``, ``/api/swarm``, ``/api/diloco``, ``/api/backups``), so ``/metrics`` and
``p2pswarm status`` can never disagree. ``exposition`` is pure (documents in, text out); ``metrics_route``
awaits the routes a node has and hands their documents to it. A document a node does not serve (a
bootstrap trains nothing) gives no families; a value that is missing or null gives no sample.

Names follow Prometheus' conventions: a ``p2pswarm_`` prefix, the unit in the name (``_bytes``,
``_seconds``, ``_bits_per_byte``, ``_ratio``), ``_total`` on every counter; labels for the stage, the
connection path (``direct``, ``holepunch``, ``relay``), the buffer and the event. The families are listed
in ``docs/operators.md``; ``docs/grafana-dashboard.json`` charts them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from p2pswarm.api.http import Route, Routes, TextReply, read_docs

DOC_PATHS = ("/api/stats", "/api/swarm", "/api/diloco", "/api/backups")
PATHS = ("direct", "holepunch", "relay")  # how a connection was made (/api/stats "connect")
PREFIX = "p2pswarm_"
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"  # the classic text format every Prometheus reads (our
#   names are plain ASCII, so prometheus_client's text is that format whatever version it announces)

Docs = Mapping[str, Mapping]


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _sub(doc: Mapping, key: str) -> Mapping:
    """``doc[key]`` if it is a document, else an empty one (a part a node does not have)."""
    value = doc.get(key)
    return value if isinstance(value, Mapping) else {}


def _count(value: object) -> int | None:
    """How many entries a list or document holds (None: neither)."""
    return len(value) if isinstance(value, (list, tuple, Mapping)) else None


def _sum(value: object) -> float | None:
    """The sum of a document's numeric values (None: not a document)."""
    if not isinstance(value, Mapping):
        return None
    return sum(n for n in map(_number, value.values()) if n is not None)


class _Families:
    """The families of one scrape, in the order they are first named, one sample per label set."""

    def __init__(self) -> None:
        self.families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}

    def add(self, kind: str, name: str, doc: str, value: object, **labels: object) -> None:
        number = _number(value)
        if number is None:
            return
        key = PREFIX + name
        family = self.families.get(key)
        if family is None:
            family = self.families[key] = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                key, doc, labels=sorted(labels))
        family.add_metric([str(labels[k]) for k in sorted(labels)], number)

    def counter(self, name: str, doc: str, value: object, **labels: object) -> None:
        self.add("counter", name, doc, value, **labels)  # prometheus_client appends "_total"

    def gauge(self, name: str, doc: str, value: object, **labels: object) -> None:
        self.add("gauge", name, doc, value, **labels)


def _node(f: _Families, stats: Mapping) -> None:
    f.gauge("uptime_seconds", "Seconds since the node started", stats.get("uptime_s"))
    f.gauge("connected_peers", "Peers with an open connection", _count(stats.get("connected_peers")))
    f.gauge("dht_routing_table_peers", "Peers in the Kademlia routing table", stats.get("routing_table_size"))
    f.gauge("dht_records_held", "Stage records this node stores for the DHT", stats.get("records_held"))
    connect = _sub(stats, "connect")
    for path in PATHS:
        entry = _sub(connect, path)
        for outcome in ("attempts", "successes", "failures"):
            f.counter(f"connect_{outcome}", f"Outgoing connection {outcome} by path", entry.get(outcome), path=path)
    f.counter("connections_reused", "Dials answered by an open connection", connect.get("reused"))
    inbound = _sub(stats, "inbound_connections")
    f.gauge("inbound_connections", "Inbound connections open now", inbound.get("open"))
    f.counter("inbound_connections_accepted", "Inbound connections accepted", inbound.get("accepted"))
    f.counter("inbound_connections_refused", "Inbound connections refused by a limit", inbound.get("refused"))
    discovery = _sub(stats, "discovery")
    for key in ("lookups", "announces", "stores_accepted", "stores_failed", "invalid_records"):
        f.counter(f"dht_{key}", f"DHT {key.replace('_', ' ')}", discovery.get(key))
    control = _sub(stats, "control")
    for key in ("requests_sent", "requests_served", "requests_failed", "peers_dropped"):
        f.counter(f"control_{key}", f"Control protocol {key.replace('_', ' ')}", control.get(key))
    pool = _sub(stats, "pool")
    f.counter("stream_frames_sent", "Frames sent on pooled streams (every protocol)", pool.get("frames_sent"))
    f.counter("stream_frames_received", "Frames received on pooled streams", pool.get("frames_received"))
    f.counter("stream_payload_sent_bytes", "Payload bytes sent on pooled streams", pool.get("payload_bytes_sent"))
    by_protocol = _sub(pool, "payload_bytes")
    for protocol in sorted(str(p) for p in by_protocol):
        for direction in ("sent", "received"):
            f.counter("stream_payload_bytes", "Payload bytes on pooled streams by protocol and direction",
                      _sub(by_protocol, protocol).get(direction), protocol=protocol, direction=direction)
    f.gauge("relay_circuits", "Relayed circuits this node's pool uses", _count(_sub(pool, "relay").get("circuits")))
    paths = _sub(stats, "paths")
    for kind in ("direct", "holepunched", "relayed"):
        count = sum(v == kind for v in paths.values())
        f.gauge("peers_by_path", "Connected peers by the path to them", count, path=kind)
    rebalance = _sub(stats, "rebalance")
    f.counter("moves", "Moves of this peer to another stage (rebalancing)", rebalance.get("moves"))
    _relay(f, _sub(stats, "relay"))


def _relay(f: _Families, relay: Mapping) -> None:
    """A relay node's service (``nat/relay_service.RelayBook.stats``; empty on other nodes)."""
    f.gauge("relay_reservations", "Reservations this relay holds now", relay.get("reservations_active"))
    f.gauge("relay_service_circuits", "Circuits this relay carries now", relay.get("circuits_active"))
    f.counter("relay_circuits_closed_at_limit", "Circuits this relay ended at their time limit",
              relay.get("circuits_closed_at_duration"))
    refused = relay.get("refused")
    for reason, value in sorted(refused.items()) if isinstance(refused, Mapping) else ():
        f.counter("relay_refused", "Reservations and circuits this relay refused, by reason", value, reason=reason)


def _swarm(f: _Families, doc: Mapping) -> None:
    stage = doc.get("stage")
    f.counter("tokens", "Tokens trained into this stage's weights", doc.get("tokens"), stage=stage)
    f.counter("steps", "Optimizer steps of this stage", doc.get("step"), stage=stage)
    f.counter("micro_batches", "Micro-batches this stage computed", doc.get("micro_batches"), stage=stage)
    f.gauge("tokens_per_second", "Tokens per second, recent", doc.get("tokens_per_s"), stage=stage)
    f.gauge("train_loss_bits_per_byte", "Training loss (last stage)", doc.get("train_loss_bpb"), stage=stage)
    f.gauge("heldout_loss_bits_per_byte", "Held-out loss, latest round", doc.get("heldout_bpb"), stage=stage)
    engine = _sub(doc, "engine")
    f.gauge("engine_busy_ratio", "Share of time the engine computed", engine.get("busy_fraction"), stage=stage)
    for buffer in ("inbound", "outbound"):
        fill = _sub(doc, buffer)
        f.gauge("buffer_items", "Micro-batches waiting in a buffer", fill.get("items"), stage=stage, buffer=buffer)
        f.gauge("buffer_capacity_items", "A buffer's room", fill.get("capacity"), stage=stage, buffer=buffer)
        f.counter("buffer_refused", "Micro-batches a full buffer refused", fill.get("refused"), stage=stage,
                  buffer=buffer)
    delivery = _sub(doc, "delivery")
    for key in ("sent", "acked", "lost", "timeouts", "rerouted", "errors"):
        f.counter(f"micro_batches_{key}", f"Micro-batches {key} to the next stage", delivery.get(key), stage=stage)
    f.counter("failovers", "Sends that failed over to another peer", (_sub(doc, "router")).get("failovers"),
              stage=stage)
    _events(f, "swarm_events", "Swarm events by kind", doc.get("counts"), stage=stage)


def _diloco(f: _Families, doc: Mapping) -> None:
    stage = doc.get("stage")
    f.counter("outer_rounds", "DiLoCo outer rounds completed", doc.get("outer_round"), stage=stage)
    f.counter("diloco_sent_bytes", "Bytes sent in outer rounds", doc.get("bytes_sent"), stage=stage)
    f.counter("diloco_received_bytes", "Bytes received in outer rounds", doc.get("bytes_received"), stage=stage)
    f.counter("diloco_refused_contributions", "Contributions this replica refused",
              _sum(doc.get("rejected_contributions")), stage=stage)
    f.counter("diloco_communicating_seconds", "Seconds spent in outer rounds", doc.get("communicating_s"), stage=stage)
    served = _sub(doc, "snapshots_served")
    f.counter("snapshots_served_bytes", "Snapshot bytes served to other replicas", served.get("bytes"), stage=stage)
    _events(f, "diloco_events", "DiLoCo events by kind", doc.get("counts"), stage=stage)


def _backups(f: _Families, doc: Mapping) -> None:
    f.gauge("backups_held", "Other stages' agreed backups this node holds", _count(doc.get("held")))
    f.gauge("backups_held_bytes", "Bytes of the backups held", doc.get("held_bytes"))
    f.counter("backups_fetched_bytes", "Backup bytes fetched", doc.get("bytes_fetched"))
    f.counter("backups_served_bytes", "Backup bytes served", doc.get("bytes_served"))
    f.counter("backups_refused", "Backups or announcements refused", _sum(doc.get("refused")))


def _events(f: _Families, name: str, doc: str, counts: object, **labels: object) -> None:
    for event, value in sorted(counts.items()) if isinstance(counts, Mapping) else ():
        f.counter(name, doc, value, event=event, **labels)


def families(docs: Docs) -> list[Metric]:
    """The metric families of ``docs`` (path -> the document that route serves)."""
    f = _Families()
    for path, fill in (("/api/stats", _node), ("/api/swarm", _swarm), ("/api/diloco", _diloco),
                       ("/api/backups", _backups)):
        if isinstance(docs.get(path), Mapping):
            fill(f, docs[path])
    return list(f.families.values())


class _Collector:
    def __init__(self, metrics: Iterable[Metric]) -> None:
        self.metrics = list(metrics)

    def collect(self) -> Iterator[Metric]:
        return iter(self.metrics)


def exposition(docs: Docs) -> bytes:
    """``docs`` as Prometheus text exposition, version 0.0.4."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(families(docs)))
    return generate_latest(registry)


def metrics_route(routes: Routes) -> Route:
    """``GET /metrics`` over ``routes`` as they are when it is asked (a node adds its stage's later)."""
    async def metrics(params: dict[str, str]) -> TextReply:
        return TextReply(exposition(await read_docs(routes, DOC_PATHS)), CONTENT_TYPE)

    return metrics
