"""The models a swarm can train, by name, how their layers split into stages, and what a stage costs.

A stage is the unit of everything above the model: a peer serves one stage, announces it
under the stage's DHT key, and routes micro-batches stage by stage. Layer ranges exist only
as stage ranges (``stage_range``); a range that is not one is refused at the command line.

Each spec also says what its transformer is: a Llama-style decoder (RMSNorm, rotary positions,
SwiGLU MLP, no biases, grouped-query attention when ``kv_heads < heads``, an untied LM head)
with its dimensions (width, heads, KV heads, SwiGLU size, context, vocabulary, RoPE theta, norm
epsilon). ``param_count`` gives a stage's parameter count and ``stage_memory`` its training
memory from the spec alone, without allocating: capacity planning and the tier table need them
for models far too big to build on the machine that asks. ``p2pswarm.model.transformer`` builds
exactly that architecture, and tests hold the formulas to the built modules.

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
DEFAULT_FFN = 256  # SwiGLU size 2 x width: as fast on a CPU as the old GELU tiny-lm, learns better (docs/benchmarks.md)
DEFAULT_CONTEXT = 128  # bytes per sequence: enough for a line or two of source code, cheap on CPU
DEFAULT_ROPE_THETA = 10000.0  # Llama 2's base: the slowest rotation (2 pi x 1e4 positions) dwarfs any context here
DEFAULT_NORM_EPS = 1e-5  # Llama 2's RMSNorm epsilon
TIER_CONTEXT = 1024  # the seed tiers' maximum sequence length
TIER_HEAD_DIM = 128  # the seed tiers' head size (Llama's)
FFN_MULTIPLE = 256  # Llama rounds its SwiGLU size up to a multiple of 256: GPU-friendly matmul shapes
TIER_KV_HEADS = 8  # GQA for small..xl: Llama 3's 8 KV heads, which divide every tier's head count


@dataclass(frozen=True)
class ModelSpec:
    name: str
    n_layers: int  # transformer blocks, the unit that layer records announce
    stage_size: int  # layers per stage: the slice one peer serves by default
    width: int = DEFAULT_WIDTH  # d_model: the size of the hidden states passed between stages
    heads: int = DEFAULT_HEADS  # query heads; width must be a multiple of it
    ffn: int = DEFAULT_FFN  # SwiGLU intermediate size (gate_proj, up_proj: width -> ffn)
    context: int = DEFAULT_CONTEXT  # longest sequence a stage accepts
    vocab: int = BYTE_VOCAB  # token ids are in [0, vocab); set from a tokenizer with dataclasses.replace
    kv_heads: int = 0  # key/value heads (GQA); 0 means heads (multi-head), resolved when the spec is made
    rope_theta: float = DEFAULT_ROPE_THETA  # RoPE base: inv_freq = 1 / theta^(2i / head_dim)
    norm_eps: float = DEFAULT_NORM_EPS  # RMSNorm epsilon

    def __post_init__(self) -> None:
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        sizes = {"n_layers": self.n_layers, "stage_size": self.stage_size, "width": self.width,
                 "heads": self.heads, "ffn": self.ffn, "context": self.context, "vocab": self.vocab,
                 "kv_heads": self.kv_heads}
        for field_name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model {self.name!r}: {field_name} must be a positive integer, not {value!r}")
        for field_name, number in {"rope_theta": self.rope_theta, "norm_eps": self.norm_eps}.items():
            if not isinstance(number, (int, float)) or isinstance(number, bool) or not 0 < number < float("inf"):
                raise ConfigError(f"model {self.name!r}: {field_name} must be a positive number, not {number!r}")
        if self.width % self.heads:
            raise ConfigError(f"model {self.name!r}: width {self.width} is not a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ConfigError(f"model {self.name!r}: heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"model {self.name!r}: head dim {self.head_dim} is odd; rotary positions "
                              f"rotate pairs of dimensions")

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def kv_width(self) -> int:
        """The width of the key (and of the value) projection: kv_heads x head_dim."""
        return self.kv_heads * self.head_dim

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


def llama_ffn(width: int) -> int:
    """Llama's SwiGLU size: 2/3 of a 4 x width MLP (the same parameters), rounded up to 256."""
    return -(-(8 * width // 3) // FFN_MULTIPLE) * FFN_MULTIPLE


def _tier(name: str, n_layers: int, width: int, stage_size: int, kv_heads: int | None = None) -> ModelSpec:
    """A seed tier: head dim 128, Llama's SwiGLU size, context 1024, byte vocabulary (until a tokenizer)."""
    heads = width // TIER_HEAD_DIM
    return ModelSpec(name, n_layers=n_layers, stage_size=stage_size, width=width, heads=heads,
                     ffn=llama_ffn(width), context=TIER_CONTEXT, kv_heads=kv_heads or heads)


MODELS = {
    # tiny-lm: 4 stages of 2 (tests and the demo depend on this split), about 1.4M parameters
    "tiny-lm": ModelSpec("tiny-lm", n_layers=8, stage_size=2, width=DEFAULT_WIDTH, heads=DEFAULT_HEADS,
                         ffn=DEFAULT_FFN, context=DEFAULT_CONTEXT),
    "small-lm": ModelSpec("small-lm", n_layers=24, stage_size=4),  # a deeper tiny-lm: 6 stages of 4
    # The seed tiers (widths, depths, head dim 128 as seeded). Each stage_size is the seed's, shrunk
    # until the largest stage trains in STAGE_MEMORY_BUDGET (bf16 working weights, fp32 master,
    # grads and AdamW, one stashed copy, one micro-batch of default_rows x 1024 tokens), also with a
    # SIZING_VOCAB-token vocabulary on the end stages: tests hold every tier to it, and
    # format_tier_table() prints the figures. nano and micro keep plain multi-head attention (GQA
    # would save next to nothing at their size); small..xl use 8 KV heads.
    "nano": _tier("nano", n_layers=8, width=512, stage_size=2),
    "micro": _tier("micro", n_layers=16, width=1024, stage_size=4),
    "small": _tier("small", n_layers=24, width=2048, stage_size=4, kv_heads=TIER_KV_HEADS),
    "medium": _tier("medium", n_layers=32, width=3072, stage_size=4, kv_heads=TIER_KV_HEADS),
    "large": _tier("large", n_layers=48, width=5120, stage_size=2, kv_heads=TIER_KV_HEADS),
    "xl": _tier("xl", n_layers=64, width=7168, stage_size=1, kv_heads=TIER_KV_HEADS),
}


def get_model(name: str) -> ModelSpec:
    """A catalog model by name; ``NAME/S`` is NAME cut into S stages (``stage_counts``)."""
    base, _, stages = name.partition("/")
    try:
        spec = MODELS[base]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))} "
                          f"(NAME/S cuts NAME into S stages)") from None
    if not stages:
        return spec
    possible = stage_counts(spec.n_layers)
    if not stages.isdigit() or int(stages) not in possible:
        raise ConfigError(f"model {name!r}: {base} has {spec.n_layers} blocks; it can be cut into "
                          f"{', '.join(map(str, possible))} stages, not {stages!r}")
    return dataclasses.replace(spec, name=f"{base}/{int(stages)}", stage_size=-(-spec.n_layers // int(stages)))


def stage_counts(n_layers: int) -> list[int]:
    """The stage counts S that NAME/S allows: stages of ceil(n_layers / S) blocks, the last one
    shorter where S does not divide the blocks, and exactly S of them (8 blocks: 1, 2, 3, 4, 8;
    3 is 3 + 3 + 2, while 5 or 6 would leave a stage empty)."""
    return [s for s in range(1, n_layers + 1) if -(-n_layers // -(-n_layers // s)) == s]


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


def least_served_stage(model: ModelSpec, replicas_per_stage: dict[int, int], rng: random.Random,
                       throughputs: dict[int, list[float]] | None = None,
                       tie_break: dict[int, int] | None = None) -> int:
    """The stage with the least served throughput, else the fewest live replicas.

    ``throughputs`` are the tokens/s each stage's replicas announce (0: not measured yet). Where
    some are known, a stage is served by the sum of its replicas' throughputs, an unknown one
    counting as the mean of the known ones (a peer that has not measured yet is taken as a
    typical one): a fast GPU replica serves a stage as much as several CPU ones, and the stage
    that bounds the pipeline gets the newcomer. Where none is known, the stage with the fewest
    replicas. Among the stages tied, those with the least ``tie_break`` (weaker evidence: peers that
    only answered a ping); ties left are broken at random so that peers joining at once spread out.
    """
    known = [t for values in (throughputs or {}).values() for t in values if t > 0]
    served: list[float]
    if known:
        assert throughputs is not None  # known is empty without it
        nominal = sum(known) / len(known)
        served = [sum(t if t > 0 else nominal for t in throughputs.get(stage, ())) for stage in range(model.n_stages)]
    else:
        served = [replicas_per_stage.get(stage, 0) for stage in range(model.n_stages)]
    least = min(served)
    tied = [stage for stage, amount in enumerate(served) if amount == least]
    fewest = min((tie_break or {}).get(stage, 0) for stage in tied)
    return rng.choice([stage for stage in tied if (tie_break or {}).get(stage, 0) == fewest])


def block_param_count(spec: ModelSpec) -> int:
    """Parameters of one decoder layer: two RMSNorm weights, q/k/v/o projections, the SwiGLU MLP.

    No biases (see ``p2pswarm.model.transformer.DecoderLayer``); k and v project to
    ``kv_heads x head_dim`` (grouped-query attention when it is less than the width).
    """
    w, f = spec.width, spec.ffn
    norms = 2 * w  # input_layernorm, post_attention_layernorm
    attention = 2 * w * w + 2 * w * spec.kv_width  # q_proj, o_proj; k_proj, v_proj
    mlp = 3 * w * f  # gate_proj, up_proj, down_proj
    return norms + attention + mlp


def param_count(spec: ModelSpec, stage: int) -> int:
    """Parameters of one stage, from the spec alone (nothing is allocated).

    Stage 0 adds the token embedding (no position table: positions are rotary); the last stage
    adds the final RMSNorm and the LM head (not tied to the embedding: the two live on
    different peers).
    """
    if not 0 <= stage < spec.n_stages:
        raise ConfigError(f"model {spec.name} has stages 0..{spec.last_stage}, not {stage}")
    start, end = spec.stage_range(stage)
    total = (end - start) * block_param_count(spec)
    if stage == 0:
        total += spec.vocab * spec.width
    if stage == spec.last_stage:
        total += spec.width + spec.width * spec.vocab
    return total


def model_param_count(spec: ModelSpec) -> int:
    """Parameters of the whole model: the sum over its stages."""
    return sum(param_count(spec, stage) for stage in range(spec.n_stages))


# ---- training memory of one stage, from the spec -------------------------------------------------

STAGE_MEMORY_BUDGET = 22 * 10**9  # bytes a stage may take on a 24 GB consumer GPU, 2 GB left to CUDA and fragmentation
SIZING_VOCAB = 32768  # the tiers must also fit with a BPE vocabulary this large (Llama 2's is 32000)
DEFAULT_ROWS = 8  # micro-batch rows (sequences) of a model that TIER_ROWS does not name
TIER_ROWS = {"large": 4, "xl": 4}  # wide tiers: 4 x 1024 tokens keep a bf16 activation message under 64 MiB
WORKING_BYTES = {"fp32": 4, "bf16": 2}  # bytes per weight (and per activation) that forwards compute in
MASTER_BYTES = 4  # the fp32 master weights a bf16 working copy is cast from (the fp32 weights are their own)
GRAD_BYTES = 4  # gradients accumulate in fp32, on the master weights
ADAM_BYTES = 8  # AdamW's exp_avg and exp_avg_sq, fp32 each
STASH_BYTES = 4  # one stashed fp32 copy of the weights (the engine's weight stashing; one version in flight)
NORM_BYTES = 4  # an RMSNorm computes in float32 and keeps x / rms(x) in float32 for backward
LOGIT_COPIES = 2  # the fp32 logits and the log-softmax that cross-entropy keeps for backward
GB = 10**9  # the tier table's unit (decimal, as GPU memory is sold)


@dataclass(frozen=True)
class StageMemory:
    """Bytes one stage needs to train one micro-batch (``stage_memory``); ``total`` is their sum."""

    weights: int  # the weights forwards run on: the fp32 weights, or the bf16 working copy
    master: int  # fp32 master weights behind a bf16 working copy; 0 in fp32
    grads: int  # fp32 gradients
    adam: int  # AdamW's two fp32 moments
    stash: int  # the frozen fp32 copy a pipelined micro-batch's forward and backward run on
    activations: int  # what autograd keeps for one micro-batch (``stage_activation_bytes``)
    transient: int  # one layer's worth again: the layer being computed (forward temporaries, then the
    #                 backward's gradients of its saved tensors); measured in bench/stage_memory.py

    @property
    def total(self) -> int:
        return self.weights + self.master + self.grads + self.adam + self.stash + self.activations + self.transient


def _working_bytes(precision: str) -> int:
    try:
        return WORKING_BYTES[precision]
    except KeyError:
        raise ConfigError(f"precision must be one of {', '.join(WORKING_BYTES)}, not {precision!r}") from None


def layer_activation_bytes(spec: ModelSpec, tokens: int, dtype_bytes: int) -> int:
    """What autograd keeps of one decoder layer for ``tokens`` tokens, activations of ``dtype_bytes``.

    Per token: the normed inputs of q/k/v and of gate/up (2 x width), q, k and v after the
    rotation (width + 2 x kv width, kept by attention), the attention output that o_proj takes
    (width), and the SwiGLU's gate, up, silu(gate) and the product down_proj takes (4 x ffn),
    all in the activation dtype; each RMSNorm's float32 x / rms(x) (2 x width x 4 bytes);
    attention's log-sum-exp per head (float32). An estimate: it counts
    what a Llama layer's backward needs, not the allocator's rounding.
    """
    w = spec.width
    per_token = dtype_bytes * (4 * w + 2 * spec.kv_width + 4 * spec.ffn) + NORM_BYTES * 2 * w + 4 * spec.heads
    return tokens * per_token


def stage_activation_bytes(spec: ModelSpec, stage: int, rows: int, seq: int, dtype_bytes: int) -> int:
    """What autograd keeps for one micro-batch of rows x seq tokens through ``stage``.

    Its layers (``layer_activation_bytes``), and on the last stage the final norm's input and
    the logits: rows x seq x vocab in float32, twice (the logits and cross-entropy's log-softmax).
    """
    if rows <= 0 or seq <= 0:
        raise ConfigError(f"a micro-batch needs positive rows and seq, not {rows} x {seq}")
    start, end = spec.stage_range(stage)
    tokens = rows * seq
    total = (end - start) * layer_activation_bytes(spec, tokens, dtype_bytes)
    if stage == spec.last_stage:
        total += tokens * spec.width * (NORM_BYTES + dtype_bytes) + LOGIT_COPIES * tokens * spec.vocab * 4
    return total


def stage_memory(spec: ModelSpec, stage: int, rows: int, seq: int, precision: str = "bf16") -> StageMemory:
    """Bytes to train ``stage`` of ``spec`` on micro-batches of rows x seq tokens.

    ``"fp32"``: fp32 weights (4 B/param), fp32 grads (4), AdamW's two fp32 moments (8) and one
    stashed fp32 copy of the weights (4): the engine runs a pipelined micro-batch on a frozen copy
    of the weights of its optimizer version; one version in flight is counted. ``"bf16"``: the
    same plus a bf16 working copy (2 B/param) that forwards run on, activations in bf16. On top of
    what autograd keeps, one layer's worth of transients: without it the estimate was 1.7x short
    of nano's measured peak (docs/benchmarks.md, "Memory of one training stage").
    """
    working = _working_bytes(precision)
    params = param_count(spec, stage)
    return StageMemory(weights=working * params, master=MASTER_BYTES * params if working != MASTER_BYTES else 0,
                       grads=GRAD_BYTES * params, adam=ADAM_BYTES * params, stash=STASH_BYTES * params,
                       activations=stage_activation_bytes(spec, stage, rows, seq, working),
                       transient=layer_activation_bytes(spec, rows * seq, working))


def activation_bytes(spec: ModelSpec, rows: int, seq: int, dtype_bytes: int) -> int:
    """The hidden states one stage sends the next for a micro-batch: rows x seq x width x dtype_bytes."""
    return rows * seq * spec.width * dtype_bytes


def default_rows(spec: ModelSpec) -> int:
    """Micro-batch rows a run of this model uses by default (each of ``spec.context`` tokens)."""
    return TIER_ROWS.get(spec.family, DEFAULT_ROWS)


def largest_stage_memory(spec: ModelSpec, rows: int | None = None, precision: str = "bf16") -> int:
    """The most bytes any stage of ``spec`` needs, micro-batches of rows (default_rows) x context tokens."""
    rows = default_rows(spec) if rows is None else rows
    return max(stage_memory(spec, s, rows, spec.context, precision).total for s in range(spec.n_stages))


@dataclass(frozen=True)
class TierRow:
    """One model's line in the tier table."""

    model: str
    n_layers: int
    stage_size: int
    stages: int
    rows: int  # default micro-batch rows, each of the model's context
    params: int  # the whole model's parameters
    params_per_stage: int  # the most parameters any stage holds
    memory: int  # bytes of the largest stage in bf16 (stage_memory), with the catalog's vocabulary
    memory_bpe: int  # the same with a SIZING_VOCAB-token vocabulary
    activation_bf16: int  # bytes of one micro-batch's hidden states between stages, bf16
    activation_fp32: int  # the same in fp32


def tier_table() -> list[TierRow]:
    """The catalog, model by model: its stages and what one stage costs to train."""
    table = []
    for name, spec in MODELS.items():
        rows = default_rows(spec)
        table.append(TierRow(
            name, spec.n_layers, spec.stage_size, spec.n_stages, rows, model_param_count(spec),
            max(param_count(spec, s) for s in range(spec.n_stages)), largest_stage_memory(spec),
            largest_stage_memory(dataclasses.replace(spec, vocab=SIZING_VOCAB)),
            activation_bytes(spec, rows, spec.context, 2), activation_bytes(spec, rows, spec.context, 4)))
    return table


def format_tier_table() -> str:
    """``tier_table()`` as a Markdown table (it reads as plain text too)."""
    lines = ["| model | params | layers | stages x size | rows x seq | params/stage | GB/stage (bf16) | GB, 32k vocab "
             "| activations bf16 / fp32 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in tier_table():
        seq = MODELS[row.model].context
        lines.append(f"| {row.model} | {_count(row.params)} | {row.n_layers} | {row.stages} x {row.stage_size} "
                     f"| {row.rows} x {seq} | {_count(row.params_per_stage)} | {row.memory / GB:.2f} "
                     f"| {row.memory_bpe / GB:.2f} "
                     f"| {row.activation_bf16 / 2**20:.1f} / {row.activation_fp32 / 2**20:.1f} MiB |")
    return "\n".join(lines)


def _count(params: int) -> str:
    return f"{params / 1e9:.1f}B" if params >= 10**9 else f"{params / 1e6:.1f}M"
