"""The compute of one stage: forward, backward, loss and optimizer steps on the stage's weights.

``StageEngine.compute`` takes one unit of work and returns what must be sent on; it runs in the
node's single compute thread (``swarm/compute_thread.py``), never on the trio loop, and only that
thread touches the engine's tensors. What one call does:

- a training forward runs the stage and keeps the graph for the backward; the last stage instead
  computes the loss and its backward at once (its own gradients accumulate) and returns the
  gradient of its input for the stage before;
- a backward runs the kept graph back with the gradient that came from the next stage and
  returns the gradient of this stage's input (stage 0 has none to return);
- an evaluation forward runs without a graph, on the agreed weights of the DiLoCo outer round it
  asks for (``agree``: the last two rounds kept as flat host vectors; the live weights when no
  round was ever agreed); the last stage returns its summed loss.

**Weight stashing.** Micro-batches are pipelined: a stage may take optimizer steps between a
micro-batch's forward and its backward. Each forward therefore runs on a frozen copy of the
weights of the current version (``torch.func.functional_call``), one copy per optimizer step
still referenced by a waiting micro-batch, and its backward runs on that same copy (PipeDream's
weight stashing): the gradient is the true gradient at the weights that made the activations,
and no in-place optimizer update can invalidate a kept graph. The gradients are then added to
the live parameters, which AdamW steps every ``accumulate`` micro-batches. The copies, and the
weight prediction that moves them to where AdamW will be when their gradients land, are
``swarm/versions.py``'s.

**Devices and precision.** The engine lives on ``placement.device`` (``swarm/device.py``): the
weights and AdamW's states are fp32 there (the master copy); with ``bf16`` each forward runs under
``torch.autocast`` (the matrix products in bf16) and its backward follows the recorded dtypes.
Hidden states and their gradients cross the wire in ``TrainConfig.activation_dtype`` and come in
as fp32; ``host_out`` and ``_input`` move them through ``swarm/staging.py``'s host buffers. On
the CPU in fp32 nothing is cast or staged: the numerics are exactly those of a plain module. The
engine is made and called on one thread for its whole life (``swarm/compute_thread.py``): a CUDA
device's current device, stream and autocast state are per thread.

The optimizer state, the weights and the step counter are in ``state_dict`` (DiLoCo and snapshots
build on it; ``host_state_dict`` is a copy of it on the host, safe to encode on another thread).
Initial weights are ``build_stage(spec, stage, seed)``: identical on every replica.
The engine computes only: frames and their checks are ``swarm/codec.py``'s. This module imports
torch (with ``model/``, the codec and DiLoCo, the only places that do).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch.func import functional_call

from p2pswarm.errors import ConfigError
from p2pswarm.model.catalog import ModelSpec
from p2pswarm.model.transformer import build_stage
from p2pswarm.run.placement import Placement
from p2pswarm.run.training import TrainConfig
from p2pswarm.swarm.activation import NO_ROUND
from p2pswarm.swarm.schedule import lr_at
from p2pswarm.swarm.staging import Staging
from p2pswarm.swarm.versions import WeightVersions

AGREED_KEPT = 2  # outer rounds whose agreed weights are kept for evaluation, at least: ours and the one before
AGREED_MAX, AGREED_BYTES = 16, 256 * 2**20  # ...and up to this many, as fit in these host bytes (a small stage)


@dataclass(frozen=True)
class Work:
    """One unit of compute for the worker."""

    kind: str  # "forward", "eval" or "backward"
    key: tuple[bytes, int]  # (session, micro-batch id)
    tensor: torch.Tensor  # token ids on stage 0, else hidden states (forward) or output gradients (backward)
    targets: torch.Tensor | None  # int64 [batch, seq] on the way to the last stage; None on a backward
    step: int = 0  # the sender's step; on an evaluation, the round
    # on an evaluation: the outer round each stage before us evaluated (activation.Forward)
    rounds: tuple[int, ...] = ()
    ids: torch.Tensor | None = None  # a subspace model's input token ids [batch, seq] past stage 0 (model.subspace)


@dataclass(frozen=True)
class Output:
    """What a unit of compute produced."""

    forward: torch.Tensor | None = None  # activations for the next stage
    backward: torch.Tensor | None = None  # the gradient of our input, for the stage before
    loss_nats: float | None = None  # the last stage's summed loss over ``tokens`` bytes
    tokens: int = 0
    round: int = NO_ROUND  # on an evaluation: the outer round whose agreed weights we used (NO_ROUND: live ones)


class StageEngine:
    """A stage's module, optimizer and kept graphs (module docstring)."""

    def __init__(self, spec: ModelSpec, stage: int, config: TrainConfig = TrainConfig(),
                 placement: Placement = Placement()) -> None:
        self.spec, self.stage, self.config, self.placement = spec, stage, config, placement
        self.device = torch.device(placement.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # this (the compute) thread's current device, for good
        self.wire_dtype = wire_dtype(config.activation_dtype)
        self._staging = Staging(self.device)
        # built on the CPU: the same weights on any device
        self.module = build_stage(spec, stage, config.seed, config.subspace).to(self.device)
        self.is_first, self.is_last = self.module.is_first, self.module.is_last
        self.params: dict[str, torch.Tensor] = dict(self.module.named_parameters())
        self.optimizer = torch.optim.AdamW(param_groups(self.module, config.weight_decay), lr=config.lr,
                                           betas=config.betas, eps=config.eps)
        self.step = 0  # optimizer steps taken
        self.micro_batches = 0  # micro-batches whose gradients reached our parameters
        self.tokens = 0  # tokens in those micro-batches
        self._pending_grads = 0
        self.versions = WeightVersions(self.params, self.optimizer, config)  # what forwards run on
        self._agreed: dict[int, torch.Tensor] = {}  # outer round -> its agreed weights, flat on the host
        self._agreed_on_device: tuple[int, dict[str, torch.Tensor]] | None = None  # the last one used, as params
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
        weights = self.versions.current(len(self._kept))
        x = self._input(work.tensor)
        x = x if self.is_first else x.requires_grad_(True)
        with self._autocast():
            y = functional_call(self.module, weights, (x,), {"ids": _ids_on(work, self.device)})
            if not self.is_last:
                self._kept[work.key] = (x, y, weights)
                return Output(forward=y.detach())
            assert work.targets is not None, "admission lets a forward reach the last stage only with targets"
            loss = self.module.loss(y, work.targets.to(self.device))
        loss.backward()
        self._absorb(weights, work.targets.numel())
        return Output(backward=None if self.is_first else x.grad,
                      loss_nats=loss.item() * work.targets.numel(), tokens=work.targets.numel())

    def _backward(self, work: Work) -> Output:
        kept = self._kept.pop(work.key, None)
        if kept is None:
            return Output()  # given up already (the deadline passed): nothing to do
        x, y, weights = kept
        if work.tensor.shape != y.shape:  # the codec checked the frame; this is a peer's lie about the graph
            raise ValueError(f"gradient of shape {tuple(work.tensor.shape)} for an output of "
                                      f"{tuple(y.shape)}")
        y.backward(self._staging.to_device(work.tensor, y.dtype))
        self._absorb(weights, y.shape[0] * y.shape[1])
        return Output(backward=None if self.is_first else x.grad)

    def _evaluate(self, work: Work) -> Output:
        """The held-out forward, on the agreed weights of the outer round stage 0 evaluates (``work.rounds[0]``;
        at stage 0 itself ``work.step``), else of our latest round; with no outer round ever agreed, on the
        live weights."""
        round_, weights = self._eval_weights(work.rounds[0] if work.rounds else work.step)
        with torch.no_grad(), self._autocast():
            x = self._input(work.tensor)
            ids = {"ids": _ids_on(work, self.device)}
            y = self.module(x, **ids) if weights is None else functional_call(self.module, weights, (x,), ids)
            if not self.is_last:
                return Output(forward=y, round=round_)
            assert work.targets is not None, "admission lets an evaluation reach the last stage only with targets"
            loss = torch.nn.functional.cross_entropy(y.reshape(-1, self.spec.vocab).float(),
                                                     work.targets.to(self.device).reshape(-1), reduction="sum")
        return Output(loss_nats=float(loss), tokens=work.targets.numel(), round=round_)

    # --- agreed weights (DiLoCo's, for evaluation) ------------------------------------------------

    def agree(self, round_: int, flat: torch.Tensor) -> None:
        """Outer round ``round_`` agreed these weights (a flat fp32 host vector in ``params`` order, ours
        to keep): held-out rounds evaluate them, so that every replica of the stage gives the same
        figure. The last ``AGREED_KEPT`` rounds are kept, and up to ``AGREED_MAX`` as fit in ``AGREED_BYTES``:
        a stage ahead of stage 0 can still evaluate the round stage 0 asks for. (A last stage whose replica
        was killed serves both stage-0 replicas alone, steps twice as fast and ran 4 rounds ahead: with 2
        kept, the demo's held-out rounds were evaluated on other rounds' weights and left out.)"""
        self._agreed[round_] = flat
        kept = max(AGREED_KEPT, min(AGREED_MAX, AGREED_BYTES // max(1, flat.numel() * flat.element_size())))
        for old in sorted(self._agreed)[:-kept]:
            del self._agreed[old]

    @property
    def agreed_round(self) -> int:
        """The latest outer round whose weights we hold (NO_ROUND: none)."""
        return max(self._agreed, default=NO_ROUND)

    def _eval_weights(self, wanted: int) -> tuple[int, dict[str, torch.Tensor] | None]:
        if not self._agreed or wanted == NO_ROUND:
            return NO_ROUND, None
        round_ = wanted if wanted in self._agreed else self.agreed_round
        if self._agreed_on_device is None or self._agreed_on_device[0] != round_:
            self._agreed_on_device = (round_, self.params_from_flat(self._agreed[round_]))
        return self._agreed_on_device

    def params_from_flat(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """A flat vector in ``params`` order (agreed weights) as parameters on our device and dtype."""
        offset, weights = 0, {}
        for name, p in self.params.items():
            weights[name] = flat[offset:offset + p.numel()].view(p.shape).to(p.device, p.dtype)
            offset += p.numel()
        return weights

    # --- devices and precision ----------------------------------------------------------

    def _input(self, tensor: torch.Tensor) -> torch.Tensor:
        """A job's input on our device: token ids as they are, hidden states as fp32 (a new leaf)."""
        if self.is_first:
            return tensor.to(self.device)
        return self._staging.to_device(tensor.detach(), torch.float32)

    def _autocast(self):
        """bf16 autocast for a forward, or nothing (fp32)."""
        dtype = self.placement.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, dtype))

    def host_out(self, tensor: torch.Tensor) -> torch.Tensor:
        """An output (activations or a gradient) on the host in the run's activation dtype, for the codec."""
        return self._staging.to_host(tensor, self.wire_dtype)

    # --- weights and optimizer -----------------------------------------------------------------

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
        c = self.config
        for group in self.optimizer.param_groups:  # the schedule follows self.step, which snapshots keep
            group["lr"] = lr_at(self.step, c.lr, c.warmup_steps, c.decay_steps, c.min_lr_ratio)
        if math.isfinite(float(norm)):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._pending_grads = 0
        self.versions.invalidate()
        self.step += 1

    def weights_changed(self) -> None:
        """The live weights were changed from outside (an outer step, a loaded snapshot): the next
        forward takes a fresh copy of them."""
        self.versions.invalidate()

    def state_dict(self) -> dict:
        """Weights, optimizer state and counters: what a snapshot or an outer step needs (the
        tensors are the engine's own, on its device: ``host_state_dict`` for a copy to keep)."""
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "step": self.step, "micro_batches": self.micro_batches, "tokens": self.tokens,
                "subspace": self.config.subspace}  # an export folds a subspace model's projections in

    def host_state_dict(self) -> dict:
        """``state_dict`` with every tensor copied to the host: what a snapshot encodes, off this
        thread, while training goes on."""
        return _to_host(self.state_dict())

    def load_state_dict(self, state: dict) -> None:
        """Take a state (host or device tensors): the weights are copied into ours on our device,
        and the optimizer moves its states to their parameters' device (``torch.optim``'s rule)."""
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.micro_batches, self.tokens = state["step"], state["micro_batches"], state["tokens"]
        self.versions.invalidate()


def param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's two groups: weight decay on matrices (attention and MLP projections, the LM head: it is
    untied from the embedding, a projection like the others), none on embeddings (a row is updated only
    when its token occurs; decay would shrink rare tokens towards 0), norms and biases (scales and
    offsets, not capacity)."""
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    decay: list[torch.nn.Parameter] = []
    plain: list[torch.nn.Parameter] = []
    for param in module.parameters():
        (decay if param.ndim >= 2 and id(param) not in embeddings else plain).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


# --- activation dtypes and token ids -----------------------------------------------------------


WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # activation dtypes


def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype of an activation dtype name; ConfigError for one that cannot carry activations."""
    if name not in WIRE_DTYPES:
        raise ConfigError(f"activation dtype must be one of {', '.join(WIRE_DTYPES)}, not {name!r}")
    return WIRE_DTYPES[name]


def _ids_on(work: Work, device: torch.device) -> torch.Tensor | None:
    """A subspace model's token ids on ``device`` (None where not needed: stage 0, a plain model)."""
    return None if work.ids is None else work.ids.to(device)


def _to_host(node):
    """A copy of a state tree with every tensor a new host tensor (the rest as it is)."""
    if isinstance(node, torch.Tensor):
        return node.detach().to("cpu", copy=True)
    if isinstance(node, dict):
        return {k: _to_host(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_to_host(v) for v in node)
    return node


def ids_tensor(rows) -> torch.Tensor:
    """Rows of equal length as an int64 [batch, seq] tensor: byte rows (the byte tokenizer) or
    integer arrays of token ids (a tokenized corpus)."""
    if rows and not isinstance(rows[0], (bytes, bytearray)):
        import numpy as np

        return torch.from_numpy(np.stack(rows).astype(np.int64))
    flat = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8)
    return flat.reshape(len(rows), -1).to(torch.int64)


def set_threads(threads: int | None) -> None:
    """torch's intra-op threads for this process (None: torch's default)."""
    if threads:
        torch.set_num_threads(threads)
