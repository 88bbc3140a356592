"""The compute of one stage: forward, backward, loss and optimizer steps on the stage's weights.

``StageEngine.compute`` takes one unit of work and returns what must be sent on; it runs in the
node's single compute worker thread (``trio.to_thread``), never on the trio loop, and only that
thread touches the engine's tensors. What one call does:

- a training forward runs the stage and keeps the graph for the backward; the last stage instead
  computes the loss and its backward at once (its own gradients accumulate) and returns the
  gradient of its input for the stage before;
- a backward runs the kept graph back with the gradient that came from the next stage and
  returns the gradient of this stage's input (stage 0 has none to return);
- an evaluation forward runs without a graph; the last stage returns its summed loss.

**Weight stashing.** Micro-batches are pipelined: a stage may take optimizer steps between a
micro-batch's forward and its backward. Each forward therefore runs on a frozen copy of the
weights of the current version (``torch.func.functional_call``), one copy per optimizer step
still referenced by a waiting micro-batch, and its backward runs on that same copy (PipeDream's
weight stashing): the gradient is the true gradient at the weights that made the activations,
and no in-place optimizer update can invalidate a kept graph. The gradients are then added to
the live parameters, which AdamW steps every ``accumulate`` micro-batches.

The optimizer state, the weights and the step counter are in ``state_dict`` (DiLoCo and snapshots
build on it). Initial weights are ``build_stage(spec, stage, seed)``: identical on every replica.
This module imports torch (with ``model/``, the only place that does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.func import functional_call

from p2pswarm import wire
from p2pswarm.errors import RemoteProtocolError
from p2pswarm.model.catalog import ModelSpec
from p2pswarm.model.transformer import build_stage

LEARNING_RATE = 3e-3  # AdamW's lr: the tiny-lm sweep's best for a 3-minute run (docs/benchmarks.md)
WEIGHT_DECAY = 0.01
BETAS = (0.9, 0.95)  # GPT-style second moment: steadier with small batches
GRAD_CLIP = 1.0  # global norm of a stage's gradient before a step
ACCUMULATE = 1  # micro-batches per optimizer step
ACTIVATION_DTYPE = "float32"  # what hidden states and their gradients travel as


@dataclass(frozen=True)
class TrainConfig:
    """How a stage trains; the defaults are the named constants above. A run file
    (``p2pswarm.model.run``) fills every field, so that all peers of a swarm agree on them."""

    lr: float = LEARNING_RATE  # peak AdamW learning rate
    weight_decay: float = WEIGHT_DECAY  # on matrices only (embeddings, norms and biases get none)
    accumulate: int = ACCUMULATE
    grad_clip: float = GRAD_CLIP
    seed: int = 0  # initial weights are a pure function of (model, seed)
    betas: tuple[float, float] = BETAS
    warmup_steps: int = 0  # linear warm-up from 0 to lr over this many optimizer steps
    decay_steps: int = 0  # cosine decay from lr to min_lr_ratio x lr after warm-up; 0: constant lr
    min_lr_ratio: float = 0.1  # the floor of the cosine decay, as a fraction of lr
    rows: int = 8  # sequences per training micro-batch
    seq: int | None = None  # tokens per sequence; None: the model's context
    activation_dtype: str = ACTIVATION_DTYPE  # what hidden states and their gradients travel as


@dataclass(frozen=True)
class Work:
    """One unit of compute for the worker."""

    kind: str  # "forward", "eval" or "backward"
    key: tuple[bytes, int]  # (session, micro-batch id)
    tensor: torch.Tensor  # token ids on stage 0, else hidden states (forward) or output gradients (backward)
    targets: torch.Tensor | None  # int64 [batch, seq] on the way to the last stage; None on a backward
    step: int = 0  # the sender's step; on an evaluation, the round


@dataclass(frozen=True)
class Output:
    """What a unit of compute produced."""

    forward: torch.Tensor | None = None  # activations for the next stage
    backward: torch.Tensor | None = None  # the gradient of our input, for the stage before
    loss_nats: float | None = None  # the last stage's summed loss over ``tokens`` bytes
    tokens: int = 0


class StageEngine:
    """A stage's module, optimizer and kept graphs (module docstring)."""

    def __init__(self, spec: ModelSpec, stage: int, config: TrainConfig = TrainConfig()) -> None:
        self.spec, self.stage, self.config = spec, stage, config
        self.module = build_stage(spec, stage, config.seed)
        self.is_first, self.is_last = self.module.is_first, self.module.is_last
        self.params = dict(self.module.named_parameters())
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=config.lr, betas=BETAS,
                                           weight_decay=config.weight_decay)
        self.step = 0  # optimizer steps taken
        self.micro_batches = 0  # micro-batches whose gradients reached our parameters
        self.tokens = 0  # tokens in those micro-batches
        self._pending_grads = 0
        self._version: dict[str, torch.Tensor] | None = None
        self._kept: dict[tuple[bytes, int], tuple[torch.Tensor, torch.Tensor, dict]] = {}

    # --- the worker's entry point ----------------------------------------------------------

    def compute(self, work: Work) -> Output:
        if work.kind == "eval":
            return self._evaluate(work)
        if work.kind == "forward":
            return self._forward(work)
        if work.kind == "backward":
            return self._backward(work)
        raise ValueError(f"unknown work kind {work.kind!r}")

    def forget(self, key: tuple[bytes, int]) -> None:
        """Drop a kept graph whose gradient will not come (safe from any thread: one dict pop)."""
        self._kept.pop(key, None)

    @property
    def kept(self) -> int:
        return len(self._kept)

    # --- forward, backward, evaluation --------------------------------------------------------

    def _forward(self, work: Work) -> Output:
        weights = self._current_version()
        x = work.tensor if self.is_first else work.tensor.detach().requires_grad_(True)
        y = functional_call(self.module, weights, (x,))
        if not self.is_last:
            self._kept[work.key] = (x, y, weights)
            return Output(forward=y.detach())
        loss = self.module.loss(y, work.targets)
        loss.backward()
        self._absorb(weights, work.targets.numel())
        return Output(backward=None if self.is_first else x.grad,
                      loss_nats=loss.item() * work.targets.numel(), tokens=work.targets.numel())

    def _backward(self, work: Work) -> Output:
        kept = self._kept.pop(work.key, None)
        if kept is None:
            return Output()  # given up already (the deadline passed): nothing to do
        x, y, weights = kept
        if work.tensor.shape != y.shape:
            raise RemoteProtocolError(f"gradient of shape {tuple(work.tensor.shape)} for an output of "
                                      f"{tuple(y.shape)}")
        y.backward(work.tensor)
        self._absorb(weights, y.shape[0] * y.shape[1])
        return Output(backward=None if self.is_first else x.grad)

    def _evaluate(self, work: Work) -> Output:
        with torch.no_grad():
            y = self.module(work.tensor)
            if not self.is_last:
                return Output(forward=y)
            loss = torch.nn.functional.cross_entropy(y.reshape(-1, self.spec.vocab), work.targets.reshape(-1),
                                                     reduction="sum")
        return Output(loss_nats=float(loss), tokens=work.targets.numel())

    # --- weights and optimizer -----------------------------------------------------------------

    def _current_version(self) -> dict[str, torch.Tensor]:
        """The weights forwards run on until the next step: a frozen copy that graphs may keep."""
        if self._version is None:
            self._version = {n: p.detach().clone().requires_grad_(True) for n, p in self.params.items()}
        return self._version

    def _absorb(self, weights: dict[str, torch.Tensor], tokens: int) -> None:
        """Add a micro-batch's gradients (on its weight version) to the live parameters; maybe step."""
        for name, stashed in weights.items():
            if stashed.grad is None:
                continue
            param = self.params[name]
            param.grad = stashed.grad.clone() if param.grad is None else param.grad.add_(stashed.grad)
            stashed.grad = None
        self.micro_batches += 1
        self.tokens += tokens
        self._pending_grads += 1
        if self._pending_grads >= self.config.accumulate:
            self._step()

    def _step(self) -> None:
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        if self._pending_grads > 1:
            for g in grads:
                g.div_(self._pending_grads)
        norm = torch.nn.utils.clip_grad_norm_(self.params.values(), self.config.grad_clip)
        if math.isfinite(float(norm)):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._pending_grads = 0
        self._version = None
        self.step += 1

    def weights_changed(self) -> None:
        """The live weights were changed from outside (an outer step, a loaded snapshot): the next
        forward takes a fresh copy of them."""
        self._version = None

    def state_dict(self) -> dict:
        """Weights, optimizer state and counters: what a snapshot or an outer step needs."""
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "step": self.step, "micro_batches": self.micro_batches, "tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.micro_batches, self.tokens = state["step"], state["micro_batches"], state["tokens"]
        self._version = None


# --- tensors on the wire ------------------------------------------------------------------------


def to_wire(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype, shape, bytes) of a tensor, as the activation protocol carries it."""
    frame, payload = wire.tensor_to_frame("", tensor)
    return frame.dtype, frame.shape, payload


def from_wire(dtype: str, shape: tuple[int, ...], payload: bytes) -> torch.Tensor:
    """The tensor a frame carries (RemoteProtocolError if it does not match its header)."""
    return wire.frame_to_tensor(wire.TensorFrame("", dtype, shape), payload)


def ids_tensor(rows) -> torch.Tensor:
    """Byte rows of equal length as an int64 [batch, seq] tensor."""
    flat = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8)
    return flat.reshape(len(rows), -1).to(torch.int64)


def targets_from_bytes(data: bytes, batch: int, seq: int) -> torch.Tensor:
    """Target bytes that travelled with a forward, as int64 [batch, seq]."""
    if len(data) != batch * seq:
        raise RemoteProtocolError(f"{len(data)} target bytes for a [{batch}, {seq}] micro-batch")
    return ids_tensor([data]).reshape(batch, seq)


def targets_to_bytes(targets: torch.Tensor) -> bytes:
    return targets.to(torch.uint8).contiguous().numpy().tobytes()


def set_threads(threads: int | None) -> None:
    """torch's intra-op threads for this process (None: torch's default)."""
    if threads:
        torch.set_num_threads(threads)
