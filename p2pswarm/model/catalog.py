"""The models a swarm can train, by name, and how their layers split into stages.

A stage is the unit of everything above the model: a peer serves one stage, announces it
under the stage's DHT key, and routes micro-batches stage by stage. Layer ranges exist only
as stage ranges (``stage_range``); a range that is not one is refused at the command line.

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

    def stage_of(self, start: int, end: int) -> int | None:
        """The stage whose layer range is exactly [start, end), or None."""
        stage, rest = divmod(start, self.stage_size)
        return stage if rest == 0 and 0 <= stage < self.n_stages and self.stage_range(stage) == (start, end) else None

    def stage_ranges_text(self) -> str:
        return ", ".join(f"{a}:{b}" for a, b in map(self.stage_range, range(self.n_stages)))


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
    """``START:END`` → one stage's (start, end); ``auto`` → None (choose at join time)."""
    if text == "auto":
        return None
    parts = text.split(":")
    try:
        start, end = (int(p) for p in parts)
    except ValueError:
        raise ConfigError(f"--layers must be START:END or auto, not {text!r}") from None
    if model.stage_of(start, end) is None:
        raise ConfigError(f"--layers {text} is not a stage of {model.name}; its stages are "
                          f"{model.stage_ranges_text()} (or use auto)")
    return start, end


def least_served_stage(model: ModelSpec, replicas_per_stage: dict[int, int], rng: random.Random) -> int:
    """The stage with the fewest live replicas.

    Ties are broken at random so that peers joining at the same moment spread out.
    """
    counts = [replicas_per_stage.get(stage, 0) for stage in range(model.n_stages)]
    fewest = min(counts)
    return rng.choice([stage for stage, count in enumerate(counts) if count == fewest])
