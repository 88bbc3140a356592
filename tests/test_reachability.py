"""Reachability verdicts and rate limits: pure cores, checked against reference models."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from p2pswarm.nat.reachability import (
    MIN_CONFIRMATIONS,
    OBSERVATION_MAX_AGE,
    DialBackResult,
    RateLimiter,
    Reachability,
    ReachabilityTracker,
)

SERVERS = st.sampled_from(["s1", "s2", "s3", "s4", "s5"])


def reference_verdict(results: list[DialBackResult], now: float) -> Reachability:
    latest: dict[str, DialBackResult] = {}
    for r in results:
        if r.server not in latest or r.at >= latest[r.server].at:
            latest[r.server] = r
    current = [r for r in latest.values() if now - OBSERVATION_MAX_AGE <= r.at <= now]
    yes = sum(r.reachable for r in current)
    no = len(current) - yes
    if yes >= MIN_CONFIRMATIONS and yes > no:
        return Reachability.PUBLIC
    if no >= MIN_CONFIRMATIONS and no > yes:
        return Reachability.PRIVATE
    return Reachability.UNKNOWN


def test_examples():
    tracker = ReachabilityTracker()
    assert tracker.verdict(0) is Reachability.UNKNOWN
    tracker.observe(DialBackResult("s1", "/ip4/1.2.3.4/tcp/1", True, 0))
    assert tracker.verdict(1) is Reachability.UNKNOWN  # one server is not enough
    tracker.observe(DialBackResult("s2", "/ip4/1.2.3.4/tcp/1", True, 1))
    assert tracker.verdict(2) is Reachability.PUBLIC
    assert tracker.reachable_addresses(2) == ["/ip4/1.2.3.4/tcp/1"]
    tracker.observe(DialBackResult("s1", "/ip4/1.2.3.4/tcp/1", False, 3))
    tracker.observe(DialBackResult("s2", "/ip4/1.2.3.4/tcp/1", False, 3))
    assert tracker.verdict(4) is Reachability.PRIVATE  # the network changed: newest answers win
    assert tracker.verdict(4 + OBSERVATION_MAX_AGE) is Reachability.UNKNOWN  # and they age out


class TrackerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tracker, self.results, self.now = ReachabilityTracker(), [], 0.0

    @rule(dt=st.floats(0, OBSERVATION_MAX_AGE / 2))
    def advance(self, dt):
        self.now += dt

    @rule(server=SERVERS, reachable=st.booleans(), lag=st.floats(0, OBSERVATION_MAX_AGE))
    def observe(self, server, reachable, lag):
        result = DialBackResult(server, "/ip4/10.0.0.1/tcp/4001", reachable, max(0.0, self.now - lag))
        self.tracker.observe(result)
        self.results.append(result)

    @invariant()
    def same_verdict_as_reference(self):
        assert self.tracker.verdict(self.now) == reference_verdict(self.results, self.now)

    @invariant()
    def never_public_on_one_server(self):
        if self.tracker.verdict(self.now) is Reachability.PUBLIC:
            assert len({r.server for r in self.results if r.reachable}) >= MIN_CONFIRMATIONS


TestTrackerMachine = TrackerMachine.TestCase


@settings(max_examples=200)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 5)), max_size=200))
def test_rate_limiter_never_exceeds_its_budget(requests):
    rate, burst = 2.0, 3.0
    limiter = RateLimiter(rate, burst, global_rate=100.0, global_burst=100.0)
    now, allowed = 0.0, {}
    for key, dt in requests:
        now += dt
        if limiter.allow(key, now):
            allowed[key] = allowed.get(key, 0) + 1
    for count in allowed.values():
        assert count <= burst + rate * now + 1e-9


def test_global_limit_caps_many_keys():
    limiter = RateLimiter(rate=10, burst=10, global_rate=1, global_burst=5)
    assert sum(limiter.allow(f"k{i}", 0.0) for i in range(50)) == 5
