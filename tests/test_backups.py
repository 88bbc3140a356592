"""Stage backups, the pure core: duties by rendezvous hashing, the ledger of announced digests, the
choice of held copies, the check of a decoded backup, and the budget."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm.dht.records import BackupClaim, Capacity, StageRecord
from p2pswarm.diloco import checkpoint
from p2pswarm.diloco.backups import (
    KEEP_ROUNDS,
    MAX_TRACKED_REPLICAS,
    AgreedLedger,
    BackupBudget,
    backup_duties,
    backup_state,
    check_backup,
    choose_backups,
    digest,
    encode_backup,
)
from p2pswarm.diloco.outer import OuterOptimizer
from p2pswarm.errors import RemoteProtocolError
from p2pswarm.model.catalog import MODELS, param_count

RUN = "fdd1f91421b0282a"
SPEC = MODELS["tiny-lm"]

peers_st = st.lists(st.text("abcdefgh", min_size=1, max_size=3), min_size=1, max_size=16, unique=True)


@st.composite
def swarms(draw) -> dict[int, list[str]]:
    """Peers spread over up to 5 stages, each peer in exactly one stage."""
    peers = draw(peers_st)
    stages = draw(st.integers(1, 5))
    members: dict[int, list[str]] = {stage: [] for stage in range(stages)}
    for peer in peers:
        members[draw(st.integers(0, stages - 1))].append(peer)
    return members


def holders(members, copies=2) -> dict[int, set[str]]:
    everyone = [peer for peers in members.values() for peer in peers]
    result: dict[int, set[str]] = {stage: set() for stage in members}
    for peer in everyone:
        for stage in backup_duties(peer, members, copies):
            result[stage].add(peer)
    return result


@given(swarms(), st.integers(1, 3))
def test_every_stage_gets_exactly_copies_holders_never_its_own_replicas(members, copies):
    everyone = {peer for peers in members.values() for peer in peers}
    for stage, held_by in holders(members, copies).items():
        outside = everyone - set(members[stage])
        assert len(held_by) == min(copies, len(outside))
        assert not held_by & set(members[stage])


@given(swarms(), st.randoms())
def test_duties_do_not_depend_on_input_order(members, rng):
    items = rng.sample(list(members.items()), len(members))
    shuffled = {stage: rng.sample(peers, len(peers)) for stage, peers in items}
    for peer in {p for peers in members.values() for p in peers}:
        assert backup_duties(peer, members) == backup_duties(peer, shuffled)


@given(swarms(), st.data())
def test_one_peer_leaving_changes_only_the_duties_it_held(members, data):
    everyone = sorted({peer for peers in members.values() for peer in peers})
    gone = data.draw(st.sampled_from(everyone))
    before = holders(members)
    after = holders({stage: [p for p in peers if p != gone] for stage, peers in members.items()})
    for stage in members:
        if gone in before[stage]:
            assert len(before[stage] - after[stage]) == 1 and before[stage] - {gone} <= after[stage]
        else:  # a replica of the stage, or a peer that held nothing of it: the holders stay
            assert after[stage] == before[stage]


@given(swarms(), st.text("xyz", min_size=1, max_size=3), st.data())
def test_one_peer_joining_takes_at_most_one_duty_per_stage_from_others(members, newcomer, data):
    stage_joined = data.draw(st.sampled_from(sorted(members)))
    before = holders(members)
    after = holders({stage: peers + ([newcomer] if stage == stage_joined else [])
                     for stage, peers in members.items()})
    for stage in members:
        assert len(before[stage] - after[stage]) <= 1  # at most the one it displaced
        assert after[stage] - before[stage] <= {newcomer}


def record(peer: str, stage: int, agreed, now: float = 100.0) -> StageRecord:
    return StageRecord(peer, (), "tiny-lm", stage, 0, 1, Capacity(0, 0), now, 30.0, RUN, agreed)


D = [bytes([i]) * 32 for i in range(8)]


def test_the_ledger_trusts_what_a_replica_of_that_stage_announced():
    ledger = AgreedLedger()
    ledger.observe([record("a", 1, (5, D[0])), record("b", 2, (5, D[1])), record("c", 1, None)], 100.0)
    assert ledger.trusted(1, 5, D[0]) and not ledger.trusted(1, 5, D[1]) and not ledger.trusted(1, 4, D[0])
    assert ledger.trusted(2, 5, D[1]) and ledger.newest(1) == (5, D[0]) and ledger.newest(3) is None


def test_the_ledger_ignores_expired_records_and_remembers_replicas_that_left():
    ledger = AgreedLedger()
    ledger.observe([record("a", 1, (5, D[0]), now=0.0)], 100.0)  # expired at 30
    assert ledger.newest(1) is None
    ledger.observe([record("a", 1, (6, D[1]))], 100.0)
    ledger.observe([], 1000.0)  # every replica gone: what they announced is still known
    assert ledger.newest(1) == (6, D[1])


def test_the_ledger_keeps_the_last_rounds_of_each_replica():
    ledger = AgreedLedger()
    for round_ in range(KEEP_ROUNDS + 3):
        ledger.observe([record("a", 1, (round_, digest(str(round_).encode())))], 100.0)
    assert not ledger.trusted(1, 2, digest(b"2")) and ledger.trusted(1, 3, digest(b"3"))
    assert ledger.newest(1) == (KEEP_ROUNDS + 2, digest(str(KEEP_ROUNDS + 2).encode()))


def test_the_ledger_keeps_a_bounded_number_of_replicas():
    ledger = AgreedLedger()
    for i in range(MAX_TRACKED_REPLICAS + 5):
        ledger.observe([record(f"p{i}", 1, (1, D[0]), now=100.0 + i)], 100.0 + i)
    assert ledger.votes(1, 1, D[0]) == MAX_TRACKED_REPLICAS


@given(st.lists(st.sampled_from(D[:3]), min_size=1, max_size=7), st.randoms())
def test_when_replicas_disagree_the_most_announced_digest_is_newest(digests, rng):
    records = [record(f"p{i}", 1, (9, d)) for i, d in enumerate(digests)]
    ledger, shuffled = AgreedLedger(), AgreedLedger()
    ledger.observe(records, 100.0)
    shuffled.observe(rng.sample(records, len(records)), 100.0)
    newest = ledger.newest(1)
    assert newest == shuffled.newest(1)
    count = {d: digests.count(d) for d in digests}
    most = max(count.values())
    assert newest == (9, min(d for d in count if count[d] == most))


def test_choose_backups_trusted_first_then_freshest():
    ledger = AgreedLedger()
    ledger.observe([record("r", 1, (4, D[0])), record("r", 1, (5, D[1]))], 100.0)
    claims = [("old", BackupClaim(1, 4, D[0])), ("new", BackupClaim(1, 5, D[1])),
              ("liar", BackupClaim(1, 9, D[2])), ("other", BackupClaim(2, 5, D[1]))]
    assert choose_backups(1, claims, ledger) == [("new", claims[1][1]), ("old", claims[0][1])]


def test_a_stale_copy_claimed_as_a_newer_round_is_not_chosen():
    ledger = AgreedLedger()
    ledger.observe([record("r", 1, (4, D[0]))], 100.0)
    ledger.observe([record("r", 1, (5, D[1]))], 101.0)
    assert choose_backups(1, [("stale", BackupClaim(1, 5, D[0]))], ledger) == []


def test_an_unannounced_digest_needs_two_holders():
    ledger = AgreedLedger()
    claim = BackupClaim(1, 7, D[3])
    assert choose_backups(1, [("a", claim)], ledger) == []
    assert choose_backups(1, [("b", claim), ("a", claim)], ledger) == [("a", claim), ("b", claim)]
    trusted = BackupClaim(1, 3, D[4])
    ledger.observe([record("r", 1, (3, D[4]))], 100.0)
    assert choose_backups(1, [("a", claim), ("b", claim), ("c", trusted)], ledger)[0] == ("c", trusted)


def outer_alike(round_started_step: int, seed: int = 0) -> OuterOptimizer:
    torch.manual_seed(seed)
    params = {"w": torch.randn(10, 3), "b": torch.randn(3)}
    outer = OuterOptimizer(params, step=round_started_step)
    outer.momentum.normal_(generator=torch.Generator().manual_seed(seed))
    outer.rounds = 4
    return outer


def test_replicas_built_alike_give_the_same_backup_bytes_whatever_their_own_step():
    a, b = outer_alike(round_started_step=0), outer_alike(round_started_step=57)
    assert a.round_started_step != b.round_started_step
    bytes_a = encode_backup("m", 1, RUN, a.rounds, a.start.clone(), a.momentum.clone())
    bytes_b = encode_backup("m", 1, RUN, b.rounds, b.start.clone(), b.momentum.clone())
    assert bytes_a == bytes_b
    c = outer_alike(round_started_step=0, seed=1)
    assert encode_backup("m", 1, RUN, c.rounds, c.start, c.momentum) != bytes_a


def a_backup(stage: int = 1, round_: int = 3, **changes) -> dict:
    numel = param_count(SPEC, stage)
    state = backup_state(SPEC.name, stage, RUN, round_, torch.zeros(numel), torch.ones(numel))
    return {**state, **changes}


def test_a_backup_round_trips_and_passes_its_check():
    state = checkpoint.decode_state(checkpoint.encode_state(a_backup()))
    assert check_backup(state, SPEC, 1, RUN, 3) is state


@pytest.mark.parametrize("changes", [
    {"round": 2}, {"round": True}, {"stage": 2}, {"model": "other"}, {"run": "0" * 16}, {"format": 2},
    {"kind": "snapshot"}, {"start": torch.zeros(5)},
    {"momentum": torch.ones(param_count(SPEC, 1), dtype=torch.float64)},
    {"start": torch.full((param_count(SPEC, 1),), float("nan"))}, {"extra": 1}, {"momentum": [1.0]},
])
def test_a_backup_that_is_not_what_it_claims_is_refused(changes):
    with pytest.raises(RemoteProtocolError):
        check_backup(a_backup(**changes), SPEC, 1, RUN, 3)


@pytest.mark.parametrize("state", [None, [], {"format": 1}, "backup"])
def test_anything_else_is_refused(state):
    with pytest.raises(RemoteProtocolError):
        check_backup(state, SPEC, 1, RUN, 3)


@given(st.dictionaries(st.integers(0, 5), st.integers(0, 1000), max_size=5), st.integers(0, 5),
       st.integers(0, 1000), st.integers(0, 4000))
def test_the_budget_counts_the_other_held_backups_and_the_new_one(held, stage, size, limit):
    others = sum(b for s, b in held.items() if s != stage)
    assert BackupBudget(limit).fits(held, stage, size) == (others + size <= limit)


def test_the_budget_example():
    budget = BackupBudget(100)
    assert budget.fits({1: 60}, 1, 90)  # replaces its own older copy
    assert not budget.fits({1: 60}, 2, 41) and budget.fits({1: 60}, 2, 40)



def test_with_outer_momentum_0_a_backup_leaves_the_momentum_out_and_passes_its_check():
    numel = param_count(SPEC, 1)
    state = backup_state(SPEC.name, 1, RUN, 3, torch.zeros(numel), None)
    assert "momentum" not in state
    full = checkpoint.encode_state(backup_state(SPEC.name, 1, RUN, 3, torch.zeros(numel), torch.ones(numel)))
    data = checkpoint.encode_state(state)
    assert len(data) < 0.6 * len(full)  # half the bytes: one vector, not two
    decoded = checkpoint.decode_state(data)
    assert check_backup(decoded, SPEC, 1, RUN, 3) is decoded


def test_a_digest_outvoted_for_its_round_strikes_its_announcer_and_a_tie_strikes_nobody():
    from p2pswarm.dht.records import Capacity, StageRecord
    from p2pswarm.diloco.backups import AgreedLedger

    def rec(peer: str, round_: int, fill: bytes) -> StageRecord:
        return StageRecord(peer, (), "m", 1, 1, 2, Capacity(0, 0), 100.0, 60.0, agreed=(round_, fill * 32))

    ledger = AgreedLedger()
    ledger.observe([rec("a", 4, b"t"), rec("liar", 4, b"f")], 100.0)
    assert ledger.newest(1) == (4, b"f" * 32) and not ledger.struck  # 1 against 1: nothing tells them apart
    ledger.observe([rec("b", 4, b"t"), rec("liar", 5, b"g")], 100.0)
    assert ledger.newest(1) == (4, b"t" * 32) and set(ledger.struck) == {"liar"}  # outvoted: its round 5 goes too
    assert not ledger.trusted(1, 5, b"g" * 32)


def test_struck_replicas_are_remembered_up_to_a_bound():
    """Identities are free: each liar struck is remembered, but no more than MAX_STRUCK of them."""
    from p2pswarm.dht.records import Capacity, StageRecord
    from p2pswarm.diloco.backups import MAX_STRUCK, AgreedLedger

    ledger = AgreedLedger()
    for batch in range(MAX_STRUCK // 60 + 2):  # 60 liars and 2 honest replicas at a time (64 tracked a stage)
        peers = [("a", b"t"), ("b", b"t"), *((f"liar{batch}-{i}", bytes([i]) * 32) for i in range(60))]
        ledger.observe([StageRecord(peer, (), "m", 1, 1, 2, Capacity(0, 0), 100.0 + batch, 60.0,
                                    agreed=(batch, fill if len(fill) == 32 else fill * 32)) for peer, fill in peers],
                       100.0 + batch)
        assert ledger.newest(1) == (batch, b"t" * 32)
    assert len(ledger.struck) == MAX_STRUCK and "a" not in ledger.struck and "b" not in ledger.struck


@given(durations=st.lists(st.floats(0.0, 3600.0, allow_subnormal=False), min_size=1, max_size=20),
       tick=st.floats(0.1, 30.0))
def test_refreshes_keep_a_line_busy_at_most_their_share_of_the_time(durations, tick):
    from p2pswarm.diloco.backups import BACKUP_LINE_SHARE, refresh_due

    assert refresh_due(0.0, None)  # nothing fetched yet: due
    now, busy, last = 0.0, 0.0, None
    for seconds in durations:  # each refresh as soon as it is due, checked every tick
        while not refresh_due(now, last):
            now += tick
        now, busy, last = now + seconds, busy + seconds, (now + seconds, seconds)
    while not refresh_due(now, last):
        now += tick
    assert busy <= BACKUP_LINE_SHARE * now + 1e-6 * now + 1e-9  # over the whole time, including the last wait
