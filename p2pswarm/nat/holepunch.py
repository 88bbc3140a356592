"""DCUtR hole punching over TCP, with one initiator and no dials to ourselves.

py-libp2p's ``DCUtRProtocol`` does the CONNECT/SYNC exchange and the simultaneous TCP open (dials
bound to our listen port, upgraded with the roles the spec fixes). Its defaults are wrong for us
(defect 12), so ``HolePunchService`` replaces four of its methods:

- ``_auto_drive_loop``: the library punches every relayed peer from both ends. Here only the side
  that received the relayed connection initiates (``punch.initiates``), budgeted by ``PunchBook``.
- ``_handle_dcutr_stream``: a CONNECT from a peer that should not have initiated is refused, so
  two exchanges never cross on one connection.
- ``_try_unilateral_upgrade``: the spec's first step (dial the other side's addresses plainly; it
  may be public) runs alongside the exchange, capped at ``UNILATERAL_TIMEOUT`` (one punch dial's
  time, ``PUNCH_DIAL_TIMEOUT``: a busy node's handshake took over 1.5 s in the suite), instead of
  before it: the library waited out every dial, ~10 s whenever one address was a black hole.
- ``_dial_peer``: addresses that lead back to ourselves (``0.0.0.0``, our own listen addresses,
  another host's loopback) are skipped.

Once a direct connection exists new streams use it (py-libp2p prefers direct connections) and the
initiator closes the relayed connection ``RELAY_CLOSE_GRACE`` later, freeing the relay's circuit
slot (a per-peer limit). The reservation stays: should the direct connection die, ``connect()``
reaches the peer through the relay again.
"""

from __future__ import annotations

import logging
import time

import trio
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

from p2pswarm.nat.punch import FAILED, PUNCHED, UNILATERAL, PunchBook, initiates
from p2pswarm.net.connect import connections_to, has_direct, is_inbound, is_relayed
from p2pswarm.net.dialplan import is_loopback, plan_dials
from p2pswarm.net.host import listen_addrs

log = logging.getLogger(__name__)

DRIVE_PERIOD = 0.25  # how often relayed connections are checked for a punch to start
IDENTIFY_WAIT = 0.5  # longest wait for identify before punching without the peer's listen addresses
UNILATERAL_TIMEOUT = 5.0  # a public dialer answers within a handshake, a NATed one never does; a node that
#                            trains on every core handshakes slowly (the plain dial races the punch: no delay)
RELAY_CLOSE_GRACE = 10.0  # streams opened on the relayed connection before the upgrade get this long
PUNCH_DIAL_TIMEOUT = 5  # one simultaneous-open dial (the library's round lasts as long)


class HolePunchService(DCUtRProtocol):
    """The DCUtR service of a node; run it with ``background_trio_service``."""

    def __init__(self, host, book: PunchBook | None = None, clock=time.monotonic) -> None:
        super().__init__(host, dial_timeout=PUNCH_DIAL_TIMEOUT)
        self.book = book or PunchBook()
        self._clock = clock
        self._plain_dialing: set[str] = set()  # peers with plain (unilateral) dials in flight
        self._budget_conn: dict[str, tuple[object, float]] = {}  # peer -> (its relayed connection, first seen)

    # ------------------------------------------------------------------ who initiates

    def _we_initiate(self, peer_id) -> bool:
        conns = connections_to(self.host, peer_id)
        relayed = [c for c in conns if is_relayed(c)]
        return initiates(inbound_relayed=any(is_inbound(c) for c in relayed),
                         outbound_relayed=any(not is_inbound(c) for c in relayed),
                         direct=len(relayed) < len(conns),
                         our_id=str(self.host.get_id()), their_id=str(peer_id))

    async def _auto_drive_loop(self) -> None:
        assert self._nursery is not None  # run() sets it before it starts this loop
        while True:
            await trio.sleep(DRIVE_PERIOD)
            now = self._clock()
            peers = list(self.host.get_network().connections.keys())
            for known in self.book.known():
                if known not in {str(p) for p in peers}:
                    self.book.gone(known)
            for peer_id in peers:
                self._new_connection_new_budget(peer_id)
                if self.book.due(str(peer_id), now) and self._ready(peer_id, now) and self._we_initiate(peer_id):
                    self.book.started(str(peer_id), now)
                    self._nursery.start_soon(self._punch, peer_id)

    def _new_connection_new_budget(self, peer_id) -> None:
        """The attempt budget is per relayed connection: a peer that reconnected faster than one
        drive period was never seen gone, and would otherwise run out of attempts."""
        relayed = [c for c in connections_to(self.host, peer_id) if is_relayed(c) and is_inbound(c)]
        seen = self._budget_conn.get(str(peer_id))
        if relayed and (seen is None or not any(c is seen[0] for c in relayed)):
            self.book.forget(str(peer_id))  # a new relayed connection: a fresh budget, no backoff
            # the object, not its id(): a closed connection's id is soon reused by the next one
            self._budget_conn[str(peer_id)] = (relayed[0], self._clock())
        elif not relayed:
            self._budget_conn.pop(str(peer_id), None)

    def _ready(self, peer_id, now: float) -> bool:
        """Identify has told us the peer's addresses (the plain dial needs them), or it has had
        IDENTIFY_WAIT: py-libp2p skips identify for a peer whose protocols it has cached, and the
        exchange itself carries the addresses the punch dials."""
        seen = self._budget_conn.get(str(peer_id))
        return self._identified(peer_id) or (seen is not None and now - seen[1] >= IDENTIFY_WAIT)

    def _identified(self, peer_id) -> bool:
        """Identify has told us the peer's listen addresses: what the plain dial and punch need."""
        try:
            return any("/p2p-circuit" not in str(a) for a in self.host.get_peerstore().addrs(peer_id))
        except Exception:  # PeerStoreError: nothing known about the peer yet
            return False

    async def _punch(self, peer_id) -> None:
        assert self._nursery is not None  # started in it
        began = self._clock()
        self._direct_connections.discard(peer_id)  # the library trusts this cache over the swarm
        try:
            await self.initiate_hole_punch(peer_id)
        except Exception as exc:  # a library error ends this attempt, never the service
            log.debug("hole punch to %s failed: %s: %s", peer_id, type(exc).__name__, exc)
        finally:
            with trio.move_on_after(UNILATERAL_TIMEOUT):  # the plain dial may still be on its way
                await self._plain_dials_done(peer_id)
            outcome = self._outcome(peer_id)
            if outcome != FAILED:
                self._nursery.start_soon(self._close_relayed_conns_after_grace, peer_id, RELAY_CLOSE_GRACE)
            seconds = self._clock() - began
            self.book.finished(str(peer_id), self._clock(), outcome, seconds)
            log.debug("hole punch to %s: %s after %.2f s", peer_id, outcome, seconds)

    def _outcome(self, peer_id) -> str:
        """Whichever got there: a direct connection we dialed as initiator came from the plain
        dial; a punched one is upgraded as responder (the spec's roles) or arrived inbound."""
        direct = [c for c in connections_to(self.host, peer_id) if not is_relayed(c)]
        if not direct:
            return FAILED
        return UNILATERAL if any(not is_inbound(c) for c in direct) else PUNCHED

    async def _plain_dials_done(self, peer_id) -> None:
        while str(peer_id) in self._plain_dialing and not has_direct(self.host, peer_id):
            await trio.sleep(0.02)

    async def _handle_dcutr_stream(self, stream) -> None:
        peer_id = stream.muxed_conn.peer_id
        if self._we_initiate(peer_id):
            self.book.refused += 1
            log.info("refusing a DCUtR exchange started by %s: the receiving side initiates", peer_id)
            with trio.move_on_after(1):
                await stream.reset()
            return
        await super()._handle_dcutr_stream(stream)

    # ------------------------------------------------------------------ what is dialed

    def _dialable(self, peer_id, addr) -> bool:
        """Not ours, not unspecified, and not a loopback address unless we only have loopback:
        a remote peer's 127.0.0.1 is this machine."""
        own = listen_addrs(self.host)
        if not plan_dials(str(peer_id), [str(addr)], own).direct:
            return False
        return not is_loopback(str(addr)) or all(is_loopback(a) for a in own)

    async def _get_observed_addrs(self) -> list[bytes]:
        """The library's CONNECT addresses, less loopback ones when we have a real address."""
        from multiaddr import Multiaddr

        encoded = await super()._get_observed_addrs()
        own = listen_addrs(self.host)
        if all(is_loopback(a) for a in own):
            return encoded
        return [raw for raw in encoded if not is_loopback(str(Multiaddr(raw)))]

    async def _dial_peer(self, peer_id, addr, source=None, as_responder: bool = False) -> None:
        if not self._dialable(peer_id, addr):
            log.debug("hole punch: not dialing %s (leads back to us)", addr)
            return
        await super()._dial_peer(peer_id, addr, source, as_responder)

    async def _try_unilateral_upgrade(self, peer_id) -> bool:
        """Start the plain dials in the background and go straight on to the exchange: they race.

        The spec dials first and punches after; waiting costs the NATed-to-NATed case (the common
        one) up to UNILATERAL_TIMEOUT before the punch even starts.
        """
        try:
            known = self.host.get_peerstore().addrs(peer_id)
        except Exception:  # PeerStoreError: no addresses known
            known = []
        addrs = [a for a in known if "/p2p-circuit" not in str(a) and self._dialable(peer_id, a)]
        if addrs and self._nursery is not None:
            self._plain_dialing.add(str(peer_id))
            self._nursery.start_soon(self._dial_unilaterally, peer_id, addrs)
        return False

    async def _dial_unilaterally(self, peer_id, addrs) -> None:
        try:
            with trio.move_on_after(UNILATERAL_TIMEOUT):
                async with trio.open_nursery() as nursery:
                    for addr in addrs:
                        nursery.start_soon(self._dial_peer, peer_id, addr)
        finally:
            self._plain_dialing.discard(str(peer_id))

    def _schedule_relay_close(self, peer_id) -> None:
        """Not here: ``_punch`` closes the relayed connection after RELAY_CLOSE_GRACE, whichever
        dial won (the library does it only after a punch, and only after 60 s)."""


def punch_stats(service: HolePunchService | None) -> dict:
    return service.book.summary() if service is not None else PunchBook().summary()
