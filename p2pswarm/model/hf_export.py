"""A Hugging Face model directory from the stages' snapshots: ``transformers`` loads it with no custom code.

Each stage's weights are its DiLoCo *agreed* weights (the snapshot's ``diloco.start``: the flat fp32
vector every replica of the stage holds after outer round ``diloco.rounds``), not a replica's live
weights, which are a few inner steps of one replica's own work on top. The flat vector is in the
order of ``StageModule.named_parameters()`` (``diloco.outer.flatten`` of the engine's params), which is
the order of the snapshot's own module weights (``engine.module``: a state dict with no buffers), so
their names and shapes cut it back into tensors (no module is built: no memory, no torch init).

**Compatibility rule.** Every stage of the model, once each, from one model and one run, and the
stages' outer rounds within ``MAX_ROUND_SPREAD`` (1) of each other. The stages of a swarm step
together (every micro-batch goes through all of them), so their rounds come at about the same
inner steps; a stage one round ahead of another is H inner steps ahead, the same gap the swarm's
own held-out evaluation accepts while a round completes. A gap of 2 or more means a stage fell
behind (or a file is old): the mix would be a model no one trained, so it is refused.

The directory (``write_export``): ``config.json`` (Llama), ``model.safetensors`` (or shards of at
most ``shard_bytes`` with ``model.safetensors.index.json``), ``generation_config.json``, tokenizer
files ``AutoTokenizer`` loads (the run's ``tokenizer.json``; for the byte-level run a ``tokenizers``
byte-level BPE with no merges whose ids are the byte values; their contents in ``model.hf_files``),
and a model card. It is written into a temporary directory beside the target and renamed into
place: a failure (a full disk) removes it.

Torch (imported when first needed: the CLI's parser reads ``MAX_ROUND_SPREAD``) and safetensors; no
transformers (a dev extra), no trio.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2pswarm.errors import ConfigError
from p2pswarm.model.catalog import ModelSpec, get_model, param_count
from p2pswarm.model.hf_files import byte_tokenizer_json, config_json, generation_config_json, tokenizer_config_json
from p2pswarm.model.hf_names import hf_name

if TYPE_CHECKING:
    import torch

    from p2pswarm.model.subspace import Subspace

SHARD_BYTES = 5 * 10**9  # transformers' own default max_shard_size ("5GB"): one file below it, shards above
MAX_ROUND_SPREAD = 1  # stages' outer rounds may differ by this much (module docstring: the rule)
STATE_FORMAT = 1  # the snapshot state layout this reads (diloco.service.STATE_FORMAT)
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_METADATA = {"format": "pt"}  # what transformers expects of a PyTorch safetensors file
TEMP_PREFIX = ".export-"  # the temporary directory beside the target
LOAD_LINES = ("from transformers import AutoModelForCausalLM, AutoTokenizer",
              'model = AutoModelForCausalLM.from_pretrained("{dir}")',
              'tokenizer = AutoTokenizer.from_pretrained("{dir}")')


@dataclass(frozen=True, eq=False)
class StageSnapshot:
    """What an export takes of one stage's decoded snapshot."""

    model: str  # the catalog name, NAME/S
    stage: int
    round: int  # the outer rounds its agreed weights are the result of
    step: int  # the replica's inner steps
    tokens: int  # tokens of the micro-batches the replica trained itself
    start: torch.Tensor  # the agreed weights, flat fp32
    layout: tuple[tuple[str, tuple[int, ...]], ...]  # (our name, shape) of each weight, in ``start``'s order
    source: str  # "peer ID" or a file's path: for messages and the card
    run: str | None = None  # the run identity (hex) when known (an API, a snapshot directory's name)
    subspace: int = 0  # directions of a subspace-constrained model (model.subspace); 0: a plain one


def stage_snapshot(state: Any, source: str, run: str | None = None) -> StageSnapshot:
    """The export's view of a decoded snapshot state (``checkpoint.decode_state``); ConfigError if it is not one."""
    import torch

    try:
        engine, diloco = state["engine"], state["diloco"]
        start, model, stage = diloco["start"], state["model"], state["stage"]
        values = (state["format"], diloco["rounds"], engine["step"], engine["tokens"], stage)
    except (TypeError, KeyError) as exc:
        raise ConfigError(f"{source}: not a p2pswarm stage snapshot (no {exc})") from None
    if values[0] != STATE_FORMAT or not all(type(v) is int and v >= 0 for v in values[1:]) or type(model) is not str:
        raise ConfigError(f"{source}: not a p2pswarm stage snapshot of format {STATE_FORMAT}")
    if not isinstance(start, torch.Tensor) or start.dtype != torch.float32 or start.dim() != 1:
        raise ConfigError(f"{source}: its agreed weights are not a flat float32 vector")
    module = engine.get("module")
    if not isinstance(module, dict) or not all(isinstance(t, torch.Tensor) for t in module.values()):
        raise ConfigError(f"{source}: its engine holds no module weights")
    layout = tuple((name, tuple(tensor.shape)) for name, tensor in module.items())
    if sum(_prod(shape) for _, shape in layout) != start.numel():
        raise ConfigError(f"{source}: {start.numel()} agreed weights for a module of "
                          f"{sum(_prod(shape) for _, shape in layout)}")
    subspace = engine.get("subspace", 0)
    if type(subspace) is not int or subspace < 0:
        raise ConfigError(f"{source}: a subspace of {subspace!r} directions")
    return StageSnapshot(model, stage, diloco["rounds"], engine["step"], engine["tokens"], start, layout, source, run,
                         subspace)


def vocab_of(snapshots: Sequence[StageSnapshot], spec: ModelSpec) -> int:
    """The vocabulary the snapshots were trained with: the rows of stage 0's embedding."""
    first = next(s for s in snapshots if s.stage == 0)
    shape = dict(first.layout).get("embed_tokens.weight")
    if shape is None or len(shape) != 2 or shape[1] != spec.width:
        raise ConfigError(f"{first.source}: no embedding of width {spec.width}: not stage 0 of {spec.name}")
    return shape[0]


def check_stages(snapshots: Sequence[StageSnapshot], vocab: int | None = None) -> ModelSpec:
    """The model spec the snapshots make together (module docstring: the rule); ConfigError, one line, if none."""
    if not snapshots:
        raise ConfigError("no stage snapshot to export")
    models = {s.model for s in snapshots}
    if len(models) > 1:
        raise ConfigError(f"the snapshots are of different models: {', '.join(sorted(models))}")
    runs = {s.run for s in snapshots if s.run is not None}
    if len(runs) > 1:
        raise ConfigError(f"the snapshots are of different runs: {', '.join(sorted(runs))}")
    spec = get_model(snapshots[0].model)
    by_stage: dict[int, StageSnapshot] = {}
    for s in snapshots:
        if s.stage in by_stage:
            raise ConfigError(f"stage {s.stage} given twice: {by_stage[s.stage].source} and {s.source}")
        by_stage[s.stage] = s
    missing = [stage for stage in range(spec.n_stages) if stage not in by_stage]
    if missing or len(by_stage) != spec.n_stages:
        raise ConfigError(f"{spec.name} has {spec.n_stages} stages; no snapshot of stage(s) "
                          f"{', '.join(map(str, missing)) or '?'}")
    rounds = [by_stage[stage].round for stage in range(spec.n_stages)]
    if max(rounds) - min(rounds) > MAX_ROUND_SPREAD:
        raise ConfigError(f"the stages' outer rounds {rounds} are more than {MAX_ROUND_SPREAD} apart: not one model "
                          f"(export again when the stages have caught up)")
    spec = replace(spec, vocab=vocab or vocab_of(snapshots, spec))
    for s in snapshots:
        if s.start.numel() != param_count(spec, s.stage) or not _has_layers(s, spec):
            raise ConfigError(f"{s.source}: {s.start.numel()} weights are not stage {s.stage} of {spec.name} "
                              f"(vocab {spec.vocab}: {param_count(spec, s.stage)})")
    return spec


def _has_layers(snapshot: StageSnapshot, spec: ModelSpec) -> bool:
    """Whether the snapshot's weights are named as stage ``snapshot.stage``'s layers (local indices 0..n-1)."""
    start, end = spec.stage_range(snapshot.stage)
    local = {int(name.split(".")[1]) for name, _ in snapshot.layout if name.startswith("layers.")}
    return local == set(range(end - start))


@dataclass(frozen=True)
class Slice:
    """One weight of the export: where it lies in its stage's flat vector, and its HF name."""

    name: str
    stage: int
    offset: int
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return 4 * _prod(self.shape)  # fp32


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def weight_slices(spec: ModelSpec, snapshots: Sequence[StageSnapshot]) -> list[Slice]:
    """Every weight of the model under its HF name, stage by stage, in the flat vectors' order (the
    order of the module's weights: ``named_parameters``, which ``diloco.outer.flatten`` follows)."""
    slices = []
    for snapshot in sorted(snapshots, key=lambda s: s.stage):
        offset = 0
        for name, shape in snapshot.layout:
            slices.append(Slice(hf_name(name, spec.stage_range(snapshot.stage)[0]), snapshot.stage, offset, shape))
            offset += _prod(shape)
    return slices


def plan_shards(slices: Sequence[Slice], shard_bytes: int) -> list[list[Slice]]:
    """Consecutive weights in files of at most ``shard_bytes`` (a bigger weight gets a file of its own)."""
    if shard_bytes < 1:
        raise ConfigError(f"the shard size must be positive, not {shard_bytes}")
    shards: list[list[Slice]] = [[]]
    size = 0
    for s in slices:
        if shards[-1] and size + s.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """transformers' names: ``model.safetensors``, or ``model-00001-of-0000N.safetensors``."""
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


# --- the model card -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Card:
    """What the model card says beyond the model itself."""

    run: str  # identity (hex), or "unknown"
    run_name: str
    tokens: int
    heldout_bpb: float | None  # the swarm's held-out bits per byte of the exported rounds; None: not measured
    heldout_note: str  # where the figure came from, or why there is none
    exported_at: str  # ISO 8601, UTC
    source: str  # "the swarm through API HOST:PORT" or "snapshot files"


def model_card(spec: ModelSpec, snapshots: Sequence[StageSnapshot], card: Card, tokenizer: str) -> str:
    figure = f"{card.heldout_bpb:.4f} bits per byte ({card.heldout_note})" if card.heldout_bpb is not None \
        else f"not measured ({card.heldout_note})"
    rows = "\n".join(f"| {s.stage} | {spec.stage_range(s.stage)[0]}:{spec.stage_range(s.stage)[1]} | {s.round} | "
                     f"{s.step} | {s.tokens} | {s.source} |" for s in sorted(snapshots, key=lambda s: s.stage))
    load = "\n".join(line.format(dir="DIR") for line in LOAD_LINES)
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [p2pswarm, llama]
---
# {spec.name}, trained by a p2pswarm swarm

- Run: `{card.run_name}`, identity `{card.run}`
- Model: Llama, {spec.n_layers} layers, width {spec.width}, {spec.heads} heads ({spec.kv_heads} KV), \
vocabulary {spec.vocab} ({tokenizer}), context {spec.context}, float32
- Tokens trained: {card.tokens}
- Held-out: {figure}
- Outer rounds (DiLoCo): {", ".join(f"stage {s.stage}: {s.round}" for s in sorted(snapshots, key=lambda s: s.stage))}
- Exported: {card.exported_at}, from {card.source}

Each stage's weights are the ones its replicas agreed on in the outer round shown (not one replica's
live weights). The stages come from one run and their outer rounds are within {MAX_ROUND_SPREAD} of each
other: the stages of a swarm run their rounds at about the same inner steps.

| stage | layers | outer round | inner steps | tokens (that replica) | from |
|---|---|---|---|---|---|
{rows}

## Use it

```python
{load}
```
"""


# --- writing ---------------------------------------------------------------------------------------


def check_out_dir(out: Path, force: bool) -> None:
    """ConfigError unless ``out`` can become the export: absent, an empty directory, or ``force``."""
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise ConfigError(f"--out {out}: exists and is not a directory")
        if not force and any(out.iterdir()):
            raise ConfigError(f"--out {out}: exists and is not empty (--force replaces it)")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: the folder {out.parent} does not exist")


def _write_file(path: Path, data: bytes) -> None:
    """One file of the export (tests replace it to fill the disk)."""
    with open(path, "wb") as f:
        f.write(data)


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=SAFETENSORS_METADATA)


def _write_json(path: Path, doc: dict) -> None:
    _write_file(path, (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode())


def _write_weights(temp: Path, spec: ModelSpec, snapshots: Sequence[StageSnapshot], shard_bytes: int,
                   fixed: Subspace | None) -> int:
    """The safetensors file(s) (and the index when sharded); returns the bytes of weights written. A
    subspace model's weights (``fixed``: its fixed parts) are written with their projections folded in."""
    flats = {s.stage: s.start for s in snapshots}
    shards = plan_shards(weight_slices(spec, snapshots), shard_bytes)
    names, weight_map, total = shard_names(len(shards)), {}, 0
    for shard, file_name in zip(shards, names):
        tensors = {s.name: flats[s.stage][s.offset:s.offset + _prod(s.shape)].view(s.shape).clone() for s in shard}
        if fixed is not None:
            from p2pswarm.model.subspace import effective_weights  # torch

            tensors = effective_weights(tensors, fixed)
        _save_shard(tensors, temp / file_name)
        weight_map.update({s.name: file_name for s in shard})
        total += sum(s.nbytes for s in shard)
    if len(shards) > 1:
        _write_json(temp / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return total


def _write_tokenizer(temp: Path, spec: ModelSpec, tokenizer_file: Path | None) -> None:
    """The run's tokenizer.json as it is, or the byte-level one (``tokenizer_file`` None)."""
    data = tokenizer_file.read_bytes() if tokenizer_file else byte_tokenizer_json().encode()
    _write_file(temp / "tokenizer.json", data)
    _write_json(temp / "tokenizer_config.json", tokenizer_config_json(spec))


@dataclass(frozen=True)
class Written:
    out: Path
    weight_bytes: int
    files: tuple[str, ...]


def write_export(out: Path, spec: ModelSpec, snapshots: Sequence[StageSnapshot], card: Card, *,
                 tokenizer_file: Path | None = None, force: bool = False,
                 shard_bytes: int = SHARD_BYTES, fixed: Subspace | None = None) -> Written:
    """The HF directory at ``out``, whole or not at all (module docstring); ConfigError, one line, on failure.
    ``fixed``: a subspace model's fixed parts (``model.subspace.build`` of its run), folded into its weights."""
    if (fixed.rank if fixed is not None else 0) != max(s.subspace for s in snapshots):
        raise ConfigError(f"the snapshots are of a model constrained to {max(s.subspace for s in snapshots)} "
                          f"directions: its run file is needed (--run) to export it")
    out = Path(out)
    check_out_dir(out, force)
    try:
        temp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{out.name}-", dir=out.parent))
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot create a directory beside it ({exc.strerror})") from None
    try:
        weight_bytes = _write_weights(temp, spec, snapshots, shard_bytes, fixed)
        _write_json(temp / "config.json", config_json(spec))
        _write_json(temp / "generation_config.json", generation_config_json(spec))
        _write_tokenizer(temp, spec, tokenizer_file)
        tokenizer = tokenizer_file.name if tokenizer_file else "byte-level: ids are the UTF-8 bytes"
        _write_file(temp / "README.md", model_card(spec, snapshots, card, tokenizer).encode())
        files = tuple(sorted(p.name for p in temp.iterdir()))
        _sync_dir(temp)
        _move_into_place(temp, out, force)
    except BaseException as exc:
        shutil.rmtree(temp, ignore_errors=True)
        if isinstance(exc, OSError):
            why = "the disk is full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
            raise ConfigError(f"writing the export to {out}: {why}; nothing was written") from None
        raise
    return Written(out, weight_bytes, files)


def _sync_dir(path: Path) -> None:
    """The files' bytes on disk before the rename makes them the export."""
    for child in path.iterdir():
        fd = os.open(child, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _move_into_place(temp: Path, out: Path, force: bool) -> None:
    """Rename ``temp`` to ``out``; an existing ``out`` (empty, or any with ``force``) is replaced."""
    if out.is_dir() and not out.is_symlink():
        if not any(out.iterdir()):
            out.rmdir()
        elif force:
            old = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{out.name}-old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(temp, out)
            shutil.rmtree(old, ignore_errors=True)
            return
    elif out.exists() or out.is_symlink():
        out.unlink()
    os.replace(temp, out)
