"""The activation codec: a computed micro-batch as frames, and frames back as tensors.

The one place tensors become bytes and bytes become tensors, for training, evaluation and
inference alike. A run chooses how activations and their gradients cross a boundary (run file
``[wire]``): dense in its dtype, or quantized per token (``swarm.quant``); a frame's ``dtype``
names its encoding, and a peer takes only the encoding its run names. A subspace run
(``model.subspace``) sends the K coordinates of each hidden state instead (the engine's module
computes them: ``Layout.width`` is K), and its forwards carry their token ids: the targets'
window one token longer (``_window``), from which the receiver takes ids and targets:

- ``tensor_to_frame`` / ``frame_to_tensor``: a tensor as a ``wire.TensorFrame`` and its payload
  (row-major, little-endian, on any host) and back; ``to_wire`` / ``from_wire`` the same as
  (dtype, shape, bytes);
- ``targets_to_bytes`` / ``targets_from_bytes``: the target tokens a forward carries to the last
  stage (``activation.target_bytes_per_token`` bytes a token);
- ``check_header`` and ``decode_work``: a peer's ``Forward`` or ``Backward`` as the engine's
  ``Work`` (right dtype, a [rows, seq, width] shape within our bounds, targets in the vocabulary),
  or a ``RemoteProtocolError``;
- ``encode_outputs``: what the engine computed for a job as the frames that carry it on.

The engine computes only; it never sees a frame. This module imports torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from p2pswarm import wire
from p2pswarm.errors import LocalProtocolError, RemoteProtocolError
from p2pswarm.model.catalog import BYTE_VOCAB
from p2pswarm.run import plan
from p2pswarm.run.spec import DEFAULT_DTYPE, DENSE, MAX_ROWS  # MAX_ROWS: rows a peer may send us in one micro-batch
from p2pswarm.swarm import engine as eng
from p2pswarm.swarm import quant
from p2pswarm.swarm.activation import (
    UNNAMED_RUN,
    Backward,
    Forward,
    target_bytes_per_token,
)
from p2pswarm.swarm.buffers import Priority
from p2pswarm.swarm.stage_core import Job, Send

_TARGET_DTYPES = {1: "u1", 2: "<u2", 4: "<i4"}  # target bytes per token -> its little-endian numpy dtype


@dataclass(frozen=True)
class Layout:
    """What one stage's frames look like: ours to send, and all we accept."""

    stage: int
    width: int  # hidden size: a frame's last dim
    context: int  # a frame's longest sequence
    vocab: int  # target ids lie below it
    dtype: str = DEFAULT_DTYPE  # the run's activation dtype: what a frame decodes to
    run: bytes = UNNAMED_RUN  # every frame we send carries it
    me: str = ""  # our peer id: an evaluation's chain
    activations: str = DENSE  # how activations travel: DENSE (in ``dtype``) or a wire.QUANTIZED_BITS key
    gradients: str = DENSE  # how their gradients travel
    carries_ids: bool = False  # a subspace model: a forward's targets window starts one token earlier (its ids)

    @classmethod
    def of(cls, spec, stage: int, config, run: bytes, me: str) -> Layout:
        """The layout of ``stage`` of ``spec`` as a ``TrainConfig`` has it travel: a subspace model's
        frames are its coordinates (``model.subspace``), ``config.subspace`` wide."""
        return cls(stage, config.subspace or spec.width, spec.context, spec.vocab, config.activation_dtype, run, me,
                   config.activation_codec, config.gradient_codec, bool(config.subspace))

    def encoding(self, message: type) -> str:
        """The frame dtype a Forward (or Backward) of this run carries."""
        codec = self.activations if message is Forward else self.gradients
        return self.dtype if codec == DENSE else codec


# --- tensors as frames ----------------------------------------------------------------------------


def _swap_to_little_endian(raw: Any, itemsize: int) -> Any:
    """Byte-swap a flat uint8 tensor of ``itemsize`` elements on big-endian hosts (an involution)."""
    if sys.byteorder == "little" or itemsize == 1:
        return raw
    return raw.reshape(-1, itemsize).flip(-1).reshape(-1)


def tensor_to_frame(name: str, tensor: torch.Tensor) -> tuple[wire.TensorFrame, bytes]:
    """A TensorFrame and payload for ``tensor`` (copied to CPU, contiguous, little-endian)."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in wire.DTYPE_SIZES:
        raise LocalProtocolError(f"tensor dtype {tensor.dtype} cannot be sent")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    buffer = bytearray(flat.numel())
    if buffer:  # frombuffer rejects an empty buffer; bytes(storage) would be very slow
        torch.frombuffer(buffer, dtype=torch.uint8).copy_(_swap_to_little_endian(flat, wire.DTYPE_SIZES[dtype]))
    return wire.TensorFrame(name, dtype, tuple(tensor.shape)), bytes(buffer)


def frame_to_tensor(frame: wire.TensorFrame, payload: bytes) -> torch.Tensor:
    """The torch tensor a TensorFrame carries; it owns its memory (a copy of ``payload``)."""
    wire.check_tensor(frame.dtype, frame.shape, len(payload))
    dtype = getattr(torch, frame.dtype)
    if not payload:
        return torch.empty(frame.shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    raw = _swap_to_little_endian(raw, wire.DTYPE_SIZES[frame.dtype])
    return raw.view(dtype).reshape(frame.shape)


def to_wire(tensor: torch.Tensor, encoding: str = DENSE) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype, shape, bytes) of a tensor, as the activation protocol carries it: dense, or quantized."""
    if encoding != DENSE:
        return encoding, tuple(tensor.shape), quant.encode(tensor, encoding)
    frame, payload = tensor_to_frame("", tensor)
    return frame.dtype, frame.shape, payload


def from_wire(dtype: str, shape: tuple[int, ...], payload: bytes, as_dtype: str | None = None) -> torch.Tensor:
    """The tensor a frame carries (RemoteProtocolError if it does not match its header); a quantized
    one in ``as_dtype`` (the run's dtype), a dense one as it came."""
    if dtype in wire.QUANTIZED_BITS:
        return quant.decode(dtype, shape, payload).to(getattr(torch, as_dtype or "float32"))
    return frame_to_tensor(wire.TensorFrame("", dtype, shape), payload)


def targets_from_bytes(data: bytes, batch: int, seq: int, vocab: int = BYTE_VOCAB) -> torch.Tensor:
    """Target tokens that travelled with a forward (``target_bytes_per_token(vocab)`` bytes each,
    little-endian), as int64 [batch, seq]; RemoteProtocolError if the count or an id is wrong."""
    import numpy as np

    width = target_bytes_per_token(vocab)
    if len(data) != batch * seq * width:
        raise RemoteProtocolError(f"{len(data)} target bytes for a [{batch}, {seq}] micro-batch "
                                  f"of {width}-byte tokens")
    ids = np.frombuffer(data, dtype=_TARGET_DTYPES[width]).astype(np.int64).reshape(batch, seq)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise RemoteProtocolError(f"a target token outside the vocabulary of {vocab}")
    return torch.from_numpy(ids)


def targets_to_bytes(targets: torch.Tensor, vocab: int = BYTE_VOCAB) -> bytes:
    """Targets as the forward frame carries them: ``target_bytes_per_token(vocab)`` bytes a token."""
    dtype = _TARGET_DTYPES[target_bytes_per_token(vocab)]
    return targets.detach().cpu().contiguous().numpy().astype(dtype).tobytes()


def max_payload(spec, dtype: str) -> int:
    """The largest micro-batch a peer may send us: MAX_ROWS x context in the run's activation dtype
    with its targets, within one frame (``run.plan``)."""
    return plan.max_message_bytes(spec, MAX_ROWS, spec.context, dtype)


# --- frames of the activation protocol --------------------------------------------------------------


def check_header(message: Forward | Backward, layout: Layout) -> None:
    """RemoteProtocolError unless the frame's tensor is a [rows, seq, width] micro-batch in our encoding."""
    shape, encoding = message.shape, layout.encoding(type(message))
    if message.dtype != encoding or len(shape) != 3 or shape[2] != layout.width \
            or not 0 < shape[0] <= MAX_ROWS or not 0 < shape[1] <= layout.context:
        raise RemoteProtocolError(f"{message.dtype} {shape} is not a [rows, seq, {layout.width}] "
                                  f"{encoding} micro-batch")


def decode_work(kind: str, message: Forward | Backward, payload: bytes, layout: Layout) -> eng.Work:
    """The engine's work for a checked frame of ``kind`` (``admission.classify``)."""
    key, shape = (message.session, message.micro_batch), message.shape
    tensor_bytes, target_bytes = message.split(payload)
    if kind == "backward":
        return eng.Work("backward", key, from_wire(message.dtype, shape, tensor_bytes, layout.dtype), None)
    assert isinstance(message, Forward)  # classify: a Backward is "backward", a Forward "forward" or "eval"
    ids = None
    if layout.carries_ids:  # the window of ids and targets: ids = window[:, :-1], targets = window[:, 1:]
        window = targets_from_bytes(target_bytes, shape[0], shape[1] + 1, layout.vocab)
        ids, targets = window[:, :-1], window[:, 1:]
    else:
        targets = targets_from_bytes(target_bytes, shape[0], shape[1], layout.vocab) if target_bytes else None
    tensor = from_wire(message.dtype, shape, tensor_bytes, layout.dtype)
    if kind == "forward":
        return eng.Work("forward", key, tensor, targets, message.step, ids=ids)
    return eng.Work("eval", key, tensor, targets, message.step, message.rounds, ids=ids)


def _window(work: eng.Work, layout: Layout) -> torch.Tensor:
    """The tokens a forward carries on: its targets, or for a subspace model its ids and the last target."""
    assert work.targets is not None  # admission: a forward always has them past stage 0, feeding at stage 0
    if not layout.carries_ids:
        return work.targets
    ids = work.tensor if layout.stage == 0 else work.ids
    assert ids is not None  # decode_work gives a subspace model's forward its ids
    return torch.cat((ids.cpu(), work.targets[:, -1:].cpu()), dim=1)


def encode_outputs(job: Job, out: eng.Output, layout: Layout, step: int,
                   to_host: Callable[[torch.Tensor], torch.Tensor]) -> list[Send]:
    """The frames of a computed job (compute thread: the tensor bytes are made off the loop):
    activations for the next stage, and the gradient of our input for the one before (its
    destination is the core's to set). ``step`` is the engine's; ``to_host`` stages a tensor to
    the host in the activation dtype (``StageEngine.host_out``)."""
    work, sends = job.work, []
    message: Forward | Backward
    if out.forward is not None:
        priority = Priority.TRAINING_FORWARD if work.kind == "forward" else Priority.INFERENCE
        dtype, shape, data = to_wire(to_host(out.forward), layout.activations)
        targets = targets_to_bytes(_window(work, layout), layout.vocab)
        header = {"session": work.key[0], "micro_batch": work.key[1], "stage": layout.stage + 1,
                  "priority": int(priority), "dtype": dtype, "shape": shape, "targets": len(targets), "run": layout.run}
        if work.kind == "eval":  # the chain and the outer rounds it was evaluated on so far
            message = Forward(**header, step=work.step, rounds=(*work.rounds, out.round),
                              path=(*job.path, layout.me))
        else:
            message = Forward(**header, step=step)
        sends.append(Send(message, data + targets, work.key))
    if out.backward is not None:
        dtype, shape, data = to_wire(to_host(out.backward), layout.gradients)
        message = Backward(session=work.key[0], micro_batch=work.key[1], stage=layout.stage - 1,
                           priority=int(Priority.TRAINING_BACKWARD), step=step, dtype=dtype, shape=shape,
                           targets=0, run=layout.run)
        sends.append(Send(message, data, work.key))
    return sends
