"""The models a swarm can train, by name, and how their layers split into stages.

A stage is the unit of everything above the model: a peer serves one stage, announces it
under the stage's DHT key, and routes micro-batches stage by stage. Layer ranges exist only
as stage ranges (``stage_range``); a range that is not one is refused at the command line.

Each spec also carries the real dimensions of its transformer (width, heads, FFN size,
context, byte vocabulary), and ``param_count`` gives a stage's parameter count from the spec
alone, without allocating: capacity planning and the tier table need it for models far too big
to build on the machine that asks. ``p2pswarm.model.transformer`` builds exactly that
architecture, and a test holds the formula to the built modules.

Importable without torch: discovery and the CLI need the layer count and stage split of a
model long before any weights exist.
"""

from __future__ import annotations

import dataclasses

import random
from dataclasses import dataclass

from p2pswarm.errors import ConfigError

DEFAULT_MODEL = "tiny-lm"  # the embedded default: small enough for a local demo on 2 cores

BYTE_VOCAB = 256  # byte-level tokens: any text (or file) is a token stream, no tokenizer to ship
DEFAULT_WIDTH = 128  # the tiny-lm width: learns visibly within minutes on 2 CPU cores
DEFAULT_HEADS = 4  # head dim 32 at the default width
DEFAULT_FFN = 512  # 4 x width, the usual MLP expansion
DEFAULT_CONTEXT = 128  # bytes per sequence: enough for a line or two of source code, cheap on CPU
TIER_CONTEXT = 1024  # the seed tiers' maximum sequence length
FFN_MULT = 4  # the seed tiers' MLP expansion: ffn = 4 x width


@dataclass(frozen=True)
class ModelSpec:
    name: str
    n_layers: int  # transformer blocks, the unit that layer records announce
    stage_size: int  # layers per stage: the slice one peer serves by default
    width: int = DEFAULT_WIDTH  # d_model: the size of the hidden states passed between stages
    heads: int = DEFAULT_HEADS  # attention heads; width must be a multiple of it
    ffn: int = DEFAULT_FFN  # hidden size of each block's MLP
    context: int = DEFAULT_CONTEXT  # longest sequence (learned positions exist up to here)
    vocab: int = BYTE_VOCAB  # token ids are in [0, vocab)

    def __post_init__(self) -> None:
        sizes = {"n_layers": self.n_layers, "stage_size": self.stage_size, "width": self.width,
                 "heads": self.heads, "ffn": self.ffn, "context": self.context, "vocab": self.vocab}
        for field_name, value in sizes.items():
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model {self.name!r}: {field_name} must be a positive integer, not {value!r}")
        if self.width % self.heads:
            raise ConfigError(f"model {self.name!r}: width {self.width} is not a multiple of heads {self.heads}")

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def last_stage(self) -> int:
        return self.n_stages - 1

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

    @property
    def family(self) -> str:
        """The model without its stage cut: ``tiny-lm/2`` and ``tiny-lm`` have the same weights."""
        return self.name.partition("/")[0]

    def stage_ranges_text(self) -> str:
        return ", ".join(f"{a}:{b}" for a, b in map(self.stage_range, range(self.n_stages)))


def _tier(name: str, n_layers: int, width: int, heads: int, stage_size: int) -> ModelSpec:
    """A seed tier: head dim 128, ffn = 4 x width, context 1024, byte vocabulary."""
    return ModelSpec(name, n_layers=n_layers, stage_size=stage_size, width=width, heads=heads,
                     ffn=FFN_MULT * width, context=TIER_CONTEXT)


MODELS = {
    # tiny-lm: 4 stages of 2 (tests and the demo depend on this split), about 1.7M parameters
    "tiny-lm": ModelSpec("tiny-lm", n_layers=8, stage_size=2, width=DEFAULT_WIDTH, heads=DEFAULT_HEADS,
                         ffn=DEFAULT_FFN, context=DEFAULT_CONTEXT),
    "small-lm": ModelSpec("small-lm", n_layers=24, stage_size=4),  # a deeper tiny-lm: 6 stages of 4
    # the seed tiers; stage sizes keep a stage's weights within one consumer GPU at the larger end
    "nano": _tier("nano", n_layers=8, width=512, heads=4, stage_size=2),
    "micro": _tier("micro", n_layers=16, width=1024, heads=8, stage_size=4),
    "small": _tier("small", n_layers=24, width=2048, heads=16, stage_size=4),
    "medium": _tier("medium", n_layers=32, width=3072, heads=24, stage_size=4),
    "large": _tier("large", n_layers=48, width=5120, heads=40, stage_size=4),
    "xl": _tier("xl", n_layers=64, width=7168, heads=56, stage_size=8),
}


def get_model(name: str) -> ModelSpec:
    """A catalog model by name; ``NAME/S`` is NAME cut into S equal stages (S must divide its blocks)."""
    base, _, stages = name.partition("/")
    try:
        spec = MODELS[base]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))} "
                          f"(NAME/S cuts NAME into S stages)") from None
    if not stages:
        return spec
    if not stages.isdigit() or int(stages) < 1 or spec.n_layers % int(stages):
        divisors = [d for d in range(1, spec.n_layers + 1) if spec.n_layers % d == 0]
        raise ConfigError(f"model {name!r}: {base} has {spec.n_layers} blocks; it can be cut into "
                          f"{', '.join(map(str, divisors))} stages, not {stages!r}")
    return dataclasses.replace(spec, name=f"{base}/{int(stages)}", stage_size=spec.n_layers // int(stages))


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


def block_param_count(spec: ModelSpec) -> int:
    """Parameters of one pre-norm block: two LayerNorms, qkv and output projections, the MLP.

    All linear layers of a block have biases (see ``p2pswarm.model.transformer.Block``).
    """
    w, f = spec.width, spec.ffn
    norms = 2 * (2 * w)  # weight and bias of ln1 and ln2
    attention = (w * 3 * w + 3 * w) + (w * w + w)  # qkv, out projection
    mlp = (w * f + f) + (f * w + w)  # up, down
    return norms + attention + mlp


def param_count(spec: ModelSpec, stage: int) -> int:
    """Parameters of one stage, from the spec alone (nothing is allocated).

    Stage 0 adds the token and position embeddings; the last stage adds the final LayerNorm
    and the bias-free LM head (not tied to the embedding: the two live on different peers).
    """
    if not 0 <= stage < spec.n_stages:
        raise ConfigError(f"model {spec.name} has stages 0..{spec.last_stage}, not {stage}")
    start, end = spec.stage_range(stage)
    total = (end - start) * block_param_count(spec)
    if stage == 0:
        total += spec.vocab * spec.width + spec.context * spec.width
    if stage == spec.last_stage:
        total += 2 * spec.width + spec.width * spec.vocab
    return total


def model_param_count(spec: ModelSpec) -> int:
    """Parameters of the whole model: the sum over its stages."""
    return sum(param_count(spec, stage) for stage in range(spec.n_stages))
