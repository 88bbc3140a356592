"""Warm bulk streams to peers, leased one user at a time: the home of training traffic.

Activations, gradients, pseudo-gradient shards and snapshots are frames of 1-64 MiB, many per
second, to a handful of peers. Opening a libp2p stream costs 5-11 ms and a connection ~250 ms,
so streams are kept open per (peer, protocol) and *leased*::

    async with pool.lease(peer, ACTIVATION_PROTOCOL) as stream:
        await stream.write_frame(request, payload)
        ack, _ = await stream.read_frame(timeout=2.0)

A stream goes back to the pool when its lease ends cleanly; it is reset, never reused, when the
lease ends with an exception or a frame was cut (a failed or timed-out write or read, which
includes a reply that did not come in time: a late reply would reach the next lessee).
``warm`` opens streams ahead of need. Peers are reached through the node's ``Connector``.

- **Whole frames.** A frame is written entirely, shielded from the caller's cancellation, within
  a deadline that grows with its size, or the stream is retired (a half-written frame corrupts
  a stream).
- **Direct first.** A stream on a relayed connection is not leased again once a direct
  connection to the peer exists; the next lease opens a stream, which libp2p puts on the
  direct connection.
- **Relay circuits.** Bytes the pool sends and receives on each relayed connection, and the
  connection's age, are accounted (``budget.CircuitLedger``); a frame that would not fit the
  circuit's remaining bytes or time is refused before its first byte with ``CircuitExhausted``
  (a ``DialError``: try the next candidate) rather than cut by the relay mid-frame. The
  exhausted connection takes no new leases and is closed once its last lease ends, so the next
  lease reaches the peer anew: a fresh circuit with a fresh budget (or a direct connection).
- **Inbound** (``serve``, in ``net/pool_inbound.py``): one reader per stream, each frame's
  bytes reserved against a per-peer and a global budget before its payload is read
  (``budget.InboundBudget``); a handler per frame whose reply goes back on the same stream.
- **Pieces.** A frame goes to the connection in pieces sized to take ~10 ms (``write_pace``).
``status()``: the counters, the inbound budget and the relayed connections' accounting.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field

import trio

from p2pswarm import wire
from p2pswarm.errors import CircuitExhausted, DialError, LocalProtocolError, Stalled
from p2pswarm.net import pool_inbound, write_pace
from p2pswarm.net.budget import STALL_DEADLINE, BudgetConfig, CircuitLedger, CircuitLimit, InboundBudget
from p2pswarm.net.connect import Connector, as_peer_id, has_direct, is_relayed
from p2pswarm.net.notify import watch_connections
from p2pswarm.net.pool_stats import PoolStats
from p2pswarm.net.streams import ByteStream, close_quietly, open_stream

log = logging.getLogger(__name__)

STREAMS_PER_KEY = 8  # per peer and protocol: two bulk protocols stay under an acceptor's 16 streams per peer
LEASE_TIMEOUT = 10.0  # wait for a free stream, or connect (relay dial: up to 10 s) and open one
WRITE_CHUNK = write_pace.MIN_PIECE  # the least bytes per write (write_pace: a fast line's pieces grow to 1 MiB)
READ_TIMEOUT = 30.0  # default wait for a reply: a stage's forward pass plus a transfer; routers pass shorter ones
IDLE_RETIRE = 60.0  # an idle warm stream is closed by us before the acceptor's idle deadline (120 s) resets it
FRAME_BOUND = wire.HEADER_LENGTH_BYTES + wire.MAX_HEADER_BYTES  # a frame's bytes beyond its payload, at most
CIRCUIT_LIMIT_ATTR = "p2pswarm_circuit_limit"  # a CircuitLimit set on a relayed connection from the relay's Limit

Reply = pool_inbound.Reply
Handler = pool_inbound.Handler


class PoolStream(ByteStream):
    """A ByteStream that knows its connection and counts its bytes on a relayed one."""

    def __init__(self, raw, ledger: CircuitLedger | None = None) -> None:
        super().__init__(raw)
        self.conn = raw.muxed_conn
        self.swarm_conn = getattr(raw, "swarm_conn", None)  # the INetConn that Connector and notifees see
        self.relayed = is_relayed(self.conn)
        self.ledger = ledger if self.relayed else None
        self.broken = False  # a frame was cut: never reuse
        self.idle_since = 0.0  # trio time it last went back to the pool
        self.watch: tuple[trio.CancelScope, float] | None = None  # a write's stall watch: (scope, stall seconds)
        self.pace = write_pace.WritePace()  # the size of a write's pieces, from how long the last ones took

    @property
    def dead(self) -> bool:
        return self.broken or bool(getattr(self._stream, "is_closed", False)) or bool(self.conn.is_closed)

    async def read(self, max_bytes: int) -> bytes:
        data = await super().read(max_bytes)
        if self.ledger is not None:
            self.ledger.record(self.conn, received=len(data))
        return data

    async def write(self, data: bytes) -> None:
        if self.ledger is not None:
            self.ledger.record(self.conn, sent=len(data))  # counted before: a cut write may have gone out
        at = 0
        while at < len(data):  # in pieces: the connection's other streams get turns (write_pace)
            piece, began, at = data[at:at + self.pace.size], trio.current_time(), at + self.pace.size
            await super().write(piece)
            self.pace.observe(len(piece), trio.current_time() - began)
            if self.watch is not None:
                scope, stall = self.watch
                scope.deadline = trio.current_time() + stall  # bytes moved: the stall deadline starts again


class Lease:
    """One user's hold on a pooled stream: framed writes and reads, valid until the lease ends."""

    def __init__(self, pool: StreamPool, stream: PoolStream, peer: str, protocol: str) -> None:
        self._pool, self._stream = pool, stream
        self.peer, self.protocol = peer, protocol
        self.ended = False

    @property
    def relayed(self) -> bool:
        return self._stream.relayed

    def circuit_left(self) -> tuple[int | None, float | None] | None:
        """(bytes, seconds) this stream's relay circuit can still carry; None on a direct connection."""
        return self._pool.circuit_left(self._stream)

    async def write_frame(self, message: wire.Message, payload: bytes = b"", *, timeout: float | None = None,
                          stall: float | None = None) -> None:
        """Write one frame whole within ``timeout``, or with ``stall`` only while its bytes keep moving (no
        WRITE_CHUNK goes out for ``stall`` s: stalled; the default, with the receiver's STALL_DEADLINE: a 345 KB
        DiLoCo part takes 14 s on a 0.2 Mbit/s uplink, and 5 s + n / (1 MiB/s) failed every one); else retire
        the stream. DialError if it fails (``Stalled`` if it stops moving); CircuitExhausted, before any byte,
        if the stream's relay circuit could not carry it."""
        self._check()
        await self._pool.send_frame(self._stream, message, payload, timeout=timeout, stall=stall)

    async def read_frame(self, *, max_payload: int = wire.MAX_PAYLOAD_BYTES,
                         timeout: float = READ_TIMEOUT) -> tuple[wire.Message, bytes]:
        """The next frame, whole, within ``timeout`` (waiting and transfer); else DialError and the
        stream is retired (a late reply would reach the next lessee)."""
        self._check()
        stream, frame = self._stream, None
        with trio.move_on_after(timeout) as scope:
            try:
                frame = await wire.read_frame(stream, max_payload=max_payload)
            except BaseException:
                stream.broken = True
                raise
        if frame is None:
            stream.broken = True
            why = f"no frame within {timeout:.1f} s" if scope.cancelled_caught else "stream closed"
            raise DialError(f"{self.protocol} from {self.peer}: {why}")
        self._pool.stats.frames_received += 1
        self._pool.stats.count(stream, received=len(frame[1]))
        return frame

    def _check(self) -> None:
        if self.ended:
            raise LocalProtocolError(f"lease of a {self.protocol} stream to {self.peer} has ended")


@dataclass
class _Slot:
    """The streams of one (peer, protocol): idle ones, and how many exist (idle, leased, opening)."""

    key: tuple[str, str]  # (peer, protocol)
    idle: list[PoolStream] = field(default_factory=list)
    count: int = 0
    changed: trio.Event = field(default_factory=trio.Event)

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class StreamPool:
    """Leases warm outbound streams and serves inbound ones under a byte budget (module docstring)."""

    def __init__(self, host, nursery: trio.Nursery, connector: Connector | None = None, *,
                 budget: BudgetConfig | None = None, circuit_limit: CircuitLimit | None = None,
                 budget_wait: float = pool_inbound.BUDGET_WAIT, streams_per_key: int = STREAMS_PER_KEY) -> None:
        self.host, self._nursery, self._connector = host, nursery, connector
        self._slots: dict[tuple[str, str], _Slot] = {}
        self._streams_per_key = streams_per_key
        self._circuit_limit = circuit_limit or CircuitLimit()
        self._opened_at: dict[object, float] = {}  # muxed connection -> when it appeared
        self._exhausted: set = set()  # relayed muxed connections that refused a frame: closed once idle
        self._leased: Counter = Counter()  # muxed connection -> leases in progress on it
        self.ledger = CircuitLedger()
        self.budget = InboundBudget(budget or BudgetConfig())
        self.stats = PoolStats()
        self.prefer: Callable[[str], bool] = lambda peer: False  # may take an idle sender's slot (pool_inbound)
        self._inbound = pool_inbound.InboundServer(self, budget_wait)
        watch_connections(host, self._connection_opened, self._connection_closed)  # a circuit's age

    # --- outbound -------------------------------------------------------------------------

    @asynccontextmanager
    async def lease(self, peer, protocol: str, *, via_relay: bool = True,
                    timeout: float = LEASE_TIMEOUT) -> AsyncIterator[Lease]:
        """Exclusive use of a warm stream to ``peer`` for ``protocol``; DialError if it cannot be had
        (``Stalled`` if none came in time)."""
        key = (str(peer), protocol)
        slot, stream = await self._acquire(key, via_relay, timeout)
        lease = Lease(self, stream, key[0], protocol)
        self._leased[stream.conn] += 1
        try:
            yield lease
        except BaseException:
            stream.broken = True
            raise
        finally:
            lease.ended = True
            self._leased[stream.conn] -= 1
            self._give_back(slot, stream)
            self._recycle_if_idle(stream)

    async def warm(self, peer, protocol: str, n: int, *, via_relay: bool = True) -> int:
        """Open streams until ``n`` (at most the per-key cap) are idle; returns how many are idle."""
        key = (str(peer), protocol)
        while True:
            slot = self._slot(key)  # fetched again after every await: an unused slot may be forgotten
            self._prune(slot)
            if len(slot.idle) >= min(n, self._streams_per_key) or slot.count >= self._streams_per_key:
                return len(slot.idle)
            stream = await self._open_counted(slot, via_relay)
            stream.idle_since = trio.current_time()
            slot.idle.append(stream)
            slot.notify()

    def _slot(self, key: tuple[str, str]) -> _Slot:
        return self._slots.setdefault(key, _Slot(key))

    async def _acquire(self, key: tuple[str, str], via_relay: bool, timeout: float) -> tuple[_Slot, PoolStream]:
        with trio.move_on_after(timeout):
            while True:
                slot = self._slot(key)
                self._prune(slot)
                if slot.idle:
                    self.stats.reused += 1
                    return slot, slot.idle.pop()
                if slot.count < self._streams_per_key:
                    return slot, await self._open_counted(slot, via_relay)
                await slot.changed.wait()
        raise Stalled(f"no {key[1]} stream to {key[0]} within {timeout:.1f} s")

    async def _open_counted(self, slot: _Slot, via_relay: bool) -> PoolStream:
        peer, protocol = slot.key
        slot.count += 1
        try:
            if self._connector is not None:
                await self._connector.connect(peer, via_relay=via_relay)
            stream = self.adopt((await open_stream(self.host, as_peer_id(peer), protocol))._stream)
        except BaseException:
            slot.count -= 1
            slot.notify()
            self._forget_if_unused(slot)
            raise
        self.stats.opened += 1
        return stream

    def _prune(self, slot: _Slot) -> None:
        """Drop idle streams that died, and relayed ones once a direct connection exists."""
        keep = []
        for stream in slot.idle:
            if stream.dead:
                self._retire(slot, stream, reset=True)
            elif stream.conn in self._exhausted or trio.current_time() - stream.idle_since > IDLE_RETIRE:
                self._retire(slot, stream, reset=False)
            elif stream.relayed and has_direct(self.host, as_peer_id(slot.key[0])):
                log.debug("pooled stream to %s moves to the direct connection", slot.key[0])
                self.stats.moved_to_direct += 1
                self._retire(slot, stream, reset=False)
            else:
                keep.append(stream)
        slot.idle[:] = keep

    def _give_back(self, slot: _Slot, stream: PoolStream) -> None:
        if stream.dead:
            self.stats.reset += stream.broken
            self._retire(slot, stream, reset=True)
            self._forget_if_unused(slot)
        else:
            stream.idle_since = trio.current_time()
            slot.idle.append(stream)
            slot.notify()

    def _retire(self, slot: _Slot, stream: PoolStream, *, reset: bool) -> None:
        slot.count -= 1
        slot.notify()
        self._nursery.start_soon(stream.reset if reset else stream.close)

    def _forget_if_unused(self, slot: _Slot) -> None:
        """Drop a slot without streams (peers come and go); users re-fetch slots after each await."""
        if slot.count == 0 and self._slots.get(slot.key) is slot:
            del self._slots[slot.key]

    # --- frames and circuits ----------------------------------------------------------------

    def adopt(self, raw) -> PoolStream:
        """Wrap a libp2p stream; a relayed one gets its connection accounted."""
        stream = PoolStream(raw, self.ledger)
        if stream.relayed:
            announced = [getattr(c, CIRCUIT_LIMIT_ATTR, None) for c in (stream.swarm_conn, stream.conn)]
            limit = announced[0] or announced[1] or self._circuit_limit
            opened = self._opened_at.setdefault(stream.conn, trio.current_time())
            self.ledger.track(stream.conn, limit, opened)
        return stream

    def circuit_left(self, stream: PoolStream) -> tuple[int | None, float | None] | None:
        usage = self.ledger.circuits.get(stream.conn) if stream.relayed else None
        if usage is None:
            return None
        return usage.remaining_bytes(), usage.remaining_seconds(trio.current_time())

    async def send_frame(self, stream: PoolStream, message: wire.Message, payload: bytes = b"", *,
                         timeout: float | None = None, stall: float | None = None) -> None:
        """Write one frame whole, or retire the stream; CircuitExhausted before a byte if it cannot fit."""
        if stream.relayed:
            refusal = self.ledger.check(stream.conn, len(payload) + FRAME_BOUND, trio.current_time())
            if refusal is not None:
                self.stats.circuit_refusals += 1
                self._exhausted.add(stream.conn)
                raise CircuitExhausted(
                    f"relayed connection to {stream.remote_peer} cannot carry {len(payload)} B more "
                    f"({refusal.reason}: {refusal.remaining_bytes} B, {refusal.remaining_seconds} s left)")
        if stall is None and timeout is None:  # the default: a frame may take as long as its bytes keep moving
            stall = STALL_DEADLINE  # (the receiver cuts one slower than its line's slowest frame rate)
        deadline = stall or timeout or STALL_DEADLINE
        with trio.CancelScope(shield=True):
            with trio.move_on_after(deadline) as scope:
                stream.watch = (scope, stall) if stall else None
                try:
                    await wire.write_frame(stream, message, payload)
                except BaseException:
                    stream.broken = True
                    raise
                finally:
                    stream.watch = None
            if scope.cancelled_caught:
                stream.broken = True
                raise Stalled(f"{message.TYPE} to {stream.remote_peer}: write stalled for {deadline:.1f} s")
        self.stats.frames_sent += 1
        self.stats.payload_bytes_sent += len(payload)
        self.stats.count(stream, sent=len(payload))

    def _connection_opened(self, conn) -> None:
        self._opened_at.setdefault(conn.muxed_conn, trio.current_time())

    def _connection_closed(self, conn) -> None:
        self._opened_at.pop(conn.muxed_conn, None)
        self.ledger.forget(conn.muxed_conn)
        self._exhausted.discard(conn.muxed_conn)
        self._leased.pop(conn.muxed_conn, None)

    def _recycle_if_idle(self, stream: PoolStream) -> None:
        """Close an exhausted relayed connection once no lease uses it: the next one re-dials."""
        conn = stream.conn
        if conn not in self._exhausted or self._leased[conn] > 0:
            return
        self._exhausted.discard(conn)
        del self._leased[conn]
        for slot in self._slots.values():
            self._prune(slot)
        self.stats.circuits_recycled += 1
        log.debug("relayed connection to %s used up its circuit; closing it (the next lease re-dials)",
                 stream.remote_peer)
        self._nursery.start_soon(close_quietly, stream.swarm_conn or conn)

    # --- inbound and status -------------------------------------------------------------------

    def serve(self, protocol: str, handler: Handler, *, max_payload: int = wire.MAX_PAYLOAD_BYTES) -> None:
        """Answer ``protocol`` streams: ``handler(peer, message, payload)`` per frame, under the budget.

        The handler's return value is written back on the same stream: a message, a
        (message, payload) pair, or None for no reply. A handler that raises has the stream reset.
        The payload's budget is released when the handler returns.
        """
        self._inbound.serve(protocol, handler, max_payload)

    def idle_streams(self, peer, protocol: str) -> int:
        slot = self._slots.get((str(peer), protocol))
        return len(slot.idle) if slot is not None else 0

    def queue_depth(self) -> int:
        """Inbound frames being handled or waiting for a handler (published as capacity)."""
        return self.budget.frames_held()

    def status(self) -> dict:
        """Counters, the inbound budget and the relayed connections in use, for /api/stats."""
        return {**asdict(self.stats), "budget": self.budget.stats(),
                "relay": self.ledger.stats(trio.current_time())}

