"""One long-lived framed control stream per peer, carrying small request/response messages.

Opening a libp2p stream costs 5-11 ms; reusing one stream per peer makes a control exchange a
single round trip. Requests on a stream are answered in order (the server handles them one at a
time), so replies are matched to requests first-in, first-out with no request ids. Exactly one
reader task runs per stream, so a sender is never blocked on a full Yamux window (defect 2).

A peer that sends an undecodable frame has its stream reset; a request the handler rejects
gets an ``ErrorReply`` and the stream stays up. Nothing a peer sends can crash the node.

Nothing stalls a channel for good. A handler runs under ``HANDLER_TIMEOUT`` (below the
client's ``REQUEST_TIMEOUT``): past it the request gets ``ErrorReply(code="timeout")`` and the
stream goes on with the next request. A client retires a channel (reader cancelled, stream
reset) as soon as one request on it fails or times out, or once it has been idle for
``CHANNEL_MAX_IDLE``; the next request opens a fresh stream. (Before this, one reply that never
came left every later request on the FIFO channel waiting behind it, for as long as the node
ran.) The reader is cancelled, not merely left to see the reset: py-libp2p does not wake a task
blocked reading a stream that was reset locally. Inbound control streams are limited to
``CONTROL_STREAMS_PER_PEER`` per peer and closed after ``CONTROL_IDLE_TIMEOUT`` of silence
(``net/guard.py``); once a request's first bytes came, the whole request must come within
``REQUEST_TIMEOUT`` (a byte now and then keeps no stream for good).

Peers are reached through the node's ``Connector`` (direct, hole punch, relay). A channel opened
over a relayed connection is replaced once a direct connection to the peer exists (a hole punch
succeeded); the old one is closed when its outstanding replies are in.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import trio

from p2pswarm import wire
from p2pswarm.errors import DialError, ProtocolError, RemoteProtocolError
from p2pswarm.net.connect import Connector, as_peer_id, has_direct
from p2pswarm.net.control_rtt import RttBook
from p2pswarm.net.guard import set_protocol_limits
from p2pswarm.net.limits import ProtocolLimits
from p2pswarm.net.streams import ByteStream, open_stream

log = logging.getLogger(__name__)

CONTROL_PROTOCOL = "/p2pswarm/control/1.0.0"
MAX_CONTROL_PAYLOAD = 64 * 1024  # control messages carry no tensors, only small blobs
MAX_PENDING_REQUESTS = 64  # per peer: a caller that floods one peer waits instead of queueing forever
REQUEST_TIMEOUT = 5.0  # hivemind's DHT timeout is 3 s; a peer silent this long is treated as gone
HANDLER_TIMEOUT = 4.0  # below REQUEST_TIMEOUT: a slow handler's caller gets an ErrorReply before giving up
CHANNEL_MAX_IDLE = 60.0  # a client reopens a channel idle this long, well before the server's idle deadline
CONTROL_IDLE_TIMEOUT = 300.0  # server side: a channel silent 5 min is dropped (clients reopen after 1 min)
CONTROL_STREAMS_PER_PEER = 16  # a client holds one channel, a few while retired ones wind down

Handler = Callable[[str, wire.Message], Awaitable[wire.Message]]
_M = TypeVar("_M", bound=wire.Message)


@dataclass
class ControlStats:
    requests_sent: int = 0
    requests_failed: int = 0
    requests_served: int = 0
    peers_dropped: int = 0
    handler_timeouts: int = 0  # requests answered ErrorReply("timeout")
    channels_retired: int = 0  # client channels given up after a failure, a timeout or idleness


class _Channel:
    """The client side of one control stream: a write lock and FIFO of waiting requesters.

    ``closed``: no new request goes on this channel. ``retire()`` also stops the reader, which
    then fails the requests still waiting and resets the stream.
    """

    def __init__(self, stream: ByteStream, now: float) -> None:
        self.stream = stream
        self.pending: deque[trio.MemorySendChannel] = deque()
        self.write_lock = trio.Lock()
        self.slots = trio.Semaphore(MAX_PENDING_REQUESTS)
        self.closed = False
        self.retiring = False  # a retirement is under way (see ControlService._retire)
        self.relayed = False  # opened while the only connection to the peer ran through a relay
        self.last_used = now
        self.reader_done = trio.Event()
        self._reader_scope = trio.CancelScope()

    def retire(self) -> None:
        """Stop at once: the reader is cancelled (a local reset would not wake it) and resets."""
        self.closed = True
        self._reader_scope.cancel()

    async def run_reader(self) -> None:
        try:
            with self._reader_scope:
                await self._read_replies()
        finally:
            self.closed = True
            for waiter in self.pending:
                waiter.close()
            self.pending.clear()
            with trio.CancelScope(shield=True):
                await self.stream.reset()
            self.reader_done.set()

    async def _read_replies(self) -> None:
        try:
            while True:
                frame = await wire.read_frame(self.stream, max_payload=MAX_CONTROL_PAYLOAD)
                if frame is None or not self.pending:
                    return  # EOF, or a reply nobody asked for
                waiter = self.pending.popleft()
                try:
                    waiter.send_nowait(frame[0])
                except (trio.BrokenResourceError, trio.WouldBlock):
                    pass  # the requester gave up (timeout); its reply is dropped
        except RemoteProtocolError as exc:
            log.warning("control stream to %s sent garbage, dropping it: %s", self.stream.remote_peer, exc)


class ControlService:
    """Sends control requests to peers and answers theirs with registered handlers."""

    def __init__(self, host, nursery: trio.Nursery, connector: Connector | None = None, *,
                 handler_timeout: float = HANDLER_TIMEOUT) -> None:
        self._host = host
        self._nursery = nursery
        self._connector = connector
        self._handler_timeout = handler_timeout
        self._channels: dict[str, _Channel] = {}
        self._opening: dict[str, trio.Lock] = {}
        self._handlers: dict[type[wire.Message], Handler] = {}
        self.stats = ControlStats()
        self.rtts = RttBook()  # each peer's measured round trip: a request's wait (control_rtt)
        host.set_stream_handler(CONTROL_PROTOCOL, self._on_stream)
        set_protocol_limits(host, CONTROL_PROTOCOL, ProtocolLimits(CONTROL_STREAMS_PER_PEER, CONTROL_IDLE_TIMEOUT))

    def handle(self, message_type: type[_M], handler: Callable[[str, _M], Awaitable[wire.Message]]) -> None:
        self._handlers[message_type] = handler  # type: ignore[assignment]  # it is given only a message_type

    async def request(self, peer_id, message: wire.Message, timeout: float = REQUEST_TIMEOUT, *,
                      via_relay: bool = True) -> wire.Message:
        """Send ``message`` to ``peer_id`` and return its reply; DialError if none comes in time: within
        ``timeout``, or the round trip measured to that peer where that is longer (``control_rtt``).

        ``via_relay=False`` never opens a relayed connection for it (DHT traffic: a server is
        publicly reachable by definition, and circuits are a relay's scarcest resource).
        """
        key = str(peer_id)
        peer_id = as_peer_id(peer_id)
        self.stats.requests_sent += 1
        timeout, began = self.rtts.get(key).timeout(timeout), trio.current_time()  # a slow line: longer
        with trio.move_on_after(timeout):
            try:
                reply = await self._exchange(peer_id, key, message, via_relay)
            except DialError:
                self.stats.requests_failed += 1
                raise
            self.rtts.answered(key, trio.current_time() - began)
            return reply
        self.stats.requests_failed += 1
        self.rtts.unanswered(key)
        raise DialError(f"{message.TYPE} to {key}: no reply within {timeout:.1f} s")

    async def _exchange(self, peer_id, key: str, message: wire.Message, via_relay: bool) -> wire.Message:
        channel = await self._channel(peer_id, key, via_relay)
        send, receive = trio.open_memory_channel(1)
        answered = False
        try:
            async with channel.slots, receive:
                async with channel.write_lock:
                    channel.pending.append(send)
                    await self._write_whole(channel, message)
                    channel.last_used = trio.current_time()
                try:
                    reply = await receive.receive()
                except trio.EndOfChannel:
                    raise DialError(f"{message.TYPE} to {key}: stream closed before the reply") from None
                answered = True
                return reply
        finally:
            if not answered:  # failed or timed out: later requests must not queue behind this one
                self._start_retiring(channel)

    @staticmethod
    async def _write_whole(channel: _Channel, message: wire.Message) -> None:
        """Write a frame entirely or retire the channel: a half-written frame corrupts the stream."""
        with trio.CancelScope(shield=True):
            with trio.move_on_after(REQUEST_TIMEOUT) as scope:
                try:
                    await wire.write_frame(channel.stream, message)
                except DialError:
                    channel.retire()
                    raise
            if scope.cancelled_caught:
                channel.retire()
                raise DialError(f"{message.TYPE}: write to {channel.stream.remote_peer} stalled")

    async def _channel(self, peer_id, key: str, via_relay: bool = True) -> _Channel:
        lock = self._opening.setdefault(key, trio.Lock())
        async with lock:
            channel = self._channels.get(key)
            if channel is not None and not channel.closed and self._worn_out(channel, peer_id):
                self._start_retiring(channel)
            if channel is None or channel.closed:
                if self._connector is not None:
                    await self._connector.connect(key, via_relay=via_relay)
                relayed = not has_direct(self._host, peer_id)
                channel = _Channel(await open_stream(self._host, peer_id, CONTROL_PROTOCOL), trio.current_time())
                channel.relayed = relayed
                self._channels[key] = channel
                self._nursery.start_soon(channel.run_reader)
            return channel

    def _worn_out(self, channel: _Channel, peer_id) -> bool:
        """Replace a relayed channel once a direct connection exists, and one idle too long."""
        if channel.relayed and has_direct(self._host, peer_id):
            log.debug("control stream to %s moves to the direct connection", peer_id)
            return True
        return not channel.pending and trio.current_time() - channel.last_used > CHANNEL_MAX_IDLE

    def _start_retiring(self, channel: _Channel) -> None:
        channel.closed = True
        if not channel.retiring:
            channel.retiring = True
            self.stats.channels_retired += 1
            self._nursery.start_soon(self._retire, channel)

    @staticmethod
    async def _retire(channel: _Channel) -> None:
        """Retire a channel once the replies it still owes are in (or overdue)."""
        with trio.move_on_after(REQUEST_TIMEOUT):
            while channel.pending:
                await trio.sleep(0.05)
        channel.retire()

    async def _on_stream(self, raw_stream) -> None:
        stream = ByteStream(raw_stream)
        peer = stream.remote_peer
        try:
            while True:
                first = await stream.read(wire.HEADER_LENGTH_BYTES)  # waiting for a request: idle time
                if not first:
                    return
                with trio.fail_after(REQUEST_TIMEOUT):  # begun, a request comes whole
                    message, n, _ = await wire.read_rest_of_header(stream, first, max_payload=MAX_CONTROL_PAYLOAD)
                    await wire.read_exactly(stream, n)  # control messages carry no payload we use
                reply = await self._answer(peer, message)
                await wire.write_frame(stream, reply)
                self.stats.requests_served += 1
        except (RemoteProtocolError, trio.TooSlowError) as exc:
            self.stats.peers_dropped += 1
            log.warning("peer %s sent an invalid or unfinished control frame, resetting: %r", peer, exc)
        except DialError:
            pass  # the peer went away mid-reply
        finally:
            await stream.reset()

    async def _answer(self, peer: str, message: wire.Message) -> wire.Message:
        handler = self._handlers.get(type(message))
        if handler is None:
            return wire.ErrorReply(code="unsupported", detail=f"no handler for {message.TYPE}")
        with trio.move_on_after(self._handler_timeout):
            try:
                return await handler(peer, message)
            except ProtocolError as exc:
                return wire.ErrorReply(code="rejected", detail=str(exc)[:200])
            except Exception:
                log.exception("control handler for %s failed", message.TYPE)
                return wire.ErrorReply(code="internal", detail="handler failed")
        self.stats.handler_timeouts += 1
        log.info("control handler for %s from %s took over %.1f s", message.TYPE, peer, self._handler_timeout)
        return wire.ErrorReply(code="timeout", detail=f"no answer within {self._handler_timeout:.1f} s")
