"""Reachability verdicts: is this node dialable from the internet? A pure function of dial-backs.

A node cannot see its own NAT. It asks other peers to dial it back over a fresh connection
(``nat/autonat.py``) and records each answer here. The verdict counts one vote per server,
the newest answer of each, within a window of time:

- PUBLIC   when at least MIN_CONFIRMATIONS servers reached us and they outnumber those that could not;
- PRIVATE  when at least MIN_CONFIRMATIONS servers could not and they outnumber those that could;
- UNKNOWN  otherwise (too few answers, or a tie).

Answers age out after OBSERVATION_MAX_AGE, so the verdict follows a changed network. Requiring
two independent servers keeps one broken or lying server from making a NATed node PUBLIC.
Also here: a token-bucket rate limiter for the servers' side. Pure: ``now`` is passed in.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

MIN_CONFIRMATIONS = 2  # independent servers that must agree; one server's word is not enough
OBSERVATION_MAX_AGE = 600.0  # seconds an answer counts; a moved laptop is re-judged within this
MAX_SERVERS_REMEMBERED = 32  # newest answers kept; enough for any verdict, bounded memory


class Reachability(enum.Enum):
    PUBLIC = "public"
    PRIVATE = "private"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class DialBackResult:
    server: str  # peer id of the server that dialled
    address: str  # the multiaddr it dialled
    reachable: bool
    at: float


class ReachabilityTracker:
    """The newest dial-back answer of each server, and the verdict they give."""

    def __init__(self, min_confirmations: int = MIN_CONFIRMATIONS, max_age: float = OBSERVATION_MAX_AGE,
                 max_servers: int = MAX_SERVERS_REMEMBERED) -> None:
        self._min, self._max_age, self._max_servers = min_confirmations, max_age, max_servers
        self._latest: dict[str, DialBackResult] = {}

    def observe(self, result: DialBackResult) -> None:
        held = self._latest.get(result.server)
        if held is None or result.at >= held.at:
            self._latest[result.server] = result
        if len(self._latest) > self._max_servers:
            oldest = min(self._latest.values(), key=lambda r: r.at)
            del self._latest[oldest.server]

    def _current(self, now: float) -> list[DialBackResult]:
        return [r for r in self._latest.values() if now - self._max_age <= r.at <= now]

    def verdict(self, now: float) -> Reachability:
        current = self._current(now)
        reached = sum(1 for r in current if r.reachable)
        missed = len(current) - reached
        if reached >= self._min and reached > missed:
            return Reachability.PUBLIC
        if missed >= self._min and missed > reached:
            return Reachability.PRIVATE
        return Reachability.UNKNOWN

    def reachable_addresses(self, now: float) -> list[str]:
        """Addresses some current answer reached, most recently confirmed first."""
        found = sorted((r for r in self._current(now) if r.reachable), key=lambda r: -r.at)
        return list(dict.fromkeys(r.address for r in found))

    def servers_heard(self, now: float) -> set[str]:
        return {r.server for r in self._current(now)}


class RateLimiter:
    """Token buckets: ``rate`` requests per second with bursts of ``burst``, per key and overall."""

    def __init__(self, rate: float, burst: float, global_rate: float, global_burst: float,
                 max_keys: int = 4096) -> None:
        self._rate, self._burst = rate, burst
        self._global_rate, self._global_burst = global_rate, global_burst
        self._max_keys = max_keys
        self._buckets: dict[str, tuple[float, float]] = {}
        self._global = (global_burst, 0.0)

    @staticmethod
    def _refill(tokens: float, at: float, now: float, rate: float, burst: float) -> float:
        return min(burst, tokens + max(0.0, now - at) * rate)

    def allow(self, key: str, now: float) -> bool:
        tokens, at = self._buckets.get(key, (self._burst, now))
        tokens = self._refill(tokens, at, now, self._rate, self._burst)
        global_tokens = self._refill(*self._global, now, self._global_rate, self._global_burst)
        if tokens < 1 or global_tokens < 1:
            self._buckets[key] = (tokens, now)
            self._global = (global_tokens, now)
            return False
        if key not in self._buckets and len(self._buckets) >= self._max_keys:
            self._buckets = {k: v for k, v in self._buckets.items() if v[0] + (now - v[1]) * self._rate < self._burst}
            if len(self._buckets) >= self._max_keys:
                return False
        self._buckets[key] = (tokens - 1, now)
        self._global = (global_tokens - 1, now)
        return True
