"""Run files: everything the peers of one swarm must agree on, and the identity that binds them.

A run is a TOML file (``p2pswarm join --run NAME|PATH.toml``): NAME is a run packaged with
p2pswarm (``p2pswarm/runs/NAME.toml``, listed by ``p2pswarm models``), a path ending in ``.toml``
is that file. Layout (every key but ``name`` and ``model`` has the default shown)::

    name = "tiny-lm"              # for humans: logs, ``p2pswarm models``; not part of the identity
    model = "tiny-lm/2"           # a catalog model, NAME/S cuts it into S stages
    seed = 0                      # initial weights are a pure function of (model, seed)
    tokenizer = "bytes"           # or "PATH/tokenizer.json", relative to the run file

    [optimizer]                   # AdamW, one step per ``accumulate`` micro-batches
    lr = 3e-3                     # peak learning rate
    betas = [0.9, 0.95]
    eps = 1e-8
    weight_decay = 0.01           # on matrices only: embeddings, norms and biases get none
    grad_clip = 1.0               # global gradient norm of a stage before a step
    accumulate = 1
    warmup_steps = 0              # linear warm-up from 0 to lr
    decay_steps = 0               # then cosine decay to min_lr_ratio x lr over this many steps; 0: constant
    min_lr_ratio = 0.1

    [batch]
    rows = 8                      # sequences per micro-batch
    context = 128                 # tokens per sequence, at most the model's context (default: it)
    dtype = "float32"             # activations and their gradients on the wire: float32, bfloat16, float16
    eval_batches = 8              # held-out micro-batches per evaluation round (32 rows each), 1 to 8

    [wire]                        # what crosses a stage boundary (swarm/quant.py); left out of the
    activations = "dense"         # identity while "dense": dense (batch.dtype), q8 or q4
    gradients = "dense"           # the gradients sent back, chosen on their own
    subspace = 0                  # K > 0: the model's residual writes span K fixed directions, and a
                                  # boundary carries K numbers a token (model/subspace.py); 0: off

    [diloco]                      # the outer-round settings that must match between replicas
    inner_steps = 500             # H
    outer_lr = 0.7
    momentum = 0.9
    codec = "int8"
    aggregator = "trimmed_mean"
    fragments = 1                 # F: a round every H / F steps synchronises 1/F of the stage (Streaming
                                  # DiLoCo); left out of the identity while 1

A malformed file, an unknown key, a wrong type or an out-of-range value is a ``ConfigError`` of
one line naming the file and the key. DiLoCo's local knobs (verify, gather, snapshot period) stay
command-line flags: they need not match.

**Identity.** ``RunSpec.identity`` is 16 hex characters of the sha256 of the run's canonical form:
canonical JSON of the resolved values (the tokenizer by its sha256, not its path), not the file's
text, so key order, comments and spelling (``3e-3`` or ``0.003``) do not change it, and any value
that does changes it. It also hashes the model's dimensions as the catalog resolves them, so two
versions of p2pswarm that build a catalog name differently never mix. The name is not part of it:
the identity decides who trains together. It is part of every stage key and record and travels in
activation, DiLoCo and snapshot requests (``run_bytes``: its 8 bytes), so peers of different runs
never exchange a tensor.

Pure: no torch, no trio (the CLI loads runs before anything starts).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from p2pswarm.errors import ConfigError
from p2pswarm.model.catalog import ModelSpec, get_model
from p2pswarm.model.tokenizer import FileTokenizer, load_tokenizer
from p2pswarm.run import diloco as dls
from p2pswarm.run import plan

DEFAULT_RUN = "tiny-lm"  # what ``join`` trains without --run: today's demo behaviour
RUN_FORMAT = 1  # part of the canonical form: a change of meaning changes every identity
IDENTITY_CHARS = 16  # 64 bits shown and sent: no two runs of one swarm collide by chance
RUNS_PACKAGE = "p2pswarm.runs"  # where packaged runs live (package data)
DTYPES = ("float32", "bfloat16", "float16")  # activation dtypes on the wire
BOUNDARY_CODECS = ("dense", "q8", "q4")  # [wire]: dense in batch.dtype, or 8-/4-bit per token (swarm/quant.py)
DENSE = "dense"
BYTES_TOKENIZER = "bytes"  # the byte-level default: vocab 256, nothing to ship
AGREED_FLAGS = {"inner_steps": "--inner-steps", "outer_lr": "--outer-lr", "momentum": "--outer-momentum",
                "codec": "--codec", "aggregator": "--aggregator",
                "fragments": "--fragments"}  # [diloco] keys: the join flags they replace

DEFAULT_SEED = 0  # any seed works; peers must only agree
DEFAULT_LR = 3e-3  # the tiny-lm sweep's best for a 3-minute run (docs/benchmarks.md)
DEFAULT_BETAS = (0.9, 0.95)  # GPT-style second moment: steadier with small batches
DEFAULT_EPS = 1e-8  # AdamW's usual epsilon
DEFAULT_WEIGHT_DECAY = 0.01  # light: tiny-lm trains for minutes, not epochs
DEFAULT_GRAD_CLIP = 1.0  # the usual global-norm clip for transformers
DEFAULT_ACCUMULATE = 1  # one step per micro-batch: pipelining already averages little
DEFAULT_WARMUP = 0  # no warm-up: tiny-lm's lr is stable from the first step
DEFAULT_DECAY = 0  # constant lr: a swarm trains open-ended unless the run says otherwise
DEFAULT_MIN_LR_RATIO = 0.1  # the usual floor of a cosine schedule (Chinchilla, Llama)
DEFAULT_ROWS = 8  # 8 x 128 tokens of tiny-lm: ~0.5 MiB of float32 activations
DEFAULT_DTYPE = "float32"  # exact on CPU; GPU runs choose bfloat16
MAX_ROWS = 256  # rows a peer accepts in one micro-batch (swarm/codec.py bounds frames by it)
DEFAULT_EVAL_BATCHES = 8  # 8 x 32 rows x 128 bytes of tiny-lm: 32 KiB of held-out text per evaluation round
MAX_EVAL_BATCHES = 8  # a round's micro-batches at most: a stage holds a few rounds' worth (swarm/stage_core.py)
MAX_STEPS = 10**9  # warm-up and decay lengths: beyond any run
MAX_SEED = 2**63 - 1  # seeds are u63 like every counter on the wire
MAX_LR = 1.0  # beyond it AdamW diverges at once: a typo, not a choice
MAX_ACCUMULATE = 4096  # micro-batches per step: far beyond a useful batch


@dataclass(frozen=True)
class RunSpec:
    """One run, resolved (module docstring); ``identity`` decides who trains together."""

    name: str
    model: str  # a catalog name, NAME/S allowed
    seed: int = DEFAULT_SEED
    tokenizer: str = BYTES_TOKENIZER  # "bytes" or the tokenizer file's path, resolved
    tokenizer_sha256: str = ""  # hex of the tokenizer file (bytes: the tokenizer module's fixed id)
    vocab: int = 256
    lr: float = DEFAULT_LR
    betas: tuple[float, float] = DEFAULT_BETAS
    eps: float = DEFAULT_EPS
    weight_decay: float = DEFAULT_WEIGHT_DECAY
    grad_clip: float = DEFAULT_GRAD_CLIP
    accumulate: int = DEFAULT_ACCUMULATE
    warmup_steps: int = DEFAULT_WARMUP
    decay_steps: int = DEFAULT_DECAY
    min_lr_ratio: float = DEFAULT_MIN_LR_RATIO
    rows: int = DEFAULT_ROWS
    context: int = 0  # tokens per sequence (0 only before resolution: the model's context)
    dtype: str = DEFAULT_DTYPE
    eval_batches: int = DEFAULT_EVAL_BATCHES  # the held-out set's size (tests that need no precise figure: fewer)
    activations: str = DENSE  # [wire]: how activations cross a stage boundary
    gradients: str = DENSE  # [wire]: how their gradients come back
    subspace: int = 0  # [wire]: directions of a subspace-constrained model (model/subspace.py); 0: a plain one
    inner_steps: int = dls.INNER_STEPS
    outer_lr: float = dls.OUTER_LR
    momentum: float = dls.OUTER_MOMENTUM
    codec: str = dls.CODEC
    aggregator: str = dls.AGGREGATOR
    fragments: int = 1
    source: str = ""  # where it was read from, for messages; not part of the identity

    def canonical(self) -> dict[str, object]:
        """The values the identity hashes: everything but the name, the tokenizer's path and the source."""
        values = dataclasses.asdict(self)
        for local in ("name", "tokenizer", "source"):
            del values[local]
        for boundary in ("activations", "gradients"):  # dense, the default: the identities runs had before
            if values[boundary] == DENSE:
                del values[boundary]
        for key, default in (("subspace", 0), ("fragments", 1)):  # the identities runs had before them
            if values[key] == default:
                del values[key]
        values["betas"] = list(self.betas)
        values["spec"] = dataclasses.asdict(self.spec())  # the model's dimensions, as this version builds it
        return {"format": RUN_FORMAT, **values}

    @functools.cached_property
    def identity(self) -> str:
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(text.encode()).hexdigest()[:IDENTITY_CHARS]

    @property
    def run_bytes(self) -> bytes:
        """The identity as the 8 bytes that activation, DiLoCo and snapshot requests carry."""
        return bytes.fromhex(self.identity)

    def spec(self) -> ModelSpec:
        """The model as this run trains it: the catalog's, with the tokenizer's vocabulary."""
        return dataclasses.replace(get_model(self.model), vocab=self.vocab)

    def diloco(self, local: dls.DilocoSettings = dls.DilocoSettings()) -> dls.DilocoSettings:
        """``local``'s own knobs (verify, gather, snapshot period) with this run's agreed ones."""
        return dataclasses.replace(local, inner_steps=self.inner_steps, outer_lr=self.outer_lr,
                                   momentum=self.momentum, codec=self.codec, aggregator=self.aggregator,
                                   fragments=self.fragments)

    def with_values(self, **values: Any) -> RunSpec:
        """The run with some values replaced and checked again (``--model`` without ``--run``)."""
        return _checked(dataclasses.replace(self, **values), self.source or self.name)

    def describe(self) -> str:
        return f"run {self.identity} ({self.name})"


def agreed_diloco(settings: dls.DilocoSettings) -> dict[str, object]:
    """The DiLoCo values of ``settings`` that a run fixes, as RunSpec fields."""
    return dict(inner_steps=settings.inner_steps, outer_lr=settings.outer_lr, momentum=settings.momentum,
                codec=settings.codec, aggregator=settings.aggregator, fragments=settings.fragments)


def run_for_join(run: str | None, model: str | None, agreed: dict[str, object]) -> RunSpec:
    """The run ``join`` trains: ``--run`` as it is (with ``--model`` only if equal, DiLoCo flags that
    a run fixes refused), or without it the default run on ``--model`` with those flags applied
    (``agreed``: RunSpec field -> the flag's value, None where not given; the identity follows)."""
    given = {key: value for key, value in agreed.items() if value is not None}
    if run is None:
        base = default_run()
        return base.with_values(model=get_model(model).name if model else base.model, **given)
    loaded = load_run(run)
    if given:
        flag = AGREED_FLAGS[next(iter(given))]
        raise ConfigError(f"{flag} is fixed by the run ({loaded.source}: [diloco]); leave it out with --run")
    if model is not None and get_model(model).name != loaded.model:
        raise ConfigError(f"--model {model} is not the model of run {loaded.name} ({loaded.model}); "
                          f"leave --model out with --run")
    return loaded


def load_run(text: str) -> RunSpec:
    """The run ``text`` names: a path ending in ``.toml``, or the name of a packaged run."""
    if text.endswith(".toml"):
        path = Path(text).expanduser()
        try:
            data = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"run file {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
        return parse_run(data, str(path), base_dir=path.parent)
    try:
        data = resources.files(RUNS_PACKAGE).joinpath(f"{text}.toml").read_text(encoding="utf-8")
    except (FileNotFoundError, OSError):
        raise ConfigError(f"unknown run {text!r}; packaged runs: {', '.join(packaged_runs())} "
                          f"(or a path to a .toml file)") from None
    return parse_run(data, f"{text}.toml (packaged)", base_dir=None)


def packaged_runs() -> list[str]:
    """The names of the runs shipped with p2pswarm."""
    return sorted(p.name[:-5] for p in resources.files(RUNS_PACKAGE).iterdir() if p.name.endswith(".toml"))


@functools.cache
def default_run() -> RunSpec:
    return load_run(DEFAULT_RUN)


# --- parsing -----------------------------------------------------------------------------------

_TOP = {"name": str, "model": str, "seed": int, "tokenizer": str}
_TABLES: dict[str, dict[str, type]] = {
    "optimizer": {"lr": float, "betas": list, "eps": float, "weight_decay": float, "grad_clip": float,
                  "accumulate": int, "warmup_steps": int, "decay_steps": int, "min_lr_ratio": float},
    "batch": {"rows": int, "context": int, "dtype": str, "eval_batches": int},
    "wire": {"activations": str, "gradients": str, "subspace": int},
    "diloco": {"inner_steps": int, "outer_lr": float, "momentum": float, "codec": str, "aggregator": str,
               "fragments": int},
}
_REQUIRED = ("name", "model")


def parse_run(data: str, source: str, base_dir: Path | None) -> RunSpec:
    """The run a TOML text describes; ConfigError naming ``source`` and the key for anything wrong."""
    try:
        doc = tomllib.loads(data)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"run file {source}: not valid TOML ({exc})") from None
    values = _flatten(doc, source)
    for key in _REQUIRED:
        if key not in values:
            raise ConfigError(f"run file {source}: {key}: missing (required)")
    if "betas" in values:
        values["betas"] = _betas(values["betas"], source)
    tokenizer = values.pop("tokenizer", BYTES_TOKENIZER)
    run = RunSpec(**values, source=source)
    try:
        model = get_model(run.model)
    except ConfigError as exc:
        raise ConfigError(f"run file {source}: model: {exc}") from None
    run = dataclasses.replace(run, model=model.name, context=run.context or model.context)
    return _checked(_with_tokenizer(run, tokenizer, source, base_dir), source)


def _flatten(doc: dict[str, Any], source: str) -> dict[str, Any]:
    """The file's values under RunSpec's field names, each of the right type; unknown keys refused."""
    values = {}
    for key, value in doc.items():
        if key in _TABLES:
            if type(value) is not dict:
                raise ConfigError(f"run file {source}: {key}: must be a table ([{key}])")
            for inner, item in value.items():
                values[inner] = _typed(f"{key}.{inner}", item, _TABLES[key].get(inner), source)
        else:
            values[key] = _typed(key, value, _TOP.get(key), source)
    return values


def _typed(key: str, value: object, kind: type | None, source: str) -> object:
    if kind is None:
        raise ConfigError(f"run file {source}: {key}: unknown key")
    if kind is float and type(value) is int:
        value = float(value)  # 1 and 1.0 are the same learning rate, and the same identity
    if type(value) is not kind:
        raise ConfigError(f"run file {source}: {key}: must be {_KIND_NAMES[kind]}, not {type(value).__name__}"
                          f" ({str(value)[:40]})")
    if isinstance(value, float) and not math.isfinite(value):  # type(value) is kind here
        raise ConfigError(f"run file {source}: {key}: must be a finite number, not {value}")
    return value


_KIND_NAMES = {str: "a string", int: "an integer", float: "a number", list: "an array"}


def _betas(value: list[Any], source: str) -> tuple[float, float]:
    if len(value) != 2 or not all(type(b) in (int, float) and 0 <= b < 1 for b in value):
        raise ConfigError(f"run file {source}: optimizer.betas: must be two numbers in [0, 1), not {value}")
    return float(value[0]), float(value[1])


def _with_tokenizer(run: RunSpec, spec: str, source: str, base_dir: Path | None) -> RunSpec:
    if spec != BYTES_TOKENIZER and base_dir is None and not Path(spec).is_absolute():
        raise ConfigError(f"run file {source}: tokenizer: a packaged run can only use 'bytes' or an absolute path")
    try:
        tokenizer = load_tokenizer(spec, base_dir)
    except ConfigError as exc:
        raise ConfigError(f"run file {source}: tokenizer: {exc}") from None
    path = str(tokenizer.path) if isinstance(tokenizer, FileTokenizer) else spec
    return dataclasses.replace(run, tokenizer=path, tokenizer_sha256=tokenizer.sha256, vocab=tokenizer.vocab_size)


def _checked(run: RunSpec, source: str) -> RunSpec:
    """``run`` if every value is within range; else ConfigError naming the first key that is not."""
    model = get_model(run.model)
    problem = _problem(run, model)
    if problem is not None:
        key, why = problem
        raise ConfigError(f"run file {source}: {key}: {why}")
    return run


def _problem(run: RunSpec, model: ModelSpec) -> tuple[str, str] | None:
    checks = [
        ("name", 0 < len(run.name) <= 64 and run.name.isprintable(), "must be 1 to 64 printable characters"),
        ("seed", 0 <= run.seed <= MAX_SEED, f"must be within [0, {MAX_SEED}]"),
        ("optimizer.lr", 0 < run.lr <= MAX_LR, f"must be within (0, {MAX_LR}]"),
        ("optimizer.eps", 0 < run.eps < 1, "must be within (0, 1)"),
        ("optimizer.weight_decay", 0 <= run.weight_decay < 1, "must be within [0, 1)"),
        ("optimizer.grad_clip", 0 < run.grad_clip, "must be positive"),
        ("optimizer.accumulate", 1 <= run.accumulate <= MAX_ACCUMULATE, f"must be within [1, {MAX_ACCUMULATE}]"),
        ("optimizer.warmup_steps", 0 <= run.warmup_steps <= MAX_STEPS, f"must be within [0, {MAX_STEPS}]"),
        ("optimizer.decay_steps", 0 <= run.decay_steps <= MAX_STEPS, f"must be within [0, {MAX_STEPS}]"),
        ("optimizer.min_lr_ratio", 0 <= run.min_lr_ratio <= 1, "must be within [0, 1]"),
        ("batch.rows", 1 <= run.rows <= MAX_ROWS, f"must be within [1, {MAX_ROWS}]"),
        ("batch.context", 1 <= run.context <= model.context, f"must be within [1, {model.context}] (the context "
                                                             f"of {model.name})"),
        ("batch.dtype", run.dtype in DTYPES, f"must be one of {', '.join(DTYPES)}"),
        ("batch.eval_batches", 1 <= run.eval_batches <= MAX_EVAL_BATCHES, f"must be within [1, {MAX_EVAL_BATCHES}]"),
        ("wire.activations", run.activations in BOUNDARY_CODECS, f"must be one of {', '.join(BOUNDARY_CODECS)}"),
        ("wire.gradients", run.gradients in BOUNDARY_CODECS, f"must be one of {', '.join(BOUNDARY_CODECS)}"),
        ("wire.subspace", 0 <= run.subspace <= model.width, f"must be within [0, {model.width}] (the width "
                                                             f"of {model.name}; 0: off)"),
    ]
    for key, ok, why in checks:
        if not ok:
            return key, f"{why}, not {getattr(run, key.rpartition('.')[2])!r}"
    problem = run.diloco().problem()  # the DiLoCo settings' own one-line checks, flag names and all
    if problem is not None:
        field = next(f for f, flag in AGREED_FLAGS.items() if problem.startswith(flag + " "))
        return f"diloco.{field}", problem
    return _plan_problem(run, model)


def _plan_problem(run: RunSpec, model: ModelSpec) -> tuple[str, str] | None:
    """Whether a micro-batch's activation message fits a frame (``model.plan`` when present)."""
    check = getattr(plan, "activation_problem", None)
    problem = check(dataclasses.replace(model, vocab=run.vocab), run.rows, run.context, run.dtype) if check else None
    return ("batch.rows", problem) if problem else None


def format_run(run: RunSpec) -> str:
    """One run resolved, as ``p2pswarm models --run`` prints it."""
    spec = run.spec()
    schedule = (f"warm-up {run.warmup_steps}, cosine over {run.decay_steps} to {run.min_lr_ratio:g} x lr"
                if run.decay_steps else f"warm-up {run.warmup_steps}, then constant")
    return "\n".join([
        f"run           {run.name}   identity {run.identity}   ({run.source})",
        f"model         {spec.name}: {spec.n_layers} layers in {spec.n_stages} stages, width {spec.width}, "
        f"vocab {spec.vocab}, seed {run.seed}",
        f"tokenizer     {run.tokenizer} (sha256 {run.tokenizer_sha256[:16]}…)",
        f"optimizer     AdamW lr {run.lr:g}, betas {run.betas[0]:g}/{run.betas[1]:g}, eps {run.eps:g}, weight decay "
        f"{run.weight_decay:g} on matrices, clip {run.grad_clip:g}, accumulate {run.accumulate}; {schedule}",
        f"micro-batch   {run.rows} x {run.context} tokens, {run.dtype} on the wire "
        f"(activations {run.activations}, gradients {run.gradients}"
        f"{f', a subspace of {run.subspace} directions' if run.subspace else ''})",
        f"diloco        H {run.inner_steps}, outer lr {run.outer_lr:g}, momentum {run.momentum:g}, codec {run.codec}, "
        f"{run.aggregator}{f', {run.fragments} fragments' if run.fragments > 1 else ''}",
    ])


def format_runs_table(runs: list[RunSpec]) -> str:
    """The packaged runs, one line each, as ``p2pswarm models`` lists them."""
    rows = [("run", "model", "identity", "tokenizer", "lr", "rows x context", "dtype")]
    rows += [(r.name, r.model, r.identity, r.tokenizer, f"{r.lr:g}", f"{r.rows} x {r.context}", r.dtype) for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
