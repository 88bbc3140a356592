"""The weight versions a stage's forwards run on: weight stashing with weight prediction.

Micro-batches are pipelined: a stage may take optimizer steps between a micro-batch's forward and
its backward. Each forward therefore runs on a frozen copy of the weights of the current version
(``torch.func.functional_call``, in ``swarm/engine.py``), one copy per optimizer step still
referenced by a waiting micro-batch, and its backward runs on that same copy (PipeDream's weight
stashing). ``WeightVersions`` makes those copies: one per version, until the engine steps or its
live weights change from outside (``invalidate``).

**Weight prediction.** A micro-batch's gradient lands after the optimizer steps of the ones still
waiting for theirs (the kept graphs): ``ahead`` steps late. Its forward therefore runs on the
weights AdamW will have by then, extrapolated along its current update direction
(``m̂ / (√v̂ + eps)``, ``ahead`` steps of the current lr; SpecTrain's rule), and its gradient is
taken there. Without it, a stage whose micro-batches come back 5 steps late learned 18 % less per
token than one process (bench/swarm_train.py, docs/benchmarks.md).

It runs on the engine's compute thread, like the engine (module docstring of ``swarm/engine.py``).
"""

from __future__ import annotations

import torch

from p2pswarm.run.training import TrainConfig

__all__ = ["WeightVersions"]


class WeightVersions:
    """The frozen copy of a stage's live ``params`` that forwards run on until the next step."""

    def __init__(self, params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                 config: TrainConfig) -> None:
        self.params, self.optimizer, self.config = params, optimizer, config
        self._version: dict[str, torch.Tensor] | None = None

    def current(self, waiting: int) -> dict[str, torch.Tensor]:
        """The current version, made now if there is none: predicted ``waiting // accumulate`` steps
        ahead (``waiting``: micro-batches whose gradients are still to come), graphs may keep it."""
        if self._version is None:
            ahead = waiting // self.config.accumulate if self.config.predict_weights else 0
            with torch.no_grad():
                self._version = {n: self._predicted(p, ahead).requires_grad_(True) for n, p in self.params.items()}
        return self._version

    def invalidate(self) -> None:
        """The live weights changed (a step, an outer step, a loaded state): the next forward takes a new copy."""
        self._version = None

    def _predicted(self, p: torch.Tensor, ahead: int) -> torch.Tensor:
        """``p`` after ``ahead`` more AdamW steps in its current direction (a copy; ``p`` itself at 0)."""
        state = self.optimizer.state.get(p)
        if not ahead or not state or "exp_avg" not in state:
            return p.detach().clone()
        beta1, beta2 = self.config.betas
        t = float(state["step"])
        lr = self.optimizer.param_groups[0]["lr"]
        direction = (state["exp_avg"] / (1 - beta1 ** t)) / ((state["exp_avg_sq"] / (1 - beta2 ** t)).sqrt()
                                                            + self.config.eps)
        return p.detach() - (lr * ahead) * direction
