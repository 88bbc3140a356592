"""What ``connect(peer)`` dials and how each way of connecting has fared: the pure part.

A peer advertises a mix of direct addresses (``/ip4/<ip>/tcp/<port>``) and relayed ones
(``<relay addr>/p2p/<relay id>/p2p-circuit``). ``plan_dials`` sorts them, drops the ones that
can only lead back to ourselves (an unspecified IP such as ``0.0.0.0``, port 0, our own listen
addresses), puts another host's loopback address last when we have a real one, and caps how
many are tried. ``ConnectStats`` counts, per method, the
attempts that finished, the successes and the time each success took. No trio, no sockets:
``net/connect.py`` drives it.
"""

from __future__ import annotations

import ipaddress
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

DIRECT = "direct"  # a plain TCP dial to an advertised address
RELAY = "relay"  # a circuit through a relay the peer holds a reservation on
HOLEPUNCH = "holepunch"  # a relayed connection that became direct (DCUtR, driven by the other side)
METHODS = (DIRECT, HOLEPUNCH, RELAY)

MAX_DIRECT_ADDRS = 8  # a peer lists its interfaces and observed addresses; more is noise or an attack
MAX_CIRCUIT_ADDRS = 4  # two relays, two addresses each (relay_client.MAX_ADDRS_PER_RELAY)
SAMPLE_WINDOW = 512  # recent timings kept per method for the percentiles
CIRCUIT = "/p2p-circuit"


@dataclass(frozen=True)
class DialPlan:
    """Addresses worth dialing, best first; circuits end in ``/p2p-circuit`` (no destination)."""

    direct: tuple[str, ...]
    circuits: tuple[str, ...]

    def empty(self) -> bool:
        return not self.direct and not self.circuits


def _strip_peer(addr: str, peer_id: str) -> str:
    suffix = f"/p2p/{peer_id}"
    return addr.removesuffix(suffix)


def _ip(addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    parts = addr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return None
    try:
        return ipaddress.ip_address(parts[2])
    except ValueError:
        return None


def _tcp_port(addr: str) -> int | None:
    parts = addr.split("/")
    if "tcp" not in parts[:-1]:
        return None
    port = parts[parts.index("tcp") + 1]
    return int(port) if port.isdigit() and len(port) <= 5 else None


def _unspecified(addr: str) -> bool:
    ip = _ip(addr)
    return addr.startswith(("/ip4/", "/ip6/")) and (ip is None or ip.is_unspecified)


def _is_direct(addr: str) -> bool:
    if not addr.startswith(("/ip4/", "/ip6/", "/dns4/", "/dns6/", "/dns/")) or "/p2p/" in addr or _unspecified(addr):
        return False
    port = _tcp_port(addr)
    return port is not None and 0 < port < 65536


def _is_circuit(addr: str, peer_id: str) -> bool:
    relay, sep, rest = addr.partition(CIRCUIT)
    if not sep or rest or "/p2p/" not in relay:
        return False
    relay_id = relay.rsplit("/p2p/", 1)[1]
    return bool(relay_id) and "/" not in relay_id and relay_id != peer_id and _is_direct(relay.rsplit("/p2p/", 1)[0])


def is_loopback(addr: str) -> bool:
    ip = _ip(addr)
    return (ip is not None and ip.is_loopback) or addr.startswith(("/dns4/localhost/", "/dns6/localhost/",
                                                                   "/dns/localhost/"))


def plan_dials(peer_id: str, addrs: Iterable[str], own_addrs: Iterable[str]) -> DialPlan:
    """The addresses of ``peer_id`` worth dialing from a node listening on ``own_addrs`` (bare)."""
    own = {str(a) for a in own_addrs}
    own_real = any(not is_loopback(a) and not _unspecified(a) for a in own)
    direct: list[str] = []
    circuits: list[str] = []
    for raw in addrs:
        addr = _strip_peer(str(raw), peer_id)
        if _is_circuit(addr, peer_id):
            if addr not in circuits:
                circuits.append(addr)
        elif _is_direct(addr) and addr not in own and addr not in direct:
            direct.append(addr)
    if own_real:  # someone else's 127.0.0.1 is our own machine: try it last, if room is left
        direct.sort(key=is_loopback)
    return DialPlan(tuple(direct[:MAX_DIRECT_ADDRS]), tuple(circuits[:MAX_CIRCUIT_ADDRS]))


def relay_address(circuit: str) -> tuple[str, str]:
    """``(relay addr, relay peer id)`` of a planned circuit address."""
    relay = circuit[: -len(CIRCUIT)]
    addr, _, relay_id = relay.rpartition("/p2p/")
    return addr, relay_id


def percentile(samples: Iterable[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``samples``; None when there are none."""
    ordered = sorted(samples)
    if not ordered:
        return None
    rank = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[rank]


@dataclass
class MethodStats:
    """Finished attempts of one method: an attempt cancelled because another method won is not one."""

    attempts: int = 0
    successes: int = 0
    seconds: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLE_WINDOW))

    def record(self, ok: bool, seconds: float) -> None:
        self.attempts += 1
        if ok:
            self.successes += 1
            self.seconds.append(seconds)

    def summary(self) -> dict[str, Any]:
        p50, p95 = percentile(self.seconds, 0.5), percentile(self.seconds, 0.95)
        return {"attempts": self.attempts, "successes": self.successes,
                "failures": self.attempts - self.successes,
                "p50_ms": None if p50 is None else round(1000 * p50, 1),
                "p95_ms": None if p95 is None else round(1000 * p95, 1)}


@dataclass
class ConnectStats:
    """Per-method counters shown under ``connect`` in /api/stats."""

    methods: dict[str, MethodStats] = field(default_factory=lambda: {m: MethodStats() for m in METHODS})
    reused: int = 0  # connect() calls answered by a connection that already existed

    def record(self, method: str, ok: bool, seconds: float) -> None:
        self.methods[method].record(ok, seconds)

    def summary(self) -> dict[str, Any]:
        return {"reused": self.reused, **{m: s.summary() for m, s in self.methods.items()}}
