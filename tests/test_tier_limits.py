"""Every catalog model trains within the wire's and the disk's limits: the proof, tier by tier.

For each ``catalog.MODELS`` entry, built on the meta device (nothing is allocated: the xl tier's
stages are tens of GB) or from the catalog's arithmetic, this shows that

- its activation message (a stage's real output, run on meta tensors, at the tier's default rows
  and context, in bfloat16 and float32, with its targets) fits one frame: bf16 at the default
  rows as is, fp32 at ``plan.fitting_rows`` (at least one row; a run file asking for more is
  refused with one line), and the receiver's bound admits it;
- its DiLoCo outer round, for 2 and 8 replicas and every codec, cuts the largest stage's flat
  pseudo-gradient into pieces that each fit a decoder (MAX_NUMEL) and a frame once encoded, and
  the Hello that names the stage is valid;
- its snapshot (fp32 weights, AdamW's two moments, DiLoCo's start and momentum, the error-feedback
  residual; with a SIZING_VOCAB vocabulary on the end stages) is within MAX_SNAPSHOT_BYTES on disk
  and on the snapshot protocol, whose offsets and totals go past 2^32.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from p2pswarm import wire
from p2pswarm.diloco import checkpoint, snapshots
from p2pswarm.diloco import messages as msgs
from p2pswarm.model import catalog
from p2pswarm.model.transformer import StageModule
from p2pswarm.run import plan
from p2pswarm.swarm.activation import MAX_TARGETS, SESSION_BYTES, Forward
from p2pswarm.swarm.buffers import Priority

TIERS = sorted(catalog.MODELS)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def built_stages(spec: catalog.ModelSpec) -> list[int]:
    """The first, a middle and the last stage: every other stage is a middle one of the same size."""
    return sorted({0, min(1, spec.last_stage), spec.last_stage})


@functools.cache  # one build per stage for the whole file (``.to(dtype)`` re-types it in place)
def meta_stage(spec: catalog.ModelSpec, stage: int) -> StageModule:
    with torch.device("meta"):
        return StageModule(spec, stage)


def stage_output(spec: catalog.ModelSpec, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """What stage 0 sends on: its real forward, on meta tensors (shapes and dtypes, no data)."""
    module = meta_stage(spec, 0).to(dtype)
    with torch.device("meta"):
        return module(torch.zeros(rows, spec.context, dtype=torch.int64))


@pytest.mark.parametrize("name", TIERS)
def test_the_catalog_arithmetic_is_the_built_stage(name):
    spec = catalog.MODELS[name]
    for stage in built_stages(spec):
        module = meta_stage(spec, stage)
        assert sum(p.numel() for p in module.parameters()) == catalog.param_count(spec, stage)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("name", TIERS)
def test_the_activation_message_fits_one_frame(name, dtype):
    spec = catalog.MODELS[name]
    asked = catalog.default_rows(spec)
    rows = asked if dtype == "bfloat16" else plan.fitting_rows(spec, asked, spec.context, dtype)
    activation_plan = plan.activation_plan(spec, rows, spec.context, dtype)
    assert activation_plan.admitted and activation_plan.rows_that_fit >= 1, activation_plan
    assert plan.activation_problem(spec, rows, spec.context, dtype) is None
    if rows < asked:  # a run file asking for the default rows in fp32 is refused, in one line
        problem = plan.activation_problem(spec, asked, spec.context, dtype)
        assert problem is not None and "\n" not in problem and f"at most {rows} rows" in problem
    if name in ("nano", "micro", "small", "medium", "large", "xl") and dtype == "bfloat16":
        assert rows == asked  # the tiers' default rows are sized for bf16 activations

    out = stage_output(spec, rows, DTYPES[dtype])
    assert tuple(out.shape) == (rows, spec.context, spec.width) and out.dtype == DTYPES[dtype]
    targets = rows * spec.context * plan.target_bytes(spec)
    payload = out.numel() * out.element_size() + targets
    assert payload == activation_plan.message_bytes <= wire.MAX_PAYLOAD_BYTES and targets <= MAX_TARGETS
    message = Forward(b"s" * SESSION_BYTES, 0, 1, int(Priority.TRAINING_FORWARD), 0, dtype, tuple(out.shape), targets)
    message.check(payload)  # the message is valid with that payload (and the payload within a frame, above)
    receiver = plan.max_message_bytes(spec, 256, spec.context, dtype)  # SwarmService._max_payload's bound
    assert payload <= receiver <= wire.MAX_PAYLOAD_BYTES


@pytest.mark.parametrize("replicas", [2, 8])
@pytest.mark.parametrize("name", TIERS)
def test_the_diloco_round_cuts_every_stage_into_admitted_pieces(name, replicas):
    spec = catalog.MODELS[name]
    numel = max(catalog.param_count(spec, stage) for stage in range(spec.n_stages))
    wire.encode_frame(msgs.Hello(spec.last_stage, 0, numel, "int8", True, False, ()))  # the stage is nameable
    receiver = min(wire.MAX_PAYLOAD_BYTES, msgs.expected_bytes("float32", numel))  # the DiLoCo service's bound
    for codec in msgs.CODECS:
        shard_plan = msgs.shard_plan(numel, replicas, codec)
        assert shard_plan.bounds[0][0] == 0 and shard_plan.bounds[-1][1] == numel
        largest = max(b - a for a, b in shard_plan.bounds)
        assert largest <= msgs.MAX_NUMEL and msgs.expected_bytes(codec, largest) <= receiver
        assert shard_plan.pieces <= msgs.MAX_PIECES


@pytest.mark.parametrize("name", TIERS)
def test_the_snapshot_fits_the_limit_on_disk_and_on_the_wire(name):
    spec = dataclasses.replace(catalog.MODELS[name], vocab=max(catalog.MODELS[name].vocab, catalog.SIZING_VOCAB))
    for stage in range(spec.n_stages):
        snapshot = plan.snapshot_plan(spec, stage)
        assert snapshot.tensor_bytes == 6 * 4 * catalog.param_count(spec, stage)
        assert snapshot.total_bytes <= checkpoint.MAX_SNAPSHOT_BYTES == snapshots.MAX_SNAPSHOT_BYTES
    total = max(plan.snapshot_plan(spec, stage).total_bytes for stage in range(spec.n_stages))
    last = snapshots.Part(spec.name, 0, 3, 10, b"d" * 32, total, total - 1)  # the last byte of the largest
    assert wire.decode_frame(wire.encode_frame(last, b"x"))[0] == last
    ask = snapshots.Get(spec.name, 0, b"d" * 32, total - 1)
    assert wire.decode_frame(wire.encode_frame(ask))[0] == ask


def test_the_largest_stage_needs_offsets_past_four_gib():
    assert checkpoint.MAX_SNAPSHOT_BYTES > 2**32  # so the protocol is exercised past u32 above
    assert plan.largest_snapshot(catalog.MODELS.values()) <= checkpoint.MAX_SNAPSHOT_BYTES
