"""The DiLoCo driver's pure decisions (``diloco.policy``) and its status records (``diloco.status``)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("torch")

from p2pswarm.dht.records import Capacity, StageRecord
from p2pswarm.diloco import messages, policy, status
from p2pswarm.diloco.policy import (
    GATHER_ROUND_SHARE,
    STRIKE_ROUNDS,
    STRIKES,
    Move,
    Source,
    believed_ahead,
    diverged_from,
    gather_seconds,
    load_sources,
    neighbours_by_round,
    next_move,
)
from p2pswarm.diloco.round import Phase


def move(now=10.0, *, behind_round=None, phase=None, rounds=3, due=True, retry_at=0.0) -> Move:
    return next_move(now, behind_round=behind_round, phase=phase, rounds=rounds, due=due, retry_at=retry_at)


def test_a_due_round_starts_only_once_the_backoff_after_being_left_out_is_over():
    assert move() is Move.START
    assert move(due=False) is Move.WAIT
    assert move(now=10.0, retry_at=15.0) is Move.WAIT
    assert move(now=15.0, retry_at=15.0) is Move.START


@pytest.mark.parametrize("phase", [Phase.IDLE, Phase.GATHER, Phase.AGREE, Phase.REDUCE, Phase.DONE])
def test_an_open_round_is_ticked_and_a_later_replica_waits_for_it(phase):
    """A DONE round is still applying its outer step: no state is loaded under it."""
    assert move(phase=phase) is Move.TICK
    assert move(phase=phase, behind_round=9) is Move.TICK


@pytest.mark.parametrize("phase", [None, Phase.LEFT_OUT])
def test_a_replica_ahead_is_caught_up_with_unless_our_round_reached_it(phase):
    assert move(phase=phase, behind_round=4, rounds=3) is Move.CATCH_UP
    assert move(phase=phase, behind_round=4, rounds=4) is Move.FORGET  # caught up by our own round meanwhile
    assert move(phase=phase, behind_round=4, rounds=3, due=False) is Move.CATCH_UP


def test_a_later_round_is_believed_only_from_a_met_replica_within_its_record():
    met = frozenset({"a"})
    assert believed_ahead("a", 6, our_round=3, met=met, record_round=5)
    assert not believed_ahead("a", 7, our_round=3, met=met, record_round=5)  # beyond its signed record + 1
    assert not believed_ahead("a", 3, our_round=3, met=met, record_round=5)  # not later than ours
    assert not believed_ahead("b", 4, our_round=3, met=met, record_round=5)  # a peer we do not meet
    assert not believed_ahead("a", 4, our_round=3, met=met, record_round=None)  # no record


def test_a_starting_peer_tries_a_neighbour_then_a_backup_then_its_own_file():
    assert load_sources(neighbours=True, backups=True, disk=True) == (Source.NEIGHBOUR, Source.BACKUP, Source.DISK)
    assert load_sources(neighbours=False, backups=True, disk=True) == (Source.BACKUP, Source.DISK)
    assert load_sources(neighbours=True, backups=False, disk=False) == (Source.NEIGHBOUR,)
    assert load_sources(neighbours=False, backups=False, disk=False) == ()
    # a stage whose replicas are all at outer round 0: its agreed weights are the seeded initial ones
    # (a backup is still tried: the loader fetches only one past round 0, which a lying record cannot hide)
    assert load_sources(neighbours=True, backups=True, disk=True, fresh=True) == (Source.BACKUP, Source.DISK)
    assert load_sources(neighbours=True, backups=False, disk=False, fresh=True) == ()


def test_neighbours_are_tried_latest_round_first_and_never_ourselves():
    records = [SimpleNamespace(peer_id=p, capacity=SimpleNamespace(outer_round=r))
               for p, r in (("a", 2), ("me", 9), ("b", 5), ("c", 3))]
    assert neighbours_by_round(records, "me") == ["b", "c", "a"]
    assert neighbours_by_round(records, "me", working={"a", "c"}) == ["c", "a", "b"]  # work before a claimed round


def test_strikes_bar_a_peer_refused_in_enough_recent_rounds_and_age_out():
    counts = Counter()
    strikes = policy.Strikes(counts)
    for round_ in range(STRIKES):
        assert not strikes.barred("x", round_)
        strikes.refuse("x", round_, "cosine -1")
        strikes.refuse("x", round_, "again, same round")  # one strike a round
    assert strikes.barred("x", STRIKES - 1) and not strikes.barred("y", STRIKES - 1)
    assert strikes.penalties["x"] == 2 * STRIKES == counts["rejected_contributions"]
    assert not strikes.barred("x", STRIKES - 1 + STRIKE_ROUNDS)


def test_a_round_record_splits_its_time_into_phases():
    done = SimpleNamespace(missing=[1], refused={2: "too long"}, pseudo_norm=1.23456, update_norm=0.5)
    times = status.RoundTimes(started=100.0, agreed_s=2.0, take_s=0.5, finished=106.0, assembled=106.25, now=107.0)
    record = status.round_record(4, ("a", "b"), times, 10, 20, done, step=40, tokens=999)
    assert record["round"] == 4 and record["members"] == ["a", "b"] and record["seconds"] == 7.0
    assert record["missing_shards"] == [1] and record["refused_results"] == [2]
    assert record["bytes_sent"] == 10 and record["bytes_received"] == 20 and record["pseudo_gradient_norm"] == 1.2346
    assert record["phases_s"] == {"gather_agree": 2.0, "take_pseudo_gradient": 0.5, "exchange": 3.5,
                                  "assemble": 0.25, "outer_step": 0.75}


def test_the_attacking_peer_replaces_the_one_contribution_seam(monkeypatch):
    """``tests/attacking_peer.py`` poisons exactly what ``contribution.encode_contribution`` returns."""
    import torch

    from p2pswarm.diloco import compression, contribution
    from tests import attacking_peer

    monkeypatch.setattr(contribution, "encode_contribution", contribution.encode_contribution)  # restored after
    pseudo = torch.arange(1.0, 9.0)
    honest = contribution.encode_contribution(pseudo, ((0, 4), (4, 8)), "float32", None)
    attacking_peer.install("negate10")
    sent = contribution.encode_contribution(pseudo, ((0, 4), (4, 8)), "float32", None)
    for mine, theirs in zip(honest, sent, strict=True):
        assert torch.equal(compression.decode(theirs, "float32", 4), -10 * compression.decode(mine, "float32", 4))


@given(configured=st.floats(0.0, 600.0), last=st.none() | st.floats(0.0, 1e6), more=st.floats(0.0, 1e6))
def test_a_gather_waits_at_least_the_configured_time_and_a_share_of_a_slow_round(configured, last, more):
    waited = gather_seconds(configured, last)
    assert waited >= configured
    if last is None:
        assert waited == configured  # the first round: nothing measured
    else:
        assert waited >= GATHER_ROUND_SHARE * last
        assert gather_seconds(configured, last + more) >= waited  # a slower round never waits less


# --- the reduce's deadline: the bytes and the measured rate -------------------------------------------------


@given(st.integers(0, 2**40), st.one_of(st.none(), st.floats(1.0, 1e10)), st.integers(0, 2**30))
def test_the_reduce_deadline_covers_the_bytes_at_the_rate_within_its_bounds(nbytes, rate, more):
    waited = policy.reduce_seconds(nbytes, rate)
    assert policy.REDUCE_S <= waited <= policy.MAX_REDUCE_S
    usable = rate if rate is not None else policy.ASSUMED_RATE
    assert waited >= min(policy.MAX_REDUCE_S, policy.REDUCE_SLACK * nbytes / usable)  # the bytes have time
    assert policy.reduce_seconds(nbytes + more, rate) >= waited  # more bytes never wait less


def test_an_xl_int8_round_on_a_20_mbit_line_gets_the_time_its_bytes_take():
    """Issue 27: an xl stage's int8 round (4 replicas) is ~0.4 GB a replica; at 20 Mbit/s that is minutes, and
    30 s cut it. The sparse codec's round of the same stage fits the same line many times faster."""
    numel, line = 532_173_824, 20e6 / 8
    int8 = messages.bytes_sent(numel, 4, "int8")
    assert int8 / line > policy.REDUCE_S and policy.reduce_seconds(int8, line) >= int8 / line
    sparse = messages.bytes_sent(numel, 4, "sparse")
    assert sparse < int8 / 8 and policy.reduce_seconds(sparse, line) < policy.reduce_seconds(int8, line)
    assert policy.reduce_seconds(10_000, None) == policy.REDUCE_S  # a small round: the floor


def test_the_link_rate_is_a_moving_mean_of_our_rounds():
    link = policy.LinkRate()
    link.observe(0, 5.0)  # a group of one sent nothing: no sample
    link.observe(100, 0.0)
    assert link.rate is None
    link.observe(1000, 1.0)
    assert link.rate == 1000.0
    link.observe(3000, 1.0)
    assert link.rate == 2000.0


def split_record(peer: str, agreed) -> StageRecord:
    return StageRecord(peer, (), "m", 0, 0, 1, Capacity(0, 0), 100.0, 60.0, agreed=agreed)


@given(st.lists(st.binary(min_size=32, max_size=32), min_size=2, max_size=6, unique=True), st.integers(0, 5))
def test_a_split_stage_settles_on_the_smallest_digest_in_one_move(digests, round_):
    """Replicas at one round with different agreed weights: every one but the holder of the smallest digest
    takes that one's state, and that one takes nobody's."""
    peers = [f"12D3KooWp{i}" for i in range(len(digests))]
    records = [split_record(p, (round_, d)) for p, d in zip(peers, digests)]
    winner = peers[digests.index(min(digests))]
    for peer, digest in zip(peers, digests):
        others = [r for r in records if r.peer_id != peer]
        chosen = diverged_from((round_, digest), others, met=frozenset(peers))
        assert (chosen is None) if peer == winner else (chosen is not None and chosen.peer_id == winner)


def test_a_split_is_only_taken_from_a_met_replica_at_our_round():
    low, high = b"\x00" * 32, b"\xff" * 32
    assert diverged_from((3, high), [split_record("12D3KooWa", (3, low))], met=frozenset()) is None  # not met
    met = frozenset({"12D3KooWa"})
    assert diverged_from((3, high), [split_record("12D3KooWa", (2, low))], met=met) is None  # another round
    assert diverged_from((3, high), [split_record("12D3KooWa", (4, low))], met=met) is None  # (ahead: CatchUp)
    assert diverged_from((3, high), [split_record("12D3KooWa", None)], met=met) is None  # no claim yet
    assert diverged_from((3, low), [split_record("12D3KooWa", (3, low))], met=met) is None  # agreed
    assert diverged_from(None, [split_record("12D3KooWa", (3, low))], met=met) is None  # no claim of ours yet
    assert diverged_from((3, high), [split_record("12D3KooWa", (3, low))], met=met).peer_id == "12D3KooWa"
