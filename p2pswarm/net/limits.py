"""Admission and deadlines of inbound streams: the pure core behind ``net/guard.py``.

py-libp2p 0.8.1 bounds streams with one node-wide semaphore that *queues* the excess (defect 9)
and never times out a stream whose protocol handler waits on a silent peer. One peer holding
~4,000 silent streams therefore locked every other peer out. Modelled on go-libp2p's resource
manager, every inbound stream here is admitted or refused at once, in two steps:

1. ``admit(peer, now)`` when the stream arrives, before protocol negotiation: refused when the
   node (``max_inbound``) or that peer (``max_inbound_per_peer``) is at its limit;
2. ``choose(ticket, protocol, now)`` once negotiated: refused when that peer holds
   ``ProtocolLimits.max_inbound_per_peer`` streams of the protocol already.

An admitted stream has a deadline: negotiation must finish within ``negotiation_timeout`` of its
arrival; afterwards, while the handler waits on the peer (a read or write in progress) without
any progress for the protocol's ``idle_timeout``, the stream is overdue and its driver closes it.
A handler busy with its own work (no I/O in progress) has no deadline: the peer is not at fault.

Every refusal and closure is counted (``stats``). Pure: no trio, no libp2p; ``now`` is passed in.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import Any

MAX_INBOUND_STREAMS = 4096  # node-wide: what py-libp2p held before (HostLimits.max_streams);
# go-libp2p's system limit is of this order
MAX_INBOUND_PER_PEER = 256  # go-libp2p's default PeerBaseLimit.StreamsInbound; 16 such peers fill the node
MAX_INBOUND_PER_PEER_PROTOCOL = 32  # "a few dozen": go-libp2p's ProtocolPeerBaseLimit is 64;
# our protocols use one or a few streams a peer
NEGOTIATION_TIMEOUT = 10.0  # go-libp2p's negotiation timeout; an honest peer negotiates in ~10 ms
DEFAULT_IDLE_TIMEOUT = 120.0  # a peer silent this long while we wait on it is gone; the count limits bound it anyway

RELAY_HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"  # same id as net/connect.HOP_PROTOCOL (kept import-free)
RELAY_STOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/stop"


@dataclass(frozen=True)
class ProtocolLimits:
    """How many inbound streams of one protocol a peer may hold, and how long one may stay silent."""

    max_inbound_per_peer: int = MAX_INBOUND_PER_PEER_PROTOCOL
    idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT  # None: no idle deadline (the count still bounds it)


# A relayed connection is as silent as the connection it carries; the relay's own duration limit ends it.
RELAY_LIMITS = ProtocolLimits(idle_timeout=None)


@dataclass(frozen=True)
class StreamLimits:
    """The node's inbound stream limits; ``protocols`` (id, limits) pairs override ``default_protocol``."""

    max_inbound: int = MAX_INBOUND_STREAMS
    max_inbound_per_peer: int = MAX_INBOUND_PER_PEER
    negotiation_timeout: float = NEGOTIATION_TIMEOUT
    default_protocol: ProtocolLimits = ProtocolLimits()
    protocols: tuple[tuple[str, ProtocolLimits], ...] = (
        (RELAY_HOP_PROTOCOL, RELAY_LIMITS), (RELAY_STOP_PROTOCOL, RELAY_LIMITS))


class Refusal(Enum):
    """Why a stream was refused."""

    NODE = "node"
    PEER = "peer"
    PROTOCOL = "protocol"


class Closure(Enum):
    """Why an admitted stream was closed by its deadline."""

    NEGOTIATION = "negotiation"
    IDLE = "idle"


@dataclass
class _Stream:
    peer: str
    opened_at: float
    protocol: str | None = None  # None while negotiating
    pending_io: int = 0
    progress_at: float = 0.0


class StreamBook:
    """Counts inbound streams per node, peer and (peer, protocol); decides admissions and deadlines."""

    def __init__(self, limits: StreamLimits | None = None) -> None:
        self.limits = limits or StreamLimits()
        self._protocols = dict(self.limits.protocols)
        self._streams: dict[int, _Stream] = {}
        self._next_ticket = 0
        self._per_peer: Counter[str] = Counter()
        self._per_protocol: Counter[tuple[str, str]] = Counter()
        self.refused: Counter[Refusal] = Counter()
        self.closed: Counter[Closure] = Counter()
        self.admitted = 0
        self.failed = 0  # handlers that raised (counted by the driver, net/guard.py)

    def protocol_limits(self, protocol: str) -> ProtocolLimits:
        return self._protocols.get(protocol, self.limits.default_protocol)

    def set_protocol_limits(self, protocol: str, limits: ProtocolLimits) -> None:
        """Limits for one protocol (a service registering its handler knows its own traffic best)."""
        self._protocols[protocol] = limits

    def admit(self, peer: str, now: float) -> int | None:
        """A ticket for a new inbound stream of ``peer``, or None: refused (counted), reset it."""
        if len(self._streams) >= self.limits.max_inbound:
            self.refused[Refusal.NODE] += 1
            return None
        if self._per_peer[peer] >= self.limits.max_inbound_per_peer:
            self.refused[Refusal.PEER] += 1
            return None
        ticket = self._next_ticket
        self._next_ticket += 1
        self._streams[ticket] = _Stream(peer, opened_at=now)
        self._per_peer[peer] += 1
        self.admitted += 1
        return ticket

    def choose(self, ticket: int, protocol: str, now: float) -> bool:
        """The stream negotiated ``protocol``: True if the peer may hold one more of it (else counted)."""
        stream = self._streams[ticket]
        if stream.protocol is not None:
            raise ValueError(f"ticket {ticket} already runs {stream.protocol}")
        key = (stream.peer, protocol)
        if self._per_protocol[key] >= self.protocol_limits(protocol).max_inbound_per_peer:
            self.refused[Refusal.PROTOCOL] += 1
            return False
        self._per_protocol[key] += 1
        stream.protocol = protocol
        stream.progress_at = now
        return True

    def io_started(self, ticket: int, now: float) -> None:
        """The handler starts waiting on the peer (a read or a write); unknown tickets are ignored."""
        stream = self._streams.get(ticket)
        if stream is None:
            return  # released already: a handler handed its stream on and returned
        if stream.pending_io == 0:
            stream.progress_at = now
        stream.pending_io += 1

    def io_done(self, ticket: int, now: float) -> None:
        """A read or write returned: progress (or the end of the wait)."""
        stream = self._streams.get(ticket)
        if stream is None:
            return
        stream.pending_io = max(0, stream.pending_io - 1)
        stream.progress_at = now

    def deadline(self, ticket: int) -> float:
        """When the stream is overdue if nothing changes; ``math.inf`` for none."""
        stream = self._streams.get(ticket)
        if stream is None:
            return math.inf
        if stream.protocol is None:
            return stream.opened_at + self.limits.negotiation_timeout
        idle = self.protocol_limits(stream.protocol).idle_timeout
        if idle is None or stream.pending_io == 0:
            return math.inf
        return stream.progress_at + idle

    def overdue(self, now: float) -> list[int]:
        """Tickets past their deadline at ``now``."""
        return [t for t in self._streams if self.deadline(t) <= now]

    def expire(self, ticket: int) -> Closure | None:
        """Record that the driver closed a stream at its deadline; None for an unknown ticket.

        The driver calls it when its timer (set from ``deadline``) fired, after the handler's
        pending I/O was cancelled, so the deadline is not checked again here.
        """
        stream = self._streams.get(ticket)
        if stream is None:
            return None
        closure = Closure.NEGOTIATION if stream.protocol is None else Closure.IDLE
        self.closed[closure] += 1
        return closure

    def release(self, ticket: int) -> None:
        """The stream ended (any way): its counts are returned. Releasing twice is a no-op."""
        stream = self._streams.pop(ticket, None)
        if stream is None:
            return
        self._per_peer[stream.peer] -= 1
        if not self._per_peer[stream.peer]:
            del self._per_peer[stream.peer]
        if stream.protocol is not None:
            key = (stream.peer, stream.protocol)
            self._per_protocol[key] -= 1
            if not self._per_protocol[key]:
                del self._per_protocol[key]

    def open_streams(self, peer: str | None = None, protocol: str | None = None) -> int:
        """Inbound streams held: by everyone, by ``peer``, or by ``peer`` on ``protocol``."""
        if peer is None:
            return len(self._streams)
        if protocol is None:
            return self._per_peer.get(peer, 0)
        return self._per_protocol.get((peer, protocol), 0)

    def stats(self) -> dict[str, Any]:
        """Counters for the node's status API."""
        return {
            "open": len(self._streams),
            "peers": len(self._per_peer),
            "admitted": self.admitted,
            **{f"refused_{r.value}": self.refused[r] for r in Refusal},
            **{f"closed_{c.value}": self.closed[c] for c in Closure},
            "handler_errors": self.failed,
        }
