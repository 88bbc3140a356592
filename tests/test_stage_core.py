"""The pure stage core (``swarm/stage_core.py``) on virtual time: stage 0's micro-batches from cut to
gradient, peers that ack, lose, fail or go silent, and the invariants that must hold throughout.

No trio, no torch: work items are plain records, ``now`` is a number the tests move on.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from p2pswarm.errors import RemoteProtocolError
from p2pswarm.swarm import admission
from p2pswarm.swarm.activation import NO_ROUND, SESSION_BYTES, Ack, Backward, Busy, Forward
from p2pswarm.swarm.buffers import INBOUND_CAPACITY_ITEMS, OUTBOUND_CAPACITY_ITEMS, Priority
from p2pswarm.swarm.inflight import IN_FLIGHT_DEADLINE
from p2pswarm.swarm.stage_core import EVAL_HOLD, MAX_HELD_EVALS, Count, Effects, HeldEvals, Job, Send, StageCore

SESSION = b"s" * SESSION_BYTES
PEERS = ("peer-a", "peer-b", "peer-c")


@dataclass(frozen=True)
class Work:
    """What the core reads of ``engine.Work``."""

    kind: str
    key: tuple[bytes, int]
    step: int = 0
    rounds: tuple[int, ...] = ()


def forward_send(key, priority=Priority.TRAINING_FORWARD) -> Send:
    message = Forward(session=key[0], micro_batch=key[1], stage=1, priority=int(priority), step=0,
                      dtype="float32", shape=(1, 1, 4), targets=0)
    return Send(message, b"\0" * 16, key)


def backward_message(key, stage: int = 0) -> Backward:
    return Backward(session=key[0], micro_batch=key[1], stage=stage, priority=int(Priority.TRAINING_BACKWARD),
                    step=0, dtype="float32", shape=(1, 1, 4), targets=0)


class StageZero(RuleBasedStateMachine):
    """Stage 0 of a pipeline: cut, compute, send, ack or lose, gradients back, peers fail, time passes."""

    @initialize(bound=st.integers(1, 5))
    def start(self, bound: int) -> None:
        self.now = 0.0
        self.core = StageCore(is_first=True, is_last=False, max_in_flight=bound, now=self.now)
        self.cut_keys: list = []  # every micro-batch cut, in order
        self.taken: set = set()  # (kind, key) of every job the core handed out
        self.failed: set = set()  # computes that raised
        self.left: dict = {}  # key -> "finished" or "given up": how it left the in-flight book
        self.seen_inflight: set = set()

    def _step(self, effects: Effects) -> None:
        """Apply ``effects`` as a driver would, and check how keys left the in-flight book."""
        assert set(effects.forget) <= set(self.cut_keys)

    def _track(self, before: set, finished: set = frozenset()) -> None:
        after = {k for k in self.cut_keys if k in self.core.inflight}
        assert not (after & set(self.left)), "a micro-batch came back into flight after it ended"
        self.seen_inflight |= after
        for key in before - after:
            assert key not in self.left, "a micro-batch ended twice"
            self.left[key] = "finished" if key in finished else "given up"

    def _inflight(self) -> set:
        return {k for k in self.cut_keys if k in self.core.inflight}

    @rule(dt=st.floats(0.0, 20.0))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        before = self._inflight()
        effects = self.core.expire(self.now)
        self._step(effects)
        self._track(before)
        assert effects.progress == bool(before - self._inflight())

    @precondition(lambda self: self.core.can_cut())
    @rule()
    def cut(self) -> None:
        key = (SESSION, len(self.cut_keys))
        effects = self.core.cut(Job(Work("forward", key), None), Priority.TRAINING_FORWARD, self.now)
        if effects is not None:
            assert effects.work
            self.cut_keys.append(key)

    @rule(fails=st.booleans())
    def compute(self, fails: bool) -> None:
        before = self._inflight()
        job, effects = self.core.take(NO_ROUND, self.now)
        self._step(effects)
        if job is None:
            return
        item = (job.work.kind, job.work.key)
        assert item not in self.taken, "a job was handed out twice"
        self.taken.add(item)
        if fails:
            if job.work.kind == "forward":
                self.failed.add(job.work.key)
            self._step(self.core.failed(job, self.now))
            self._track(before)
            return
        sends = [forward_send(job.work.key)] if job.work.kind == "forward" else []
        done_before = self.core.counts[Count.MICRO_BATCHES_DONE]
        effects = self.core.done(job, sends, 0.01, self.now)
        self._step(effects)
        finished = {job.work.key} if self.core.counts[Count.MICRO_BATCHES_DONE] > done_before else set()
        self._track(before, finished)
        if job.work.kind == "forward" and job.work.key not in self.core.inflight:  # a local-only step
            assert (Count.GIVEN_UP in self.core.counts) and job.work.key in effects.forget
            self.left[job.work.key] = "given up"

    @rule(peer=st.sampled_from(PEERS), ack=st.booleans())
    def deliver(self, peer: str, ack: bool) -> None:
        entry = self.core.outbound.take(self.now)
        if entry is None:
            return
        before = self._inflight()
        send = entry.item
        assert send.to is None  # a forward: the router chooses
        self._step(self.core.acked(send.key, peer) if ack else self.core.lost(send))
        self._track(before)

    @rule(data=st.data(), duplicate=st.booleans())
    def gradient_arrives(self, data, duplicate: bool) -> None:
        waiting = sorted(self._inflight())
        key = data.draw(st.sampled_from(waiting)) if waiting else (SESSION, len(self.cut_keys) + 7)
        kind = admission.classify(backward_message(key), stage=0, is_last=False, waiting=self.core.inflight)
        if kind is None:
            assert key not in self.core.inflight  # a late gradient: acked and ignored
            return
        job = Job(Work("backward", key), "peer-a")
        reply, effects = self.core.admit(job, Priority.TRAINING_BACKWARD, self.now)
        self._step(effects)
        assert isinstance(reply, Ack)  # the buffer never fills here: one gradient per micro-batch in flight
        if duplicate:  # a re-send after a lost ack: never queued twice
            queued = len(self.core.inbound)
            again, effects = self.core.admit(job, Priority.TRAINING_BACKWARD, self.now)
            assert again.duplicate and len(self.core.inbound) == queued and not effects.work

    @rule(peer=st.sampled_from(PEERS))
    def peer_fails(self, peer: str) -> None:
        before = self._inflight()
        self._step(self.core.peer_failed(peer))
        self._track(before)

    @rule(connected=st.sets(st.sampled_from(PEERS)))
    def peers_disconnect(self, connected: set) -> None:
        before = self._inflight()
        self._step(self.core.disconnected(connected))
        self._track(before)

    @invariant()
    def in_flight_never_above_the_bound(self) -> None:
        assert self.core.local_queued + self.core.inflight.waiting_from(None) <= self.core.max_in_flight
        assert len(self.core.inflight) <= self.core.max_in_flight

    @invariant()
    def every_micro_batch_is_in_one_place_and_ends_once(self) -> None:
        """Each cut micro-batch is queued, computing failed, in flight, or ended (finished or given up)
        exactly once; the counts agree with that."""
        counts, left = self.core.counts, list(self.left.values())
        queued = self.core.local_queued
        assert counts[Count.MICRO_BATCHES_DONE] == left.count("finished")
        assert counts[Count.GIVEN_UP] == left.count("given up")
        assert queued + len(self.failed) + len(self._inflight()) + len(self.left) == len(self.cut_keys)
        assert not (set(self.left) & self._inflight())

    @invariant()
    def counts_are_named_and_never_zero(self) -> None:
        assert all(isinstance(k, Count) and n > 0 for k, n in self.core.counts.items())


StageZero.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestStageZero = StageZero.TestCase


# --- admitting a peer's frames ---------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 80).map(lambda i: ("frame", i)), st.just(("take", 0))), max_size=200))
def test_a_micro_batch_is_queued_once_and_busy_only_when_full(events):
    core = StageCore(is_first=False, is_last=False, max_in_flight=2, now=0.0)
    queued, taken = set(), []
    for what, i in events:
        if what == "take":
            job, _ = core.take(NO_ROUND, 0.0)
            if job is not None:
                core.done(job, [], 0.01, 0.0)
                queued.discard(job.work.key)
                taken.append(job.work.key)
            continue
        key = (SESSION, i)
        full = len(core.inbound) >= INBOUND_CAPACITY_ITEMS
        reply, effects = core.admit(Job(Work("forward", key), "up"), Priority.TRAINING_FORWARD, 0.0)
        if key in queued or key in taken:
            assert reply == Ack(i, len(core.inbound), duplicate=True) and not effects.work
        elif full:
            assert isinstance(reply, Busy) and reply.retry_after_ms > 0
        else:
            assert reply == Ack(i, len(core.inbound)) and effects.work
            queued.add(key)
        assert len(core.inbound) == len(queued)
    assert len(taken) == len(set(taken))  # never computed twice
    assert core.counts[Count.DUPLICATES_DROPPED] == sum(1 for w, i in events if w == "frame") - len(queued) \
        - len(taken) - core.counts[Count.BUSY_REPLIES]


def test_a_gradient_goes_back_to_where_its_forward_came_from():
    """The one place a gradient's destination is set: a middle stage's forward waits in flight with its
    upstream; the gradient computed from the next stage's gradient goes to that upstream peer."""
    core, key = StageCore(is_first=False, is_last=False, max_in_flight=2, now=0.0), (SESSION, 3)
    core.admit(Job(Work("forward", key), "upstream-peer"), Priority.TRAINING_FORWARD, 0.0)
    job, _ = core.take(NO_ROUND, 0.0)
    assert core.done(job, [forward_send(key)], 0.01, 0.0).worked == (("upstream-peer", -1),)  # work we saw
    core.acked(key, "downstream-peer")
    core.admit(Job(Work("backward", key), "downstream-peer"), Priority.TRAINING_BACKWARD, 1.0)
    job, _ = core.take(NO_ROUND, 1.0)
    gradient = Send(backward_message(key, stage=0), b"\0" * 16, key)
    assert core.done(job, [gradient], 0.01, 1.0).worked == (("downstream-peer", +1),)  # it computed ours
    core.outbound.take(1.0)  # the forward
    assert core.outbound.take(1.0).item.to == "upstream-peer"
    assert core.counts[Count.GRADIENTS_PASSED] == 1 and key not in core.inflight


def test_the_last_stage_sends_its_gradient_to_the_forwards_sender_and_keeps_nothing_in_flight():
    core, key = StageCore(is_first=False, is_last=True, max_in_flight=2, now=0.0), (SESSION, 1)
    core.admit(Job(Work("forward", key), "up"), Priority.TRAINING_FORWARD, 0.0)
    job, _ = core.take(NO_ROUND, 0.0)
    effects = core.done(job, [Send(backward_message(key, stage=1), b"\0" * 16, key)], 0.01, 0.0)
    assert effects.sends and core.outbound.take(0.0).item.to == "up" and len(core.inflight) == 0


def test_a_full_outbound_queue_makes_a_local_only_step_and_gives_the_micro_batch_up():
    core = StageCore(is_first=True, is_last=False, max_in_flight=100, now=0.0)
    outcomes = []
    for i in range(OUTBOUND_CAPACITY_ITEMS + 1):
        core.cut(Job(Work("forward", (SESSION, i)), None), Priority.TRAINING_FORWARD, 0.0)
        job, _ = core.take(NO_ROUND, 0.0)
        effects = core.done(job, [forward_send(job.work.key)], 0.01, 0.0)
        outcomes.append(core.ledger.stats(0.0).local_only)
    assert outcomes[-1] == 1 and (SESSION, i) in effects.forget and (SESSION, i) not in core.inflight
    assert core.counts[Count.LOST_FORWARD] == 1 and core.counts[Count.GIVEN_UP] == 1


def test_overdue_gradients_blame_the_peer_that_took_them():
    core = StageCore(is_first=True, is_last=False, max_in_flight=2, now=0.0)
    for i in range(2):
        core.cut(Job(Work("forward", (SESSION, i)), None), Priority.TRAINING_FORWARD, 0.0)
        job, _ = core.take(NO_ROUND, 0.0)
        core.done(job, [forward_send(job.work.key)], 0.01, 0.0)
    core.acked((SESSION, 0), "slow-peer")
    assert core.expire(IN_FLIGHT_DEADLINE - 1) == Effects()
    effects = core.expire(IN_FLIGHT_DEADLINE)
    assert set(effects.forget) == {(SESSION, 0), (SESSION, 1)} and effects.blame == ("slow-peer",)
    assert core.counts[Count.GRADIENTS_OVERDUE] == 1 and core.counts[Count.GIVEN_UP] == 2 and core.can_cut()


# --- held evaluations ------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.floats(0, 40), st.integers(0, 6)), max_size=60))
def test_held_evaluations_wait_for_their_round_never_longer_than_eval_hold(events):
    held, released, now = HeldEvals(), [], 0.0
    for i, (wanted, dt, agreed) in enumerate(events):
        now += dt
        released += held.release(agreed, now)
        job = Job(Work("eval", (SESSION, i), rounds=(wanted,)), "up", ("p",), now)
        was = len(held.jobs)
        if held.hold(job, agreed, now):
            assert wanted > agreed and was < MAX_HELD_EVALS
        assert len(held.jobs) <= MAX_HELD_EVALS
        assert all(j.work.rounds[0] > agreed and now - j.arrived <= EVAL_HOLD for j in held.jobs)
    keys = [j.work.key for j in released]
    assert len(keys) == len(set(keys))  # nothing released twice


def test_no_outer_round_means_nothing_is_held():
    assert not HeldEvals().hold(Job(Work("eval", (SESSION, 0), rounds=(3,)), "up"), NO_ROUND, 0.0)


# --- which frames a stage computes -----------------------------------------------------------------------


@pytest.mark.parametrize("stage, is_last, priority, targets, rounds, expected", [
    (1, False, Priority.TRAINING_FORWARD, 0, (), "forward"),
    (1, True, Priority.TRAINING_FORWARD, 16, (), "forward"),
    (1, True, Priority.INFERENCE, 16, (NO_ROUND,), "eval"),
    (1, True, Priority.TRAINING_FORWARD, 0, (), RemoteProtocolError),  # no targets for the last stage
    (0, False, Priority.TRAINING_FORWARD, 0, (), RemoteProtocolError),  # a forward for stage 0
    (1, False, Priority.TRAINING_BACKWARD, 0, (), RemoteProtocolError),
    (2, False, Priority.INFERENCE, 0, (NO_ROUND,), RemoteProtocolError),  # one round short
])
def test_classify(stage, is_last, priority, targets, rounds, expected):
    message = Forward(session=SESSION, micro_batch=0, stage=stage, priority=int(priority), step=0,
                      dtype="float32", shape=(1, 1, 4), targets=targets, rounds=rounds,
                      path=tuple("p" for _ in rounds))
    if expected is RemoteProtocolError:
        with pytest.raises(RemoteProtocolError):
            admission.classify(message, stage=stage, is_last=is_last, waiting=())
    else:
        assert admission.classify(message, stage=stage, is_last=is_last, waiting=()) == expected


def test_bans_expire():
    bans = admission.Bans(period=10.0)
    bans.bar("liar", 0.0)
    assert bans.barred("liar", 9.9) and not bans.barred("honest", 1.0)
    bans.prune(10.0)
    assert not bans.barred("liar", 10.0) and not bans.until
