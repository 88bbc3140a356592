"""Byte budgets for bulk traffic: what a peer may make us buffer, and what a relay circuit can carry.

Two pure accounting cores used by the stream pool (``net/pool.py``); neither imports trio or
libp2p, so both are tested as state machines without an event loop.

``InboundBudget``: a frame's payload length is known from its header before the payload is
read (wire framing), so the pool *reserves* that many bytes before reading and *releases*
them when the handler is done. The rules:

- every peer with an open inbound stream (or bytes still reserved) holds one of ``max_peers``
  slots and may have at most ``peer_bytes`` reserved;
- the slots are full: a newcomer the driver prefers (a peer that worked with us) may take the slot
  of the least recently active peer that holds no bytes and is not preferred (``idle_victim``;
  the driver ends that peer's streams), so identities that open a stream each and idle cannot
  keep a node's neighbours out;
- the global budget is ``max_peers * peer_bytes``: every slot's share is guaranteed, so a peer
  under its own share is never made to wait by another peer's use (no borrowing, by design:
  borrowing is what lets one peer's burst delay another's frame);
- a frame that would take a peer past its share answers ``WAIT`` (the driver waits, bounded,
  for that peer's own earlier frames to be released, then refuses); a frame larger than a
  whole share, or from a peer holding no slot, answers ``REFUSE``;
- each frame is charged at least ``min_charge`` bytes, so that a flood of empty frames is
  bounded like a flood of full ones (a decoded header and its queue entry cost memory too).

The core is ``now``-free: waiting is the driver's business; the core only counts waits.

``CircuitLedger``: a relay ends a circuit when its byte or time limit is reached, cutting
whatever frame is in flight. The ledger keeps, per relayed connection, the bytes the pool sent
and received and the connection's age, and says whether a frame of ``n`` bytes can start and
finish inside the circuit's remaining budget (with margins for traffic it does not see, wire
overhead, and the time the frame may take at most: its ``frame_deadline``). It takes ``now``.
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from p2pswarm import wire

MIB = 1024 * 1024

# A share holds the largest frame wire allows (64 MiB payload plus its header), or four 16 MiB activations.
PEER_BUDGET_BYTES = wire.MAX_PAYLOAD_BYTES + wire.HEADER_LENGTH_BYTES + wire.MAX_HEADER_BYTES
MAX_BUDGET_PEERS = 16  # senders at once: neighbour stages' replicas and its own; 16 shares = ~1 GiB at worst
MAX_STREAMS_PER_PEER = 16  # a router keeps a few warm streams per candidate; bounds unread Yamux buffers (defect 3)
MIN_FRAME_CHARGE = 4096  # a decoded header plus its queue entry is ~1-2 KiB of Python objects: round up

# Circuit limits: the defaults of p2pswarm's own relay (nat/relay_service.RelayConfig), the smallest
# a p2pswarm swarm runs; a relay that announces its own Limit overrides them per connection.
RELAY_CIRCUIT_BYTES = 16 * MIB  # RelayConfig.circuit_bytes (both directions together)
RELAY_CIRCUIT_SECONDS = 120.0  # RelayConfig.circuit_duration
CIRCUIT_HEADROOM_BYTES = 1 * MIB  # control requests, identify, DCUtR and window updates share the circuit uncounted
WIRE_OVERHEAD = 1.01  # Noise adds 18 B per 64 KiB message and Yamux 12 B per frame (<0.1 %); 1 % is a margin
CIRCUIT_TIME_MARGIN = 10.0  # the relay's clock starts at CONNECT admission, before the upgrade we see
MIN_TRANSFER_RATE = 1 * MIB  # B/s: a third of the slowest relayed path measured (3 MiB/s); slower is a dead path
FRAME_DEADLINE_BASE = 5.0  # s: a live stream moves within this; Yamux itself gives up after 5 s of zero window


# B/s: one frame's share of the thinnest line a swarm trains on (0.2 Mbit/s, the lab's gpu-ratio uplink,
# shared by a few frames and the control plane). An arriving frame slower than this is a trickle, not a line.
SLOWEST_FRAME_RATE = 4 * 1024


def frame_deadline(nbytes: int) -> float:
    """Seconds a frame of ``nbytes`` may take to write or arrive before its stream counts as dead."""
    return FRAME_DEADLINE_BASE + nbytes / MIN_TRANSFER_RATE


READ_GRAIN = 64 * 1024  # bytes one read of a Yamux stream returns at once at most (a whole Yamux/Noise frame)
# s without a byte of a payload after which its stream counts as stalled: one read grain at the slowest frame
# rate (on a thin line a few streams' 64 KiB frames take turns: each stream sees a read every ~16 s)
STALL_DEADLINE = FRAME_DEADLINE_BASE + READ_GRAIN / SLOWEST_FRAME_RATE


def arrival_deadline(nbytes: int) -> float:
    """Seconds an arriving frame's payload of ``nbytes`` may take in all while its bytes keep moving (none
    may stall for STALL_DEADLINE): a thin line's frame arrives slowly but steadily; a trickle ends."""
    return FRAME_DEADLINE_BASE + nbytes / SLOWEST_FRAME_RATE


class Verdict(enum.Enum):
    """Why a reservation was not granted."""

    WAIT = "wait"  # over the peer's own share: retry when its earlier frames are released
    REFUSE = "refuse"  # can never be granted: reset the stream


@dataclass(frozen=True)
class Ticket:
    """A granted reservation; give it back to ``InboundBudget.release`` exactly once."""

    peer: str
    charged: int
    serial: int


@dataclass(frozen=True)
class BudgetConfig:
    peer_bytes: int = PEER_BUDGET_BYTES
    max_peers: int = MAX_BUDGET_PEERS
    streams_per_peer: int = MAX_STREAMS_PER_PEER
    min_charge: int = MIN_FRAME_CHARGE

    def __post_init__(self) -> None:
        for name in ("peer_bytes", "max_peers", "streams_per_peer", "min_charge"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"budget {name} must be a positive int, not {value!r}")
        if self.min_charge > self.peer_bytes:
            raise ValueError("budget min_charge must not exceed peer_bytes")

    @property
    def global_bytes(self) -> int:
        """Every slot's share at once: the most the budget ever grants."""
        return self.peer_bytes * self.max_peers


@dataclass
class _Peer:
    streams: int = 0
    in_use: int = 0
    active: int = 0  # serial of its last stream opened or frame reserved: the least recent gives way first
    waits: int = 0
    refused: int = 0


@dataclass
class InboundBudget:
    """Per-peer and global accounting of inbound frame bytes (see the module docstring)."""

    config: BudgetConfig = field(default_factory=BudgetConfig)
    in_use: int = 0
    high_water: int = 0
    waits: int = 0
    evictions: int = 0  # slots given to a preferred newcomer (the driver counts what it ended)
    refused: Counter[str] = field(default_factory=Counter)
    _peers: dict[str, _Peer] = field(default_factory=dict)
    _tickets: dict[int, Ticket] = field(default_factory=dict)
    _serials: itertools.count[int] = field(default_factory=itertools.count)

    def open_stream(self, peer: str) -> bool:
        """A peer opened an inbound stream: False (counted) if it may not have another."""
        state = self._peers.get(peer)
        if state is None:
            if len(self._peers) >= self.config.max_peers:
                self.refused["peers"] += 1
                return False
            state = self._peers[peer] = _Peer()
        if state.streams >= self.config.streams_per_peer:
            self._refuse(peer, "streams")
            return False
        state.streams += 1
        state.active = next(self._serials)
        return True

    def idle_victim(self, preferred: Callable[[str], bool]) -> str | None:
        """With every slot taken, the peer whose slot a preferred newcomer may take: the least recently
        active one that holds no bytes and is not ``preferred``; None if none may give way."""
        if len(self._peers) < self.config.max_peers:
            return None
        idle = [(state.active, peer) for peer, state in self._peers.items() if state.in_use == 0]
        return next((peer for _, peer in sorted(idle) if not preferred(peer)), None)

    def close_stream(self, peer: str) -> None:
        state = self._peers.get(peer)
        if state is None or state.streams == 0:
            raise ValueError(f"close_stream({peer!r}) without an open stream")
        state.streams -= 1
        self._forget_if_idle(peer)

    def charge(self, nbytes: int) -> int:
        return max(nbytes, self.config.min_charge)

    def reserve(self, peer: str, nbytes: int) -> Ticket | Verdict:
        """Reserve room for a frame of ``nbytes`` from ``peer`` before reading its payload."""
        if nbytes < 0:
            raise ValueError(f"cannot reserve {nbytes} bytes")
        state = self._peers.get(peer)
        charged = self.charge(nbytes)
        if state is None or state.streams == 0:
            self._refuse(peer, "no_stream")
            return Verdict.REFUSE
        if charged > self.config.peer_bytes:
            self._refuse(peer, "too_large")
            return Verdict.REFUSE
        if state.in_use + charged > self.config.peer_bytes or self.in_use + charged > self.config.global_bytes:
            return Verdict.WAIT
        ticket = Ticket(peer, charged, next(self._serials))
        state.active = ticket.serial
        self._tickets[ticket.serial] = ticket
        state.in_use += charged
        self.in_use += charged
        self.high_water = max(self.high_water, self.in_use)
        return ticket

    def release(self, ticket: Ticket) -> None:
        if self._tickets.pop(ticket.serial, None) is None:
            raise ValueError(f"ticket {ticket.serial} released twice or never granted")
        state = self._peers[ticket.peer]
        state.in_use -= ticket.charged
        self.in_use -= ticket.charged
        self._forget_if_idle(ticket.peer)

    def note_wait(self, peer: str) -> None:
        """The driver made a frame of ``peer`` wait (counted once per frame)."""
        self.waits += 1
        if peer in self._peers:
            self._peers[peer].waits += 1

    def refuse(self, peer: str, reason: str) -> None:
        """The driver refused a frame of ``peer`` (e.g. it waited too long)."""
        self._refuse(peer, reason)

    def _refuse(self, peer: str, reason: str) -> None:
        self.refused[reason] += 1
        if peer in self._peers:
            self._peers[peer].refused += 1

    def _forget_if_idle(self, peer: str) -> None:
        state = self._peers[peer]
        if state.streams == 0 and state.in_use == 0:
            del self._peers[peer]  # frees its slot; its totals live on in the global counters

    def frames_held(self) -> int:
        """Inbound frames reserved and not yet released: work queued at this peer."""
        return len(self._tickets)

    def peer_in_use(self, peer: str) -> int:
        state = self._peers.get(peer)
        return state.in_use if state is not None else 0

    def peers(self) -> list[str]:
        return list(self._peers)

    def stats(self) -> dict[str, Any]:
        return {
            "in_use": self.in_use,
            "high_water": self.high_water,
            "global_bytes": self.config.global_bytes,
            "peer_bytes": self.config.peer_bytes,
            "waits": self.waits,
            "evictions": self.evictions,
            "refused": dict(sorted(self.refused.items())),
            "peers": {peer: {"in_use": s.in_use, "streams": s.streams, "waits": s.waits, "refused": s.refused}
                      for peer, s in sorted(self._peers.items())},
        }


# --- relay circuits ----------------------------------------------------------------------


@dataclass(frozen=True)
class CircuitLimit:
    """What a relay allows one circuit; 0 means unlimited, as in the relay spec's Limit message."""

    seconds: float = RELAY_CIRCUIT_SECONDS
    bytes: int = RELAY_CIRCUIT_BYTES

    def __post_init__(self) -> None:
        if self.seconds < 0 or self.bytes < 0:
            raise ValueError(f"circuit limits must not be negative: {self}")


@dataclass(frozen=True)
class CircuitRefusal:
    """Why a frame may not start on a relayed connection, and what is left of the circuit."""

    reason: str  # "bytes" or "time"
    remaining_bytes: int | None  # usable bytes left (None: unlimited)
    remaining_seconds: float | None  # usable seconds left (None: unlimited)


@dataclass
class CircuitUsage:
    limit: CircuitLimit
    opened_at: float
    sent: int = 0
    received: int = 0

    def remaining_bytes(self) -> int | None:
        """Bytes the pool may still put on the circuit (frame bytes, before wire overhead)."""
        if not self.limit.bytes:
            return None
        usable = (self.limit.bytes - CIRCUIT_HEADROOM_BYTES) / WIRE_OVERHEAD
        return max(0, int(usable) - self.sent - self.received)

    def remaining_seconds(self, now: float) -> float | None:
        if not self.limit.seconds:
            return None
        return max(0.0, self.limit.seconds - CIRCUIT_TIME_MARGIN - (now - self.opened_at))


@dataclass
class CircuitLedger:
    """Bytes and age of each relayed connection the pool uses; keys are opaque (connections)."""

    circuits: dict[object, CircuitUsage] = field(default_factory=dict)
    refused: Counter[str] = field(default_factory=Counter)

    def track(self, key: object, limit: CircuitLimit, opened_at: float) -> CircuitUsage:
        """Start accounting ``key`` (idempotent: the first call fixes its limit and age)."""
        usage = self.circuits.get(key)
        if usage is None:
            usage = self.circuits[key] = CircuitUsage(limit, opened_at)
        return usage

    def record(self, key: object, *, sent: int = 0, received: int = 0) -> None:
        usage = self.circuits.get(key)
        if usage is not None:
            usage.sent += sent
            usage.received += received

    def check(self, key: object, nbytes: int, now: float) -> CircuitRefusal | None:
        """None if a frame of ``nbytes`` can start and finish on ``key`` now; else why not (counted)."""
        usage = self.circuits.get(key)
        if usage is None:
            return None
        left_bytes, left_seconds = usage.remaining_bytes(), usage.remaining_seconds(now)
        reason = None
        if left_bytes is not None and nbytes > left_bytes:
            reason = "bytes"
        elif left_seconds is not None and frame_deadline(nbytes) > left_seconds:
            reason = "time"
        if reason is None:
            return None
        self.refused[reason] += 1
        return CircuitRefusal(reason, left_bytes, left_seconds)

    def forget(self, key: object) -> None:
        self.circuits.pop(key, None)

    def stats(self, now: float) -> dict[str, Any]:
        return {
            "refused": dict(sorted(self.refused.items())),
            "circuits": [{"sent": u.sent, "received": u.received, "age_s": round(now - u.opened_at, 3),
                          "remaining_bytes": u.remaining_bytes(), "remaining_s": u.remaining_seconds(now),
                          "limit_bytes": u.limit.bytes, "limit_s": u.limit.seconds}
                         for u in self.circuits.values()],
        }
