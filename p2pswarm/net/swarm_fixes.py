"""Patches of py-libp2p 0.8.1's swarm that keep a node open for its whole life.

``Swarm._handle_inbound_connection`` takes one slot of ``_inbound_limiter``
(``max_connections - min_connections``) per inbound connection and releases it when
``_do_handle_inbound_connection`` returns. That function awaits ``manager.wait_finished()``,
the whole swarm's end, after the upgrade: an inbound connection kept its slot after it closed,
and after that many inbound connections in a node's life every new one was closed during the
handshake (a bootstrap node locked every new peer out after 257 of them). The handler task also
stayed alive, holding the connection's objects, until shutdown.

``serve_inbound`` replaces ``_handle_inbound_connection`` (installed per swarm by ``install``):
the same slot taken without a checkpoint, the same gate check and upgrade, then it waits only
until *this* connection is closed. The slot then counts
the inbound connections open now (handshakes included), which is what the limit means. The TCP
listener (trio's ``serve_listeners``) closes the socket when the handler returns, so the handler
must live exactly as long as the connection: it returns once the muxer reports it closed, or once
the swarm no longer holds the connection (a pruned or trimmed duplicate), checked every
``ORPHAN_CHECK_PERIOD`` in case a muxer exit path ever skips its closed event.

It also caps the inbound connections open from one IP address at ``MAX_INBOUND_PER_IP``
(``PerAddress``): identities are free, addresses are not, so a few addresses cannot take every
one of the node's connection slots. Loopback (this machine: the demo, a local swarm, the tests)
and connections of no known IP are not capped.

The other limiters on the connection and stream paths were checked for the same pattern; what
was found is listed in docs/architecture.md ("py-libp2p 0.8.1 workarounds").
"""

from __future__ import annotations

import ipaddress
import logging
import math
from collections import Counter
from collections.abc import Callable

import trio

from p2pswarm.net.streams import close_quietly

log = logging.getLogger(__name__)

ORPHAN_CHECK_PERIOD = 10.0  # seconds between checks that the swarm still holds an inbound connection
MAX_INBOUND_PER_IP = 32  # inbound connections open from one IP: a household, a lab, peers behind a CGNAT
REFUSAL_LOG_PERIOD = 60.0  # a node at its limit says so once a minute, not once per refused peer


def install(swarm, max_inbound: int) -> None:
    """Make ``swarm`` release each inbound slot when its connection closes, not at shutdown, and
    hold at most ``max_inbound`` inbound connections (the library's own count is one more)."""
    swarm.p2pswarm_inbound = InboundStats()
    swarm.p2pswarm_per_address = PerAddress(MAX_INBOUND_PER_IP)
    swarm._inbound_limiter.total_tokens = max_inbound
    _count_resource_denials(swarm)

    async def handle_inbound_connection(read_write_closer, maddr) -> None:
        await serve_inbound(swarm, read_write_closer, maddr)

    swarm._handle_inbound_connection = handle_inbound_connection
    # The auto-connector is switched off (net/host.py), so nothing ever reads or prunes its
    # disconnect backoff (it prunes only inside its own dial loop): one entry per peer ever seen.
    swarm.auto_connector.record_disconnect = _forget_disconnect


def _count_resource_denials(swarm) -> None:
    """Count each connection scope and stream libp2p's resource manager denies, by its return value
    (None, False) rather than by the text of whatever the library then raises or logs."""
    manager, stats = swarm._resource_manager, swarm.p2pswarm_inbound
    if manager is None:
        return
    open_connection, acquire_stream = manager.open_connection, manager.acquire_stream

    def counted_open_connection(*args, **kwargs):
        scope = open_connection(*args, **kwargs)
        if scope is None:
            stats.resource_manager_connections += 1
        return scope

    def counted_acquire_stream(*args, **kwargs):
        granted = acquire_stream(*args, **kwargs)
        if not granted:
            stats.resource_manager_streams += 1
        return granted

    manager.open_connection, manager.acquire_stream = counted_open_connection, counted_acquire_stream
    lifecycle = getattr(manager, "connection_lifecycle", None)
    if lifecycle is not None:  # its per-peer and total limits on established connections raise
        for name in ("handle_established_inbound_connection", "handle_established_outbound_connection"):
            setattr(lifecycle, name, _counting_limit_errors(getattr(lifecycle, name), stats))


def _counting_limit_errors(handle, stats: InboundStats):
    """``handle`` (a lifecycle coroutine method), counting each ResourceLimitExceeded it raises."""
    from libp2p.rcmgr.exceptions import ResourceLimitExceeded

    async def counted(*args, **kwargs):
        try:
            return await handle(*args, **kwargs)
        except ResourceLimitExceeded:
            stats.connection_limits += 1
            raise
    return counted


class InboundStats:
    """Inbound connections accepted and refused at the limit (refusals logged at most once a period), and
    the resource manager's denials of connections and streams."""

    def __init__(self) -> None:
        self.accepted = 0
        self.refused = 0
        self.resource_manager_connections = 0  # connection scopes denied (either direction)
        self.resource_manager_streams = 0  # outbound streams denied
        self.connection_limits = 0  # established connections over libp2p's per-peer or total limits
        self._logged_at = -math.inf

    def refuse(self, remote, reason: str) -> None:
        self.refused += 1
        now = trio.current_time()
        if now - self._logged_at >= REFUSAL_LOG_PERIOD:
            self._logged_at = now
            log.warning("refusing inbound connections (%s; %d refused so far; latest from %s); if these are honest "
                        "peers, raise --max-connections",
                        reason, self.refused, remote)


class PerAddress:
    """Inbound connections open per remote IP address, at most ``limit`` each (module docstring)."""

    def __init__(self, limit: int, exempt: Callable[[str], bool] | None = None) -> None:
        self.limit, self.open, self.refused = limit, Counter[str](), 0
        self._exempt = exempt or _local_or_unknown

    def take(self, ip: str) -> bool:
        if self._exempt(ip):
            return True
        if self.open[ip] >= self.limit:
            self.refused += 1
            return False
        self.open[ip] += 1
        return True

    def give_back(self, ip: str) -> None:
        if not self._exempt(ip):
            self.open[ip] -= 1
            if not self.open[ip]:
                del self.open[ip]


def _local_or_unknown(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return True  # no IP we could attribute the connection to


def _ip_of(remote) -> str:
    parts = str(remote).split("/") if remote is not None else []
    return parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6") else ""


async def serve_inbound(swarm, read_write_closer, maddr) -> None:
    """Replaces ``Swarm._handle_inbound_connection``: a slot while the connection is open."""
    ip = _ip_of(swarm._build_remote_multiaddr(read_write_closer))
    per_address = swarm.p2pswarm_per_address
    if not per_address.take(ip):
        swarm.p2pswarm_inbound.refuse(ip, f"{per_address.limit} inbound connections open from one address")
        await close_quietly(read_write_closer)
        return
    try:
        await _serve_inbound_slot(swarm, read_write_closer, maddr)
    finally:
        per_address.give_back(ip)


async def _serve_inbound_slot(swarm, read_write_closer, maddr) -> None:
    try:
        swarm._inbound_limiter.acquire_nowait()  # no checkpoint between the check and the take
    except trio.WouldBlock:
        swarm.p2pswarm_inbound.refuse(swarm._build_remote_multiaddr(read_write_closer),
                                      f"{int(swarm._inbound_limiter.total_tokens)} inbound connections open")
        await close_quietly(read_write_closer)
        return
    try:
        await serve_inbound_until_closed(swarm, read_write_closer, maddr)
    finally:
        swarm._inbound_limiter.release()


def _forget_disconnect(peer_id) -> None:
    """Replaces ``AutoConnector.record_disconnect``: the backoff it records is never used here."""


async def serve_inbound_until_closed(swarm, read_write_closer, maddr) -> None:
    """Gate, upgrade and register one inbound connection; return when it is closed."""
    from libp2p.network.connection.raw_connection import RawConnection

    remote = swarm._build_remote_multiaddr(read_write_closer)
    if remote is not None and not await swarm.connection_gate.is_allowed(remote):
        await close_quietly(read_write_closer)
        return
    raw_conn = RawConnection(read_write_closer, False)
    try:
        muxed_conn = await swarm.upgrade_inbound_raw_conn(raw_conn, maddr)
    except Exception as exc:  # refused (counted where refused: the limiter, the resource manager), failed
        log.debug("inbound connection from %s not upgraded: %s", remote, exc)  # handshake, timeout: cleaned up
        await close_quietly(raw_conn)
        return
    swarm.p2pswarm_inbound.accepted += 1
    await wait_closed(swarm, muxed_conn)


async def wait_closed(swarm, muxed_conn) -> None:
    """Until ``muxed_conn`` is closed, or the swarm holds it no longer (then it is closed here)."""
    while True:
        with trio.move_on_after(ORPHAN_CHECK_PERIOD):
            await muxed_conn.event_closed.wait()
            return
        if not held_by(swarm, muxed_conn):
            log.debug("closing an inbound connection the swarm no longer holds (%s)", muxed_conn.peer_id)
            await close_quietly(muxed_conn)
            return


def held_by(swarm, muxed_conn) -> bool:
    """Whether one of the swarm's live connections runs over ``muxed_conn``."""
    return any(conn.muxed_conn is muxed_conn for conn in swarm.connections.get(muxed_conn.peer_id, ()))


def inbound_stats(host) -> dict:
    """Inbound connections open now (upgrading included), accepted and refused at the limit, and the
    resource manager's denials."""
    swarm = host.get_network()
    stats = getattr(swarm, "p2pswarm_inbound", None) or InboundStats()
    return {"open": int(swarm._inbound_limiter.borrowed_tokens), "limit": int(swarm._inbound_limiter.total_tokens),
            "accepted": stats.accepted, "refused": stats.refused,
            "resource_manager_denied_connections": stats.resource_manager_connections,
            "resource_manager_denied_streams": stats.resource_manager_streams,
            "over_connection_limits": stats.connection_limits,
            "refused_per_address": getattr(swarm, "p2pswarm_per_address", PerAddress(0)).refused}
