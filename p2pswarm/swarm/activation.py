"""The messages of the activation protocol, ``/p2pswarm/activation/1.0.0``: what stages send each other.

Micro-batches cross stage boundaries as tensors: activations forward, gradients backward. Each
travels as one frame whose header says where it belongs (session, micro-batch, stage, priority,
step) and what the payload is (dtype and shape); the payload is the tensor's raw bytes, as in
``wire.TensorFrame``, followed on a forward by the micro-batch's target tokens (``targets`` bytes
of them, ``target_bytes_per_token(vocab)`` bytes a token), which ride along to the last stage for
its loss. The receiver answers every tensor frame with an ``Ack`` (it took the micro-batch, and
here is its queue depth, which the router reads for free) or a ``Busy`` (its queue is full:
explicit backpressure, so a sender never mistakes a full peer for a dead one).

This module only defines and validates the messages; it imports neither trio nor torch. Every
field is bounded, and a header that does not match its payload is a ``RemoteProtocolError``.
``docs/protocols.md`` ("Activations") is the normative description.
"""

from __future__ import annotations

import dataclasses

from p2pswarm import wire
from p2pswarm.dht.records import MAX_STAGES, RUN_BYTES
from p2pswarm.dht.records import UNNAMED_RUN_BYTES as UNNAMED_RUN  # frames made without a run (tests, tools)
from p2pswarm.errors import RemoteProtocolError
from p2pswarm.run.plan import MAX_TARGETS, target_bytes_per_token  # noqa: F401 - part of the frame format
from p2pswarm.swarm.buffers import Priority  # the inbound buffer's classes: one enum for both

PROTOCOL_ID = "/p2pswarm/activation/1.0.0"  # the libp2p protocol these frames travel on
SESSION_BYTES = 16  # a session id is 128 random bits: no two sessions collide by chance
MAX_MICRO_BATCH = wire.INT_MAX  # micro-batch ids count up for a whole run: any u63 is fine
MAX_STEP = wire.INT_MAX  # training steps count up for a whole run: any u63 is fine
NO_ROUND = -1  # in an evaluation's ``rounds``: this stage has no outer rounds and used its live weights
MAX_QUEUE_DEPTH = 1 << 20  # far beyond any real buffer; bounds what a peer can claim
MAX_RETRY_AFTER_MS = 10_000  # a hint beyond 10 s means "dead" to a router: fail over instead


_PRIORITIES = frozenset(int(p) for p in Priority)


def _check_int(kind: str, name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise RemoteProtocolError(f"{kind}: {name} {value} is not within [{low}, {high}]")


def _check_session(kind: str, session: bytes) -> None:
    if len(session) != SESSION_BYTES:
        raise RemoteProtocolError(f"{kind}: session id of {len(session)} bytes, not {SESSION_BYTES}")


@dataclasses.dataclass(frozen=True)
class _TensorMessage(wire.Message):
    """Fields and checks shared by Forward and Backward; the payload is the tensor's bytes."""

    session: bytes  # SESSION_BYTES random bytes naming one training (or inference) session
    micro_batch: int  # 0 <= id <= MAX_MICRO_BATCH, unique within the session
    stage: int  # the stage that is to process this tensor, 0 <= stage < MAX_STAGES
    priority: int  # a Priority value: which inbound buffer class it joins
    step: int  # the sender's training step, 0 <= step <= MAX_STEP
    dtype: str  # a wire.DTYPE_SIZES key
    shape: tuple[int, ...]  # at most wire.MAX_TENSOR_DIMS non-negative dims
    targets: int  # target *bytes* after the tensor in the payload (rows x seq x target_bytes_per_token); 0 if none
    run: bytes = UNNAMED_RUN  # the sender's run identity: a peer of another run refuses the tensor

    def check(self, payload_len: int) -> None:
        kind = self.TYPE
        _check_session(kind, self.session)
        if len(self.run) != RUN_BYTES:
            raise RemoteProtocolError(f"{kind}: run identity of {len(self.run)} bytes, not {RUN_BYTES}")
        _check_int(kind, "micro-batch", self.micro_batch, 0, MAX_MICRO_BATCH)
        _check_int(kind, "stage", self.stage, 0, MAX_STAGES - 1)
        if self.priority not in _PRIORITIES:
            raise RemoteProtocolError(f"{kind}: priority {self.priority} is not one of {sorted(_PRIORITIES)}")
        _check_int(kind, "step", self.step, 0, MAX_STEP)
        _check_int(kind, "targets", self.targets, 0, min(MAX_TARGETS, payload_len))
        wire.check_tensor(self.dtype, self.shape, payload_len - self.targets)

    def split(self, payload: bytes) -> tuple[bytes, bytes]:
        """The payload as (tensor bytes, target bytes)."""
        cut = len(payload) - self.targets
        return payload[:cut], payload[cut:]


MAX_PEER_ID_CHARS = 128  # a libp2p peer id in base58 is ~52 characters; room for any multihash


@wire.message("activation.forward")
class Forward(_TensorMessage):
    """Activations of a micro-batch, for ``stage`` to run forward.

    An evaluation forward (``priority`` INFERENCE) also says which weights made it: ``rounds``, the
    DiLoCo outer round whose agreed weights each stage before ``stage`` used (one per stage, in
    order; ``NO_ROUND`` for a stage without outer rounds, which used its live weights), and
    ``path``, the peer ids of those stages: the chain the held-out figure belongs to. Both are
    empty on a training forward."""

    rounds: tuple[int, ...] = ()
    path: tuple[str, ...] = ()

    def check(self, payload_len: int) -> None:
        super().check(payload_len)
        if len(self.rounds) != len(self.path) or len(self.rounds) > self.stage:
            raise RemoteProtocolError(f"{self.TYPE}: {len(self.rounds)} rounds and {len(self.path)} peers for "
                                      f"stage {self.stage} (at most one of each per stage before it)")
        for round_ in self.rounds:
            _check_int(self.TYPE, "round", round_, NO_ROUND, MAX_STEP)
        for peer in self.path:
            if not 0 < len(peer) <= MAX_PEER_ID_CHARS:
                raise RemoteProtocolError(f"{self.TYPE}: a peer id of {len(peer)} characters in the path")


@wire.message("activation.backward")
class Backward(_TensorMessage):
    """Gradients with respect to ``stage``'s output, for ``stage`` to run backward (no targets)."""

    def check(self, payload_len: int) -> None:
        super().check(payload_len)
        if self.targets:
            raise RemoteProtocolError(f"{self.TYPE} carries no targets, got {self.targets}")


class _NoPayload(wire.Message):
    def check(self, payload_len: int) -> None:
        if payload_len:
            raise RemoteProtocolError(f"{self.TYPE} carries no payload, got {payload_len} bytes")


@wire.message("activation.ack")
class Ack(_NoPayload):
    """The receiver queued ``micro_batch``; ``queue_depth`` is its inbound queue after that.
    ``duplicate``: it already held or had done this micro-batch, and dropped this copy."""

    micro_batch: int
    queue_depth: int
    duplicate: bool = False

    def check(self, payload_len: int) -> None:
        super().check(payload_len)
        _check_int(self.TYPE, "micro-batch", self.micro_batch, 0, MAX_MICRO_BATCH)
        _check_int(self.TYPE, "queue depth", self.queue_depth, 0, MAX_QUEUE_DEPTH)


@wire.message("activation.busy")
class Busy(_NoPayload):
    """The receiver's queue is full: it dropped ``micro_batch``; try elsewhere, or here later."""

    micro_batch: int
    queue_depth: int
    retry_after_ms: int  # when the receiver expects room again; 0 = no estimate

    def check(self, payload_len: int) -> None:
        super().check(payload_len)
        _check_int(self.TYPE, "micro-batch", self.micro_batch, 0, MAX_MICRO_BATCH)
        _check_int(self.TYPE, "queue depth", self.queue_depth, 0, MAX_QUEUE_DEPTH)
        _check_int(self.TYPE, "retry-after", self.retry_after_ms, 0, MAX_RETRY_AFTER_MS)
