"""The models a swarm can train, by name, and how their layers split into stages.

Importable without torch: discovery and the CLI need the layer count and stage split of a
model long before any weights exist.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from p2pswarm.errors import ConfigError

DEFAULT_MODEL = "tiny-lm"  # the embedded default: small enough for a local demo on 2 cores


@dataclass(frozen=True)
class ModelSpec:
    name: str
    n_layers: int  # transformer blocks, the unit that layer records announce
    stage_size: int  # layers per stage: the slice one peer serves by default

    @property
    def n_stages(self) -> int:
        return -(-self.n_layers // self.stage_size)

    def stage_range(self, stage: int) -> tuple[int, int]:
        start = stage * self.stage_size
        return start, min(start + self.stage_size, self.n_layers)


MODELS = {
    "tiny-lm": ModelSpec("tiny-lm", n_layers=8, stage_size=2),
    "small-lm": ModelSpec("small-lm", n_layers=24, stage_size=4),
}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}") from None


def parse_layers(text: str, model: ModelSpec) -> tuple[int, int] | None:
    """``START:END`` → (start, end) within the model; ``auto`` → None (choose at join time)."""
    if text == "auto":
        return None
    parts = text.split(":")
    try:
        start, end = (int(p) for p in parts)
    except ValueError:
        raise ConfigError(f"--layers must be START:END or auto, not {text!r}") from None
    if not 0 <= start < end <= model.n_layers:
        raise ConfigError(f"--layers {text}: need 0 <= START < END <= {model.n_layers} for {model.name}")
    return start, end


def least_served_stage(
    model: ModelSpec, replicas_per_layer: dict[int, int], rng: random.Random
) -> tuple[int, int]:
    """The stage with the fewest live replicas (its least-served layer decides).

    Ties are broken at random so that peers joining at the same moment spread out.
    """

    def replicas(stage: int) -> int:
        start, end = model.stage_range(stage)
        return min(replicas_per_layer.get(layer, 0) for layer in range(start, end))

    fewest = min(replicas(s) for s in range(model.n_stages))
    return model.stage_range(rng.choice([s for s in range(model.n_stages) if replicas(s) == fewest]))
