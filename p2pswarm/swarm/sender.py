"""Delivering activations and gradients: warm streams, acks, adaptive timeouts and failover.

The driver of ``swarm/router.py``. A forward goes to the best live peer of the next stage; each
attempt is one frame on a warm pooled stream answered by an ``Ack`` or a ``Busy``. No answer
within the router's ack timeout for that peer (adaptive, RFC 6298, 200 ms at most), or a stream
error, is a failure: the peer is backed off and the *same* micro-batch goes to the next
candidate at once. A ``Busy`` is not a failure: the peer's queue depth is noted and the next
candidate is tried; when every live candidate is busy the sender waits for the shortest
retry-after hint. A forward that no candidate takes within ``NO_CANDIDATE_WAIT`` is lost.

A gradient has exactly one destination, the peer that holds the micro-batch's graph, so it is
retried on ``Busy`` and lost on failure. Every loss is reported (``on_lost``) and counted; none
raises out of here.

An attempt runs in its own task and the failover does not wait for it: a hung peer cannot stall
a sender for longer than its ack timeout, even while the pool finishes (or times out) the frame
it was writing. Imports neither torch nor the model.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import trio

from p2pswarm import wire
from p2pswarm.errors import NoCandidates, P2PSwarmError, first_error
from p2pswarm.swarm.activation import PROTOCOL_ID, Ack, Backward, Busy, Forward
from p2pswarm.swarm.router import Failure, Router

log = logging.getLogger(__name__)

LEASE_TIMEOUT = 5.0  # a stream to a warm candidate is immediate; a cold one needs a connection
ATTEMPT_READ_TIMEOUT = 10.0  # how long a detached attempt may still wait for its late ack before it retires the stream
NO_CANDIDATE_WAIT = 5.0  # seconds a forward waits for a live candidate of the next stage before it is lost
BACKWARD_ACK_TIMEOUT = 2.0  # a gradient has one possible destination: wait longer for it than for a forward
BACKWARD_TRIES = 4  # Busy replies a gradient waits out before it is lost
BUSY_WAIT_CAP = 1.0  # seconds: the longest a sender sleeps on a Busy's retry-after hint
IDLE_POLL = 0.05  # seconds between looks for a candidate when there is none
LINK_DELAY = float(os.environ.get("P2PSWARM_LINK_DELAY_MS", "0")) / 1000  # benchmarks only: latency added per frame


Key = tuple[bytes, int]


@dataclass(frozen=True)
class Send:
    """A frame waiting in the outbound queue."""

    message: Forward | Backward
    payload: bytes
    key: Key
    to: str | None = None  # the gradient's destination; None for a forward (the router chooses)


@dataclass(frozen=True)
class Reply:
    """How one attempt ended: an Ack or Busy message, or a failure."""

    message: wire.Message | None
    failure: Failure | None
    seconds: float


class Deliverer:
    """Sends forwards with failover and gradients to their one destination (module docstring)."""

    def __init__(self, pool, router: Router, nursery: trio.Nursery, *,
                 on_acked: Callable[[Key, str], None], on_lost: Callable[[Send, str], None],
                 on_peer_error: Callable[[str], None]) -> None:
        self._pool, self._router, self._nursery = pool, router, nursery
        self._on_acked, self._on_lost, self._on_peer_error = on_acked, on_lost, on_peer_error
        self.counts: Counter = Counter()  # sent, acked, busy, timeouts, errors, rerouted, lost
        self.failover_ms: list[float] = []  # failure -> ack of the re-routed micro-batch, recent ones
        self._busy: dict[str, float] = {}  # peer -> its last Busy's retry-after hint, seconds

    async def forward(self, send: Send) -> None:
        """Deliver a forward to some live peer of its stage; report it lost if none takes it."""
        stage, tried, failed_at = send.message.stage, set(), None
        deadline = trio.current_time() + NO_CANDIDATE_WAIT
        while trio.current_time() < deadline:
            try:
                peer = self._router.next_after(stage, tried, time.time())
            except NoCandidates:
                await self._wait_for_candidate(tried)
                continue
            reply = await self._attempt(peer, send, self._router.ack_timeout(peer))
            if isinstance(reply.message, Ack):
                self._router.observe_ack(peer, reply.seconds, time.time(), reply.message.queue_depth)
                self._busy.pop(peer, None)
                self._acked(send, peer, failed_at)
                return
            tried.add(peer)
            if isinstance(reply.message, Busy):
                self.counts["busy"] += 1
                self._router.observe_capacity(peer, reply.message.queue_depth, time.time())
                self._busy[peer] = reply.message.retry_after_ms / 1000
                continue
            if failed_at is None:  # failover time runs from the start of the first failed attempt
                failed_at = trio.current_time() - reply.seconds
            self._failed(peer, reply.failure)
        self._lost(send, "no live peer of the next stage took it")

    async def backward(self, send: Send) -> None:
        """Deliver a gradient to the peer holding its graph; report it lost if it cannot."""
        for _ in range(BACKWARD_TRIES):
            reply = await self._attempt(send.to, send, BACKWARD_ACK_TIMEOUT)
            if isinstance(reply.message, Ack):
                self._router.observe_ack(send.to, reply.seconds, time.time(), reply.message.queue_depth)
                self._acked(send, send.to, None)
                return
            if not isinstance(reply.message, Busy):
                self._failed(send.to, reply.failure)
                break
            self.counts["busy"] += 1
            await trio.sleep(min(BUSY_WAIT_CAP, reply.message.retry_after_ms / 1000))
        self._lost(send, "the peer holding its graph did not take it")

    # --- attempts -------------------------------------------------------------------------------

    async def _wait_for_candidate(self, tried: set[str]) -> None:
        """No untried live candidate: wait out the shortest Busy hint, then try the busy ones again."""
        busy = [self._busy.pop(p) for p in list(tried) if p in self._busy]
        tried.difference_update(p for p in list(tried) if self._router.is_live(p, time.time()))
        await trio.sleep(min([BUSY_WAIT_CAP, *busy]) if busy else IDLE_POLL)

    async def _attempt(self, peer: str, send: Send, timeout: float) -> Reply:
        """One frame to ``peer`` and its reply, or a failure once ``timeout`` passes (the frame's
        task goes on detached and retires its stream if the reply never comes)."""
        self.counts["sent"] += 1
        done = trio.Event()
        box: list[Reply] = []
        late: list[bool] = []  # non-empty once the caller stopped waiting
        started = trio.current_time()

        async def exchange() -> None:
            try:
                if LINK_DELAY:  # a benchmark's simulated link latency (bench/swarm_train.py)
                    await trio.sleep(LINK_DELAY)
                async with self._pool.lease(peer, PROTOCOL_ID, timeout=LEASE_TIMEOUT) as lease:
                    await lease.write_frame(send.message, send.payload)
                    message, _ = await lease.read_frame(max_payload=0, timeout=ATTEMPT_READ_TIMEOUT)
            except Exception as exc:  # whatever a peer or its connection does, it is that peer's failure
                error = first_error(exc)
                expected = isinstance(error, (P2PSwarmError, OSError, trio.BrokenResourceError,
                                              trio.ClosedResourceError))
                log.log(logging.DEBUG if expected else logging.WARNING, "%s to %s failed: %r",
                        send.message.TYPE, peer, error)
                box.append(Reply(None, Failure.ERROR, trio.current_time() - started))
            else:
                ok = isinstance(message, (Ack, Busy)) and message.micro_batch == send.message.micro_batch
                box.append(Reply(message if ok else None, None if ok else Failure.ERROR,
                                 trio.current_time() - started))
                if ok and late:  # a late ack: the peer lives, and its timeout should grow
                    self.counts["late_acks"] += 1
                    self._router.observe_ack(peer, trio.current_time() - started, time.time(), message.queue_depth)
            finally:
                done.set()

        self._nursery.start_soon(exchange)
        with trio.move_on_after(timeout):
            await done.wait()
        if box:
            return box[0]
        late.append(True)
        return Reply(None, Failure.TIMEOUT, timeout)

    # --- outcomes -------------------------------------------------------------------------------

    def _acked(self, send: Send, peer: str, failed_at: float | None) -> None:
        self.counts["acked"] += 1
        self._on_acked(send.key, peer)
        if failed_at is not None:
            self.counts["rerouted"] += 1
            self.failover_ms.append(1000 * (trio.current_time() - failed_at))
            del self.failover_ms[:-1000]

    def _failed(self, peer: str, failure: Failure | None) -> None:
        failure = failure or Failure.ERROR
        self.counts["timeouts" if failure is Failure.TIMEOUT else "errors"] += 1
        self._router.observe_failure(peer, time.time(), failure)
        if failure is Failure.ERROR:
            self._on_peer_error(peer)

    def _lost(self, send: Send, why: str) -> None:
        self.counts["lost"] += 1
        log.debug("%s of micro-batch %d lost: %s", send.message.TYPE, send.key[1], why)
        self._on_lost(send, why)

    def stats(self) -> dict:
        latencies = sorted(self.failover_ms)

        def pct(q: float) -> float | None:
            return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 1) if latencies else None

        return {**{k: self.counts[k] for k in ("sent", "acked", "busy", "timeouts", "late_acks", "errors", "rerouted", "lost")},
                "failover_ms_p50": pct(0.5), "failover_ms_p99": pct(0.99), "failovers_measured": len(latencies),
                "failover_ms_recent": [round(x, 1) for x in self.failover_ms[-100:]]}
