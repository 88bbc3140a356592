"""``GET /metrics``: the node's status documents as Prometheus text, parsed back with prometheus_client's own
parser; any document shape gives parseable text; the API serves it as text, behind the same token."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from p2pswarm.api.metrics import exposition, metrics_route
from tests.procs import Swarm, small_batch_run, wait_until
from tests.test_api import http, running_api

STATS = {"uptime_s": 12.5, "connected_peers": ["a", "b"], "routing_table_size": 3, "records_held": 1,
         "connect": {"direct": {"attempts": 4, "successes": 3, "failures": 1}, "relay": {"attempts": 2},
                     "holepunch": None, "reused": 7},
         "pool": {"frames_sent": 10, "payload_bytes_sent": 2048, "relay": {"circuits": [{"peer": "x"}]},
                  "payload_bytes": {"/p2pswarm/activation/1.0.0": {"sent": 2000, "received": 48}}},
         "paths": {"a": "direct", "b": "relayed"},
         "rebalance": {"moves": 2},
         "relay": {"reservations_active": 5, "circuits_active": 2, "circuits_closed_at_duration": 1,
                   "refused": {"per_ip": 3}}}
SWARM = {"stage": 1, "tokens": 6912, "step": 27, "micro_batches": 27, "tokens_per_s": 2451.9,
         "train_loss_bpb": None, "heldout_bpb": 5.25, "engine": {"busy_fraction": 0.63},
         "inbound": {"items": 2, "capacity": 64, "refused": 0}, "delivery": {"sent": 30, "lost": 1},
         "router": {"failovers": 3}, "counts": {"explored": 4}}
DILOCO = {"stage": 1, "outer_round": 2, "bytes_sent": 2767648, "bytes_received": 100,
          "rejected_contributions": {"12D3KooWx": 2, "12D3KooWy": 1}, "counts": {"rounds": 2, "splits": 1}}
BACKUPS = {"held": [{"stage": 0}], "held_bytes": 4096, "refused": {"bad digest": 1}}
DOCS = {"/api/stats": STATS, "/api/swarm": SWARM, "/api/diloco": DILOCO, "/api/backups": BACKUPS}


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, every family's type checked against its samples' names."""
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        assert family.name.startswith("p2pswarm_") and family.type in ("counter", "gauge")
        for s in family.samples:
            assert s.name.endswith("_total") == (family.type == "counter"), s.name  # counters end in _total
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_the_documents_become_counters_and_gauges_with_their_labels():
    got = samples(exposition(DOCS))
    assert got[("p2pswarm_tokens_total", (("stage", "1"),))] == 6912
    assert got[("p2pswarm_heldout_loss_bits_per_byte", (("stage", "1"),))] == 5.25
    assert ("p2pswarm_train_loss_bits_per_byte", (("stage", "1"),)) not in got  # null: no sample
    assert got[("p2pswarm_connect_failures_total", (("path", "direct"),))] == 1
    assert got[("p2pswarm_connect_attempts_total", (("path", "relay"),))] == 2
    assert ("p2pswarm_connect_attempts_total", (("path", "holepunch"),)) not in got
    assert got[("p2pswarm_connected_peers", ())] == 2 and got[("p2pswarm_relay_circuits", ())] == 1
    assert got[("p2pswarm_outer_rounds_total", (("stage", "1"),))] == 2
    assert got[("p2pswarm_diloco_refused_contributions_total", (("stage", "1"),))] == 3
    assert got[("p2pswarm_diloco_events_total", (("event", "splits"), ("stage", "1")))] == 1
    assert got[("p2pswarm_failovers_total", (("stage", "1"),))] == 3
    assert got[("p2pswarm_micro_batches_lost_total", (("stage", "1"),))] == 1
    assert got[("p2pswarm_buffer_items", (("buffer", "inbound"), ("stage", "1")))] == 2
    assert got[("p2pswarm_moves_total", ())] == 2 and got[("p2pswarm_backups_held", ())] == 1
    assert got[("p2pswarm_relay_reservations", ())] == 5 and got[("p2pswarm_relay_service_circuits", ())] == 2
    assert got[("p2pswarm_relay_refused_total", (("reason", "per_ip"),))] == 3
    activation = (("direction", "sent"), ("protocol", "/p2pswarm/activation/1.0.0"))
    assert got[("p2pswarm_stream_payload_bytes_total", activation)] == 2000
    assert got[("p2pswarm_peers_by_path", (("path", "relayed"),))] == 1


def test_a_bootstrap_without_a_stage_has_only_the_node_families():
    names = {name for name, _ in samples(exposition({"/api/stats": STATS}))}
    assert "p2pswarm_uptime_seconds" in names and not any("tokens" in n or "outer" in n for n in names)
    assert exposition({}) == b""


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=20)
keys = st.sampled_from(sorted({*STATS, *SWARM, *DILOCO, *BACKUPS, "inbound", "outbound", "delivery"}))


@settings(max_examples=60, deadline=None)
@given(st.fixed_dictionaries({path: st.dictionaries(keys, json_values, max_size=8) for path in DOCS}))
def test_any_document_shape_gives_text_prometheus_can_parse(docs):
    assert all(isinstance(value, float) for value in samples(exposition(docs)).values())


def test_the_api_serves_metrics_as_text_behind_the_token():
    async def stats(params):
        return STATS

    routes = {"/api/stats": stats}
    routes["/metrics"] = metrics_route(routes)
    with running_api(routes, token="s3cret") as address:
        assert http(address, "/metrics")[0] == 401
        status, body = http(address, "/metrics", headers={"Authorization": "Bearer s3cret"})
        assert status == 200 and samples(body)[("p2pswarm_uptime_seconds", ())] == 12.5
        assert json.loads(http(address, "/api/stats", headers={"Authorization": "Bearer s3cret"})[1]) == STATS


def scrape(api: str) -> dict[tuple[str, tuple], float]:
    """The node's samples; {} while its API is not up yet."""
    try:
        with urllib.request.urlopen(f"http://{api}/metrics", timeout=10) as response:
            assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
            return samples(response.read())
    except OSError:  # (refused, or URLError: the node is still starting)
        return {}


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_training_peer_s_metrics_grow_as_it_trains(tmp_path):
    """A real peer training tiny-lm/1 alone: its tokens and steps counters grow from scrape to scrape."""
    pytest.importorskip("torch")
    swarm = Swarm(tmp_path)
    try:
        boot = swarm.bootstrap()
        _, api = swarm.join(boot, "0:8", "m0", *small_batch_run(tmp_path, "tiny-lm/1", 8))
        tokens = ("p2pswarm_tokens_total", (("stage", "0"),))
        first = wait_until(lambda: (lambda got: got if got.get(tokens, 0) > 0 else None)(scrape(api)), 120)
        assert first, "no tokens counted"
        assert wait_until(lambda: scrape(api).get(tokens, 0) > first[tokens], 60)
        assert ("p2pswarm_steps_total", (("stage", "0"),)) in first and ("p2pswarm_uptime_seconds", ()) in first
    finally:
        swarm.close()


def test_every_name_the_grafana_dashboard_charts_is_one_the_node_exports():
    dashboard = json.loads((Path(__file__).parent.parent / "docs" / "grafana-dashboard.json").read_text())
    exported = {name.removesuffix("_total") for name, _ in samples(exposition(
        {**DOCS, "/api/swarm": {**SWARM, "train_loss_bpb": 5.0}}))}
    charted = {name.removesuffix("_total") for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"p2pswarm_[a-z_]+", target["expr"])}
    assert charted and charted <= exported, charted - exported
