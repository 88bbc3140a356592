"""The one place that builds the py-libp2p host, with every workaround p2pswarm needs.

py-libp2p 0.8.1's defaults are unsafe or slow for us (see docs/architecture.md, "libp2p
workarounds"), so the host is always built here:
- Noise only: the default also accepts /plaintext/2.0.0 and /secio/1.0.0 (a downgrade).
- Yamux only, TCP only.
- ``max_connections_per_peer=1``: with more allowed, every ``connect()`` waits a fixed
  ~250 ms happy-eyeballs delay for alternates, even after the first dial succeeded.
- explicit connection, stream and memory limits, and the auto-connector switched off: it
  dials every peer in the peerstore towards the midpoint of the watermarks (128 here),
  whatever ``min_connections`` says. We dial whom we need.
- the connection limit is off by one (libp2p holds at most ``max_connections - 1``), so it is
  passed one higher; a test checks that exactly ``HostLimits.max_connections`` peers are held.
  The resource manager gets twice that: it counts each upgrading inbound connection twice, so
  at the same cap a burst of cap/2 concurrent handshakes was denied to the last one.
- wildcard listen addresses (0.0.0.0) are expanded to the machine's interface addresses
  before they are advertised; otherwise peers are told to dial 0.0.0.0, i.e. themselves.
- an inbound connection's slot is released when that connection closes, not when the whole
  swarm stops (``net/swarm_fixes.py``); before, a node refused everyone after 257 inbound
  connections in its life.
- ``host.close()`` always runs on the way out; leaving ``host.run()`` alone leaves a
  listener accepting connections.
- a port already in use is detected before listening: libp2p binds with SO_REUSEPORT (for
  hole punching), so a second node on a taken port would silently share it with the first.
- every inbound stream passes ``net/guard.StreamGuard`` (installed as the swarm's common stream
  handler, in place of BasicHost's): per-peer and per-(peer, protocol) limits refused at once,
  negotiation and idle deadlines. The swarm's node-wide stream semaphore is left out: it
  *queues* the excess (defect 9), so one peer holding ~4,000 silent streams made every other
  peer's streams, and our own outbound ones, wait for as long as it held them.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import multiaddr
import trio

from p2pswarm.errors import ConfigError, DialError, StartupError
from p2pswarm.identity import Identity
from p2pswarm.net import swarm_fixes
from p2pswarm.net.dialplan import plan_dials
from p2pswarm.net.guard import StreamGuard
from p2pswarm.net.limits import StreamLimits

if TYPE_CHECKING:  # libp2p is imported when a host is built
    from libp2p.abc import IHost

log = logging.getLogger(__name__)

NOISE_PROTOCOL = "/noise"
YAMUX_PROTOCOL = "/yamux/1.0.0"


@dataclass(frozen=True)
class HostLimits:
    """Resource limits set explicitly, since the library's own are loose or unchecked."""

    max_connections: int = 256  # a trainer talks to a few dozen peers; a bootstrap to hundreds
    max_streams: int = 8192  # libp2p's own cap, in and out: the guard's inbound limit plus as many of ours
    streams: StreamLimits = StreamLimits()  # inbound limits and deadlines enforced by net/guard.py
    max_memory_mb: int = 1024  # bound for libp2p's own buffers, not model memory
    dial_timeout: float = 5.0  # Petals' connect timeout; a peer slower than this is not useful
    upgrade_timeout: float = 5.0  # Noise + Yamux negotiation on a live TCP connection
    max_connections_per_peer: int = 1  # >1 makes every connect() wait ~250 ms (defect 8)


DEFAULT_LIMITS = HostLimits()
LIBP2P_CONNECTION_LIMIT_SLACK = 1  # py-libp2p holds at most max_connections - 1 peers (defect 9)
RCMGR_SCOPES_PER_CONNECTION = 2  # the resource manager counts an upgrading inbound connection twice


def parse_multiaddr(text: str) -> multiaddr.Multiaddr:
    """Parse a multiaddr given by a user; ConfigError with the reason when it is not one."""
    try:
        return multiaddr.Multiaddr(text)
    except Exception as exc:  # the multiaddr package raises several unrelated types
        raise ConfigError(f"bad multiaddr {text!r}: {exc}") from None


def interface_ipv4_addresses() -> list[str]:
    """IPv4 addresses of this machine's interfaces, non-loopback first."""
    import ifaddr

    found: list[str] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and ip.ip not in found:
                found.append(ip.ip)
    return sorted(found, key=lambda a: (ipaddress.ip_address(a).is_loopback, a))


def expand_wildcards(
    addrs: Sequence[multiaddr.Multiaddr], interface_ips: Sequence[str]
) -> list[multiaddr.Multiaddr]:
    """Replace each /ip4/0.0.0.0 address by one address per interface IP; keep the rest."""
    expanded: list[multiaddr.Multiaddr] = []
    for addr in addrs:
        text = str(addr)
        if text.startswith("/ip4/0.0.0.0/"):
            rest = text[len("/ip4/0.0.0.0") :]
            candidates = [multiaddr.Multiaddr(f"/ip4/{ip}{rest}") for ip in interface_ips]
        else:
            candidates = [addr]
        for candidate in candidates:
            if str(candidate) not in {str(a) for a in expanded}:
                expanded.append(candidate)
    return expanded


def build_host(identity: Identity, limits: HostLimits = DEFAULT_LIMITS) -> IHost:
    """A libp2p host speaking TCP + Noise + Yamux only, with explicit limits."""
    from libp2p import new_host
    from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
    from libp2p.custom_types import TProtocol
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport
    from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_ID
    from libp2p.stream_muxer.yamux.yamux import Yamux

    noise = NoiseTransport(identity.key_pair, noise_privkey=new_x25519_key_pair().private_key)
    resource_manager = _resource_manager(limits)
    interface_ips = interface_ipv4_addresses()
    host = new_host(
        key_pair=identity.key_pair,
        sec_opt={NOISE_ID: noise},
        muxer_opt={TProtocol(YAMUX_ID): Yamux},
        connection_config=_connection_config(limits),
        resource_manager=resource_manager,
        addrs_factory=lambda addrs: expand_wildcards(addrs, interface_ips),
        enable_mDNS=False,
        enable_upnp=False,
    )
    _install_fixes(host, limits, resource_manager)
    _advertise_extra_addrs(host)
    return host


def _connection_config(limits: HostLimits):
    """The swarm's connection limits (one above ours: defect 9) and timeouts."""
    from libp2p.network.config import ConnectionConfig

    return ConnectionConfig(
        max_connections=limits.max_connections + LIBP2P_CONNECTION_LIMIT_SLACK,
        min_connections=0,
        low_watermark=limits.max_connections * 3 // 4,  # the pruner trims down to this
        high_watermark=limits.max_connections,
        max_connections_per_peer=limits.max_connections_per_peer,
        dial_timeout=limits.dial_timeout,
        inbound_upgrade_timeout=limits.upgrade_timeout,
        outbound_upgrade_timeout=limits.upgrade_timeout,
    )


def _resource_manager(limits: HostLimits):
    """libp2p's resource manager with our memory and stream limits, and room for every connection."""
    from libp2p.rcmgr import ResourceLimits, new_resource_manager

    return new_resource_manager(
        limits=ResourceLimits(
            # Every inbound handshake holds two of its connection scopes for a moment (one before
            # the upgrade, one after); with the swarm's cap here, a burst of cap/2 handshakes took
            # every scope and all of them were denied. The swarm enforces the cap itself.
            max_connections=RCMGR_SCOPES_PER_CONNECTION * (limits.max_connections + LIBP2P_CONNECTION_LIMIT_SLACK),
            max_memory_mb=limits.max_memory_mb,
            max_streams=limits.max_streams,
        ),
        enable_metrics=False,
    )


def _install_fixes(host, limits: HostLimits, resource_manager) -> None:
    """The stream guard, no auto-connector, per-connection slots and dials of every address."""
    # Without the swarm's stream semaphore: it queues instead of refusing (see the module doc).
    host.get_network().set_resource_manager(resource_manager, enable_stream_semaphore=False)
    host.p2pswarm_guard = StreamGuard(host, limits.streams)
    host.p2pswarm_guard.install()
    host.get_network().auto_connector.start = _auto_connector_stays_off
    swarm_fixes.install(host.get_network(), limits.max_connections)  # slots released when connections close
    host.get_network().dial_peer = _dial_every_address(host)


def _advertise_extra_addrs(host) -> None:
    """``host.get_addrs`` also gives ``host.p2pswarm_extra_addrs`` (e.g. /p2p-circuit addresses; see
    set_extra_addrs); the listen addresses alone stay as ``host.p2pswarm_listen_addrs``."""
    extra_addrs: list[multiaddr.Multiaddr] = []
    host.p2pswarm_extra_addrs = extra_addrs
    listen_addrs = host.get_addrs

    ours = multiaddr.Multiaddr(f"/p2p/{host.get_id()!s}")  # parsed once: identify asks on every connection

    def get_addrs() -> list[multiaddr.Multiaddr]:
        # Not through addrs_factory: BasicHost.get_addrs() strips the last /p2p/<id> of every
        # address before appending ours, which turns <relay>/p2p/<relay id>/p2p-circuit into the
        # relay's own address.
        # Confirmed public addresses (a DMZ router's) first: many dialers try only the first.
        extra = [a.encapsulate(ours) for a in extra_addrs]
        public = [a for a in extra if "/p2p-circuit" not in str(a)]
        return public + list(listen_addrs()) + [a for a in extra if a not in public]

    host.get_addrs = get_addrs
    host.p2pswarm_listen_addrs = listen_addrs


def _dial_every_address(host):
    """A replacement for ``Swarm.dial_peer`` that tries every known address (see ``connect``).

    Every dial the library makes on its own (Kademlia queries, ``new_stream`` to a peer not yet
    connected) goes through ``dial_peer``, which tries one TCP address: the first in the
    peerstore, often an unreachable LAN address.
    """
    from libp2p.network.exceptions import SwarmException
    from libp2p.peer.peerinfo import PeerInfo

    network = host.get_network()
    locks: dict = {}

    async def dial_peer(peer_id) -> list:
        lock = locks.setdefault(peer_id, trio.Lock())
        try:
            async with lock:
                existing = [c for c in network.get_connections(peer_id) if not c.is_closed]
                if existing:
                    return existing
                try:
                    known = [str(a) for a in host.get_peerstore().addrs(peer_id)]
                except Exception:  # PeerStoreError: nothing known
                    known = []
                own = [str(a).split("/p2p/")[0] for a in host.p2pswarm_listen_addrs()]
                plan = plan_dials(str(peer_id), known, own)
                if not plan.direct:
                    raise SwarmException(f"no dialable address known for {peer_id}")
                try:
                    await connect(host, PeerInfo(peer_id, [multiaddr.Multiaddr(a) for a in plan.direct]))
                except DialError as exc:
                    raise SwarmException(str(exc)) from None
                return [c for c in network.get_connections(peer_id) if not c.is_closed]
        finally:
            if not lock.locked() and not lock.statistics().tasks_waiting:
                locks.pop(peer_id, None)

    return dial_peer


def set_extra_addrs(host, addrs: Sequence[str]) -> None:
    """Advertise ``addrs`` (without our /p2p suffix) in ``host.get_addrs()``: direct ones before
    the listen addresses, /p2p-circuit ones after them."""
    extra = host.p2pswarm_extra_addrs
    extra[:] = [parse_multiaddr(a) for a in addrs]


def listen_addrs(host) -> list[str]:
    """The addresses the host listens on (wildcards expanded), without /p2p/<id> or extras."""
    return [str(a).split("/p2p/")[0] for a in host.p2pswarm_listen_addrs()]


async def _auto_connector_stays_off() -> None:
    """Replaces AutoConnector.start: never started, its periodic task returns at once."""


@asynccontextmanager
async def open_host(
    identity: Identity,
    listen_addrs: Sequence[str],
    limits: HostLimits = DEFAULT_LIMITS,
) -> AsyncIterator[IHost]:
    """Build a host, listen on ``listen_addrs`` and always close it on the way out."""
    addrs = [parse_multiaddr(a) for a in listen_addrs]
    for addr in addrs:
        if not str(addr).startswith(("/ip4/", "/ip6/")) or "/tcp/" not in str(addr):
            raise ConfigError(f"listen address {addr} must be /ip4/<ip>/tcp/<port> (TCP only)")
    for addr in addrs:
        check_port_free(addr)
    host = build_host(identity, limits)
    started = False
    try:
        async with host.run(listen_addrs=addrs):
            started = True
            try:
                yield host
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(10):
                    await host.close()
    except Exception as exc:
        if started:
            raise
        raise StartupError(f"cannot listen on {', '.join(listen_addrs)}: {_root_cause(exc)}") from None
    finally:
        if not started:
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await host.close()


def check_port_free(addr: multiaddr.Multiaddr) -> None:
    """StartupError if the TCP port of ``addr`` is taken (probe-bound without SO_REUSEPORT)."""
    text = str(addr).split("/")
    ip, port = text[2], int(text[4])
    if port == 0:
        return
    family = socket.AF_INET6 if text[1] == "ip6" else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # ignore TIME_WAIT leftovers
        try:
            probe.bind((ip, port))
        except OSError as exc:
            raise StartupError(f"cannot listen on {addr}: {exc.strerror}") from None


def _root_cause(exc: BaseException) -> str:
    while (cause := exc.__cause__ or exc.__context__) is not None:
        exc = cause
    return str(exc) or type(exc).__name__


def check_peer_multiaddr(addr: str):
    """``addr`` parsed; ConfigError unless it is a multiaddr ending in /p2p/<peer id> (the multiaddr package
    checks the peer id's encoding): the command line's check, without importing libp2p (1.2 s)."""
    parsed = parse_multiaddr(addr)
    protocols = parsed.protocols()
    if not protocols or protocols[-1].name != "p2p":
        raise ConfigError(f"multiaddr {addr} must end in /p2p/<peer id>")
    return parsed


def peer_info_from_multiaddr(addr: str):
    """PeerInfo for a full multiaddr ending in /p2p/<peer id>; ConfigError if it has none."""
    from libp2p.peer.peerinfo import info_from_p2p_addr

    parsed = check_peer_multiaddr(addr)  # the one rule, and its one-line errors
    try:
        return info_from_p2p_addr(parsed)
    except Exception:
        raise ConfigError(f"multiaddr {addr} must end in /p2p/<peer id>") from None


HAPPY_EYEBALLS_DELAY = 0.25  # RFC 8305: the next address is tried this long after the previous one


async def connect(host, peer_info, timeout: float = DEFAULT_LIMITS.dial_timeout) -> None:
    """Connect to a peer by dialing the addresses in ``peer_info``, in order; DialError if none answers.

    Not ``host.connect``: py-libp2p dials only the first TCP address in its peerstore (at most
    one address per transport), so a peer that lists its LAN address before its public one can
    never be reached, and an AutoNAT dial-back may test a different address than the one asked.
    Here each given address gets a single attempt, the next one starting HAPPY_EYEBALLS_DELAY
    later or as soon as the previous one failed; the first connection wins.
    """
    if list(host.get_network().get_connections(peer_info.peer_id)):
        return
    addrs = list(peer_info.addrs)
    if not addrs:
        raise DialError(f"cannot reach {peer_info.peer_id}: no address given")
    host.get_peerstore().add_addrs(peer_info.peer_id, addrs, PEERSTORE_ADDR_TTL)
    errors: list[str] = []
    won: list[object] = []  # the connection that won the race
    with trio.move_on_after(timeout) as scope:
        async with trio.open_nursery() as nursery:
            for addr in addrs:
                failed = trio.Event()
                nursery.start_soon(_dial_one, host, peer_info.peer_id, addr, failed, errors, won, nursery.cancel_scope)
                with trio.move_on_after(HAPPY_EYEBALLS_DELAY):
                    await failed.wait()
    if won:
        schedule_identify = getattr(host, "_schedule_identify", None)
        if schedule_identify is not None:
            schedule_identify(peer_info.peer_id, reason="connect")
        return
    if scope.cancelled_caught and not errors:
        raise DialError(f"cannot reach {peer_info.peer_id}: no answer within {timeout:.0f} s")
    raise DialError(f"cannot reach {peer_info.peer_id}: " + ("; ".join(errors) or f"no answer within {timeout:.0f} s"))


PEERSTORE_ADDR_TTL = 120  # seconds, as host.connect keeps the addresses it is given


async def _dial_one(host, peer_id, addr, failed: trio.Event, errors: list[str], won: list,
                    cancel_scope: trio.CancelScope) -> None:
    try:
        conn = await host.get_network()._dial_addr_single_attempt(addr, peer_id)
        event_started = getattr(conn, "event_started", None)
        if event_started is not None:
            await event_started.wait()
    except trio.Cancelled:
        raise
    except Exception as exc:
        errors.append(f"{addr}: {_root_cause(exc)}")
        failed.set()
        return
    won.append(conn)
    cancel_scope.cancel()
