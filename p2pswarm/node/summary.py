"""One log line a minute per node: what it did in that minute and what is wrong, for a person to read.

Routine events (announcements, backup refreshes, each outer round, each held-out score) are logged at
DEBUG; this line is what a node says at INFO while nothing changes. ``summary_line`` is a pure function
of the node's status documents (the JSON routes ``/api/stats``, ``/api/swarm``, ``/api/diloco``,
``/api/backups``, ``/api/stages``) a minute apart, total over any shape as ``api/metrics.py`` is;
``log_summaries`` is the driver that reads them from the routes every ``SUMMARY_PERIOD`` seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import trio

from p2pswarm.api.http import Routes, read_docs

log = logging.getLogger("p2pswarm.node.summary")

SUMMARY_PERIOD = 60.0  # one line a minute: the bound for a joined peer's routine INFO lines
DOC_PATHS = ("/api/stats", "/api/swarm", "/api/diloco", "/api/backups", "/api/stages")
Docs = Mapping[str, Mapping]


def _get(doc: object, *keys: str) -> object:
    for key in keys:
        doc = doc.get(key) if isinstance(doc, Mapping) else None
    return doc


def _num(doc: object, *keys: str) -> float:
    value = _get(doc, *keys)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _delta(before: Docs, now: Docs, path: str, *keys: str) -> float:
    return max(0.0, _num(now.get(path), *keys) - _num(before.get(path), *keys))


def _count(value: object) -> int:
    return len(value) if isinstance(value, list | dict) else 0


def _total(doc: object) -> float:
    return sum(_num(v) for v in doc.values()) if isinstance(doc, Mapping) else 0.0


def training_part(before: Docs, now: Docs, seconds: float) -> list[str]:
    """A training peer's minute: tokens, steps, losses, outer rounds, DiLoCo bytes, lost and failovers."""
    swarm, diloco = now.get("/api/swarm"), now.get("/api/diloco")
    if not isinstance(swarm, Mapping):
        return []
    tokens = _delta(before, now, "/api/swarm", "tokens")
    parts = [f"stage {swarm.get('stage')}: {tokens:,.0f} tokens ({tokens / max(seconds, 1e-9):,.0f} tok/s), "
             f"step {_num(swarm, 'step'):.0f}"]
    if isinstance(swarm.get("train_loss_bpb"), int | float):
        parts.append(f"train loss {swarm['train_loss_bpb']:.3f} bpb")
    if isinstance(swarm.get("heldout_bpb"), int | float):
        parts.append(f"held-out {swarm['heldout_bpb']:.3f}")
    if isinstance(diloco, Mapping):
        rounds = _delta(before, now, "/api/diloco", "counts", "rounds")
        sent = _delta(before, now, "/api/diloco", "bytes_sent")
        parts.append(f"outer round {_num(diloco, 'outer_round'):.0f} ({rounds:.0f} done, {sent / 1e6:.2f} MB sent)")
    lost, failovers = _delta(before, now, "/api/swarm", "delivery", "lost"), _delta(
        before, now, "/api/swarm", "router", "failovers")
    parts.append(f"{lost:.0f} lost, {failovers:.0f} failovers")
    return parts


def node_part(before: Docs, now: Docs) -> list[str]:
    """Any node's minute: peers by path, the DHT, connections accepted and refused, a relay's service."""
    stats = now.get("/api/stats") or {}
    paths = _get(stats, "paths")
    kinds: dict[str, int] = {}
    for kind in paths.values() if isinstance(paths, Mapping) else ():
        kinds[str(kind)] = kinds.get(str(kind), 0) + 1
    peers = _count(_get(stats, "connected_peers"))
    by_path = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    parts = [f"{peers} peers" + (f" ({by_path})" if by_path else ""),
             f"routing table {_num(stats, 'routing_table_size'):.0f}"]
    accepted = _delta(before, now, "/api/stats", "inbound_connections", "accepted")
    refused = _delta(before, now, "/api/stats", "inbound_connections", "refused")
    if accepted or refused:
        parts.append(f"{accepted:.0f} connections accepted, {refused:.0f} refused")
    relay = _get(stats, "relay")
    if isinstance(relay, Mapping):
        refused = _total(relay.get("refused"))
        parts.append(f"relay: {_num(relay, 'reservations_active'):.0f} reservations, "
                     f"{_num(relay, 'circuits_active'):.0f} circuits, {refused:.0f} refused in all")
    return parts


def problems(before: Docs, now: Docs) -> list[str]:
    """What is wrong now, each with what it means or what the operator can do."""
    found = []
    stats, swarm = now.get("/api/stats") or {}, now.get("/api/swarm") or {}
    if not _get(stats, "connected_peers"):
        found.append("no peers connected (check --bootstrap and the network)")
    if _get(stats, "reachability") == "private" and not _get(stats, "circuit_addrs"):
        found.append("behind a NAT with no relay reservation: peers cannot dial us (pass --relay, or open a port)")
    if _get(swarm, "blocked"):
        found.append(f"not training: {_get(swarm, 'blocked')}")
    health = _get(now.get("/api/stages"), "health", "stages")
    for stage, level in sorted(health.items()) if isinstance(health, Mapping) else ():
        if level != "healthy":
            replicas = _num(now.get("/api/stages"), "stages", str(stage), "replicas")
            found.append(f"stage {stage} {level} ({replicas:.0f} live replicas)")
    lost = _delta(before, now, "/api/swarm", "delivery", "lost")
    if lost:
        found.append(f"{lost:.0f} micro-batches lost (a next-stage peer failed or was too slow)")
    rejected = _total(_get(now.get("/api/diloco"), "rejected_contributions")) - _total(
        _get(before.get("/api/diloco"), "rejected_contributions"))
    if rejected > 0:
        found.append(f"{rejected:.0f} DiLoCo contributions refused (see /api/diloco)")
    return found


def summary_line(role: str, before: Docs, now: Docs, seconds: float) -> str:
    """The line for the ``seconds`` between the documents ``before`` and ``now``."""
    wrong = problems(before, now)
    parts = [*training_part(before, now, seconds), *node_part(before, now)]
    return (f"last {seconds:.0f} s as {role}: " + "; ".join(parts)
            + "; " + ("problems: " + "; ".join(wrong) if wrong else "no problems"))


async def log_summaries(routes: Routes, role: str, period: float = SUMMARY_PERIOD) -> None:
    """Log ``summary_line`` every ``period`` seconds until cancelled."""
    before, since = await read_docs(routes, DOC_PATHS), trio.current_time()
    while True:
        await trio.sleep(period)
        now, at = await read_docs(routes, DOC_PATHS), trio.current_time()
        log.info("%s", summary_line(role, before, now, at - since))
        before, since = now, at
