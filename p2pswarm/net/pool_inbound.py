"""The inbound side of the stream pool: frames read under a byte budget, handled, answered in order.

Per inbound stream there is exactly one reader task (py-libp2p resets a sender blocked on a
zero Yamux window for 5 s, defect 2) and one handler task; a memory channel between them holds
the frames read but not yet handled. What bounds that channel is the byte budget, not a count:

1. the reader reads a frame's header (wire framing: its payload length ``n`` is in it);
2. it reserves the frame's bytes against the peer's share and the global budget
   (``budget.InboundBudget``). Over its share, the frame waits, at most ``BUDGET_WAIT``, for that
   peer's own earlier frames to be released; then, or if the frame can never fit, the stream is
   reset and the refusal counted. Nothing of the payload is read before the reservation;
   Waiting for a frame is idle time (the protocol's idle deadline, ``net.limits``), but once its
   first bytes came the rest of the header must come within ``HEADER_DEADLINE``: a byte now and
   then keeps no stream, and its sender slot, for good;
3. it reads the payload while its bytes keep moving (none for ``budget.STALL_DEADLINE``: a stall) and
   keep up with a thin line's slowest frame rate (``arrival_deadline`` of the bytes so far): a
   frame on a 0.2 Mbit/s line arrives; a stalled or trickling sender is reset;
4. the handler task calls ``handler(peer, message, payload)`` frames in order, releases the
   reservation when the handler returns, and writes the handler's reply (if any) whole on the
   same stream. A handler that raises, or a reply that cannot be written, resets the stream.

A stream ending at a frame boundary (EOF) is closed once its queued frames are handled.
Because Yamux does not enforce its receive window (defect 3), a sender that ignores the
window can still make Yamux buffer data while its frame waits; the wait is short and bounded
and a peer has at most ``budget.MAX_STREAMS_PER_PEER`` streams, each then reset.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from p2pswarm import wire
from p2pswarm.errors import DialError, LocalProtocolError, ProtocolError, RemoteProtocolError
from p2pswarm.net import budget
from p2pswarm.net.budget import STALL_DEADLINE, InboundBudget, Ticket, Verdict, arrival_deadline, frame_deadline
from p2pswarm.net.streams import ByteStream

log = logging.getLogger(__name__)

HEADER_DEADLINE = frame_deadline(wire.HEADER_LENGTH_BYTES + wire.MAX_HEADER_BYTES)  # s, from a header's first bytes
EVICTION_WAIT = 1.0  # s an evicted peer's streams have to wind down (cancelled: at once, bar a handler's reply)
EVICTION_POLL = 0.01  # s between looks for the evicted peer's slot
BUDGET_WAIT = 2.0  # a slowed peer's frame waits at most this: well under Yamux's 5 s zero-window reset (defect 2)

Reply = wire.Message | tuple[wire.Message, bytes] | None
Handler = Callable[[str, wire.Message, bytes], Awaitable[Reply]]


class InboundPool(Protocol):
    """What the inbound side uses of its pool (``net.pool.StreamPool``), named here so that this
    module need not import the pool that imports it."""

    host: Any  # the libp2p host whose stream handlers serve the pool's protocols
    budget: InboundBudget
    stats: Any  # pool.PoolStats: inbound_refused, handler_failures and frames_served are counted here
    prefer: Callable[[str], bool]  # peers that may take an idle sender's slot

    def adopt(self, raw: Any) -> ByteStream: ...

    async def send_frame(self, stream: Any, message: wire.Message, payload: bytes = b"") -> None: ...


async def read_moving(stream: ByteStream, n: int) -> bytes:
    """Exactly ``n`` bytes while they keep moving (step 3 of the module docstring): trio.TooSlowError when
    a read stalls or the payload falls behind the slowest frame rate (each read is due by the time its
    bytes so far plus one read grain take at that rate: a trickle on a 64 MiB claim is cut in seconds,
    not after the whole claim's hours), RemoteProtocolError when the stream ends first."""
    chunks, got, began = [], 0, trio.current_time()
    while got < n:
        due = min(trio.current_time() + STALL_DEADLINE, began + arrival_deadline(min(n, got + budget.READ_GRAIN)))
        with trio.move_on_at(due) as step:
            chunk = await stream.read(n - got)
        if step.cancelled_caught:
            raise trio.TooSlowError(f"a payload stalled or fell behind the slowest frame rate at {got} of {n} bytes")
        if not chunk:  # a reset peer looks like a clean EOF, so EOF here is an error
            raise RemoteProtocolError(f"stream ended after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class _Refused(Exception):
    """The budget refused a frame; the stream is reset."""


class InboundServer:
    """Serves the pool's protocols; one instance per pool."""

    def __init__(self, pool: InboundPool, budget_wait: float) -> None:
        self._pool = pool
        self._budget = pool.budget
        self._budget_wait = budget_wait
        self._released: dict[str, trio.Event] = {}  # peer -> set when one of its reservations is released
        self._scopes: dict[str, set[trio.CancelScope]] = {}  # peer -> the cancel scopes of its inbound streams
        self._handlers: dict[str, tuple[Handler, int]] = {}  # protocol -> (handler, max payload), read per frame

    def serve(self, protocol: str, handler: Handler, max_payload: int) -> None:
        """Serve ``protocol`` with ``handler`` from now on: on new streams, and on the frames still to come on
        streams already open (a stage's services replaced by a move never see another frame)."""
        self._handlers[protocol] = (handler, max_payload)
        self._pool.host.set_stream_handler(protocol, functools.partial(self._on_stream, protocol))

    async def _on_stream(self, protocol: str, raw) -> None:
        stream = self._pool.adopt(raw)
        peer = stream.remote_peer
        if not self._budget.open_stream(peer) and not await self._take_idle_slot(peer):
            self._pool.stats.inbound_refused += 1
            await stream.reset()
            return
        send, receive = trio.open_memory_channel(math.inf)  # bounded by the byte budget, see module doc
        failure: list[str] = []
        evictable = trio.CancelScope()  # cancelled when a peer that works with us takes this peer's slot
        self._scopes.setdefault(peer, set()).add(evictable)
        try:
            with evictable:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._handle_frames, stream, peer, protocol, receive, failure,
                                       nursery.cancel_scope)
                    try:
                        await self._read_frames(stream, peer, protocol, send)
                    except (_Refused, RemoteProtocolError, DialError, trio.TooSlowError) as exc:
                        failure.append(f"{type(exc).__name__}: {exc}")
                        nursery.cancel_scope.cancel()
                    finally:
                        send.close()
            if evictable.cancelled_caught and not failure:
                failure.append("its slot went to a peer that works with us")
        finally:
            scopes = self._scopes[peer]
            scopes.discard(evictable)
            if not scopes:
                del self._scopes[peer]
            self._drain(receive)
            self._budget.close_stream(peer)
            with trio.CancelScope(shield=True):
                if failure:
                    self._pool.stats.inbound_refused += 1
                    log.debug("pool: resetting an inbound stream from %s: %s", peer, failure[0])
                    await stream.reset()
                else:
                    await stream.close()

    async def _take_idle_slot(self, peer: str) -> bool:
        """Every slot is taken: a peer the pool prefers (``StreamPool.prefer``: it worked with us) takes the
        slot of the least recently active idle peer that is not preferred, whose streams end (budget
        module docstring). Whether ``peer`` now holds a slot."""
        if peer in self._budget.peers() or not self._pool.prefer(peer):  # at its own stream limit, or no worker
            return False
        victim = self._budget.idle_victim(self._pool.prefer)
        if victim is None:
            return False
        for scope in self._scopes.get(victim, ()):
            scope.cancel()
        with trio.move_on_after(EVICTION_WAIT):
            while victim in self._budget.peers():
                await trio.sleep(EVICTION_POLL)
        if not self._budget.open_stream(peer):
            return False
        self._budget.evictions += 1
        log.debug("pool: %s took the inbound slot of idle %s (it works with us)", peer, victim)
        return True

    async def _read_frames(self, stream: ByteStream, peer: str, protocol: str, send) -> None:
        """Read frames until EOF at a frame boundary; each admitted by the budget before its payload."""
        while True:
            first = await stream.read(wire.HEADER_LENGTH_BYTES)  # waiting for a frame: idle time
            if not first:
                return
            max_payload = self._handlers[protocol][1]
            with trio.fail_after(HEADER_DEADLINE):  # begun, a header comes whole
                message, n, header_bytes = await wire.read_rest_of_header(stream, first, max_payload=max_payload)
            ticket = await self._reserve(peer, header_bytes + n)
            try:
                payload = await read_moving(stream, n)
                send.send_nowait((message, payload, ticket))
            except BaseException:
                self._release(ticket)
                raise

    async def _reserve(self, peer: str, nbytes: int) -> Ticket:
        result = self._budget.reserve(peer, nbytes)
        if result is Verdict.WAIT:
            self._budget.note_wait(peer)
            with trio.move_on_after(self._budget_wait):
                while result is Verdict.WAIT:
                    await self._released.setdefault(peer, trio.Event()).wait()
                    result = self._budget.reserve(peer, nbytes)
            if result is Verdict.WAIT:
                self._budget.refuse(peer, "timeout")
                raise _Refused(f"{nbytes} B frame waited {self._budget_wait:.1f} s over the peer's budget")
        if result is Verdict.REFUSE:
            raise _Refused(f"{nbytes} B frame refused by the budget")
        return result

    def _release(self, ticket: Ticket) -> None:
        self._budget.release(ticket)
        event = self._released.pop(ticket.peer, None)
        if event is not None:
            event.set()

    def _drain(self, receive) -> None:
        """Release the reservations of frames read but never handled (the stream failed)."""
        while True:
            try:
                _, _, ticket = receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            self._release(ticket)
        receive.close()

    async def _handle_frames(self, stream: ByteStream, peer: str, protocol: str, receive, failure: list[str],
                             scope: trio.CancelScope) -> None:
        while True:
            try:
                message, payload, ticket = await receive.receive()
            except trio.EndOfChannel:
                return
            try:
                reply = await self._handlers[protocol][0](peer, message, payload)  # the one serving it now
            except Exception as exc:
                self._pool.stats.handler_failures += 1
                if not isinstance(exc, ProtocolError):
                    log.exception("pool: handler for %s from %s failed", message.TYPE, peer)
                failure.append(f"handler: {type(exc).__name__}: {exc}")
                scope.cancel()
                return
            finally:
                self._pool.stats.count(stream, received=len(payload))
                del payload
                self._release(ticket)
            self._pool.stats.frames_served += 1
            if reply is None:
                continue
            reply_message, reply_payload = reply if isinstance(reply, tuple) else (reply, b"")
            try:
                await self._pool.send_frame(stream, reply_message, reply_payload)
            except (DialError, LocalProtocolError) as exc:
                failure.append(f"reply: {type(exc).__name__}: {exc}")
                scope.cancel()
                return

