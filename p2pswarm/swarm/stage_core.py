"""The pure core of a stage's training: what it admits, holds, computes next and hands on, and counts.

``SwarmService`` (``swarm/service.py``) is the trio driver around this core; the core itself is
plain Python. Time comes in as ``now`` (trio's clock in the driver, numbers in tests); events
come in as method calls (a frame admitted, a job taken or done, a frame acked or lost, a peer
failed, the clock passed a deadline) and what the driver must do comes back as ``Effects``:
kept graphs for the engine to forget, peers to blame for an overdue gradient, and which waiters
to wake (the compute worker, the senders, stage 0's feeders). Nothing here imports trio or torch.

What it keeps:

- the bounded inbound buffer (``buffers.inbound_buffer``), the outbound queue and the engine's
  ledger; ``taken`` (a micro-batch is computed at most once: a copy is a duplicate);
- the micro-batches whose gradient we wait for (``inflight.InFlight``); a gradient's destination
  is decided in one place, ``_route``: the peer the micro-batch's forward came from;
- stage 0's own work: micro-batches cut and not yet computed (bounded by ``max_in_flight``
  together with those in flight), held-out batches cut and not yet computed or acked;
- evaluations that wait for our outer round to reach theirs (``HeldEvals``, ``EVAL_HOLD`` at most);
- the counts ``/api/swarm`` shows, keyed by ``Count``.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from p2pswarm.run.spec import MAX_EVAL_BATCHES
from p2pswarm.swarm.activation import (
    MAX_RETRY_AFTER_MS,
    NO_ROUND,
    Ack,
    Backward,
    Busy,
    Forward,
)
from p2pswarm.swarm.buffers import (
    EngineLedger,
    Outcome,
    Priority,
    hand_on,
    inbound_buffer,
    outbound_queue,
)
from p2pswarm.swarm.inflight import InFlight, Pending, RecentKeys

Key = tuple[bytes, int]  # (session, micro-batch id)

EVAL_HOLD = 30.0  # seconds an evaluation waits for our outer round to reach stage 0's (a round's gather + reduce)
MAX_HELD_EVALS = 4 * MAX_EVAL_BATCHES  # evaluations held at once: a few rounds' worth, never unbounded
COMPUTE_S = 0.05  # first guess of one job's compute time, before any is measured: Busy's retry-after hint
COMPUTE_EMA = 0.1  # weight of a new job's compute time in its average


class Count(enum.StrEnum):
    """The counters of ``/api/swarm`` ``counts`` (their values are the keys it shows)."""

    GARBAGE_FRAMES = "garbage_frames"  # frames that broke the protocol: the sender is barred
    OTHER_RUN_FRAMES = "other_run_frames"  # tensors of another run, refused
    WRONG_STAGE_FRAMES = "wrong_stage_frames"  # tensors for a stage we do not serve (we moved), refused
    LATE_GRADIENTS = "late_gradients"  # gradients of micro-batches given up already
    DUPLICATES_DROPPED = "duplicates_dropped"  # re-sends of what we hold or did
    BUSY_REPLIES = "busy_replies"  # frames refused because the inbound buffer was full
    FORWARDS_TRAINED = "forwards_trained"  # training forwards from a peer that we computed
    MICRO_BATCHES_DONE = "micro_batches_done"  # stage 0: gradients that came back
    GRADIENTS_PASSED = "gradients_passed"  # other stages: gradients handed on upstream
    GIVEN_UP = "given_up"  # micro-batches whose gradient will not come
    GRADIENTS_OVERDUE = "gradients_overdue"  # of those, the ones a peer acked and never answered
    LOST_FORWARD = "lost_forward"  # forwards no peer took
    LOST_BACKWARD = "lost_backward"  # gradients their one destination did not take
    NON_FINITE_LOSSES = "non_finite_losses"  # NaN or inf losses, left out of the average


@dataclass(frozen=True)
class Job:
    """A unit of work in the inbound buffer, with the peer it came from (None: cut here)."""

    work: Any  # engine.Work: its kind, key, step and rounds are all the core reads
    upstream: str | None
    path: tuple[str, ...] = ()  # an evaluation's chain so far: the peers of the stages before us
    arrived: float = 0.0  # when it came in: an evaluation waits for our outer round EVAL_HOLD at most


@dataclass(frozen=True)
class Send:
    """A frame waiting in the outbound queue."""

    message: Forward | Backward
    payload: bytes
    key: Key
    to: str | None = None  # the gradient's destination (``StageCore._route``); None for a forward (the router's)


@dataclass(frozen=True)
class Effects:
    """What the driver does after an event: engine graphs to forget, peers to blame, waiters to wake."""

    forget: tuple[Key, ...] = ()
    blame: tuple[str, ...] = ()  # peers that acked a micro-batch and never sent its gradient back
    work: bool = False  # new work in the inbound buffer: wake the compute worker
    sends: bool = False  # new frames in the outbound queue: wake the senders
    progress: bool = False  # a job done or a micro-batch given up: wake stage 0's feeders
    worked: tuple[tuple[str, int], ...] = ()  # (peer, stage offset): the upstream peer whose forward we computed
    #   (-1), the downstream peer that sent back the gradient of what we sent it (+1): work we saw (dht.work)

    def __or__(self, other: Effects) -> Effects:
        return Effects(self.forget + other.forget, self.blame + other.blame, self.work or other.work,
                       self.sends or other.sends, self.progress or other.progress, self.worked + other.worked)


NOTHING = Effects()


class HeldEvals:
    """Evaluations that ask for an outer round we have not agreed yet (stage 0 finished it before
    us): held beside the buffer until we reach it or EVAL_HOLD passes, MAX_HELD_EVALS at most."""

    def __init__(self) -> None:
        self.jobs: list[Job] = []

    def hold(self, job: Job, agreed: int, now: float) -> bool:
        """Hold ``job`` if it must wait; True if it was held."""
        work = job.work
        if work.kind != "eval" or not work.rounds or agreed == NO_ROUND or work.rounds[0] <= agreed \
                or now - job.arrived > EVAL_HOLD or len(self.jobs) >= MAX_HELD_EVALS:
            return False
        self.jobs.append(job)
        return True

    def release(self, agreed: int, now: float) -> list[Job]:
        """The held jobs whose round we reached, or that waited long enough (no longer held)."""
        ready = [j for j in self.jobs if j.work.rounds[0] <= agreed or now - j.arrived > EVAL_HOLD]
        self.jobs = [j for j in self.jobs if j not in ready]
        return ready


class StageCore:
    """One stage's buffers, in-flight book and counts (module docstring)."""

    def __init__(self, *, is_first: bool, is_last: bool, max_in_flight: int, now: float) -> None:
        self.is_first, self.is_last, self.max_in_flight = is_first, is_last, max_in_flight
        self.inbound, self.outbound = inbound_buffer(now), outbound_queue(now)
        self.ledger = EngineLedger(now)
        self.inflight = InFlight()
        self.taken = RecentKeys()  # micro-batches taken from peers: copies are duplicates
        self.held = HeldEvals()
        self.counts: Counter[Count] = Counter()
        self.compute_s = COMPUTE_S  # average of one job's compute time: the basis of Busy's retry-after
        self.local_queued = 0  # stage 0: training micro-batches cut and not yet computed
        self.evals_queued = 0  # stage 0: held-out batches cut and not yet computed
        self.eval_sends: set[Key] = set()  # stage 0: held-out batches computed and not yet acked downstream

    # --- admitting --------------------------------------------------------------------------------

    def admit(self, job: Job, priority: Priority, now: float) -> tuple[Ack | Busy, Effects]:
        """A peer's frame, checked already: queued and acked, acked as a duplicate, or refused Busy."""
        micro_batch, taken = job.work.key[1], (job.work.kind, job.work.key)
        if not self.taken.add(taken):  # a re-send of what we hold or did: never computed twice
            self.counts[Count.DUPLICATES_DROPPED] += 1
            return Ack(micro_batch, len(self.inbound), duplicate=True), NOTHING
        if not self.inbound.offer(job, priority, now).accepted:
            self.taken.discard(taken)
            self.counts[Count.BUSY_REPLIES] += 1
            retry_ms = min(MAX_RETRY_AFTER_MS, int(1000 * self.compute_s * max(1, len(self.inbound))))
            return Busy(micro_batch, len(self.inbound), retry_ms), NOTHING
        return Ack(micro_batch, len(self.inbound)), Effects(work=True)

    def can_cut(self) -> bool:
        """Stage 0: whether another training micro-batch may be cut (the in-flight bound)."""
        return self.local_queued + self.inflight.waiting_from(None) < self.max_in_flight

    def cut(self, job: Job, priority: Priority, now: float) -> Effects | None:
        """Stage 0: our own micro-batch (training or held-out) into the buffer; None if it is full."""
        if not self.inbound.offer(job, priority, now).accepted:
            return None
        if job.work.kind == "eval":
            self.evals_queued += 1
        else:
            self.local_queued += 1
        return Effects(work=True)

    @property
    def evals_pending(self) -> bool:
        """Stage 0: held-out batches of the last round still to compute or to be acked."""
        return bool(self.evals_queued or self.eval_sends)

    def release_held(self, agreed: int, now: float) -> Effects:
        """Held evaluations that may go now, back into the buffer."""
        woke = False
        for job in self.held.release(agreed, now):
            woke = self.inbound.offer(job, Priority.INFERENCE, now).accepted or woke
        return Effects(work=woke)

    # --- computing --------------------------------------------------------------------------------

    def take(self, agreed: int, now: float) -> tuple[Job | None, Effects]:
        """The most urgent job to compute now (evaluations ahead of our round are held), or None."""
        while True:
            entry = self.inbound.take(now)
            if entry is None:
                return None, NOTHING
            job: Job = entry.item
            if not self.held.hold(job, agreed, now):
                break
        effects = NOTHING
        if job.upstream is None and job.work.kind == "forward":
            self.local_queued -= 1
        if job.upstream is None and job.work.kind == "eval":
            self.evals_queued -= 1
            effects = Effects(progress=True)
        self.ledger.begin(now)
        return job, effects

    def failed(self, job: Job, now: float) -> Effects:
        """The job's compute raised: the micro-batch is lost here."""
        self.ledger.finish(now, Outcome.DROPPED)
        return self.give_up(job.work.key)

    def done(self, job: Job, sends: list[Send], seconds: float, now: float) -> Effects:
        """The job was computed in ``seconds``; ``sends`` are its frames, their gradients' destinations unset."""
        self.compute_s += COMPUTE_EMA * (seconds - self.compute_s)
        worked: tuple[tuple[str, int], ...] = ()
        if job.upstream is not None and job.work.kind == "forward":
            self.counts[Count.FORWARDS_TRAINED] += 1  # at most once per micro-batch: ``taken``
            worked = ((job.upstream, -1),)
        entry = self.inflight.finish(job.work.key) if job.work.kind == "backward" else None
        if entry is not None and job.upstream is not None and entry.sent_to == job.upstream:
            worked = ((job.upstream, +1),)  # the peer we sent the forward to computed it and its backward
        outcome, effects = self._hand_on(job, self._route(job, sends, entry), now)
        self.ledger.finish(now, outcome)
        return effects | Effects(progress=True, worked=worked)

    def _route(self, job: Job, sends: list[Send], entry: Pending | None) -> list[Send]:
        """The one place a gradient's destination is set: the peer its micro-batch's forward came from
        (for a backward job, the in-flight ``entry``'s upstream; else the job's own upstream). A gradient
        whose micro-batch was given up while it was computed goes nowhere."""
        work = job.work
        if work.kind == "backward":
            if entry is None:
                return []
            self.counts[Count.MICRO_BATCHES_DONE if self.is_first else Count.GRADIENTS_PASSED] += 1
            upstream = entry.upstream
        else:
            upstream = job.upstream
        return [replace(s, to=upstream) if isinstance(s.message, Backward) else s for s in sends]

    def _hand_on(self, job: Job, sends: list[Send], now: float) -> tuple[Outcome, Effects]:
        work, outcome, effects = job.work, Outcome.SENT, NOTHING
        if work.kind == "forward" and not self.is_last:
            self.inflight.add(work.key, job.upstream, now)
        if work.kind == "eval" and self.is_first and sends:
            self.eval_sends.add(work.key)  # on its way until acked or lost
        for send in sends:
            if hand_on(self.outbound, send, Priority(send.message.priority), now, len(send.payload)) \
                    is Outcome.LOCAL_ONLY:
                outcome = Outcome.LOCAL_ONLY
                effects = effects | self.lost(send)
            else:
                effects = effects | Effects(sends=True)
        return outcome, effects

    # --- what became of what we sent --------------------------------------------------------------

    def acked(self, key: Key, peer: str) -> Effects:
        """The next stage (or the upstream peer) acked ``key``."""
        self.inflight.sent_to(key, peer)
        self.eval_sends.discard(key)
        return Effects(progress=True)

    def lost(self, send: Send) -> Effects:
        """No peer took ``send`` (or the outbound queue had no room for it)."""
        self.counts[Count.LOST_FORWARD if isinstance(send.message, Forward) else Count.LOST_BACKWARD] += 1
        self.eval_sends.discard(send.key)
        if isinstance(send.message, Forward) and send.message.priority == Priority.TRAINING_FORWARD:
            return self.give_up(send.key)
        return NOTHING

    def give_up(self, key: Key) -> Effects:
        if self.inflight.give_up(key) is not None:
            self.counts[Count.GIVEN_UP] += 1
        return Effects(forget=(key,), progress=True)

    def peer_failed(self, peer: str) -> Effects:
        """``peer`` failed: every micro-batch that went to it is given up."""
        keys = tuple(self.inflight.peer_failed(peer))
        self._count(Count.GIVEN_UP, len(keys))
        return Effects(forget=keys, progress=True)

    def disconnected(self, connected: set[str]) -> Effects:
        """The peers we sent micro-batches to that are no longer connected have failed."""
        effects = NOTHING
        for peer in {e.sent_to for e in self.inflight.entries() if e.sent_to} - connected:
            effects = effects | self.peer_failed(peer)
        return effects

    def expire(self, now: float) -> Effects:
        """Give up micro-batches whose gradient is overdue; blame the peers that took them (measured
        from our side: their acks alone prove nothing)."""
        expired = self.inflight.expire(now)
        blame = tuple(e.sent_to for _, e in expired if e.sent_to is not None)
        self._count(Count.GIVEN_UP, len(expired))
        self._count(Count.GRADIENTS_OVERDUE, len(blame))
        return Effects(forget=tuple(k for k, _ in expired), blame=blame, progress=bool(expired))

    def _count(self, count: Count, n: int) -> None:
        if n:  # a count shows in /api/swarm once it happened: never as a 0
            self.counts[count] += n
