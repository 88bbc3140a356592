"""The node's one-line summary a minute (``node/summary.py``): what it did and what is wrong, from its status
documents; total over any document shape; and a real joined peer logs nothing routine at INFO beside it."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.node.summary import DOC_PATHS, summary_line
from tests.procs import Swarm, small_batch_run, wait_until

BEFORE = {"/api/stats": {"connected_peers": ["a"], "inbound_connections": {"accepted": 3, "refused": 0}},
          "/api/swarm": {"stage": 1, "tokens": 1000, "step": 10, "delivery": {"lost": 0}, "router": {"failovers": 1}},
          "/api/diloco": {"outer_round": 4, "counts": {"rounds": 4}, "bytes_sent": 1_000_000,
                          "rejected_contributions": {}}}
NOW = {"/api/stats": {"connected_peers": ["a", "b", "c"], "paths": {"a": "direct", "b": "direct", "c": "relayed"},
                      "routing_table_size": 5, "inbound_connections": {"accepted": 5, "refused": 1}},
       "/api/swarm": {"stage": 1, "tokens": 7000, "step": 70, "train_loss_bpb": 4.25, "heldout_bpb": 4.5,
                      "delivery": {"lost": 2}, "router": {"failovers": 4}},
       "/api/diloco": {"outer_round": 6, "counts": {"rounds": 6}, "bytes_sent": 2_500_000,
                       "rejected_contributions": {"x": 1}},
       "/api/stages": {"health": {"stages": {"0": "healthy", "1": "degraded"}}}}


def test_a_training_peer_s_minute_in_one_line():
    line = summary_line("join", BEFORE, NOW, 60.0)
    assert "\n" not in line and line.startswith("last 60 s as join: stage 1: 6,000 tokens (100 tok/s), step 70")
    for part in ("train loss 4.250 bpb", "held-out 4.500", "outer round 6 (2 done, 1.50 MB sent)",
                 "2 lost, 3 failovers", "3 peers (2 direct, 1 relayed)", "2 connections accepted, 1 refused",
                 "stage 1 degraded (0 live replicas)", "2 micro-batches lost", "1 DiLoCo contributions refused"):
        assert part in line, (part, line)


def test_a_quiet_bootstrap_says_it_has_no_problems_and_a_lonely_one_what_to_check():
    boot = {"/api/stats": {"connected_peers": ["a"], "routing_table_size": 1}}
    quiet = "last 60 s as bootstrap: 1 peers; routing table 1; no problems"
    assert summary_line("bootstrap", boot, boot, 60.0) == quiet
    alone = summary_line("join", {}, {"/api/stats": {"connected_peers": [], "reachability": "private"}}, 60.0)
    assert "no peers connected (check --bootstrap" in alone and "pass --relay" in alone


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=6),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=20)
keys = st.sampled_from(sorted({k for doc in NOW.values() for k in doc} | {"blocked", "relay", "health",
                                                                           "reachability"}))
docs_st = st.fixed_dictionaries({}, optional={p: st.dictionaries(keys, json_values, max_size=6) for p in DOC_PATHS})


@settings(max_examples=80, deadline=None)
@given(docs_st, docs_st, st.floats(0, 1e6))
def test_any_document_shapes_give_one_line(before, now, seconds):
    line = summary_line("join", before, now, seconds)
    assert isinstance(line, str) and line.startswith("last ")


ROUTINE_LOGGERS = ("p2pswarm.diloco.service", "p2pswarm.diloco.backup_service", "p2pswarm.swarm.losses",
                   "p2pswarm.dht.announcing", "p2pswarm.swarm.sender")


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_joined_peer_logs_its_summary_each_period_and_nothing_routine_at_info(tmp_path):
    """Two stages train (outer rounds, backups of each other, held-out rounds, announcements every 5 s):
    each peer's INFO lines are its summary once a period and no routine line of those services."""
    pytest.importorskip("torch")
    swarm = Swarm(tmp_path)
    try:
        boot = swarm.bootstrap()
        run = (*small_batch_run(tmp_path, "tiny-lm/2", 8), "--tune", "summary_period_s=5", "--tune", "eval_share=1")
        swarm.join(boot, "0:4", "p0", *run)
        swarm.join(boot, "4:8", "p1", *run)

        def summaries(name: str) -> list[str]:
            return re.findall(r"INFO  p2pswarm\.node\.summary: (last .*)", (tmp_path / f"{name}.log").read_text())

        def rounds() -> list[int]:
            return [int(n) for s in summaries("p0") for n in re.findall(r"outer round (\d+) \(", s)]

        assert wait_until(lambda: max(rounds(), default=0) >= 2, 180), summaries("p0")[-3:]
    finally:
        swarm.close()
    for name in ("p0", "p1"):
        text = (tmp_path / f"{name}.log").read_text()
        routine = [line for line in text.splitlines() if " INFO " in line and any(n in line for n in ROUTINE_LOGGERS)]
        assert len(routine) <= 1 and all("announced stage" in line for line in routine), routine  # the first is news
        assert "Traceback" not in text
    last = summaries("p0")[-1]
    assert re.match(r"last \d+ s as join: stage 0: [\d,]+ tokens", last) and "1 peers" not in last, last
