"""The sender's size rules (p2pswarm.swarm.sender): local errors blame no peer; a peer's share is kept.

A micro-batch whose payload is past the wire's frame limit cannot go to any peer: the Deliverer
finds that before trying one, logs it at ERROR once (with the sizes), reports the micro-batch
lost, and leaves every peer of the next stage live, un-failed and not backed off. A frame that
fits is delivered as before (a fake pool on the lease interface acks it). Frames on the way to
one peer stay within its inbound share (one 64 MiB frame): a second big one waits for the first's
answer, while small ones go side by side.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time

import trio
import trio.testing

from p2pswarm import wire
from p2pswarm.swarm.activation import SESSION_BYTES, Ack, Backward, Forward
from p2pswarm.swarm.buffers import Priority
from p2pswarm.swarm.router import Candidate, Router
from p2pswarm.swarm.sender import Deliverer, Send

PEERS = ("next-a", "next-b")


class FakeLease:
    """A stream that acks every frame written to it."""

    def __init__(self, pool: FakePool) -> None:
        self.pool = pool
        self.message = None

    async def write_frame(self, message, payload=b"", *, timeout=None, stall=None) -> None:
        wire.check_outgoing(message, payload)  # as the real stream does, before any byte
        self.pool.frames += 1
        self.message = message

    async def read_frame(self, *, max_payload=wire.MAX_PAYLOAD_BYTES, timeout=0.0):
        await self.pool.answer.wait()
        return Ack(self.message.micro_batch, 0), b""


class FakePool:
    def __init__(self) -> None:
        self.leases = self.frames = 0
        self.answer = trio.Event()  # acks wait for this; set from the start unless a test holds them
        self.answer.set()

    @contextlib.asynccontextmanager
    async def lease(self, peer, protocol, *, via_relay=True, timeout=0.0):
        self.leases += 1
        yield FakeLease(self)


def deliverer() -> tuple[Deliverer, Router, FakePool, dict]:
    router, pool = Router(random.Random(1)), FakePool()
    router.offer([Candidate(peer, 1, 0, heard_at=time.time()) for peer in PEERS], time.time())
    seen = {"acked": [], "lost": [], "peer_errors": []}
    d = Deliverer(pool, router, on_acked=lambda key, peer: seen["acked"].append(key),
                  on_lost=lambda send, why: seen["lost"].append(why),
                  on_peer_error=seen["peer_errors"].append)
    return d, router, pool, seen


def send(cls, rows: int, micro_batch: int = 0, to: str | None = None) -> Send:
    """A float32 [rows, 1024, 2048] micro-batch (8 MiB a row) of the small tier, a forward with its
    byte targets: 8 rows and their targets are past a 64 MiB frame (a gradient: 9 rows)."""
    shape = (rows, 1024, 2048)
    targets = rows * 1024 if cls is Forward else 0
    payload = bytes(rows * 1024 * 2048 * 4 + targets)
    priority = int(Priority.TRAINING_FORWARD if cls is Forward else Priority.TRAINING_BACKWARD)
    message = cls(b"s" * SESSION_BYTES, micro_batch, 1, priority, 0, "float32", shape, targets)
    return Send(message, payload, (message.session, micro_batch), to)


def test_a_frame_too_big_to_send_is_a_local_error_that_blames_no_peer(caplog):
    d, router, pool, seen = deliverer()

    async def main():
        with caplog.at_level(logging.DEBUG, logger="p2pswarm.swarm.sender"):
            await d.forward(send(Forward, 8, 0))
            await d.forward(send(Forward, 8, 1))
            await d.backward(send(Backward, 9, 2, to=PEERS[0]))

    trio.run(main)
    assert pool.leases == 0 and pool.frames == 0  # no peer was even tried
    assert len(seen["lost"]) == 3 and not seen["peer_errors"] and not seen["acked"]
    assert d.counts["unsendable"] == 3 and d.counts["errors"] == d.counts["timeouts"] == d.counts["sent"] == 0
    now = time.time()
    assert all(router.is_live(peer, now) for peer in PEERS)
    assert all(router.peers[peer].failures == 0 for peer in PEERS)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2  # once per message type (forward, backward), not once per micro-batch
    assert str(8 * 1024 * (2048 * 4 + 1)) in errors[0].getMessage()
    assert str(wire.MAX_PAYLOAD_BYTES) in errors[0].getMessage()
    assert d.stats()["unsendable"] == 3


def test_a_frame_that_fits_is_delivered():
    d, _router, pool, seen = deliverer()
    trio.run(d.forward, send(Forward, 7))  # 56 MiB: within the frame
    assert pool.frames == 1 and len(seen["acked"]) == 1 and not seen["lost"] and d.counts["unsendable"] == 0


def test_frames_on_the_way_to_a_peer_stay_within_its_share():
    d, router, pool, seen = deliverer()
    router.forget(PEERS[1])  # one candidate: everything goes to the same peer

    async def main(rows: int, expect_before_answer: int):
        pool.answer, pool.frames = trio.Event(), 0
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(d.forward, send(Forward, rows, i))
            await trio.testing.wait_all_tasks_blocked()
            assert pool.frames == expect_before_answer
            pool.answer.set()
        assert pool.frames == 2

    trio.run(main, 5, 1)  # 2 x 40 MiB: the second waits for the first's ack
    assert d.counts["byte_waits"] >= 1
    trio.run(main, 2, 2)  # 2 x 16 MiB: side by side
    assert len(seen["acked"]) == 4 and not seen["lost"] and not d._bytes_out


def test_an_ack_waits_behind_the_bytes_already_on_the_way_from_us():
    """A frame written while another is on the way may sit behind it in our uplink: its ack gets the
    deadline of both. The first frame, alone when written, keeps its own deadline."""
    d, router, pool, seen = deliverer()
    router.forget(PEERS[1])
    first, second = send(Forward, 1, 0), send(Forward, 1, 1)
    alone = router.deadline(PEERS[0], len(first.payload))
    behind = router.deadline(PEERS[0], 2 * len(first.payload))
    assert behind > alone + 5

    async def main():
        pool.answer = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(d.forward, first)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(d.forward, second)
            await trio.sleep((alone + behind) / 2)  # past the first's deadline, within the second's
            pool.answer.set()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert d.counts["timeouts"] == 1, d.counts  # the first: nothing was ahead of it
    assert second.key in seen["acked"], seen


def test_a_gradient_survives_one_stream_error_and_is_lost_on_the_second():
    """A relayed connection closed at its circuit's limit ended the streams on it while the peer lived:
    its gradients were lost at the first error (19 in 150 s through a relay). One error is retried on a
    fresh lease now; a second means the peer is gone, with its graph."""
    class FailingLease(FakeLease):
        async def write_frame(self, message, payload=b"", *, timeout=None, stall=None) -> None:
            if self.pool.errors_left:
                self.pool.errors_left -= 1
                raise trio.BrokenResourceError("the relay closed the circuit")
            await super().write_frame(message, payload, timeout=timeout, stall=stall)

    async def main():
        for errors, acked, lost in ((1, 1, 0), (2, 0, 1)):
            d, _, pool, seen = deliverer()
            pool.errors_left = errors
            pool.lease = contextlib.asynccontextmanager(lambda *a, pool=pool, **k: _yield(FailingLease(pool)))
            await d.backward(send(Backward, 1, 3, to=PEERS[0]))
            assert (len(seen["acked"]), len(seen["lost"])) == (acked, lost), (errors, seen)

    async def _yield(lease):
        yield lease

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
