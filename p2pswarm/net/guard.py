"""Every inbound stream of a host passes here: admitted or refused at once, and timed.

py-libp2p 0.8.1 dispatches a new muxed stream as ``SwarmConn._handle_muxed_stream`` →
(node-wide stream semaphore, which *queues* the excess) → ``Swarm.common_stream_handler``
(= ``BasicHost._swarm_stream_handler``: multistream-select, then the protocol's handler).
One peer holding thousands of silent streams used up the semaphore, so every other peer's
streams, and our own outbound ones, waited behind it. ``StreamGuard.install`` (called by
``net/host.build_host``) replaces the common stream handler with ``StreamGuard.on_stream``, and
the host is built without that semaphore. ``on_stream`` asks the pure ``limits.StreamBook``:

- per peer and node-wide before negotiation, per (peer, protocol) after it; a refused stream is
  reset at once, never queued;
- negotiation runs under the book's negotiation deadline, the handler under the protocol's
  idle deadline (kept in a cancel scope, moved on every read/write of the stream). An overdue
  stream's handler is *cancelled*, then the stream reset: a local Yamux reset does not wake a
  task blocked reading that stream (measured), so resetting alone would leave the task behind.

A handler that raises (ours, or a library one such as Kademlia's or identify's, e.g. on a
stream the peer reset) has its stream reset and the error counted (``handler_errors``). Uncaught,
the exception ended the connection's stream-accepting task (``SwarmConn._handle_new_streams``)
while the connection stayed open: every later stream the peer opened on it hung in negotiation
(measured: a peer resetting two streams in a row wedged its connection).

Protocols set their own limits with ``set_protocol_limits(host, protocol, limits)``.
"""

from __future__ import annotations

import logging
import math

import trio

from p2pswarm.net.limits import ProtocolLimits, StreamBook, StreamLimits

log = logging.getLogger(__name__)

RESET_TIMEOUT = 1.0  # resetting an unwanted stream writes one small frame; a connection slower than this is dead


class StreamGuard:
    """Admits, times and counts the inbound streams of one host."""

    def __init__(self, host, limits: StreamLimits | None = None) -> None:
        self._host = host
        self.book = StreamBook(limits)

    def install(self) -> None:
        """Make every inbound stream of the host pass through ``on_stream``."""
        self._host.get_network().set_stream_handler(self.on_stream)

    def set_protocol_limits(self, protocol: str, limits: ProtocolLimits) -> None:
        self.book.set_protocol_limits(protocol, limits)

    def stats(self) -> dict:
        """Open streams, admissions, refusals and closures (for ``/api/stats``)."""
        return self.book.stats()

    async def on_stream(self, net_stream) -> None:
        """The swarm's handler of each new inbound stream (replaces BasicHost's)."""
        peer = str(net_stream.muxed_conn.peer_id)
        ticket = self.book.admit(peer, trio.current_time())
        if ticket is None:
            log.debug("refused an inbound stream of %s (limit reached)", peer)
            await _reset(net_stream)
            return
        try:
            await self._serve(ticket, peer, net_stream)
        finally:
            self.book.release(ticket)

    async def _serve(self, ticket: int, peer: str, net_stream) -> None:
        chosen = None
        with trio.CancelScope(deadline=self.book.deadline(ticket)) as scope:
            chosen = await self._negotiate(net_stream)
        if scope.cancelled_caught:
            self._expire(ticket, peer, "negotiation")
        if chosen is None:
            await _reset(net_stream)
            return
        protocol, handler = chosen
        if not self.book.choose(ticket, protocol, trio.current_time()):
            log.debug("refused a %s stream of %s (limit reached)", protocol, peer)
            await _reset(net_stream)
            return
        net_stream.set_protocol(protocol)
        scope = trio.CancelScope(deadline=self.book.deadline(ticket))
        _watch(net_stream, self.book, ticket, scope)
        failed = False
        with scope:
            try:
                await handler(net_stream)
            except Exception as exc:  # a handler's error ends its stream, never the connection
                log.debug("the %s handler failed on a stream of %s: %r", protocol, peer, exc)
                self.book.failed += 1
                failed = True
        if scope.cancelled_caught:
            self._expire(ticket, peer, protocol)
        if scope.cancelled_caught or failed:
            await _reset(net_stream)

    def _expire(self, ticket: int, peer: str, what: str) -> None:
        self.book.expire(ticket)
        log.debug("closing a silent %s stream of %s", what, peer)

    async def _negotiate(self, net_stream):
        """multistream-select as BasicHost does it (TCP path); (protocol, handler) or None."""
        from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator

        library_timeout = math.ceil(self.book.limits.negotiation_timeout) + 1  # ours fires first
        try:
            protocol, handler = await self._host.get_mux().negotiate(
                MultiselectCommunicator(net_stream), library_timeout)
        except Exception as exc:  # MultiselectError and stream errors: the peer is gone or speaks nonsense
            log.debug("inbound stream negotiation failed: %s", exc)
            return None
        if protocol is None or handler is None:
            return None
        return protocol, handler


def _watch(net_stream, book: StreamBook, ticket: int, scope: trio.CancelScope) -> None:
    """Move ``scope``'s deadline with every read and write of the stream (instance attributes
    shadow NetStream's methods, so handlers keep the library's own stream object)."""
    read, write = net_stream.read, net_stream.write

    def moved(started: bool) -> None:
        (book.io_started if started else book.io_done)(ticket, trio.current_time())
        scope.deadline = book.deadline(ticket)

    async def watched_read(n: int | None = None) -> bytes:
        moved(True)
        try:
            return await read(n)
        finally:
            moved(False)

    async def watched_write(data: bytes) -> None:
        moved(True)
        try:
            await write(data)
        finally:
            moved(False)

    net_stream.read = watched_read
    net_stream.write = watched_write


async def _reset(net_stream) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(RESET_TIMEOUT):
        try:
            await net_stream.reset()
        except Exception:  # resetting a dead stream is not an error worth reporting
            pass


def set_protocol_limits(host, protocol: str, limits: ProtocolLimits) -> None:
    """Limits for ``protocol``'s inbound streams on ``host``; a host without a guard ignores them."""
    guard = getattr(host, "p2pswarm_guard", None)
    if guard is not None:
        guard.set_protocol_limits(protocol, limits)


def guard_stats(host) -> dict:
    """The host's guard counters, or {} for a host built without one."""
    guard = getattr(host, "p2pswarm_guard", None)
    return guard.stats() if guard is not None else {}
