"""The pure buffers and the pure accounting of the compute engine (issue 8, item 7; seed Epic 2).

A stage's compute worker must never wait on the network and the network must never silently
lose work. Both needs meet in bounded queues with explicit backpressure: ``offer`` answers
``ACCEPTED`` or says why not (``FULL``, ``TOO_LARGE``) so that the activation protocol can tell
the sender, and nothing is ever dropped behind anyone's back. The inbound buffer serves the most
urgent work first (inference-urgent > inference > training-forward > training-backward), FIFO
within a priority; the outbound queue has the same semantics with its own capacity, and when it
is full the engine takes a local-only step (soft overflow) instead of waiting.

Everything here is pure: time comes in as ``now`` (seconds, non-decreasing; trio's clock in the
driver, hand-built numbers in tests), and the statistics (time-weighted mean occupancy, offers,
accepted and refused per priority, steps, local-only rate, drops, compute-busy fraction) are
computed from those ``now`` values alone. No trio, no libp2p, no torch.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Any

from p2pswarm.errors import ConfigError

INBOUND_CAPACITY_ITEMS = 64  # a few steps of micro-batches: the worker never starves, senders hear "full" early
OUTBOUND_CAPACITY_ITEMS = 32  # results waiting on the network; past this, downstream is the bottleneck
CAPACITY_BYTES = None  # no byte bound unless asked: item counts already bound memory for a fixed model


class Priority(enum.IntEnum):
    """What a micro-batch is for; a lower value is served first."""

    INFERENCE_URGENT = 0
    INFERENCE = 1
    TRAINING_FORWARD = 2
    TRAINING_BACKWARD = 3


class Offer(enum.Enum):
    """The answer to an offer: taken, or refused with the reason the sender is told."""

    ACCEPTED = "accepted"
    FULL = "full"  # no room now: try again later or another peer
    TOO_LARGE = "too_large"  # larger than the whole byte capacity: no room ever

    @property
    def accepted(self) -> bool:
        return self is Offer.ACCEPTED


@dataclass(frozen=True)
class BufferConfig:
    """How much a buffer holds: a count of items and, optionally, a total of bytes."""

    capacity_items: int = INBOUND_CAPACITY_ITEMS
    capacity_bytes: int | None = CAPACITY_BYTES

    def __post_init__(self) -> None:
        if self.capacity_items < 1:
            raise ConfigError(f"buffer capacity must be at least 1 item, not {self.capacity_items}")
        if self.capacity_bytes is not None and self.capacity_bytes < 1:
            raise ConfigError(f"buffer byte capacity must be at least 1, not {self.capacity_bytes}")


INBOUND = BufferConfig(INBOUND_CAPACITY_ITEMS)
OUTBOUND = BufferConfig(OUTBOUND_CAPACITY_ITEMS)


@dataclass(frozen=True)
class Entry:
    """An item as it leaves a buffer, with what it was offered as and when."""

    item: Any
    priority: Priority
    size: int
    offered_at: float


@dataclass(frozen=True)
class PriorityCounts:
    """Offers of one priority: every offer is either accepted or refused."""

    priority: Priority
    offered: int
    accepted: int
    refused: int


@dataclass(frozen=True)
class FillStats:
    """A snapshot of a buffer's fill rate, from the ``now`` values it was given."""

    capacity_items: int
    items: int
    bytes: int
    peak_items: int
    mean_items: float  # time-weighted mean occupancy since the buffer was made
    mean_fill: float  # mean_items / capacity_items, in [0, 1]
    elapsed: float
    counts: tuple[PriorityCounts, ...]  # one per Priority, in priority order

    @property
    def offered(self) -> int:
        return sum(c.offered for c in self.counts)

    @property
    def accepted(self) -> int:
        return sum(c.accepted for c in self.counts)

    @property
    def refused(self) -> int:
        return sum(c.refused for c in self.counts)


class TimeWeighted:
    """The integral over time of a level that changes in steps: a time-weighted mean."""

    def __init__(self, start: float, level: float = 0.0) -> None:
        self.start = start
        self.last = start
        self.level = level
        self.area = 0.0

    def advance(self, now: float) -> None:
        """Account for the level held from the last change until ``now``."""
        if now < self.last:
            raise ValueError(f"time went backwards: {now} < {self.last}")
        self.area += self.level * (now - self.last)
        self.last = now

    def set(self, now: float, level: float) -> None:
        self.advance(now)
        self.level = level

    def area_until(self, now: float) -> float:
        if now < self.last:
            raise ValueError(f"time went backwards: {now} < {self.last}")
        return self.area + self.level * (now - self.last)

    def mean(self, now: float) -> float:
        """The mean level over [start, now]; the current level when no time has passed."""
        elapsed = now - self.start
        return self.area_until(now) / elapsed if elapsed > 0 else float(self.level)


class PriorityBuffer:
    """A bounded buffer: highest priority first, FIFO within a priority, explicit when full.

    Used for both the inbound buffer (``INBOUND``) and the outbound queue (``OUTBOUND``).
    """

    def __init__(self, config: BufferConfig, start: float) -> None:
        self.config = config
        self._queues: dict[Priority, deque[Entry]] = {p: deque() for p in Priority}
        self._items = 0
        self._bytes = 0
        self._peak = 0
        self._occupancy = TimeWeighted(start)
        self._offered = {p: 0 for p in Priority}
        self._accepted = {p: 0 for p in Priority}

    def __len__(self) -> int:
        return self._items

    @property
    def bytes(self) -> int:
        return self._bytes

    def room_for(self, size: int = 0) -> Offer:
        """What an offer of ``size`` bytes would be answered now, without offering it."""
        if size < 0:
            raise ValueError(f"an item's size cannot be negative: {size}")
        cap = self.config.capacity_bytes
        if cap is not None and size > cap:
            return Offer.TOO_LARGE
        if self._items >= self.config.capacity_items:
            return Offer.FULL
        if cap is not None and self._bytes + size > cap:
            return Offer.FULL
        return Offer.ACCEPTED

    @property
    def full(self) -> bool:
        """No room for even an empty item: the congestion signal the engine reads."""
        return self.room_for(0) is not Offer.ACCEPTED

    def offer(self, item: Any, priority: Priority, now: float, size: int = 0) -> Offer:
        """Take ``item`` if there is room; otherwise say why not. Every offer is counted."""
        priority = Priority(priority)
        self._occupancy.advance(now)
        verdict = self.room_for(size)
        self._offered[priority] += 1
        if verdict is Offer.ACCEPTED:
            self._accepted[priority] += 1
            self._queues[priority].append(Entry(item, priority, size, now))
            self._items += 1
            self._bytes += size
            self._peak = max(self._peak, self._items)
            self._occupancy.set(now, self._items)
        return verdict

    def take(self, now: float) -> Entry | None:
        """The oldest entry of the highest priority present, or None when empty."""
        self._occupancy.advance(now)
        for priority in Priority:
            queue = self._queues[priority]
            if queue:
                entry = queue.popleft()
                self._items -= 1
                self._bytes -= entry.size
                self._occupancy.set(now, self._items)
                return entry
        return None

    def stats(self, now: float) -> FillStats:
        """The fill rate so far; ``now`` must not be earlier than the last operation."""
        mean = self._occupancy.mean(now)
        counts = tuple(
            PriorityCounts(p, self._offered[p], self._accepted[p], self._offered[p] - self._accepted[p])
            for p in Priority
        )
        return FillStats(
            capacity_items=self.config.capacity_items,
            items=self._items,
            bytes=self._bytes,
            peak_items=self._peak,
            mean_items=mean,
            mean_fill=mean / self.config.capacity_items,
            elapsed=now - self._occupancy.start,
            counts=counts,
        )


def inbound_buffer(start: float, config: BufferConfig = INBOUND) -> PriorityBuffer:
    """The inbound buffer of a stage: micro-batches waiting for the compute worker."""
    return PriorityBuffer(config, start)


def outbound_queue(start: float, config: BufferConfig = OUTBOUND) -> PriorityBuffer:
    """The outbound queue of a stage: results waiting for the network."""
    return PriorityBuffer(config, start)


class Outcome(enum.Enum):
    """How a piece of compute ended."""

    SENT = "sent"  # a step whose result was handed to the outbound queue
    LOCAL_ONLY = "local_only"  # a step taken while outbound was congested: soft overflow, the engine goes on
    DROPPED = "dropped"  # the micro-batch was lost (its path lost a peer, bad input): counted, never fatal


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's accounting, from the ``now`` values it was given."""

    steps: int  # SENT + LOCAL_ONLY
    local_only: int
    drops: int
    local_only_rate: float  # local_only / steps, 0 before the first step
    busy_fraction: float  # share of wall time the worker had a micro-batch, in [0, 1]
    elapsed: float
    busy_since_first: float = 0.0  # the same share since the first micro-batch (the swarm formed), in [0, 1]


def hand_on(outbound: PriorityBuffer, item: Any, priority: Priority, now: float, size: int = 0) -> Outcome:
    """Offer a finished step's result to the outbound queue; congested means a local-only step.

    The engine never waits on the network: a refused result is not retried here, the step is
    counted as ``LOCAL_ONLY`` (soft overflow) and the worker goes on with its next micro-batch.
    """
    accepted = outbound.offer(item, priority, now, size).accepted
    return Outcome.SENT if accepted else Outcome.LOCAL_ONLY


class EngineLedger:
    """The pure accounting of the compute engine: steps, local-only steps, drops, busy time."""

    def __init__(self, start: float) -> None:
        self._busy = TimeWeighted(start)
        self._counts = {o: 0 for o in Outcome}
        self._first: float | None = None  # when the worker picked up its first micro-batch

    @property
    def busy(self) -> bool:
        return self._busy.level > 0

    def begin(self, now: float) -> None:
        """The worker picked up a micro-batch; it is busy from ``now``."""
        if self.busy:
            raise ValueError("the worker already has a micro-batch")
        self._first = now if self._first is None else self._first
        self._busy.set(now, 1)

    def finish(self, now: float, outcome: Outcome) -> None:
        """The worker is done with its micro-batch at ``now``; count how it ended."""
        if not self.busy:
            raise ValueError("the worker has no micro-batch to finish")
        self._busy.set(now, 0)
        self._counts[Outcome(outcome)] += 1

    def drop(self, count: int = 1) -> None:
        """Micro-batches lost outside the worker (a path lost a peer before compute)."""
        if count < 0:
            raise ValueError(f"cannot drop a negative count: {count}")
        self._counts[Outcome.DROPPED] += count

    def stats(self, now: float) -> EngineStats:
        """The accounting so far; an ongoing micro-batch counts as busy until ``now``."""
        sent, local = self._counts[Outcome.SENT], self._counts[Outcome.LOCAL_ONLY]
        steps = sent + local
        elapsed = now - self._busy.start
        area = self._busy.area_until(now)
        busy = area / elapsed if elapsed > 0 else 0.0
        since = now - self._first if self._first is not None else 0.0
        return EngineStats(
            steps=steps,
            local_only=local,
            drops=self._counts[Outcome.DROPPED],
            local_only_rate=local / steps if steps else 0.0,
            busy_fraction=min(1.0, max(0.0, busy)),
            elapsed=elapsed,
            busy_since_first=min(1.0, max(0.0, area / since)) if since > 0 else 0.0,
        )
