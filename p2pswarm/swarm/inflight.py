"""Micro-batches a stage holds state for until their gradient comes back: the pure book of them.

When a stage runs a training forward it keeps what the backward will need (the engine's saved
graph) and waits for the gradient from the stage after it. That gradient may never come: the
peer the activations went to died after acking them, or the path behind it did. This book says
which waits to give up, so that the engine frees their state and the stage-0 driver cuts new
micro-batches instead of waiting forever:

- ``add`` a micro-batch when its forward has run (``upstream`` is the peer it came from, None
  on stage 0, where micro-batches start), ``sent_to`` once a downstream peer acked it;
- ``finish`` it when its gradient arrived (the entry is returned: the backward goes upstream);
- ``peer_failed`` gives up every micro-batch that went to a peer now known dead;
- ``expire`` gives up those older than the deadline (a silent loss somewhere downstream).

Pure: time is ``now`` (seconds), no trio, no torch. Bounded: at most ``capacity`` entries.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

Key = tuple[bytes, int]  # (session, micro-batch id)

# seconds a micro-batch may wait for its gradient: a stage's compute on a loaded machine, twice
IN_FLIGHT_DEADLINE = 30.0
IN_FLIGHT_CAPACITY = 256  # entries at most: a stage's inbound buffer (64) several times over
RECENT_KEYS = 4096  # micro-batches a receiver remembers taking: minutes of work, far beyond any re-send


@dataclass(frozen=True)
class Pending:
    """One micro-batch waiting for its gradient."""

    upstream: str | None  # the peer that sent us its forward; None where it started (stage 0)
    started: float
    sent_to: str | None = None  # the downstream peer that acked its activations


@dataclass(frozen=True)
class _From:
    """``InFlight.awaiting``: a container of the keys one peer may send the gradient of."""

    book: InFlight
    peer: str

    def __contains__(self, key: Key) -> bool:
        return self.book.awaits(key, self.peer)


class InFlight:
    """The micro-batches of one stage that wait for a gradient (module docstring)."""

    def __init__(self, deadline: float = IN_FLIGHT_DEADLINE, capacity: int = IN_FLIGHT_CAPACITY) -> None:
        if deadline <= 0 or capacity < 1:
            raise ValueError(f"in-flight deadline and capacity must be positive, not {deadline}, {capacity}")
        self.deadline, self.capacity = deadline, capacity
        self._entries: dict[Key, Pending] = {}
        self.finished = 0
        self.given_up = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    @property
    def full(self) -> bool:
        return len(self._entries) >= self.capacity

    def add(self, key: Key, upstream: str | None, now: float) -> bool:
        """Start waiting for ``key``'s gradient; False (nothing kept) when full or already waiting."""
        if self.full or key in self._entries:
            return False
        self._entries[key] = Pending(upstream, now)
        return True

    def awaits(self, key: Key, peer: str) -> bool:
        """Whether a gradient of ``key`` from ``peer`` is one we wait for: only the peer that acked its
        activations may answer them (before its ack is in, any peer may: the ack and the gradient race)."""
        entry = self._entries.get(key)
        return entry is not None and entry.sent_to in (None, peer)

    def awaiting(self, peer: str) -> _From:
        """The keys whose gradient we would take from ``peer`` (``admission.Waiting``)."""
        return _From(self, peer)

    def sent_to(self, key: Key, peer: str) -> None:
        """``peer`` acked ``key``'s activations: its death now means this gradient will not come."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries[key] = replace(entry, sent_to=peer)

    def finish(self, key: Key) -> Pending | None:
        """``key``'s gradient arrived: the entry (to send the gradient upstream), or None if not waiting."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.finished += 1
        return entry

    def give_up(self, key: Key) -> Pending | None:
        """Stop waiting for ``key`` (its activations could not be delivered anywhere)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.given_up += 1
        return entry

    def peer_failed(self, peer: str) -> list[Key]:
        """Give up every micro-batch whose activations went to ``peer``; their keys."""
        keys = [k for k, e in self._entries.items() if e.sent_to == peer]
        for key in keys:
            self.give_up(key)
        return keys

    def expire(self, now: float) -> list[tuple[Key, Pending]]:
        """Give up every micro-batch older than the deadline; their keys and entries."""
        expired = [(k, e) for k, e in self._entries.items() if now - e.started >= self.deadline]
        for key, _ in expired:
            self.give_up(key)
        return expired

    def entries(self) -> list[Pending]:
        return list(self._entries.values())

    def waiting_from(self, upstream: str | None) -> int:
        """Micro-batches from ``upstream`` still waiting (None: those that started here)."""
        return sum(1 for e in self._entries.values() if e.upstream == upstream)


class RecentKeys:
    """The last ``capacity`` micro-batches (by kind and key) a receiver took: a copy of one of them
    (a sender's re-send after a lost ack) is a duplicate, dropped and acked as such. Bounded: the
    oldest is forgotten first."""

    def __init__(self, capacity: int = RECENT_KEYS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, not {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[tuple[str, Key], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, item: tuple[str, Key]) -> bool:
        return item in self._keys

    def add(self, item: tuple[str, Key]) -> bool:
        """Remember ``item``; False if it was already remembered (a duplicate)."""
        if item in self._keys:
            return False
        self._keys[item] = None
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        return True

    def discard(self, item: tuple[str, Key]) -> None:
        """Forget ``item`` (it was refused, so a later copy is no duplicate)."""
        self._keys.pop(item, None)
