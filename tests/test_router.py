"""Properties of the pure router core: staleness, backoff, failover order, score and timeout bounds,
and affinity (partner choice, partner first, failover kept)."""

import copy
import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from p2pswarm.dht.records import FLAG_DRAINING, FLAG_RELAYED, Capacity, StageRecord
from p2pswarm.errors import NoCandidates
from p2pswarm.swarm.pacing import DEADLINE_CEILING, DEADLINE_FLOOR, WINDOW_INITIAL, Link
from p2pswarm.swarm.router import (
    BACKOFF_CAP,
    K_CANDIDATES,
    STALE_AFTER,
    Candidate,
    Failure,
    Router,
    RouterConfig,
    backoff_delay,
    partner_for,
    score,
)

PEERS = [f"peer{i}" for i in range(8)]
latencies = st.floats(0.0, 2.0, allow_nan=False)
queues = st.integers(0, 500)
candidates = st.builds(Candidate, peer=st.sampled_from(PEERS), stage=st.integers(0, 1), queue_depth=queues,
                       flags=st.sampled_from([0, FLAG_RELAYED, FLAG_DRAINING]),
                       heard_at=st.floats(0.0, 40.0, allow_nan=False))
observations = st.lists(st.tuples(st.sampled_from(["ack", "fail", "cap"]), st.sampled_from(PEERS), latencies,
                                  queues), max_size=30)


def _router(seed: int, offered, obs, now: float) -> Router:
    router = Router(random.Random(seed))
    router.offer(offered, now=0.0)
    for kind, peer, latency, queue in obs:
        if kind == "ack":
            router.observe_ack(peer, latency, now=0.0, queue_depth=queue)
        elif kind == "fail":
            router.observe_failure(peer, now=now - latency * 10)
        else:
            router.observe_capacity(peer, queue, now=0.0)
    return router


@given(st.integers(), st.lists(candidates, max_size=12), observations, st.floats(0.0, 60.0))
def test_never_routes_to_a_stale_backed_off_or_draining_peer(seed, offered, obs, now):
    router = _router(seed, offered, obs, now)
    for stage in (0, 1):
        chosen = router.choose(stage, now)
        assert len(chosen) <= K_CANDIDATES and len(set(chosen)) == len(chosen)
        for peer in router.ranked(stage, now):
            state = router.peers[peer]
            assert now - state.candidate.heard_at < STALE_AFTER
            assert now >= state.backoff_until
            assert not state.candidate.flags & FLAG_DRAINING
            assert state.candidate.stage == stage


@given(st.integers(), st.lists(candidates, max_size=12), observations, st.floats(0.0, 30.0),
       st.sets(st.sampled_from(PEERS)))
def test_failover_tries_every_live_candidate_before_no_candidates(seed, offered, obs, now, good):
    router = _router(seed, offered, obs, now)
    live = set(router.ranked(0, now))
    tried: list[str] = []
    with pytest.raises(NoCandidates):
        for _ in range(len(PEERS) + 1):
            peer = router.next_after(0, tried, now)
            assert peer not in tried and router.is_live(peer, now)
            tried.append(peer)
            if peer not in good:
                router.observe_failure(peer, now, Failure.ERROR)
    assert set(tried) == live


@given(st.integers(), st.lists(candidates, min_size=1, max_size=12), st.floats(0.0, 14.0))
def test_choose_is_the_head_of_the_failover_order_and_direct_before_relayed(seed, offered, now):
    router = _router(seed, offered, [], now)
    ranked = router.ranked(0, now)
    assert router.choose(0, now) == ranked[:K_CANDIDATES]
    relayed = [router.peers[p].candidate.relayed for p in ranked]
    assert relayed == sorted(relayed)
    if ranked:
        assert router.next_after(0, (), now) == ranked[0]


@given(latencies, latencies, queues)
def test_score_is_monotone_in_latency(a, b, queue):
    low, high = sorted((a, b))
    assert score(low, queue) <= score(high, queue)


@given(queues, queues, latencies)
def test_score_is_monotone_in_queue_depth(a, b, latency):
    low, high = sorted((a, b))
    assert score(latency, low) <= score(latency, high)


@given(latencies, queues, queues)
def test_a_deeper_queue_never_ranks_first(latency, q1, q2):
    router = Router(random.Random(0))
    router.offer([Candidate("a", 0, q1, heard_at=0.0), Candidate("b", 0, q2, heard_at=0.0)], now=0.0)
    router.observe_ack("a", latency, 0.0)
    router.observe_ack("b", latency, 0.0)
    if q1 < q2:
        assert router.choose(0, 1.0)[0] == "a"
    elif q2 < q1:
        assert router.choose(0, 1.0)[0] == "b"


@given(st.lists(latencies, min_size=0, max_size=40), st.integers(0, 1 << 22))
def test_deadline_stays_within_floor_and_ceiling(samples, size):
    router = Router(random.Random(0))
    router.offer([Candidate("a", 0, 0, heard_at=0.0)], now=0.0)
    for sample in samples:
        router.observe_ack("a", sample, now=0.0, size=size)
        assert DEADLINE_FLOOR <= router.deadline("a", size) <= DEADLINE_CEILING
    assert router.deadline("unknown", size) == Link().deadline(size)


def test_next_after_offers_only_a_peer_with_room_in_its_window():
    router = Router(random.Random(0))
    router.offer([Candidate("a", 0, 0, heard_at=0.0), Candidate("b", 0, 5, heard_at=0.0)], now=0.0)
    for _ in range(int(WINDOW_INITIAL)):
        assert router.next_after(0, (), 0.0) == "a"  # the better one while it has room
        router.observe_sent("a", 1000)
    assert router.next_after(0, (), 0.0) == "b"
    for _ in range(int(WINDOW_INITIAL)):
        router.observe_sent("b", 1000)
    assert router.next_after(0, (), 0.0) is None and not router.has_room(0, 0.0)  # wait for an answer
    router.observe_ack("a", 0.01, now=0.0, size=1000)
    assert router.next_after(0, (), 0.0) == "a" and router.has_room(0, 0.0)
    with pytest.raises(NoCandidates):
        router.next_after(0, ("a", "b"), 0.0)


@given(st.integers(1, 200), st.integers())
def test_backoff_is_capped_jittered_and_grows(failures, seed):
    delay = backoff_delay(failures, random.Random(seed))
    assert 0 < delay <= BACKOFF_CAP
    config = RouterConfig()
    nominal = min(BACKOFF_CAP, config.backoff_base * 2.0 ** (failures - 1))
    assert nominal / 2 <= delay <= nominal


def test_from_record_carries_queue_flags_and_time():
    record = StageRecord("p", ("/ip4/127.0.0.1/tcp/1",), "tiny-lm", 1, 2, 4, Capacity(100, 7, FLAG_RELAYED), 5.0, 30.0)
    c = Candidate.from_record(record)
    assert (c.peer, c.stage, c.queue_depth, c.relayed, c.heard_at) == ("p", 1, 7, True, 5.0)


class RouterMachine(RuleBasedStateMachine):
    """Peers appear, report, fail, recover when their backoff ends, and die (go stale)."""

    @initialize(seed=st.integers())
    def start(self, seed):
        self.router = Router(random.Random(seed))
        self.now = 0.0
        self.dead: set[str] = set()

    @rule(peer=st.sampled_from(PEERS), queue=queues, relayed=st.booleans())
    def appear(self, peer, queue, relayed):
        self.dead.discard(peer)
        self.router.offer([Candidate(peer, 0, queue, FLAG_RELAYED if relayed else 0, self.now)], self.now)

    @rule(peer=st.sampled_from(PEERS), latency=latencies)
    def ack(self, peer, latency):
        if peer not in self.dead:
            self.router.observe_ack(peer, latency, self.now)
            if peer in self.router.peers:
                assert self.router.is_live(peer, self.now) == (
                    self.now - self.router.peers[peer].candidate.heard_at < STALE_AFTER)

    @rule(peer=st.sampled_from(PEERS))
    def fail(self, peer):
        self.router.observe_failure(peer, self.now)
        assert not self.router.is_live(peer, self.now)

    @rule(peer=st.sampled_from(PEERS))
    def die(self, peer):
        self.dead.add(peer)

    @rule(dt=st.floats(0.0, 20.0))
    def advance(self, dt):
        self.now += dt

    @precondition(lambda self: any(s.backoff_until > self.now for s in self.router.peers.values()))
    @rule()
    def wait_for_a_recovery(self):
        self.now = min(s.backoff_until for s in self.router.peers.values() if s.backoff_until > self.now)

    @invariant()
    def routes_only_to_live_peers_in_order(self):
        if not hasattr(self, "router"):
            return
        ranked = self.router.ranked(0, self.now)
        for peer in ranked:
            state = self.router.peers[peer]
            assert self.now - state.candidate.heard_at < STALE_AFTER and self.now >= state.backoff_until
        assert self.router.choose(0, self.now) == ranked[:K_CANDIDATES]
        relayed = [self.router.peers[p].candidate.relayed for p in ranked]
        assert relayed == sorted(relayed)
        if not ranked:
            with pytest.raises(NoCandidates):
                self.router.next_after(0, (), self.now)

    @invariant()
    def fresh_unfailed_peers_are_routable(self):
        if not hasattr(self, "router"):
            return
        for peer, state in self.router.peers.items():
            fresh = self.now - state.candidate.heard_at < STALE_AFTER
            if fresh and self.now >= state.backoff_until:
                assert peer in self.router.ranked(0, self.now)
            assert DEADLINE_FLOOR <= self.router.deadline(peer, 1 << 19) <= DEADLINE_CEILING


TestRouterMachine = RouterMachine.TestCase


# --- affinity ---------------------------------------------------------------------------------------

peer_ids = st.sets(st.text("abcdef0123", min_size=1, max_size=4), max_size=10)


@given(peer_ids.filter(bool), peer_ids.filter(bool))
def test_partners_share_the_next_stage_within_one(mine, nexts):
    shares = Counter(partner_for(me, mine, nexts) for me in mine)
    if len(nexts) > len(mine):  # a partner each would leave next-stage peers idle: none, all are used
        assert set(shares) == {None}
        return
    assert set(shares) <= nexts
    counts = [shares.get(peer, 0) for peer in nexts]
    assert max(counts) - min(counts) <= 1
    if len(mine) == len(nexts):
        assert set(shares) == nexts  # equal counts: a one-to-one chain per replica


@given(st.text(min_size=1, max_size=4), peer_ids, peer_ids, st.text(min_size=1, max_size=4))
def test_partner_is_stable_when_a_later_peer_of_our_stage_comes_or_goes(me, mine, nexts, other):
    if other > me and len(nexts) <= len((mine - {other}) | {me}):  # sorts after us: our index, hence our
        # partner, is unchanged (while the next stage has no more peers than ours, else there is none)
        assert partner_for(me, mine | {other}, nexts) == partner_for(me, mine - {other}, nexts)


@given(st.text(min_size=1, max_size=4), peer_ids, peer_ids.filter(bool), st.text(min_size=1, max_size=4))
def test_partner_is_stable_when_a_next_stage_peer_after_it_comes(me, mine, nexts, newcomer):
    partner = partner_for(me, mine, nexts)
    index = sorted(mine | {me}).index(me)
    if newcomer not in nexts and partner is not None and newcomer > partner and index < len(nexts) < len(mine | {me}):
        assert partner_for(me, mine, nexts | {newcomer}) == partner


def test_no_partner_without_a_next_stage_peer_and_me_counted_when_unlisted():
    assert partner_for("a", ["b"], []) is None
    assert partner_for("b", ["a"], ["x", "y"]) == partner_for("b", ["a", "b"], ["y", "x"]) == "y"
    assert partner_for("a", [], ["x", "y"]) is None  # one of us, two of them: both are used


def _two_stage_one(partner: str | None = "b") -> Router:
    router = Router(random.Random(0))
    router.offer([Candidate("a", 1, 0, heard_at=0.0), Candidate("b", 1, 50, heard_at=0.0)], now=0.0)
    router.set_partner(1, partner)
    return router


def test_the_partner_waits_for_room_rather_than_spilling_and_fails_over_when_tried():
    router = _two_stage_one()  # "b" scores worse (queue 50) but is the partner
    assert router.ranked(1, 0.0) == ["b", "a"] and router.choose(1, 0.0)[0] == "b"
    for _ in range(int(WINDOW_INITIAL)):
        assert router.next_after(1, (), 0.0) == "b" and router.has_room(1, 0.0)
        router.observe_sent("b", 1000)
    assert router.next_after(1, (), 0.0) is None and not router.has_room(1, 0.0)  # "a" has room: not used
    assert router.next_after(1, ("b",), 0.0) == "a"  # tried (a Busy, a failure): the others as before
    router.observe_ack("a", 0.01, now=0.0, size=1000)
    assert [router.stats(0.0)["peers"][p]["acks"] for p in "ab"] == [1, 0]  # /api/swarm: which one took frames
    router.observe_failure("b", 0.0, Failure.ERROR)
    assert router.next_after(1, (), 0.0) == "a" and router.has_room(1, 0.0)  # backed off: not preferred
    router.set_partner(1, None)
    assert router.ranked(1, 10.0) == ["a", "b"]  # no preference: by score


def test_an_exploring_micro_batch_tries_each_live_non_partner_in_turn_then_fails_over_to_the_partner():
    router = _two_stage_one()
    router.offer([Candidate("c", 1, 0, heard_at=0.0)], now=0.0)
    firsts = [router.next_after(1, (), 0.0, explore=True) for _ in range(4)]
    assert firsts == ["a", "c", "a", "c"]  # disjoint chains see each other work (dht.work)
    assert router.next_after(1, ("a",), 0.0, explore=True) == "b"  # a failover is not an exploration
    assert router.next_after(1, (), 0.0) == "b"  # an ordinary micro-batch goes to the partner alone
    router.observe_failure("a", 0.0, Failure.ERROR)  # backed off: not live, not explored
    assert {router.next_after(1, (), 0.0, explore=True) for _ in range(3)} == {"c"}
    router.set_partner(1, None)
    assert router.next_after(1, (), 0.0, explore=True) == "c"  # no partner: ranked as ever


def test_a_partner_of_another_stage_or_unknown_is_ignored():
    for partner in ("nobody", "c"):
        router = _two_stage_one(partner)
        router.offer([Candidate("c", 2, 0, heard_at=0.0)], now=0.0)
        assert router.live_partner(1, 0.0) is None and router.ranked(1, 0.0) == ["a", "b"]


class PartnerMachine(RuleBasedStateMachine):
    """Peers of one stage appear, take frames, ack, fail and die while one of them is our partner."""

    @initialize(seed=st.integers(), partner=st.sampled_from(PEERS))
    def start(self, seed, partner):
        self.router = Router(random.Random(seed))
        self.router.set_partner(0, partner)
        self.now = 0.0

    @rule(peer=st.sampled_from(PEERS), queue=queues, relayed=st.booleans())
    def appear(self, peer, queue, relayed):
        self.router.offer([Candidate(peer, 0, queue, FLAG_RELAYED if relayed else 0, self.now)], self.now)

    @rule(peer=st.sampled_from(PEERS))
    def send(self, peer):
        self.router.observe_sent(peer, 1 << 16)

    @rule(peer=st.sampled_from(PEERS), latency=latencies)
    def ack(self, peer, latency):
        self.router.observe_ack(peer, latency, self.now, size=1 << 16)

    @rule(peer=st.sampled_from(PEERS))
    def fail(self, peer):
        self.router.observe_failure(peer, self.now, Failure.ERROR)

    @rule(peer=st.sampled_from(PEERS))
    def move_partner(self, peer):
        self.router.set_partner(0, peer)

    @rule(dt=st.floats(0.0, 20.0))
    def advance(self, dt):
        self.now += dt

    @invariant()
    def partner_first_when_live_and_never_a_dead_peer(self):
        if not hasattr(self, "router"):
            return
        router, partner = self.router, self.router.partners[0]
        ranked = router.ranked(0, self.now)
        assert all(router.is_live(p, self.now) for p in ranked) and len(set(ranked)) == len(ranked)
        assert (partner in ranked) == router.is_live(partner, self.now)
        if not ranked:
            return
        chosen = router.next_after(0, (), self.now)
        if partner in ranked:
            assert ranked[0] == partner and router.has_room(0, self.now) == router.link(partner).has_room
            assert chosen == (partner if router.link(partner).has_room else None)
        else:
            assert chosen is None or (router.is_live(chosen, self.now) and router.link(chosen).has_room)
        explored = router.next_after(0, (), self.now, explore=True)
        assert explored is None or (router.is_live(explored, self.now) and router.link(explored).has_room)
        roomy = [p for p in ranked if p != partner and router.link(p).has_room]
        if partner in ranked and roomy:  # the partner is passed over, full or not, for a non-partner with room
            assert explored in roomy
        else:
            assert explored == chosen

    @invariant()
    def failover_reaches_every_live_peer_when_each_fails(self):
        if not hasattr(self, "router"):
            return
        router = copy.deepcopy(self.router)
        live, tried = set(router.ranked(0, self.now)), []
        for peer in PEERS:  # a fresh window for each: only failures are under test here
            router.links.pop(peer, None)
        with pytest.raises(NoCandidates):
            for _ in range(len(PEERS) + 1):
                peer = router.next_after(0, tried, self.now)
                assert peer not in tried and router.is_live(peer, self.now)
                tried.append(peer)
                router.observe_failure(peer, self.now, Failure.ERROR)
        assert set(tried) == live


TestPartnerMachine = PartnerMachine.TestCase
