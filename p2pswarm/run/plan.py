"""What a model's stage puts on the wire and on disk, from its spec alone: the size plans.

A stage sends the next one micro-batches of hidden states (``[rows, seq, width]`` in the run's
activation dtype) with their target tokens, each micro-batch as ONE frame of the activation
protocol; the gradient that comes back is the same tensor without targets. So the rule is simple:
a micro-batch's message must fit one frame (``FRAME_BUDGET``, the wire's payload limit), and its
targets ``MAX_TARGETS``. ``activation_plan`` says how many rows fit; a run file whose
micro-batch does not fit is refused with one line (``activation_problem``), and a place that cuts
micro-batches of its own (evaluation) takes at most ``fitting_rows``.

A stage's snapshot holds its fp32 weights, AdamW's two moments, DiLoCo's start weights and
momentum and the error-feedback residual (``snapshot_plan``). ``MAX_SNAPSHOT_BYTES``, the limit of
``checkpoint`` and of the snapshot protocol, is the largest such snapshot of any catalog stage
(with a ``SIZING_VOCAB`` vocabulary on the end stages), rounded up to a GiB.

Pure arithmetic: no torch, no trio, nothing allocated (the xl tier's numbers are computed on a
laptop).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from p2pswarm import wire
from p2pswarm.errors import ConfigError
from p2pswarm.model.catalog import MODELS, SIZING_VOCAB, ModelSpec, param_count

FRAME_BUDGET = wire.MAX_PAYLOAD_BYTES  # a micro-batch's tensor and targets are one frame's payload
FP32_BYTES = 4  # snapshots keep every tensor in float32 (master weights and optimizer state)
SNAPSHOT_COPIES = 6  # weights, AdamW exp_avg and exp_avg_sq, DiLoCo start and momentum, error-feedback residual
SNAPSHOT_OVERHEAD = 64 * 1024 * 1024  # the header (<= 16 MiB), padding and digest, with room to spare
GIB = 1024**3  # the snapshot limit is rounded up to whole GiB
MAX_TARGETS = 1 << 22  # target bytes a forward may carry: 256 rows x 4096 tokens x 4 bytes fits
BYTE_TOKEN_VOCAB = 1 << 8  # vocabularies up to here send a target as one byte (uint8)
SHORT_TOKEN_VOCAB = 1 << 16  # up to here as two (little-endian uint16); beyond, four (little-endian int32)


def target_bytes_per_token(vocab: int) -> int:
    """How many bytes one target token takes on the wire for a run of this vocabulary: 1 (uint8) up to
    256, 2 (uint16) up to 65,536, else 4 (int32: torch has no arithmetic on uint32; ids < 2^31 fit)."""
    if vocab < 1:
        raise ValueError(f"a vocabulary has at least one token, not {vocab}")
    return 1 if vocab <= BYTE_TOKEN_VOCAB else 2 if vocab <= SHORT_TOKEN_VOCAB else 4


@dataclass(frozen=True)
class ActivationPlan:
    """One micro-batch of ``rows`` x ``seq`` tokens of a stage's hidden states on the wire."""

    rows: int  # the rows asked for
    seq: int  # tokens per row
    dtype: str  # the activation dtype on the wire (a ``wire.DTYPE_SIZES`` key)
    row_bytes: int  # one row's tensor bytes plus its target bytes
    message_bytes: int  # the forward's payload: rows x row_bytes
    rows_that_fit: int  # the most rows whose message fits FRAME_BUDGET (and whose targets MAX_TARGETS)

    @property
    def admitted(self) -> bool:
        return 1 <= self.rows <= self.rows_that_fit


def target_bytes(spec: ModelSpec) -> int:
    """Bytes one target token takes on the wire for this model's vocabulary (1, 2 or 4)."""
    return target_bytes_per_token(spec.vocab)


def activation_plan(spec: ModelSpec, rows: int, seq: int, dtype: str, *, budget: int = FRAME_BUDGET) -> ActivationPlan:
    """How a micro-batch of ``rows`` x ``seq`` tokens of ``spec`` in ``dtype`` travels; ConfigError
    for a dtype the wire does not carry or a non-positive shape."""
    itemsize = wire.DTYPE_SIZES.get(dtype)
    if itemsize is None:
        raise ConfigError(f"activation dtype must be one of {', '.join(sorted(wire.DTYPE_SIZES))}, not {dtype!r}")
    if type(rows) is not int or type(seq) is not int or rows < 1 or seq < 1:
        raise ConfigError(f"a micro-batch needs positive rows and seq, not {rows!r} x {seq!r}")
    targets = seq * target_bytes(spec)
    row_bytes = seq * spec.width * itemsize + targets
    fit = min(budget // row_bytes, MAX_TARGETS // targets)
    return ActivationPlan(rows, seq, dtype, row_bytes, rows * row_bytes, fit)


def activation_problem(spec: ModelSpec, rows: int, seq: int, dtype: str) -> str | None:
    """None if the micro-batch fits one frame, else the one line that says why not and what fits."""
    plan = activation_plan(spec, rows, seq, dtype)
    if plan.admitted:
        return None
    if plan.rows_that_fit < 1:
        return (f"one row of {seq} tokens of {spec.name} in {dtype} is {plan.row_bytes} bytes, more than a "
                f"frame's {FRAME_BUDGET}: use fewer tokens a row or a narrower dtype")
    return (f"{rows} rows x {seq} tokens of {spec.name} in {dtype} are {plan.message_bytes} bytes a micro-batch, "
            f"more than a frame's {FRAME_BUDGET}: use at most {plan.rows_that_fit} rows")


def fitting_rows(spec: ModelSpec, rows: int, seq: int, dtype: str) -> int:
    """``rows``, or fewer where a micro-batch of them would not fit one frame (at least 1)."""
    return max(1, min(rows, activation_plan(spec, rows, seq, dtype).rows_that_fit))


def max_message_bytes(spec: ModelSpec, rows: int, seq: int, dtype: str) -> int:
    """The largest forward payload a receiver of ``spec``'s micro-batches (up to ``rows`` x ``seq``
    in ``dtype``) must accept: the message, within FRAME_BUDGET."""
    return min(FRAME_BUDGET, activation_plan(spec, rows, seq, dtype).message_bytes)


@dataclass(frozen=True)
class SnapshotPlan:
    """A stage's snapshot, from its parameter count."""

    params: int  # the stage's parameters
    tensor_bytes: int  # SNAPSHOT_COPIES fp32 copies of them
    total_bytes: int  # with SNAPSHOT_OVERHEAD on top: what the snapshot limit must admit


def snapshot_plan(spec: ModelSpec, stage: int) -> SnapshotPlan:
    """What a snapshot of ``stage`` of ``spec`` takes (weights, AdamW, DiLoCo start and momentum, fp32)."""
    params = param_count(spec, stage)
    tensors = SNAPSHOT_COPIES * FP32_BYTES * params
    return SnapshotPlan(params, tensors, tensors + SNAPSHOT_OVERHEAD)


def largest_snapshot(models: Iterable[ModelSpec]) -> int:
    """The most bytes a snapshot of any stage of any of ``models`` takes, with at least a
    SIZING_VOCAB vocabulary (``snapshot_plan``)."""
    sized = [dataclasses.replace(spec, vocab=max(spec.vocab, SIZING_VOCAB)) for spec in models]
    return max(snapshot_plan(spec, stage).total_bytes for spec in sized for stage in range(spec.n_stages))


MAX_SNAPSHOT_BYTES = -(-largest_snapshot(MODELS.values()) // GIB) * GIB  # the largest catalog stage's snapshot
