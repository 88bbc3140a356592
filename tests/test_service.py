"""What a training peer does with each frame a lying peer can send on the activation protocol.

The handler of a real ``SwarmService`` (no network: frames are handed to it as the stream pool
would) must ack what it will compute, answer ``Busy`` when its buffer is full, and refuse with
``RemoteProtocolError`` (the pool then resets the stream) anything else, barring the sender. A tensor
for a stage it does not serve is no lie (the sender's map is behind a move): refused, never barred.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
import trio  # noqa: E402

from p2pswarm import wire  # noqa: E402
from p2pswarm.errors import RemoteProtocolError  # noqa: E402
from p2pswarm.model.catalog import get_model  # noqa: E402
from p2pswarm.swarm.activation import SESSION_BYTES, Ack, Backward, Busy, Forward  # noqa: E402
from p2pswarm.swarm.buffers import INBOUND_CAPACITY_ITEMS, Priority  # noqa: E402
from p2pswarm.swarm.engine import Output, Work  # noqa: E402
from p2pswarm.swarm.service import SwarmService  # noqa: E402
from p2pswarm.swarm.stage_core import Job  # noqa: E402

SPEC = get_model("tiny-lm/2")
SESSION = b"s" * SESSION_BYTES
ROWS, SEQ = 2, 8


def forward(micro_batch: int = 0, *, stage: int = 1, priority: int = Priority.TRAINING_FORWARD,
            shape=(ROWS, SEQ, SPEC.width), dtype: str = "float32", targets: int = ROWS * SEQ):
    count = math.prod(shape) * 4
    return Forward(SESSION, micro_batch, stage, int(priority), 0, dtype, shape, targets), b"\0" * (count + targets)


def service(stage: int = 1) -> SwarmService:
    return SwarmService(spec=SPEC, stage=stage, me="me", pool=None, stage_map=None, host=None)


def run(test):
    trio.run(test)


def test_a_good_forward_is_acked_and_queued():
    async def main():
        svc = service()
        reply = await svc._on_frame("up", *forward())
        assert reply == Ack(0, 1) and len(svc.inbound) == 1
    run(main)


def test_a_re_sent_forward_is_acked_as_a_duplicate_and_not_queued_twice():
    async def main():
        svc = service()
        assert await svc._on_frame("up", *forward(7)) == Ack(7, 1)
        assert await svc._on_frame("other-up", *forward(7)) == Ack(7, 1, duplicate=True)  # whoever re-sends it
        assert len(svc.inbound) == 1 and svc.counts["duplicates_dropped"] == 1
        assert await svc._on_frame("up", *forward(8)) == Ack(8, 2)  # the next one is new
    run(main)


def test_a_forward_refused_busy_is_no_duplicate_when_it_comes_again():
    async def main():
        svc = service()
        for i in range(INBOUND_CAPACITY_ITEMS):
            await svc._on_frame("up", *forward(i))
        late = INBOUND_CAPACITY_ITEMS + 1
        assert isinstance(await svc._on_frame("up", *forward(late)), Busy)
        svc.inbound.take(trio.current_time())  # room again
        reply = await svc._on_frame("up", *forward(late))
        assert isinstance(reply, Ack) and not reply.duplicate
    run(main)


def test_a_flood_is_answered_busy_not_queued_without_bound():
    async def main():
        svc = service()
        replies = [await svc._on_frame("up", *forward(i)) for i in range(INBOUND_CAPACITY_ITEMS + 5)]
        assert all(isinstance(r, Ack) for r in replies[:INBOUND_CAPACITY_ITEMS])
        assert all(isinstance(r, Busy) and r.retry_after_ms > 0 for r in replies[INBOUND_CAPACITY_ITEMS:])
        assert len(svc.inbound) == INBOUND_CAPACITY_ITEMS
    run(main)


LIES = {
    "wrong width": forward(shape=(ROWS, SEQ, SPEC.width + 1)),
    "longer than the context": forward(shape=(1, SPEC.context + 1, SPEC.width), targets=SPEC.context + 1),
    "too many rows": forward(shape=(257, 1, SPEC.width), targets=257),
    "wrong dtype": forward(dtype="float64"),
    "no targets for the last stage": forward(targets=0),
    "a forward that claims to be a gradient": forward(priority=Priority.TRAINING_BACKWARD),
    "a gradient with a forward's priority": (Backward(SESSION, 0, 1, int(Priority.TRAINING_FORWARD), 0, "float32",
                                                      (ROWS, SEQ, SPEC.width), 0), b"\0" * ROWS * SEQ * SPEC.width * 4),
    "a reply instead of a request": (Ack(0, 0), b""),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_every_lie_is_refused_and_its_sender_barred(lie):
    async def main():
        svc = service()
        with pytest.raises(RemoteProtocolError):
            await svc._on_frame("liar", *LIES[lie])
        assert svc.counts["garbage_frames"] == 1 and len(svc.inbound) == 0
        with pytest.raises(RemoteProtocolError):  # barred: even a good frame is refused now
            await svc._on_frame("liar", *forward())
        assert await svc._on_frame("honest", *forward()) == Ack(0, 1)  # others are served
    run(main)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_tensor_for_a_stage_we_moved_from_is_refused_and_its_sender_still_served(stage):
    """Issue 25: after a move, neighbours whose map still shows our old stage send us its tensors for up
    to a record's TTL. Each gets ``moved`` (a stage we never served: ``wrong-stage``), counted; the sender routes
    it elsewhere and nobody is barred."""
    async def main():
        svc = service()
        svc.moved_from = frozenset({0})
        gradient = Backward(SESSION, 0, stage, int(Priority.TRAINING_BACKWARD), 0, "float32", (ROWS, SEQ, SPEC.width),
                            0), b"\0" * ROWS * SEQ * SPEC.width * 4
        for frame in (forward(stage=stage), gradient):
            reply = await svc._on_frame("behind", *frame)
            expected = "moved" if stage == 0 else "wrong-stage"
            assert isinstance(reply, wire.ErrorReply) and reply.code == expected, reply
        assert svc.counts["wrong_stage_frames"] == 2 and svc.counts["garbage_frames"] == 0 and len(svc.inbound) == 0
        assert await svc._on_frame("behind", *forward()) == Ack(0, 1)  # not barred
    run(main)


def test_a_gradient_nobody_waits_for_is_acked_and_ignored():
    async def main():
        svc = service(stage=0)
        message = Backward(SESSION, 9, 0, int(Priority.TRAINING_BACKWARD), 0, "float32", (ROWS, SEQ, SPEC.width), 0)
        assert await svc._on_frame("down", message, b"\0" * ROWS * SEQ * SPEC.width * 4) == Ack(9, 0)
        assert len(svc.inbound) == 0 and svc.counts["late_gradients"] == 1
    run(main)


def test_a_non_finite_loss_does_not_poison_the_published_average():
    async def main():
        svc = service()
        work = Work("forward", (SESSION, 0), torch.zeros(1), torch.zeros(1, 4, dtype=torch.int64))
        svc._record_loss(Job(work, None), Output(loss_nats=4.0 * math.log(2) * 4, tokens=4))
        svc._record_loss(Job(work, None), Output(loss_nats=float("nan"), tokens=4))
        assert svc.train_loss_bpb == pytest.approx(4.0) and svc.counts["non_finite_losses"] == 1
    run(main)
