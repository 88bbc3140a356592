"""The DiLoCo outer optimizer: the weights a round started from, the outer momentum, the outer step.

DiLoCo trains each replica of a stage alone for ``inner_steps`` AdamW steps (the inner phase),
then the replicas combine what they learned: each one's *pseudo-gradient* is the weights at the
start of the phase minus its weights now, the group averages (or robustly combines) them, and
every replica applies the same outer step to the same start weights, so that all of them leave
the round with the same new start. The outer step is SGD with Nesterov momentum on the
pseudo-gradient (the DiLoCo paper: lr 0.7, momentum 0.9, H = 500 inner steps).

**Overlap.** A replica keeps training while its round is being agreed and reduced: the pseudo-
gradient is taken at flat weights ``at``, and by the time the aggregate arrives the live weights
have moved on by ``live - at``. ``outer_step`` keeps that progress: the live weights become
``new_start + (live - at)``, and the local steps taken since ``at`` are counted in the next
round's pseudo-gradient (they are part of ``new start - live`` then).

**Streaming** (Streaming DiLoCo, arXiv 2501.18512). With ``fragments`` F > 1 the stage's flat vector
is cut into F contiguous pieces and a round synchronises one of them, fragment ``rounds % F``, every
H / F inner steps (``round_steps``): each fragment still meets every H steps, the rounds are
staggered, and each sends 1/F of the bytes. The start weights stay one vector, the same on every
member (each fragment's part changes only in that fragment's rounds), so ``engine.agree`` and the
snapshots keep working on it. Every vector a round passes (``at``, the pseudo-gradient, the
aggregate) is the fragment's (``fragment()``); F = 1 is plain DiLoCo.

**No ``skip_round``.** A round in which we were alone is DiLoCo with one worker: the caller
passes its own pseudo-gradient as the aggregate to ``outer_step``. A round that failed (the
group fell apart mid-reduce) needs nothing either: the caller does not call ``outer_step``, the
start weights stay, ``due`` stays true, and the next attempt's pseudo-gradient simply covers more
inner steps. Both are sound; neither needs a third operation.

Pure torch, no I/O. Everything is float32 on the CPU, in the order of the parameter dict (the
engine's ``dict(module.named_parameters())``, the same order on every replica), even when the
engine's parameters are on a GPU: the start weights, the momentum and the error feedback stay on
the host, and ``flatten``/``shift_flat`` move one parameter's slice at a time (no stage-sized
vector on the device).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from p2pswarm.diloco.compression import all_finite
from p2pswarm.errors import ConfigError
from p2pswarm.run.diloco import MAX_FRAGMENTS

INNER_STEPS = 500  # H, the DiLoCo paper's default: rare rounds, little communication
OUTER_LR = 0.7  # the paper's outer learning rate for Nesterov
OUTER_MOMENTUM = 0.9  # the paper's outer momentum (Nesterov)
NESTEROV = True  # the paper's outer optimizer; False gives heavy-ball momentum

_CONFIG_FIELDS = ("inner_steps", "lr", "momentum", "nesterov", "fragments")
_STATE_KEYS = frozenset({"start", "momentum", "rounds", "round_started_step", "config"})


@dataclass(frozen=True)
class OuterConfig:
    """The outer optimizer's settings; ConfigError on values that cannot train."""

    inner_steps: int = INNER_STEPS
    lr: float = OUTER_LR
    momentum: float = OUTER_MOMENTUM
    nesterov: bool = NESTEROV
    fragments: int = 1  # F: one fragment of the stage synchronised per round (module docstring)

    def __post_init__(self) -> None:
        if type(self.inner_steps) is not int or self.inner_steps < 1:
            raise ConfigError(f"inner_steps must be a positive int, not {self.inner_steps!r}")
        if not _is_real(self.lr) or not 0 < self.lr < math.inf:
            raise ConfigError(f"outer lr must be a positive finite number, not {self.lr!r}")
        if not _is_real(self.momentum) or not 0 <= self.momentum < 1:
            raise ConfigError(f"outer momentum must be in [0, 1), not {self.momentum!r}")
        if type(self.nesterov) is not bool:
            raise ConfigError(f"nesterov must be a bool, not {self.nesterov!r}")
        if type(self.fragments) is not int or not 1 <= self.fragments <= min(MAX_FRAGMENTS, self.inner_steps):
            raise ConfigError(f"fragments must be an int within [1, min({MAX_FRAGMENTS}, inner_steps)], "
                              f"not {self.fragments!r}")

    @property
    def round_steps(self) -> int:
        """Inner steps between two rounds: H / F, rounded up (each fragment meets every H steps)."""
        return -(-self.inner_steps // self.fragments)


def _is_real(value: object) -> bool:
    return type(value) in (int, float)


# --- flat views of a parameter dict ---------------------------------------------------------


def flatten(params: dict[str, torch.Tensor], out: torch.Tensor | None = None,
            bounds: tuple[int, int] | None = None) -> torch.Tensor:
    """One 1-D float32 host tensor holding every parameter, in the dict's order, or only its elements
    ``bounds`` = [a, b) (a fragment): a new one, or ``out`` (a float32 vector of the right length,
    reused round after round: no page faults). Parameters on a device are copied to the host one at
    a time, straight into their slice."""
    a, b = bounds if bounds is not None else (0, _numel(params))
    if out is None:
        out = torch.empty(b - a, dtype=torch.float32, device="cpu")
    _check_flat(params, out, (a, b))
    if out.dtype != torch.float32:
        raise ValueError("out must be float32")
    for p, lo, hi, at in _pieces(params, a, b):
        out[at:at + hi - lo].copy_(p.detach().reshape(-1)[lo:hi])
    return out


def _numel(params: dict[str, torch.Tensor]) -> int:
    return sum(p.numel() for p in params.values())


def _pieces(params: dict[str, torch.Tensor], a: int, b: int):
    """(parameter, [lo, hi) of its flat elements, where they start in the vector of [a, b)) for each
    parameter that [a, b) of the stage's flat vector overlaps."""
    offset = 0
    for p in params.values():
        lo, hi = max(a, offset), min(b, offset + p.numel())
        if lo < hi:
            yield p, lo - offset, hi - offset, lo - a
        offset += p.numel()


def _check_flat(params: dict[str, torch.Tensor], flat: torch.Tensor, bounds: tuple[int, int] | None = None) -> None:
    a, b = bounds if bounds is not None else (0, _numel(params))
    if not 0 <= a <= b <= _numel(params):
        raise ValueError(f"bounds [{a}, {b}) outside the {_numel(params)} parameters")
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise ValueError("expected a 1-D tensor")
    if flat.numel() != b - a:
        raise ValueError(f"flat tensor of {flat.numel()} elements for {b - a} parameters")


def shift_flat(params: dict[str, torch.Tensor], old: torch.Tensor, new: torch.Tensor,
               bounds: tuple[int, int] | None = None) -> None:
    """``params += new - old`` over the elements ``bounds`` (all of them if None), in place and
    without a temporary vector (``params - old`` first: for close values that difference is exact);
    ValueError if the sizes differ. ``old`` and ``new`` are host vectors, the params may be on a
    device: each slice moves to its parameter's device on its own (a parameter-sized temporary
    there, never a stage-sized one)."""
    a, b = bounds if bounds is not None else (0, _numel(params))
    _check_flat(params, old, (a, b))
    _check_flat(params, new, (a, b))
    with torch.no_grad():
        for p, lo, hi, at in _pieces(params, a, b):
            n = hi - lo
            p.view(-1)[lo:hi].sub_(old[at:at + n].to(p.device)).add_(new[at:at + n].to(p.device))


# --- the outer optimizer -------------------------------------------------------------------


class OuterOptimizer:
    """Holds the weights at the start of the inner phase, the outer momentum and the counters."""

    def __init__(self, params: dict[str, torch.Tensor], config: OuterConfig = OuterConfig(),
                 step: int = 0) -> None:
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        self.config = config
        self.start = flatten(params)
        self.numel = self.start.numel()
        if config.fragments > self.numel:
            raise ConfigError(f"{config.fragments} fragments of a stage of {self.numel} parameters")
        self.momentum = torch.zeros_like(self.start)
        self.rounds = 0  # outer steps taken
        self.round_started_step = step  # the engine's inner step when the current phase began

    def fragment(self) -> tuple[int, int]:
        """The elements [a, b) of the stage's flat vector the current round synchronises: fragment
        ``rounds % F`` of F equal contiguous pieces (all of them when F = 1)."""
        count = self.config.fragments
        index = self.rounds % count
        return self.numel * index // count, self.numel * (index + 1) // count

    def inner_steps_done(self, step: int) -> int:
        """Inner steps taken since the current inner phase began."""
        return step - self.round_started_step

    def due(self, step: int) -> bool:
        """Whether the inner phase is long enough for an outer round (H / F steps: ``round_steps``)."""
        return self.inner_steps_done(step) >= self.config.round_steps

    def pseudo_gradient(self, current: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``start - current`` over the round's fragment (``current``: the weights there now): what the
        inner phase moved, as a gradient (a new tensor, or ``out``)."""
        a, b = self.fragment()
        self._check_vector(current, "current")
        if out is None:
            return self.start[a:b] - current.to(torch.float32)
        self._check_vector(out, "out")
        return torch.sub(self.start[a:b], current.to(torch.float32), out=out)

    def outer_step(self, aggregated: torch.Tensor, at: torch.Tensor, params: dict[str, torch.Tensor],
                   step: int) -> None:
        """Apply the group's pseudo-gradient to the start weights of the round's fragment; move the live
        params along.

        Nesterov as ``torch.optim.SGD(nesterov=True)``: ``m = mu*m + g``, the update is
        ``g + mu*m`` (heavy ball: ``m``), ``new_start = start - lr*update``. The live parameters
        become ``new_start + (live - at)`` (module docstring). ValueError, with nothing changed, on
        wrong sizes, a non-finite aggregate or a ``step`` before the round began.

        In place, without one temporary vector: a stage's vector is up to 256 MB, and every
        full-size temporary costs its page faults (64 MiB: ~25 ms each, on top of the pass).
        """
        a, b = self.fragment()
        self._check_vector(aggregated, "aggregated")
        self._check_vector(at, "at")
        _check_flat(params, at, (a, b))
        self._check_step(step)
        g = aggregated.to(torch.float32)
        if not all_finite(g):
            raise ValueError("the aggregated pseudo-gradient is not finite")
        mu, lr = self.config.momentum, self.config.lr
        momentum, start = self.momentum[a:b], self.start[a:b]
        torch.add(g, momentum, alpha=mu, out=momentum)  # m = g + mu*m
        if self.config.nesterov:  # start -= lr * (g + mu*m), as two passes with no temporary
            start.add_(g, alpha=-lr).add_(momentum, alpha=-lr * mu)
        else:
            start.add_(momentum, alpha=-lr)
        shift_flat(params, at.to(torch.float32), start, (a, b))
        self.rounds += 1
        self.round_started_step = step

    def adopt(self, at: torch.Tensor, step: int) -> None:
        """A round of one that applies no outer step: the weights at its close become the fragment's start
        as they are (the live ones stay), the momentum is kept for the next round with others."""
        a, b = self.fragment()
        self._check_vector(at, "at")
        self._check_step(step)
        self.start[a:b].copy_(at)
        self.rounds += 1
        self.round_started_step = step

    def _check_step(self, step: int) -> None:
        if type(step) is not int or step < self.round_started_step:
            raise ValueError(f"step {step!r} is before the round began at {self.round_started_step}")

    def _check_vector(self, vector: torch.Tensor, name: str, numel: int | None = None) -> None:
        """``vector`` is 1-D of ``numel`` elements (None: the round's fragment's)."""
        if numel is None:
            a, b = self.fragment()
            numel = b - a
        if not isinstance(vector, torch.Tensor) or vector.dim() != 1 or vector.numel() != numel:
            raise ValueError(f"{name} must be a 1-D tensor of {numel} elements")

    # --- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Start weights, momentum, counters and config: copies, safe to snapshot."""
        return {"start": self.start.clone(), "momentum": self.momentum.clone(), "rounds": self.rounds,
                "round_started_step": self.round_started_step, "config": asdict(self.config)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict`` (config included); ValueError, with nothing changed, if it does not fit."""
        if not isinstance(state, dict) or state.keys() != _STATE_KEYS:
            raise ValueError(f"outer state must be a dict with the keys {sorted(_STATE_KEYS)}")
        start = self._loaded_vector(state["start"], "start")
        momentum = self._loaded_vector(state["momentum"], "momentum")
        for key in ("rounds", "round_started_step"):
            if type(state[key]) is not int or state[key] < 0:
                raise ValueError(f"outer state {key} must be a non-negative int, not {state[key]!r}")
        config = state["config"]
        if not isinstance(config, dict) or set(config) not in (set(_CONFIG_FIELDS), set(_CONFIG_FIELDS[:-1])):
            raise ValueError(f"outer state config must be a dict with the keys {list(_CONFIG_FIELDS)} (the last "
                             "may be left out: a state written before fragments, F = 1)")
        try:
            config = OuterConfig(**config)
        except ConfigError as e:
            raise ValueError(f"outer state config: {e}") from e
        if config.fragments > self.numel:
            raise ValueError(f"outer state config: {config.fragments} fragments of {self.numel} parameters")
        self.config, self.start, self.momentum = config, start, momentum
        self.rounds, self.round_started_step = state["rounds"], state["round_started_step"]

    def _loaded_vector(self, vector: object, name: str) -> torch.Tensor:
        if not isinstance(vector, torch.Tensor) or vector.dtype != torch.float32:
            raise ValueError(f"outer state {name} must be a float32 tensor")
        self._check_vector(vector, f"outer state {name}", self.numel)
        return vector.detach().to("cpu").clone()
