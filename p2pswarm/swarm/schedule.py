"""The learning rate of each optimizer step: linear warm-up, cosine decay to a floor, then constant.

``lr_at(step, lr, warmup_steps, decay_steps, min_lr_ratio)`` is a pure function of the step
counter, so a replica that loads a snapshot (whose ``step`` is in the engine's state) continues
the schedule where its source was. Step 0 is the first optimizer step:

- warm-up, ``step < warmup_steps``: ``lr x (step + 1) / warmup_steps`` (never 0: every step learns);
- decay, the next ``decay_steps`` steps: cosine from ``lr`` down to ``min_lr_ratio x lr``;
- after it (or with ``decay_steps = 0``, after the warm-up): constant, the floor or ``lr``.
"""

from __future__ import annotations

import math


def lr_at(step: int, lr: float, warmup_steps: int = 0, decay_steps: int = 0, min_lr_ratio: float = 0.1) -> float:
    """The learning rate of optimizer step ``step`` (module docstring)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay_steps <= 0:
        return lr
    done = min(step - warmup_steps, decay_steps) / decay_steps  # 0 at the end of warm-up, 1 at the floor
    floor = lr * min_lr_ratio
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * done))
