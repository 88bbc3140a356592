"""The inference sessions of one replica: which sequences it holds a KV cache for, and their limits.

A generation client opens a session at a replica of each stage by sending its first step
(position 0) and extends it one step at a time (``swarm/inference.py``). The replica keeps the
session's KV cache between steps; this module is the pure table that decides whether a step may
run and accounts for the memory it takes:

- at most ``max_sessions`` sessions at once, and at most ``max_per_peer`` of one peer (a peer that
  floods a replica leaves the rest to everyone else), else ``Overloaded``;
- a session is its opener's: a step or close from another peer is refused as if it were not here;
- a session's cache within ``session_bytes`` (``bytes_per_token`` x positions, the figure
  ``model.transformer.kv_bytes`` gives for the stage), else ``Overloaded``; all sessions' caches
  within ``total_bytes``, else ``Overloaded``;
- positions are contiguous: a step must start where the session's cache ends (``WrongPosition``);
  a step at position 0 (re)starts the session from nothing, which is how a client replays;
- a step for an unknown session at a position past 0 is ``UnknownSession`` (expired, closed, or
  never here: the client replays the prefix);
- one step at a time per session (``begin`` ... ``finish`` or ``abandon``);
- a session idle for ``idle_s`` is expired (its cache dropped) on the next call.

Pure: time is the ``now`` argument; the cache itself is an opaque value held for the caller.
No trio, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from p2pswarm.errors import ConfigError, P2PSwarmError

MAX_SESSIONS = 16  # concurrent generations a replica serves: each step is a small job; more would queue
MAX_SESSIONS_PER_PEER = MAX_SESSIONS // 2  # one peer's share: a flooding peer leaves the other half to the rest
SESSION_KV_BYTES = 64 * 1024 * 1024  # one session's cache: the xl tier's stage at its full context takes 4 MiB
TOTAL_KV_BYTES = 512 * 1024 * 1024  # every session's cache together: small beside a stage's training memory
IDLE_S = 60.0  # a session whose client went quiet this long is dropped (a client steps every few ms)


class SessionRefused(P2PSwarmError):
    """A step that cannot run here; ``code`` is the error code the protocol answers with."""

    code = "refused"


class UnknownSession(SessionRefused):
    code = "unknown-session"


class WrongPosition(SessionRefused):
    code = "bad-position"


class SessionBusy(SessionRefused):
    code = "busy"


class SessionOverloaded(SessionRefused):
    """Too many sessions, or past a memory budget (``errors.Overloaded`` to a client)."""

    code = "overloaded"


@dataclass(frozen=True)
class Limits:
    bytes_per_token: int  # KV bytes one position takes at this stage
    max_sessions: int = MAX_SESSIONS
    max_per_peer: int = MAX_SESSIONS_PER_PEER
    session_bytes: int = SESSION_KV_BYTES
    total_bytes: int = TOTAL_KV_BYTES
    idle_s: float = IDLE_S

    def __post_init__(self) -> None:
        if min(self.bytes_per_token, self.max_sessions, self.max_per_peer, self.session_bytes, self.total_bytes) < 1 \
                or not self.idle_s > 0:
            raise ConfigError(f"session limits must be positive: {self}")


@dataclass
class Session:
    """One sequence's state at this replica."""

    length: int = 0  # positions its cache holds
    round: int | None = None  # the outer round its cache was computed with (set by the caller at position 0)
    cache: Any = None
    last_used: float = 0.0
    pending: int = 0  # positions of the step under way (0: none)
    peer: str = ""  # the peer that opened it: only it may step or close it


@dataclass
class SessionTable:
    limits: Limits
    sessions: dict[bytes, Session] = field(default_factory=dict)
    expired: int = 0  # sessions dropped for idleness, for the status page

    def begin(self, session: bytes, position: int, n: int, now: float, peer: str = "") -> Session:
        """Reserve a step of ``n`` positions at ``position`` for ``peer``; raises a ``SessionRefused``."""
        self.expire(now)
        entry = self.sessions.get(session)
        if entry is not None and entry.peer != peer:  # another peer's: it learnt the id, it gets nothing of it
            raise SessionBusy("this session is another peer's") if position == 0 else \
                UnknownSession("no such session of yours here: replay it")
        if position == 0:
            if entry is not None and entry.pending:
                raise SessionBusy("a step of this session is under way")
            self.sessions.pop(session, None)  # a replay starts over
            if len(self.sessions) >= self.limits.max_sessions:
                raise SessionOverloaded(f"this replica serves {self.limits.max_sessions} sessions already")
            if sum(e.peer == peer for e in self.sessions.values()) >= self.limits.max_per_peer:
                raise SessionOverloaded(f"this replica serves {self.limits.max_per_peer} sessions of this peer "
                                        f"already, its share")
            entry = Session(last_used=now, peer=peer)
        elif entry is None:
            raise UnknownSession("no such session here (expired, closed or never opened): replay it")
        elif entry.pending:
            raise SessionBusy("a step of this session is under way")
        elif position != entry.length:
            raise WrongPosition(f"the session holds {entry.length} positions; a step at {position} does not follow")
        need = (entry.length + n) * self.limits.bytes_per_token
        if need > self.limits.session_bytes:
            raise SessionOverloaded(f"{entry.length + n} positions take {need} bytes of KV cache, past the "
                                    f"session budget of {self.limits.session_bytes}")
        if self.used_bytes() + n * self.limits.bytes_per_token > self.limits.total_bytes:
            raise SessionOverloaded(f"the KV caches of this replica's sessions would pass "
                                    f"{self.limits.total_bytes} bytes")
        entry.pending, entry.last_used = n, now
        self.sessions[session] = entry
        return entry

    def finish(self, session: bytes, cache: Any, now: float) -> None:
        """The step reserved by ``begin`` ran: the cache now holds its positions too."""
        entry = self.sessions[session]
        entry.length += entry.pending
        entry.pending, entry.cache, entry.last_used = 0, cache, now

    def abandon(self, session: bytes) -> None:
        """The step failed: the session is dropped (its cache may be half-extended)."""
        self.sessions.pop(session, None)

    def close(self, session: bytes, peer: str = "") -> bool:
        """Drop ``peer``'s session (no step may be under way); True if it was here."""
        entry = self.sessions.get(session)
        if entry is None or entry.pending or entry.peer != peer:
            return False
        del self.sessions[session]
        return True

    def expire(self, now: float) -> int:
        """Drop the sessions idle for ``idle_s`` (none with a step under way); how many were dropped."""
        idle = [s for s, e in self.sessions.items() if not e.pending and now - e.last_used >= self.limits.idle_s]
        for session in idle:
            del self.sessions[session]
        self.expired += len(idle)
        return len(idle)

    def used_bytes(self) -> int:
        """KV bytes held and reserved, by the table's accounting."""
        return sum(e.length + e.pending for e in self.sessions.values()) * self.limits.bytes_per_token

    def doc(self) -> dict:
        return {"sessions": len(self.sessions), "kv_bytes": self.used_bytes(), "expired": self.expired,
                "max_sessions": self.limits.max_sessions, "total_bytes": self.limits.total_bytes}
