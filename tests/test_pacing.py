"""Properties of the link core (swarm/pacing.py) and of the router's use of it: deadlines that fit
the measured link, a bounded AIMD window, and failover only on failures.

The state machine drives a Router the way ``swarm/sender.py`` does, over peers with a hidden true
behaviour: *live* peers answer each frame after a latency drawn within a factor of 2 of their own
(a slow link is a live one), *hung* peers never answer, *dead* peers error at once. It checks that a
live peer's ack always comes within the deadline the sender gave that attempt once the link is
measured (so a live peer, however slow, is never failed over; before the first sample it is the
driver's rule, no failure while bytes move, that keeps a slow first frame alive), that windows stay
bounded, that a peer is offered only with room in its window, and that every re-send of a
micro-batch follows a failure or a Busy.
"""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from p2pswarm.errors import NoCandidates
from p2pswarm.swarm.pacing import (
    DEADLINE_CEILING,
    DEADLINE_FLOOR,
    INITIAL_SLACK,
    MAX_BACKOFF,
    SAMPLE_MIN_BYTES,
    WINDOW_INITIAL,
    WINDOW_MAX,
    WINDOW_MIN,
    Link,
)
from p2pswarm.swarm.router import Candidate, Failure, Router

FRAME = 512 * 1024  # a tiny-lm/2 micro-batch at the stage boundary
events = st.lists(st.tuples(st.sampled_from(["sent", "ack", "busy", "timeout"]), st.floats(0.0, 30.0),
                            st.integers(0, 4 * FRAME)), max_size=60)


def replay(link: Link, history) -> Link:
    for kind, seconds, size in history:
        link = {"sent": link.sent, "ack": functools.partial(link.acked, size, seconds),
                "busy": link.busy, "timeout": link.timed_out}[kind]()
    return link


@given(events, st.integers(0, 64 * FRAME))
def test_window_and_deadline_stay_bounded_whatever_happens(history, size):
    link = replay(Link(), history)
    assert WINDOW_MIN <= link.window <= WINDOW_MAX
    assert link.on_the_way >= 0
    assert DEADLINE_FLOOR <= link.deadline(size) <= DEADLINE_CEILING
    assert link.deadline(size) <= link.deadline(size + FRAME)  # a bigger frame never has a shorter deadline


def test_a_new_link_is_generous_and_learns_the_rate():
    link = Link()
    assert link.deadline(FRAME) == pytest.approx(2 * FRAME / 1.25e6 + INITIAL_SLACK)
    for _ in range(30):  # a 20 Mbit/s link: 512 KiB in 0.21 s
        link = link.sent().acked(FRAME, FRAME / 2.5e6)
    assert link.throughput == pytest.approx(2.5e6, rel=0.01)
    assert FRAME / 2.5e6 < link.deadline(FRAME) <= 3 * FRAME / 2.5e6 + DEADLINE_FLOOR
    assert link.window == WINDOW_MAX


def test_acks_slowed_by_our_own_queue_shrink_the_window():
    link = Link()
    for _ in range(6):  # the line at its best: 512 KiB in 0.2 s
        link = link.sent().acked(FRAME, 0.2)
    grown = link.window
    for _ in range(6):  # the same line with seconds of our own frames queued in front
        link = link.sent().acked(FRAME, 1.5)
    assert link.window < grown and link.window >= WINDOW_MIN
    assert link.sent().acked(FRAME, 0.25).window > link.window  # the queue drained: it grows again


def test_small_frames_measure_latency_not_throughput():
    link = Link().acked(SAMPLE_MIN_BYTES - 1, 0.5)
    assert link.throughput is None
    assert link.slack == pytest.approx(0.5 - (SAMPLE_MIN_BYTES - 1) / 1.25e6)  # what the assumed rate does not explain


def test_small_frames_acked_back_to_back_measure_a_thin_line():
    """A subspace run's 13 KB frames queued on a 25 KB/s uplink: acked 0.52 s apart, each after seconds in
    the queue. The line is learnt, so the deadline of the bytes queued ahead is seconds, not 10 Mbit/s'."""
    small, rate, now, link = 13_000, 25_000.0, 0.0, Link()
    for _ in range(4):
        link = link.sent()
    for _ in range(20):
        now += small / rate
        link = link.sent().acked(small, 2.0 + small / rate, now)  # 2 s in the queue, then its transfer
    assert link.throughput == pytest.approx(rate, rel=0.01)
    assert link.deadline(8 * small) > 8 * small / rate  # 8 frames ahead: 4.2 s of line


def test_a_fast_line_left_idle_by_a_slow_sender_keeps_its_rate():
    """13 KB frames cut every 0.25 s (the compute's pace) on a fast line: acked in 5 ms each; the time
    between acks is the sender's pace, not the line's, and the shorter time (5 ms) is what counts."""
    small, now, link = 13_000, 0.0, Link().sent().sent()
    for _ in range(20):
        now += 0.25
        link = link.sent().acked(small, 0.005, now)
    assert link.throughput == pytest.approx(small / 0.005, rel=0.01)
    alone = Link().sent().acked(small, 0.005, 1.0).acked(small, 0.005, 2.0)  # one on the way at a time
    assert alone.throughput is None


def test_a_timeout_backs_the_deadline_off_until_an_ack():
    """RFC 6298 5.5: a path slower than the deadline gets twice the time at each timeout, up to
    MAX_BACKOFF, and the first ack brings it back; an error is no reason to wait longer."""
    link = Link()
    base = link.deadline(13_000)
    late = link.timed_out().timed_out()
    assert late.deadline(13_000) == pytest.approx(4 * base)
    for _ in range(10):
        late = late.timed_out()
    assert late.deadline(13_000) == pytest.approx(min(DEADLINE_CEILING, MAX_BACKOFF * base))
    assert late.sent().acked(13_000, 3.0).backoff == 1.0
    assert link.timed_out(late=False).deadline(13_000) == base


def test_aimd_adds_one_per_window_and_halves_on_a_timeout_or_busy():
    link = Link()
    for _ in range(2):  # one window's worth of acks at window 2
        link = link.sent().acked(FRAME, 0.1)
    assert link.window == pytest.approx(WINDOW_INITIAL + 0.5 + 1 / 2.5)
    assert link.timed_out().window == pytest.approx(link.window / 2)
    assert link.busy().window == pytest.approx(link.window / 2)
    assert Link(window=1.0).timed_out().window == WINDOW_MIN


@settings(max_examples=200)
@given(st.floats(0.001, 20.0), st.lists(st.floats(1.0, 2.0), min_size=1, max_size=40), st.floats(1.0, 2.0))
def test_a_steady_slow_link_is_never_late(base, factors, next_factor):
    """Latencies within a factor of 2 of each other: the next one is always within the deadline."""
    link = Link()
    for factor in factors:
        link = link.sent().acked(FRAME, base * factor)
    assert base * next_factor <= link.deadline(FRAME) or base * next_factor <= DEADLINE_FLOOR


class DeliveryMachine(RuleBasedStateMachine):
    """A sender's use of the router against peers that are live (slow or fast), hung or dead."""

    @initialize(seed=st.integers(), bases=st.lists(st.floats(0.001, 5.0), min_size=1, max_size=4))
    def setup(self, seed, bases):
        self.rng = random.Random(seed)
        self.router = Router(random.Random(seed))
        self.now = 100.0
        self.peers = {f"p{i}": {"base": b, "state": "live"} for i, b in enumerate(bases)}
        self.router.offer([Candidate(p, 1, 0, 0, self.now) for p in self.peers], self.now)
        self.attempts: list[tuple[int, str, float]] = []  # (micro-batch, peer, deadline) on the way
        self.tried: dict[int, set[str]] = {}
        self.sends = self.failures = self.busies = 0
        self.next_mb = 0

    def _refresh(self):
        self.router.offer([Candidate(p, 1, 0, 0, self.now) for p, s in self.peers.items() if s["state"] != "dead"],
                          self.now)

    def _send(self, mb: int) -> None:
        try:
            peer = self.router.next_after(1, self.tried.setdefault(mb, set()), self.now)
        except NoCandidates:
            return
        if peer is None:
            return
        link = self.router.link(peer)
        assert link.has_room  # never offered without room
        self.router.observe_sent(peer, FRAME)
        measured = link.throughput is not None  # before a sample only the driver's progress rule holds
        self.attempts.append((mb, peer, self.router.deadline(peer, FRAME) if measured else float("inf")))
        self.sends += 1

    @rule()
    def cut(self):
        self.next_mb += 1
        self._send(self.next_mb)

    @precondition(lambda self: self.attempts)
    @rule(data=st.data())
    def answer(self, data):
        mb, peer, deadline = self.attempts.pop(data.draw(st.integers(0, len(self.attempts) - 1)))
        state = self.peers[peer]
        self.now += 0.01
        if state["state"] == "live":
            latency = state["base"] * data.draw(st.floats(1.0, 2.0))
            if data.draw(st.booleans()):
                self.busies += 1
                self.router.observe_busy(peer, 64, self.now)
                self.tried[mb].add(peer)
                self._send(mb)
                return
            # the property: a live peer, however slow, answers within the deadline it was given
            assert latency <= deadline or latency <= DEADLINE_FLOOR, (latency, deadline)
            self.router.observe_ack(peer, latency, self.now, 0, FRAME)
            self.tried.pop(mb, None)
            return
        self.failures += 1
        self.router.observe_failure(peer, self.now, Failure.TIMEOUT if state["state"] == "hung" else Failure.ERROR)
        self.tried[mb].add(peer)
        self._send(mb)

    @rule(index=st.integers(0, 3), state=st.sampled_from(["hung", "dead"]))
    def break_peer(self, index, state):
        peers = sorted(self.peers)
        self.peers[peers[index % len(peers)]]["state"] = state

    @rule(dt=st.floats(0.0, 40.0))
    def time_passes(self, dt):
        self.now += dt
        self._refresh()

    @invariant()
    def windows_bounded(self):
        for peer in self.peers:
            link = self.router.link(peer)
            assert WINDOW_MIN <= link.window <= WINDOW_MAX and link.on_the_way >= 0
            assert link.on_the_way == sum(1 for _, p, _ in self.attempts if p == peer)

    @invariant()
    def resends_follow_failures(self):
        # every send beyond a micro-batch's first came after a failure or a Busy of an earlier attempt
        assert self.sends <= self.next_mb + self.failures + self.busies


TestDelivery = DeliveryMachine.TestCase
TestDelivery.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
