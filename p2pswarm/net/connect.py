"""``connect(peer)``: the one way every protocol reaches a peer — direct, hole punch, relay.

Direct dials start at once. A relay dial joins the race after ``RELAY_HEAD_START`` (at once if
the peer has no direct address or every direct dial already failed); the first connection wins
and the other attempt is cancelled. A NATed peer that receives a relayed connection then
upgrades it to a direct one by hole punching (DCUtR: only the receiving side initiates, see
``nat/holepunch.py``); here the dialing side watches for that upgrade and counts it. New streams
prefer a direct connection (py-libp2p picks direct over relayed); the relayed one is closed a
grace period later, and the peer's relay reservation remains the fallback path.

The relayed dial is ours, not ``CircuitV2Transport.dial``: that one consults the peerstore,
a relay-selection heuristic and a DHT, and leaves the new connection untagged, so nothing can
tell it is relayed. The autonat dial-back is the one dial that bypasses ``connect``: it must
test one address over a fresh connection from another host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence

import trio

from p2pswarm.errors import DialError, RemoteProtocolError
from p2pswarm.net.budget import CircuitLimit
from p2pswarm.net.dialplan import (
    DIRECT,
    HOLEPUNCH,
    RELAY,
    ConnectStats,
    DialPlan,
    plan_dials,
    relay_address,
)
from p2pswarm.net.host import connect as dial_direct
from p2pswarm.net.host import parse_multiaddr

log = logging.getLogger(__name__)

HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"  # circuit relay v2; the relay service serves it
RELAY_HEAD_START = 0.25  # happy-eyeballs delay (RFC 8305): a reachable direct address answers well inside it
RELAY_DIAL_TIMEOUT = 10.0  # dial the relay, CONNECT through it, then Noise + Yamux over the circuit
# How long the dialer watches a relayed connection for the other side's direct upgrade: its whole
# procedure, three punch rounds with their backoffs (a first round lost on a loaded machine made
# an upgrade at 20.09 s count as a failure against a 20 s watch: a CI failure).
UPGRADE_WATCH = 45.0
UPGRADE_POLL = 0.1
MAX_HOP_REPLY = 4096  # a HopMessage STATUS is a few bytes; the spec caps messages at 4 KiB


def as_peer_id(peer):
    """A libp2p ID from an ID or its base58 text; DialError if it is not one."""
    from libp2p.peer.id import ID

    if isinstance(peer, ID):
        return peer
    try:
        return ID.from_base58(str(peer))
    except Exception:
        raise DialError(f"{peer!r} is not a peer id") from None


def connections_to(host, peer_id) -> list:
    """Open connections to ``peer_id`` (a libp2p ID)."""
    try:
        return [c for c in host.get_network().get_connections(peer_id) if not getattr(c, "is_closed", False)]
    except Exception:  # the swarm raises for a peer it never saw
        return []


def is_relayed(conn) -> bool:
    """A connection that runs through a relay's circuit (either direction)."""
    from libp2p.connection_types import ConnectionType

    try:
        if conn.get_connection_type() == ConnectionType.RELAYED:
            return True
    except Exception:  # a connection type the library could not determine
        pass
    addrs = getattr(conn, "_actual_transport_addresses", None) or []
    return any("/p2p-circuit" in str(a) for a in addrs)


def is_inbound(conn) -> bool:
    """The remote side opened this connection."""
    try:
        return not conn.muxed_conn.is_initiator
    except Exception:  # no muxer information: treat as ours, which never makes us punch
        return False


def has_direct(host, peer_id) -> bool:
    return any(not is_relayed(c) for c in connections_to(host, peer_id))


def path_kinds(host, punched: Collection[str] = ()) -> dict[str, str]:
    """Each connected peer's path as this node sees it: ``direct``, ``holepunched`` (a direct connection
    to a peer we punched to, ``punched``) or ``relayed`` (through a relay's circuit only)."""
    kinds = {}
    for peer_id in host.get_connected_peers():
        conns, peer = connections_to(host, peer_id), str(peer_id)
        if conns:
            direct = any(not is_relayed(c) for c in conns)
            kinds[peer] = ("holepunched" if peer in punched else "direct") if direct else "relayed"
    return kinds


def remote_ip(host, peer_id) -> str | None:
    """The IP address a connected peer's direct connection comes from, or None (relayed, gone)."""
    for conn in connections_to(host, peer_id):
        if is_relayed(conn):
            continue
        try:
            address = conn.muxed_conn.get_remote_address()
        except Exception:  # a closing connection may have lost its socket
            continue
        if address:
            return str(address[0])
    return None


async def dial_via_relay(host, circuit: str, peer_id) -> object:
    """Open a connection to ``peer_id`` through the relay in ``circuit``; DialError if refused."""
    from libp2p.connection_types import ConnectionType
    from libp2p.custom_types import TProtocol
    from libp2p.network.connection.raw_connection import RawConnection
    from libp2p.peer.peerinfo import PeerInfo
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, PeerId, Status
    from libp2p.relay.circuit_v2.utils import write_delimited_msg

    relay_addr, relay_text = relay_address(circuit)
    relay_id = as_peer_id(relay_text)
    await dial_direct(host, PeerInfo(relay_id, [parse_multiaddr(relay_addr)]))
    stream = await host.new_stream(relay_id, [TProtocol(HOP_PROTOCOL)])
    try:
        await write_delimited_msg(stream, HopMessage(type=HopMessage.CONNECT, peer=PeerId(id=peer_id.to_bytes())))
        reply = await read_hop_reply(stream)
        if reply.type != HopMessage.STATUS or reply.status != Status.OK:
            raise DialError(f"relay {relay_text} refused the circuit: {Status.Name(reply.status)}")
        target = parse_multiaddr(f"{circuit}/p2p/{peer_id}")
        raw = RawConnection(stream=stream, initiator=True, connection_type=ConnectionType.RELAYED,
                            addresses=[target])
        conn = await host.upgrade_outbound_connection(raw, peer_id)
    except BaseException:
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await stream.reset()
        raise
    conn.set_transport_info([target], ConnectionType.RELAYED)  # the upgrade path leaves it untagged
    limit = circuit_limit(reply)
    if limit is not None:  # what the relay allows this circuit; the stream pool accounts against it
        conn.p2pswarm_circuit_limit = limit
    return conn


def circuit_limit(reply):
    """The ``CircuitLimit`` a relay's STATUS reply announces, or None when it names none."""
    if not reply.HasField("limit"):
        return None
    try:
        return CircuitLimit(seconds=float(reply.limit.duration), bytes=int(reply.limit.data))
    except ValueError:  # negative values cannot come from unsigned protobuf fields; be total anyway
        return None


async def read_hop_reply(stream):
    """One length-prefixed HopMessage, at most MAX_HOP_REPLY bytes; RemoteProtocolError otherwise."""
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
    from libp2p.utils.varint import read_varint_prefixed_bytes_limited

    try:
        data = await read_varint_prefixed_bytes_limited(stream, MAX_HOP_REPLY)
        reply = HopMessage()
        reply.ParseFromString(data)
    except trio.Cancelled:
        raise
    except Exception as exc:
        raise RemoteProtocolError(f"bad HOP reply: {type(exc).__name__}: {exc}") from None
    return reply


class Connector:
    """Reaches peers and keeps per-method counters; one per node, shared by every protocol."""

    def __init__(self, host, nursery: trio.Nursery, *, relay_head_start: float = RELAY_HEAD_START,
                 upgrade_watch: float = UPGRADE_WATCH) -> None:
        self._host = host
        self._nursery = nursery
        self._head_start = relay_head_start
        self._upgrade_watch = upgrade_watch
        self.stats = ConnectStats()

    def plan(self, peer_id: str, addrs: Sequence[str] = ()) -> DialPlan:
        """Dial plan from ``addrs`` plus what the peerstore knows of the peer."""
        known = list(addrs)
        pid = as_peer_id(peer_id)
        try:
            known += [str(a) for a in self._host.get_peerstore().addrs(pid)]
        except Exception:  # PeerStoreError: a peer the peerstore has never seen
            pass
        own = [str(a) for a in self._host.get_addrs()]
        return plan_dials(peer_id, known, own)

    async def connect(self, peer_id: str, addrs: Sequence[str] = (), *, via_relay: bool = True) -> str:
        """Ensure a connection to ``peer_id``; returns how: "connected" (one existed), direct or relay.

        ``via_relay=False``: direct dials only (see ControlService.request).
        """
        pid = as_peer_id(str(peer_id))
        if connections_to(self._host, pid):
            self.stats.reused += 1
            return "connected"
        plan = self.plan(str(peer_id), addrs)
        if not via_relay:
            plan = DialPlan(plan.direct, ())
        if plan.empty():
            raise DialError(f"cannot reach {peer_id}: no dialable address known")
        return await self._race(pid, plan)

    async def _race(self, pid, plan: DialPlan) -> str:
        won: list[str] = []
        errors: list[str] = []
        direct_done = trio.Event()

        async def attempt(method: str, dial) -> None:
            began = time.monotonic()
            try:
                await dial()
            except DialError as exc:
                errors.append(f"{method}: {exc}")
                self.stats.record(method, False, time.monotonic() - began)
                return
            self.stats.record(method, True, time.monotonic() - began)
            won.append(method)
            nursery.cancel_scope.cancel()

        async def direct() -> None:
            try:
                await dial_direct(self._host, _info(pid, plan.direct))
            finally:
                direct_done.set()

        async def relayed() -> None:
            if plan.direct:
                with trio.move_on_after(self._head_start):
                    await direct_done.wait()
            await self._dial_circuits(pid, plan.circuits)

        async with trio.open_nursery() as nursery:
            if plan.direct:
                nursery.start_soon(attempt, DIRECT, direct)
            if plan.circuits:
                nursery.start_soon(attempt, RELAY, relayed)
        if not won:
            raise DialError(f"cannot reach {pid}: " + "; ".join(errors))
        log.debug("connected to %s by %s", pid, won[0])
        if won[0] == RELAY:
            self._nursery.start_soon(self._watch_upgrade, pid)
        return won[0]

    async def _dial_circuits(self, pid, circuits: Sequence[str]) -> None:
        reasons = []
        for circuit in circuits:  # one relay at a time: each costs the peer a circuit slot
            with trio.move_on_after(RELAY_DIAL_TIMEOUT):
                try:
                    await dial_via_relay(self._host, circuit, pid)
                    return
                except trio.Cancelled:
                    raise
                except DialError as exc:
                    reasons.append(str(exc))
                    continue
                except Exception as exc:  # libp2p's upgrade and stream errors
                    reasons.append(f"via {relay_address(circuit)[1]}: {type(exc).__name__}: {exc}")
                    continue
            reasons.append(f"via {relay_address(circuit)[1]}: no circuit within {RELAY_DIAL_TIMEOUT:.0f} s")
        raise DialError("; ".join(reasons) or "no relay")

    async def _watch_upgrade(self, pid) -> None:
        """Count the other side's hole punch: a direct connection appearing next to our relayed one."""
        began = time.monotonic()
        with trio.move_on_after(self._upgrade_watch):
            while connections_to(self._host, pid):
                if has_direct(self._host, pid):
                    self.stats.record(HOLEPUNCH, True, time.monotonic() - began)
                    log.debug("connection to %s upgraded to direct after %.2f s", pid, time.monotonic() - began)
                    return
                await trio.sleep(UPGRADE_POLL)
        self.stats.record(HOLEPUNCH, False, time.monotonic() - began)


def _info(pid, addrs: Sequence[str]):
    from libp2p.peer.peerinfo import PeerInfo

    return PeerInfo(pid, [parse_multiaddr(a) for a in addrs])

