"""Delivering activations and gradients: warm streams, acks, link-fitted deadlines, windows, failover.

The driver of ``swarm/router.py`` and ``swarm/pacing.py``. A forward goes to the best live peer
of the next stage that has room in its window (``pacing``: AIMD on the frames on the way to it);
when every live peer's window is full the forward waits for an answer rather than piling more
onto a full link (a live partner, ``router``'s affinity, is the only candidate until tried, so
the forward waits for room in its window). Each attempt is one frame on a warm pooled stream
answered by an ``Ack`` (or a duplicate's ack) or a ``Busy``, and it fails only when the peer
makes no progress:

- while the frame is written, its bytes must keep moving: no WRITE_CHUNK for one deadline
  (``Link.deadline`` of the frame's size: measured throughput plus RFC 6298 slack) is a stall;
- once written (the last write is progress too: the bytes may still wait in socket and router
  buffers behind other frames), the ack must come within the deadline of the frame's size plus
  every other byte on the way from us, to any peer (our uplink is one queue: a held-out
  evaluation round of several MB beside training frames on a 20 Mbit/s line);
- a stream error is a failure at once (a crashed peer is found in milliseconds).

A failure backs the peer off, halves its window, resets the attempt's stream (the first attempt
is cancelled, so a hung peer never receives it late) and sends the *same* micro-batch to the next
candidate. A ``Busy`` is not a failure: the window halves, the queue depth is noted and the next
candidate is tried; when every live candidate is busy the sender waits for the shortest
retry-after hint. A forward is lost when no live candidate exists for ``NO_CANDIDATE_WAIT`` or
no window opens for ``ROOM_WAIT``.

Besides its window, a peer takes at most its inbound share of bytes on the way at once
(``net/budget.PEER_BUDGET_BYTES``, one 64 MiB frame): the receiver reserves each frame's bytes
against that share before reading it and refuses one that waits past its budget wait, which
would fail a healthy peer. So an attempt whose frame would take the bytes on the way to a peer
past that share waits for an earlier one to end (a single frame always fits).

A frame that we may not send at all (its payload is past the wire's limit: a micro-batch too
big for one frame) is a *local* error: it is found before any peer is tried, logged at ERROR
once with its sizes, and the micro-batch is lost; no peer is failed or backed off for it.

A gradient has exactly one destination, the peer that holds the micro-batch's graph, so it is
retried on ``Busy`` and on a timeout (the receiver drops a duplicate), and once on an error (a relayed
connection closed at its circuit's limit ends its streams, the peer lives on); a second error loses it. Every
loss is reported (``on_lost``) and counted; none raises out of here. Imports neither torch nor the model.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import trio

from p2pswarm import wire
from p2pswarm.errors import (
    CircuitExhausted,
    LocalProtocolError,
    NoCandidates,
    P2PSwarmError,
    Stalled,
    first_error,
)
from p2pswarm.net.budget import MIN_FRAME_CHARGE, PEER_BUDGET_BYTES
from p2pswarm.run.tunables import Tunables
from p2pswarm.swarm.activation import PROTOCOL_ID, Ack, Busy, Forward
from p2pswarm.swarm.buffers import Priority
from p2pswarm.swarm.router import EXPLORE_EVERY, Failure, Router
from p2pswarm.swarm.stage_core import Key, Send

log = logging.getLogger(__name__)

LEASE_TIMEOUT = 5.0  # a stream to a warm candidate is immediate; a cold one needs a connection
NO_CANDIDATE_WAIT = 15.0  # seconds a forward waits for a live candidate (a backed-off one, a fresh relay
#                          circuit) of the next stage before it is lost: the router's staleness bound
ROOM_WAIT = 30.0  # seconds a forward waits for room in a live candidate's window before it is lost
BACKWARD_TRIES = 6  # Busy replies, timeouts or full circuits a gradient waits out before it is lost
# stream errors a gradient survives: its one destination's connection may end under it while the peer
# lives (a relayed connection closed at its circuit's limit: the next lease dials a fresh one)
BACKWARD_ERRORS = 2
BUSY_WAIT_CAP = 1.0  # seconds: the longest a sender sleeps on a Busy's retry-after hint
IDLE_POLL = 0.05  # seconds between looks for a candidate when there is none
ACK_READ_GRACE = 1.0  # seconds past the ack deadline the read itself may run (the watch cancels it first)
ACK_SAMPLES = 1000  # recent ack latencies kept for the p50/p99 of /api/swarm


@dataclass(frozen=True)
class Reply:
    """How one attempt ended: an Ack or Busy message, or a failure."""

    message: wire.Message | None
    failure: Failure | None
    seconds: float


class Deliverer:
    """Sends forwards with failover and gradients to their one destination (module docstring)."""

    def __init__(self, pool, router: Router, *,
                 on_acked: Callable[[Key, str], None], on_lost: Callable[[Send, str], None],
                 on_peer_error: Callable[[str], None], tunables: Tunables = Tunables()) -> None:
        self._pool, self._router = pool, router
        self._link_delay = tunables.link_delay_s  # a benchmark's simulated link latency (bench/swarm_train.py)
        self._on_acked, self._on_lost, self._on_peer_error = on_acked, on_lost, on_peer_error
        self.counts: Counter = Counter()  # sent, acked, busy, timeouts, errors, rerouted, lost, duplicates
        self.failover_ms: list[float] = []  # failure -> ack of the re-routed micro-batch, recent ones
        self.ack_ms: list[float] = []  # first byte -> ack, recent ones
        self._busy: dict[str, float] = {}  # peer -> its last Busy's retry-after hint, seconds
        self._answered = trio.Event()  # set whenever an attempt ends: a window may have room again
        self._unsendable_logged: set[str] = set()  # message types whose refusal was logged at ERROR
        self._bytes_out: Counter = Counter()  # peer -> bytes of the frames on the way to it (as it charges them)
        self._forwards = 0  # forwards taken: every EXPLORE_EVERY-th is first offered to a non-partner (router)

    async def forward(self, send: Send) -> None:
        """Deliver a forward to some live peer of its stage; report it lost if none takes it."""
        if not self._sendable(send):
            return
        tried: set[str]
        stage, tried, failed_at = send.message.stage, set(), None
        waiting_since: float | None = None  # since when no attempt could be made
        self._forwards += 1
        explore = self._forwards % EXPLORE_EVERY == EXPLORE_EVERY // 2
        while True:
            now = trio.current_time()
            try:
                peer = self._router.next_after(stage, tried, time.time(), explore=explore)
            except NoCandidates:
                waiting_since = now if waiting_since is None else waiting_since
                if now - waiting_since >= NO_CANDIDATE_WAIT:
                    return self._lost(send, "no live peer of the next stage took it")
                await self._wait_for_candidate(tried)
                continue
            if peer is None:  # every untried live candidate has a full window: wait for an answer
                waiting_since = now if waiting_since is None else waiting_since
                if now - waiting_since >= ROOM_WAIT:
                    return self._lost(send, "no window of the next stage opened")
                await self.wait_for_room()
                continue
            waiting_since = None
            reply = await self._attempt(peer, send)
            if isinstance(reply.message, Ack):
                self._acked(send, peer, failed_at, reply)
                return
            tried.add(peer)
            if isinstance(reply.message, Busy):
                self._busy_reply(peer, reply.message)
                continue
            if failed_at is None:  # failover time runs from the start of the first failed attempt
                failed_at = trio.current_time() - reply.seconds
            self._failed(peer, reply.failure)

    async def backward(self, send: Send) -> None:
        """Deliver a gradient to the peer holding its graph; report it lost if it cannot."""
        if not self._sendable(send):
            return
        assert send.to is not None  # StageCore routes every gradient to one peer
        errors = 0
        for _ in range(BACKWARD_TRIES):
            reply = await self._attempt(send.to, send)
            if isinstance(reply.message, Ack):
                self._acked(send, send.to, None, reply)
                return
            if isinstance(reply.message, Busy):
                self._busy_reply(send.to, reply.message)
                await trio.sleep(min(BUSY_WAIT_CAP, reply.message.retry_after_ms / 1000))
                continue
            self._failed(send.to, reply.failure)
            errors += reply.failure is Failure.ERROR
            if errors >= BACKWARD_ERRORS:  # the peer is gone: its graph with it
                break
            # no progress within the deadline (the one peer that can take it may be slow), a full relay
            # circuit or a connection that ended under it (a fresh one is on its way): the receiver drops
            # a copy it already took, so trying again never trains it twice
            if reply.failure is not Failure.TIMEOUT:
                await trio.sleep(BUSY_WAIT_CAP)
        self._lost(send, "the peer holding its graph did not take it")

    def _sendable(self, send: Send) -> bool:
        """Whether the protocol lets us send this frame at all; if not it is lost (a local error:
        logged at ERROR once per message type, with the sizes), and no peer is blamed for it."""
        try:
            wire.check_outgoing(send.message, send.payload)
        except LocalProtocolError as exc:
            self.counts["unsendable"] += 1
            kind = send.message.TYPE
            if kind not in self._unsendable_logged:
                self._unsendable_logged.add(kind)
                log.error("cannot send a %s of %d bytes (shape %s, %s; the frame limit is %d bytes): %s; "
                          "such micro-batches are lost (logged once)", kind, len(send.payload),
                          send.message.shape, send.message.dtype, wire.MAX_PAYLOAD_BYTES, exc)
            self._lost(send, f"unsendable: {exc}")
            return False
        return True

    # --- attempts -------------------------------------------------------------------------------

    async def _wait_for_candidate(self, tried: set[str]) -> None:
        """No untried live candidate: wait out the shortest Busy hint, then try the busy ones again."""
        busy = [self._busy.pop(p) for p in list(tried) if p in self._busy]
        tried.difference_update(p for p in list(tried) if self._router.is_live(p, time.time()))
        await trio.sleep(min([BUSY_WAIT_CAP, *busy]) if busy else IDLE_POLL)

    async def wait_for_room(self) -> None:
        """Until some attempt ends (a window may have opened), or BUSY_WAIT_CAP passes."""
        with trio.move_on_after(BUSY_WAIT_CAP):
            await self._answered.wait()

    async def _attempt(self, peer: str, send: Send) -> Reply:
        """One frame to ``peer`` and its reply, or a failure when the peer makes no progress
        (module docstring); the attempt's stream is reset on any failure."""
        size = len(send.payload)
        charge = size + MIN_FRAME_CHARGE  # the receiver charges the header too: a few hundred bytes
        while self._bytes_out[peer] and self._bytes_out[peer] + charge > PEER_BUDGET_BYTES:
            self.counts["byte_waits"] += 1
            await self.wait_for_room()  # its share is taken by earlier frames: wait for one to end
        deadline = self._router.deadline(peer, size)
        self.counts["sent"] += 1
        self._router.observe_sent(peer, size)
        self._bytes_out[peer] += charge
        try:
            reply = await self._exchange(peer, send, deadline)
        finally:
            self._bytes_out[peer] -= charge
            if not self._bytes_out[peer]:
                del self._bytes_out[peer]
            self._answered.set()
            self._answered = trio.Event()
        return reply

    async def _exchange(self, peer: str, send: Send, deadline: float) -> Reply:
        started = trio.current_time()
        try:
            if self._link_delay:  # a benchmark's simulated link latency
                await trio.sleep(self._link_delay)
            async with self._pool.lease(peer, PROTOCOL_ID, timeout=min(LEASE_TIMEOUT, deadline)) as lease:
                started = trio.current_time()  # the deadline runs from the first byte, not from a dial
                await lease.write_frame(send.message, send.payload, stall=deadline)
                # the last byte written is progress too: it may still sit in buffers behind the other
                # frames on the way from us (our uplink is one queue), so one more deadline for them all
                ack_deadline = self._ack_deadline(peer, len(send.payload))
                with trio.move_on_after(ack_deadline):
                    message, _ = await lease.read_frame(max_payload=0, timeout=ack_deadline + ACK_READ_GRACE)
                    ok = isinstance(message, (Ack, Busy)) and message.micro_batch == send.message.micro_batch
                    return Reply(message if ok else None, None if ok else Failure.ERROR,
                                 trio.current_time() - started)
                return Reply(None, Failure.TIMEOUT, trio.current_time() - started)  # read cut: stream retired
        except CircuitExhausted as exc:  # refused before a byte: the peer is fine, this relayed path is full
            log.debug("%s to %s re-routed: %s", send.message.TYPE, peer, exc)
            return Reply(None, Failure.CIRCUIT, trio.current_time() - started)
        except Stalled as exc:
            log.debug("%s to %s: %s", send.message.TYPE, peer, exc)
            return Reply(None, Failure.TIMEOUT, trio.current_time() - started)
        except Exception as exc:  # whatever a peer or its connection does, it is that peer's failure
            error = first_error(exc)
            expected = isinstance(error, (P2PSwarmError, OSError, trio.BrokenResourceError, trio.ClosedResourceError))
            log.log(logging.DEBUG if expected else logging.WARNING, "%s to %s failed: %r", send.message.TYPE, peer,
                    error)
            return Reply(None, Failure.ERROR, trio.current_time() - started)

    def _ack_deadline(self, peer: str, size: int) -> float:
        """The ack's deadline once a frame is written: the link's deadline for the frame and every
        other byte on the way from us, to any peer, which may sit ahead of it in the same uplink
        (a held-out evaluation round of several MB beside training frames on a 20 Mbit/s line)."""
        others = max(0, sum(self._bytes_out.values()) - size - MIN_FRAME_CHARGE)
        return self._router.deadline(peer, size + others)

    # --- outcomes -------------------------------------------------------------------------------

    def _acked(self, send: Send, peer: str, failed_at: float | None, reply: Reply) -> None:
        assert isinstance(reply.message, Ack)  # called on an Ack only
        self._router.observe_ack(peer, reply.seconds, time.time(), reply.message.queue_depth, len(send.payload))
        self._busy.pop(peer, None)
        self.counts["acked"] += 1
        if reply.message.duplicate:
            self.counts["acked_as_duplicate"] += 1
        if isinstance(send.message, Forward) and send.message.priority == Priority.TRAINING_FORWARD:
            self.counts["training_forwards_acked"] += 1  # each micro-batch once: what the next stage may train on
        self.ack_ms.append(1000 * reply.seconds)
        del self.ack_ms[:-ACK_SAMPLES]
        self._on_acked(send.key, peer)
        if failed_at is not None:
            self.counts["rerouted"] += 1
            self.failover_ms.append(1000 * (trio.current_time() - failed_at))
            del self.failover_ms[:-1000]

    def _busy_reply(self, peer: str, busy: Busy) -> None:
        self.counts["busy"] += 1
        self._router.observe_busy(peer, busy.queue_depth, time.time())
        self._busy[peer] = busy.retry_after_ms / 1000

    def _failed(self, peer: str, failure: Failure | None) -> None:
        failure = failure or Failure.ERROR
        if failure is Failure.CIRCUIT:  # no failure of the peer's: nothing it acked is given up
            self.counts["circuit_full"] += 1
            self._router.observe_busy(peer, self._router.queue_depth(peer), time.time())
            return
        self.counts["timeouts" if failure is Failure.TIMEOUT else "errors"] += 1
        self._router.observe_failure(peer, time.time(), failure)
        if failure is Failure.ERROR:
            self._on_peer_error(peer)

    def _lost(self, send: Send, why: str) -> None:
        self.counts["lost"] += 1
        log.debug("%s of micro-batch %d lost: %s", send.message.TYPE, send.key[1], why)
        self._on_lost(send, why)

    def stats(self) -> dict:
        return {**{k: self.counts[k] for k in ("sent", "acked", "busy", "timeouts", "errors", "rerouted", "lost",
                                               "acked_as_duplicate", "circuit_full",
                                               "training_forwards_acked", "unsendable")},
                "ack_ms_p50": percentile(self.ack_ms, 0.5), "ack_ms_p99": percentile(self.ack_ms, 0.99),
                "failover_ms_p50": percentile(self.failover_ms, 0.5),
                "failover_ms_p99": percentile(self.failover_ms, 0.99),
                "failovers_measured": len(self.failover_ms),
                "failover_ms_recent": [round(x, 1) for x in self.failover_ms[-100:]]}


def percentile(samples: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``samples`` (nearest rank), rounded; None when there are none."""
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) if ordered else None
