"""Dial-back reachability checks with AutoNAT v2 semantics, over p2pswarm's own CBOR frames.

py-libp2p's AutoNAT v1 server "dials back" over the connection the request arrived on, so a
NATed node is told it is PUBLIC (defect 11). Here the server dials back from a *separate host*
(its own throwaway identity), so the dial-back is always a fresh connection that has to get
through the requester's NAT, and proves it reached the requester by echoing a nonce.

Amplification guard (autonat-v2 spec): the server dials only the IP address the request came
from, never an address the requester names, so nobody can aim a server's dials at a third
party. Requests are rate limited per peer and overall. Every node that is not known to be
PRIVATE serves the protocol: the answer depends only on the requester's NAT, since the
dial-back is an outbound connection from the server.

Protocols: ``/p2pswarm/autonat/1.0.0`` (request → dial-back → response) and
``/p2pswarm/autonat/dial-back/1.0.0`` (the nonce check); see docs/protocols.md.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

import multiaddr
import trio

from p2pswarm import wire
from p2pswarm.errors import DialError, RemoteProtocolError
from p2pswarm.identity import generate_identity
from p2pswarm.nat.reachability import MIN_CONFIRMATIONS, DialBackResult, RateLimiter, Reachability
from p2pswarm.net.host import connect, open_host
from p2pswarm.net.streams import ByteStream, open_stream

if TYPE_CHECKING:  # libp2p is imported when a host is built
    from libp2p.abc import IHost

log = logging.getLogger(__name__)

AUTONAT_PROTOCOL = "/p2pswarm/autonat/1.0.0"
DIAL_BACK_PROTOCOL = "/p2pswarm/autonat/dial-back/1.0.0"
DIAL_BACK_TIMEOUT = 5.0  # a SYN dropped by a NAT is only ever seen as a timeout; Petals waits 5 s
REQUEST_TIMEOUT = DIAL_BACK_TIMEOUT + 5.0  # the client waits for the dial-back plus two exchanges
PER_PEER_RATE, PER_PEER_BURST = 1 / 30, 2  # a client re-checks every minute or so; allow a retry
GLOBAL_RATE, GLOBAL_BURST = 1.0, 10  # dial-backs per second a server spends on everyone together
# the dialer only dials out; it listens on loopback because it must listen somewhere
DIALER_LISTEN = "/ip4/127.0.0.1/tcp/0"
MAX_REQUEST_ADDRS = 16  # a peer has a few listen addresses; more is padding or an attack

STATUS_OK, STATUS_DIAL_ERROR, STATUS_REFUSED, STATUS_RATE_LIMITED = "ok", "dial-error", "refused", "rate-limited"


@wire.message("autonat.request")
class DialRequest(wire.Message):
    addrs: tuple[str, ...]  # the requester's listen addresses; only their TCP ports are used
    nonce: int


@wire.message("autonat.response")
class DialResponse(wire.Message):
    status: str  # ok | dial-error | refused | rate-limited
    address: str  # the address dialled, "" when none was


@wire.message("autonat.dial-back")
class DialBack(wire.Message):
    nonce: int


@wire.message("autonat.dial-back-ack")
class DialBackAck(wire.Message):
    nonce: int


def dial_target(addrs: tuple[str, ...], observed_ip: str) -> str | None:
    """The address to dial back: the requester's observed IP with the first TCP port it listens on."""
    for addr in addrs[:MAX_REQUEST_ADDRS]:
        parts = addr.split("/")
        if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp" and parts[4].isdigit():
            port = int(parts[4])
            if 0 < port < 65536:
                family = "ip6" if ":" in observed_ip else "ip4"
                return f"/{family}/{observed_ip}/tcp/{port}"
    return None


class AutonatService:
    """Both sides: answers other peers' requests, checks our own reachability with theirs."""

    def __init__(self, host, nursery: trio.Nursery, rng: random.Random, clock=time.time) -> None:
        self._host, self._nursery, self._rng, self._clock = host, nursery, rng, clock
        self._limiter = RateLimiter(PER_PEER_RATE, PER_PEER_BURST, GLOBAL_RATE, GLOBAL_BURST)
        self._expected: dict[int, trio.Event] = {}
        self._dialer: IHost | None = None  # the separate host dial-backs come from (serve_dialer)
        self.serving = True
        host.set_stream_handler(DIAL_BACK_PROTOCOL, self._on_dial_back)
        host.set_stream_handler(AUTONAT_PROTOCOL, self._on_request)

    async def serve_dialer(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the separate host that dial-backs come from, with its own throwaway identity."""
        async with open_host(generate_identity(), [DIALER_LISTEN]) as dialer:
            self._dialer = dialer
            task_status.started()
            await trio.sleep_forever()

    # --- client side -------------------------------------------------------------------------

    async def check(self, server_peer) -> DialBackResult | None:
        """Ask ``server_peer`` to dial us back; None when it would not (refused, limited, gone)."""
        nonce = self._rng.getrandbits(62)
        seen = self._expected[nonce] = trio.Event()
        addrs = tuple(str(a) for a in self._host.get_addrs())
        try:
            with trio.move_on_after(REQUEST_TIMEOUT):
                stream = await open_stream(self._host, server_peer, AUTONAT_PROTOCOL)
                try:
                    await wire.write_frame(stream, DialRequest(addrs=addrs, nonce=nonce))
                    frame = await wire.read_frame(stream, max_payload=0)
                finally:
                    await stream.close()
                reply = frame[0] if frame else None
                if not isinstance(reply, DialResponse) or reply.status not in (STATUS_OK, STATUS_DIAL_ERROR):
                    return None
                reachable = reply.status == STATUS_OK and seen.is_set()
                return DialBackResult(str(server_peer), reply.address, reachable, self._clock())
            return None
        except (DialError, RemoteProtocolError) as exc:
            log.debug("reachability check with %s failed: %s", server_peer, exc)
            return None
        finally:
            del self._expected[nonce]

    async def _on_dial_back(self, raw_stream) -> None:
        stream = ByteStream(raw_stream)
        try:
            with trio.move_on_after(DIAL_BACK_TIMEOUT):
                frame = await wire.read_frame(stream, max_payload=0)
                message = frame[0] if frame else None
                if isinstance(message, DialBack) and message.nonce in self._expected:
                    self._expected[message.nonce].set()
                    await wire.write_frame(stream, DialBackAck(nonce=message.nonce))
        except (DialError, RemoteProtocolError):
            pass
        finally:
            await stream.close()

    # --- server side -------------------------------------------------------------------------

    async def _on_request(self, raw_stream) -> None:
        stream = ByteStream(raw_stream)
        try:
            with trio.move_on_after(REQUEST_TIMEOUT):
                frame = await wire.read_frame(stream, max_payload=0)
                if frame is None or not isinstance(frame[0], DialRequest):
                    raise RemoteProtocolError("expected an autonat.request")
                reply = await self._answer(stream.remote_peer, raw_stream.get_remote_address(), frame[0])
                await wire.write_frame(stream, reply)
        except (DialError, RemoteProtocolError) as exc:
            log.debug("autonat request from %s dropped: %s", stream.remote_peer, exc)
            await stream.reset()
        finally:
            await stream.close()

    async def _answer(self, peer: str, remote: tuple[str, int] | None, request: DialRequest) -> DialResponse:
        if not self.serving:
            return DialResponse(status=STATUS_REFUSED, address="")
        if not self._limiter.allow(peer, self._clock()):
            return DialResponse(status=STATUS_RATE_LIMITED, address="")
        target = dial_target(request.addrs, remote[0]) if remote else None
        if target is None:
            return DialResponse(status=STATUS_REFUSED, address="")
        reached = await self._dial_back(peer, target, request.nonce)
        return DialResponse(status=STATUS_OK if reached else STATUS_DIAL_ERROR, address=target)

    async def _dial_back(self, peer: str, target: str, nonce: int) -> bool:
        from libp2p.peer.id import ID
        from libp2p.peer.peerinfo import PeerInfo

        dialer = self._dialer
        if dialer is None:
            return False
        peer_id = ID.from_base58(peer)
        try:
            with trio.move_on_after(DIAL_BACK_TIMEOUT):
                await connect(dialer, PeerInfo(peer_id, [multiaddr.Multiaddr(target)]), DIAL_BACK_TIMEOUT)
                stream = await open_stream(dialer, peer_id, DIAL_BACK_PROTOCOL)
                await wire.write_frame(stream, DialBack(nonce=nonce))
                frame = await wire.read_frame(stream, max_payload=0)
                return frame is not None and frame[0] == DialBackAck(nonce=nonce)
            return False
        except (DialError, RemoteProtocolError):
            return False
        finally:
            with trio.move_on_after(2):
                await dialer.disconnect(peer_id)  # the next check must dial afresh, never reuse
            dialer.get_peerstore().clear_addrs(peer_id)


FIRST_CHECK_DELAY = 2.0  # seconds after joining: identify has told us who serves autonat by then
RECHECK_PERIOD = 60.0  # a settled verdict is re-checked this often, so it follows network changes
RETRY_PERIOD = 10.0  # while the verdict is UNKNOWN, ask again sooner
CHECKS_PER_ROUND = 3  # servers asked each round: more than MIN_CONFIRMATIONS, so one may fail
SERVER_WAIT = RETRY_PERIOD  # longest wait for enough connected servers before asking the few there are
SERVER_POLL = 0.5  # seconds between looks at who is connected while waiting


def autonat_servers(host, rng: random.Random) -> list:
    """Connected peers that (per identify) serve the protocol, in random order."""
    peerstore = host.get_peerstore()
    servers = []
    for peer in host.get_connected_peers():
        try:
            protocols = peerstore.get_protocols(peer)
        except Exception:  # peer without an identify record yet
            continue
        if AUTONAT_PROTOCOL in protocols:
            servers.append(peer)
    rng.shuffle(servers)
    return servers


async def _no_more_servers(want: int) -> None:
    """Default of ``serve_reachability(find_servers=...)``: wait for peers to connect to us."""


async def serve_reachability(host, service: AutonatService, tracker, rng: random.Random, on_verdict,
                             find_servers=_no_more_servers) -> None:
    """Check our reachability with a few servers every round; report each new verdict.

    ``find_servers(n)`` is asked to connect to about ``n`` more peers when fewer than two
    servers are connected (a DHT client talks to few peers on its own).
    """
    verdict = Reachability.UNKNOWN
    await trio.sleep(FIRST_CHECK_DELAY)
    while True:
        missing = MIN_CONFIRMATIONS - len(autonat_servers(host, rng))
        if missing > 0:
            with trio.move_on_after(SERVER_WAIT):
                await find_servers(CHECKS_PER_ROUND)
        if verdict is Reachability.UNKNOWN:  # one server's answer cannot settle a verdict: wait for two
            with trio.move_on_after(SERVER_WAIT):
                while len(autonat_servers(host, rng)) < MIN_CONFIRMATIONS:
                    await trio.sleep(SERVER_POLL)
        async def ask(server) -> None:
            result = await service.check(server)
            if result is not None:
                tracker.observe(result)

        async with trio.open_nursery() as nursery:
            for server in autonat_servers(host, rng)[:CHECKS_PER_ROUND]:
                nursery.start_soon(ask, server)
        new = tracker.verdict(service._clock())
        service.serving = new is not Reachability.PRIVATE
        if new is not verdict:
            verdict = new
            await on_verdict(new)
        await trio.sleep(RETRY_PERIOD if verdict is Reachability.UNKNOWN else RECHECK_PERIOD)
