"""Circuit relay v2 client: hold reservations on a few relays while we are behind a NAT.

A node that reachability detection finds PRIVATE cannot be dialled directly; it reserves a slot
on ``WANT_RELAYS`` relays and advertises ``<relay addr>/p2p/<relay id>/p2p-circuit`` addresses
(``host.get_addrs()`` appends ``/p2p/<our id>``, the form py-libp2p's ``CircuitV2Transport.dial``
parses). The decisions live in a pure core, ``RelayPicker`` (plain class, ``now`` passed in, the
random source injected); ``serve_relay_reservations`` is a thin driver that asks it what to do
every ``TICK`` seconds.

py-libp2p's own client is used for the RESERVE exchange (``CircuitV2Transport._make_reservation``),
not ``CircuitV2Transport.reserve``: the latter also starts the library's refresher, which renews
only a few seconds before expiry and keeps retrying relays that died; here the picker decides.
A ``CircuitV2Protocol`` without hop runs alongside so that circuits to us (STOP streams) are
accepted and upgraded into ordinary connections.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import trio

from p2pswarm.nat.relay_service import HOP_PROTOCOL
from p2pswarm.net.notify import stop_watching, watch_connections

log = logging.getLogger(__name__)

WANT_RELAYS = 2  # one relay is a single point of failure; more costs slots on shared relays
REFRESH_AT = 0.5  # refresh once half the reservation's lifetime is gone: a failed refresh has time to retry elsewhere
RELAY_BACKOFF = 60.0  # a relay that failed is not picked again for this long
TICK = 2.0  # how often the driver consults the picker
RESERVE_TIMEOUT = 10.0  # dial + RESERVE exchange with one relay
MAX_ADDRS_PER_RELAY = 2  # circuit addresses advertised per relay


@dataclass
class Held:
    granted_at: float
    expiry: float
    lost: bool = False  # a connection to the relay closed since: the relay may have ended the reservation

    def refresh_at(self) -> float:
        return self.granted_at if self.lost else self.granted_at + REFRESH_AT * (self.expiry - self.granted_at)


@dataclass
class RelayPicker:
    """Which relays to hold reservations on, when to refresh them, which replaces a failed one."""

    rng: random.Random
    want: int = WANT_RELAYS
    backoff: float = RELAY_BACKOFF
    candidates: dict[str, tuple[str, ...]] = field(default_factory=dict)  # relay peer id -> its addrs
    held: dict[str, Held] = field(default_factory=dict)  # relay peer id -> reservation
    failed_at: dict[str, float] = field(default_factory=dict)

    def add_candidate(self, peer: str, addrs: Sequence[str]) -> None:
        known = list(self.candidates.get(peer, ()))
        self.candidates[peer] = tuple(known + [a for a in addrs if a not in known])

    def in_backoff(self, peer: str, now: float) -> bool:
        failed = self.failed_at.get(peer)
        return failed is not None and now - failed < self.backoff

    def expire(self, now: float) -> None:
        """A reservation that reached its expiry without a refresh counts as a failure."""
        for peer in [p for p, h in self.held.items() if h.expiry <= now]:
            self.failed(peer, now)

    def to_reserve(self, now: float) -> list[str]:
        """Relays to reserve on now, enough to fill the free slots (random among the eligible)."""
        self.expire(now)
        slots = self.want - len(self.held)
        if slots <= 0:
            return []
        eligible = sorted(p for p in self.candidates if p not in self.held and not self.in_backoff(p, now))
        return self.rng.sample(eligible, min(slots, len(eligible)))

    def refresh_due(self, now: float) -> list[str]:
        self.expire(now)
        return sorted(p for p, h in self.held.items() if now >= h.refresh_at())

    def reserved(self, peer: str, now: float, expiry: float) -> bool:
        """Record a granted (or refreshed) reservation; False (not held) if the slots are full."""
        if peer not in self.held and len(self.held) >= self.want:
            return False
        if expiry <= now:
            self.failed(peer, now)
            return False
        self.held[peer] = Held(now, expiry)
        return True

    def connection_lost(self, peer: str) -> None:
        """A connection to ``peer`` closed. A relay ends a reservation with the peer's last connection
        (``relay_service``), and other traffic may have connected us again at once: refresh it now."""
        if peer in self.held:
            self.held[peer].lost = True

    def failed(self, peer: str, now: float) -> None:
        self.held.pop(peer, None)
        self.failed_at[peer] = now

    def release_all(self) -> None:
        self.held.clear()

    def next_wakeup(self, now: float) -> float:
        """Seconds until something is due (a refresh), at most TICK."""
        due = [h.refresh_at() - now for h in self.held.values()]
        return max(0.0, min([TICK, *due]))

    def circuit_addrs(self) -> list[str]:
        addrs = []
        for peer in sorted(self.held):
            for addr in self.candidates.get(peer, ())[:MAX_ADDRS_PER_RELAY]:
                addrs.append(f"{strip_p2p(addr)}/p2p/{peer}/p2p-circuit")
        return addrs

    def stats(self, now: float) -> list[dict]:
        return [{"peer": p, "expires_in_s": round(h.expiry - now, 1)} for p, h in sorted(self.held.items())]


def strip_p2p(addr: str) -> str:
    """``addr`` without a trailing /p2p/<id>."""
    parts = addr.split("/p2p/")
    return parts[0] if len(parts) > 1 and "/" not in parts[-1] else addr


def _usable(addr: str) -> bool:
    return "/p2p-circuit" not in addr and addr.startswith(("/ip4/", "/ip6/", "/dns")) and "/tcp/" in addr


def _loopback(addr: str) -> bool:
    return addr.startswith(("/ip4/127.", "/ip6/::1/"))


def learn_candidates(host, picker: RelayPicker) -> None:
    """Add connected peers whose identify protocols include the hop protocol.

    A configured relay keeps its configured address (identify would add its loopback and private
    ones too); a discovered relay is advertised with its non-loopback addresses.
    """
    peerstore = host.get_peerstore()
    for peer in host.get_connected_peers():
        if str(peer) in picker.candidates:
            continue
        try:
            protocols = peerstore.get_protocols(peer)
        except Exception:  # not identified yet
            continue
        if HOP_PROTOCOL in [str(p) for p in protocols or ()]:
            addrs = [str(a) for a in peerstore.addrs(peer) if _usable(str(a))]
            addrs = [a for a in addrs if not _loopback(a)] or addrs
            if addrs:
                picker.add_candidate(str(peer), addrs)


async def _reserve(host, transport, peer: str, addrs: Sequence[str]) -> float | None:
    """Dial ``peer`` if needed and RESERVE on it; the expiry (unix seconds) or None."""
    import multiaddr
    from libp2p.custom_types import TProtocol
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo

    relay_id = ID.from_base58(peer)
    with trio.move_on_after(RESERVE_TIMEOUT):
        try:
            if relay_id not in host.get_connected_peers():
                await host.connect(PeerInfo(relay_id, [multiaddr.Multiaddr(strip_p2p(a)) for a in addrs]))
            stream = await host.new_stream(relay_id, [TProtocol(HOP_PROTOCOL)])
            try:
                ok = await transport._make_reservation(stream, relay_id)
            finally:
                with trio.move_on_after(2):
                    await stream.close()
        except trio.Cancelled:
            raise
        except Exception as exc:
            log.info("relay client: cannot reserve on %s: %s", peer, exc)
            return None
        expiry = transport._reservations.pop(relay_id, None)
        transport._reservation_proofs.pop(relay_id, None)
        if not ok or not expiry:
            log.info("relay client: cannot reserve on %s: refused (full, or limits for our IP)", peer)
            return None
        return float(expiry)
    log.info("relay client: reservation on %s timed out", peer)
    return None


async def _reserve_due(host, transport, picker: RelayPicker, clock) -> None:
    """Refresh the reservations that are due, then fill the free slots (the picker says which)."""
    for peer in picker.refresh_due(clock()):
        expiry = await _reserve(host, transport, peer, picker.candidates.get(peer, ()))
        if expiry is None:
            picker.failed(peer, clock())
        else:
            picker.reserved(peer, clock(), expiry)
    for peer in picker.to_reserve(clock()):
        expiry = await _reserve(host, transport, peer, picker.candidates.get(peer, ()))
        if expiry is None:
            picker.failed(peer, clock())
        elif picker.reserved(peer, clock(), expiry):
            log.debug("relay client: reserved on %s for %.0f s", peer, expiry - clock())


async def serve_relay_reservations(host, picker: RelayPicker, on_change: Callable[[list[str]], None], *,
                                   clock=time.time, tick: float = TICK,
                                   task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Keep reservations per ``picker`` until cancelled; ``on_change(circuit_addrs)`` on every change.

    ``clock`` is wall-clock time: relays state expiry in unix seconds.
    """
    from libp2p.relay.circuit_v2.config import RelayConfig as LibRelayConfig
    from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
    from libp2p.relay.circuit_v2.transport import CircuitV2Transport
    from libp2p.tools.anyio_service import background_trio_service

    protocol = CircuitV2Protocol(host, allow_hop=False)  # accepts STOP streams: circuits to us
    transport = CircuitV2Transport(host, protocol, LibRelayConfig())
    advertised: list[str] = []

    def publish() -> None:
        nonlocal advertised
        addrs = picker.circuit_addrs()
        if addrs != advertised:
            advertised = addrs
            log.info("relay client: advertising %d circuit address(es) via %d relay(s)", len(addrs), len(picker.held))
            on_change(list(addrs))

    lost: set[str] = set()
    woken = trio.Event()

    def on_disconnected(conn) -> None:
        peer = str(conn.muxed_conn.peer_id)
        if peer in picker.held:  # other peers' comings and goings are no reason to wake
            lost.add(peer)
            woken.set()

    watching = watch_connections(host, on_disconnected=on_disconnected)  # the node may start us again and again
    try:
        async with background_trio_service(protocol):
            await protocol.event_started.wait()
            task_status.started()
            while True:
                learn_candidates(host, picker)
                for peer in sorted(lost):
                    picker.connection_lost(peer)
                lost.clear()
                now = clock()
                connected = {str(p) for p in host.get_connected_peers()}
                for peer in [p for p in picker.held if p not in connected]:
                    log.info("relay client: lost the connection to relay %s", peer)
                    picker.failed(peer, now)
                await _reserve_due(host, transport, picker, clock)
                publish()
                with trio.move_on_after(min(tick, picker.next_wakeup(clock())) or tick):
                    await woken.wait()  # or at once when a connection closed
                woken = trio.Event()
    finally:
        stop_watching(host, watching)
        picker.release_all()
        if advertised:
            on_change([])
