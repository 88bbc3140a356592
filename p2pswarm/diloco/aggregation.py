"""Robust combination of the replicas' pseudo-gradient shards, and verification of each one.

In an outer DiLoCo round every replica of a stage contributes its pseudo-gradient, and a plain
mean lets one broken or malicious replica move the shared model anywhere it likes. This module
combines contributions so that a minority of bad ones has bounded influence:

- ``mean``: the plain average (no robustness; the reference point for the others);
- ``trimmed_mean`` (the default): per coordinate, drop the ``floor(n * TRIM_FRACTION)`` lowest
  and highest values and average the rest;
- ``median``: per coordinate (for an even count, the mean of the two middle values);
- ``centered_clip``: centered clipping (Karimireddy, He and Jaggi, 2021), starting from the
  coordinate-wise median, each contribution's pull clipped to a radius derived from the
  contributions themselves;
- ``chunk_clip``: for sparse contributions (``sparse_aggregate``), the mean of every contribution
  clipped, per chunk, to the members' median largest magnitude there. The coordinate-wise ones
  above would drop an entry that only one member sent.

Before combining, ``combine`` checks each peer's contribution against a reference (``verify``):
it must point roughly the same way and have a similar magnitude and spread, otherwise it is
left out, with the reason recorded. Everything here is pure torch, deterministic (contributors
are taken in sorted order, so every replica that combines the same contributions gets the same
bits) and vectorised. Coordinate-wise methods work in blocks of ``BLOCK_ELEMENTS`` coordinates,
so sorting 16 shards of 16M elements never holds more than a block's temporaries at once.
Contributions are expected to be finite: ``compression.decode`` guarantees it for a peer's
shard, and ``combine`` refuses a non-finite own contribution.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from p2pswarm.diloco.compression import all_finite
from p2pswarm.diloco.sparse_aggregate import chunk_clipped_mean, refused_sparse

AGGREGATORS = ("mean", "trimmed_mean", "median", "centered_clip", "chunk_clip")
DEFAULT_AGGREGATOR = "trimmed_mean"  # robust to a quarter of outliers per coordinate, yet averages
TRIM_FRACTION = 0.25  # per side: n=4 drops 1+1, n=8 drops 2+2; below 4 nothing is dropped
CLIP_TAU = 1.0  # clip radius in units of the median distance to the center (see _centered_clip)
CLIP_ITERATIONS = 3  # the paper needs 1 from a good start; 3 from the median, at 3 passes a step
MIN_VERIFIED = 3  # contributions needed before any is judged: with two, neither can be called the liar
NETWORK_MAX = 8  # contributions sorted by a min/max network (28 comparators at 8) rather than torch.sort
BLOCK_ELEMENTS = 1 << 18  # coordinates sorted at once: temporaries ~16 B * n * 256K (64 MiB at n=16)
MIN_COSINE = 0.2  # honest replicas descend the same loss from the same start; noise has cosine ~0
COSINE_SHARE = 0.2  # ...but a group that disagrees (cold start, skewed data) lowers the bar: see _group_bar
AGREEING = 0.5  # a group whose median cosine with the reference is below this does not agree
COSINE_FLOOR = -0.1  # the bar in a group that does not agree: honest ones at pairwise -1/(n-1) measured -0.02
MAX_NORM_RATIO = 4.0  # honest vectors lie within 3x (data skew, more steps); a shard's slice a few % more
MAX_VAR_RATIO = 16.0  # MAX_NORM_RATIO squared: variance scales as the square of magnitude


def judged(members: int) -> bool:
    """Whether a round of ``members`` can tell a liar from an honest replica (``combine``): a round of 2
    checks norms only, so noise of an honest norm passes there and proves no work (``DilocoService``)."""
    return members >= MIN_VERIFIED


def aggregate(contributions: list[torch.Tensor], method: str) -> torch.Tensor:
    """Combine equal-length 1-D float32 tensors with ``method``; a new tensor.

    Raises ValueError on an empty list, tensors that are not 1-D float32 of one length, or an
    unknown method. The inputs are not modified.
    """
    _check_contributions(contributions)
    if method not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {method!r}, expected one of {AGGREGATORS}")
    if len(contributions) == 1:
        return contributions[0].detach().clone()
    if method == "mean":
        return _mean(contributions)
    if method == "trimmed_mean":
        return _blockwise(contributions, lambda block: _trimmed_mean_of_sorted(_sorted(block)))
    if method == "median":
        return _median(contributions)
    if method == "chunk_clip":
        return chunk_clipped_mean(contributions)
    return _centered_clip(contributions)


@dataclass(frozen=True)
class VerifyConfig:
    """Bounds a contribution must meet, relative to the reference, to be accepted."""

    min_cosine: float = MIN_COSINE  # must point roughly the same way as the reference
    max_norm_ratio: float = MAX_NORM_RATIO  # ||c|| / ||ref|| within [1/r, r]
    max_var_ratio: float = MAX_VAR_RATIO  # var(c) / var(ref) within [1/r, r]
    min_projection: float = -math.inf  # dot(c, ref) / ||ref||^2: how far c may pull back along ref
    refuse_short: bool = True  # False: a short or flat c (ratios below 1/r) passes; it can do little harm

    def __post_init__(self) -> None:
        if not -1.0 <= self.min_cosine <= 1.0:
            raise ValueError(f"min_cosine must lie in [-1, 1], got {self.min_cosine}")
        if math.isnan(self.min_projection):
            raise ValueError("min_projection must be a number")
        if not (self.max_norm_ratio >= 1.0 and self.max_var_ratio >= 1.0):
            raise ValueError("max_norm_ratio and max_var_ratio must be at least 1")


@dataclass(frozen=True)
class Verdict:
    """The outcome of ``verify``, with the figures it was based on."""

    accepted: bool
    reason: str  # "" when accepted; else every failed check with its figure, joined by "; "
    cosine: float
    norm_ratio: float
    var_ratio: float
    projection: float = math.nan  # dot(c, ref) / ||ref||^2 (0 for a zero reference)


def verify(contribution: torch.Tensor, reference: torch.Tensor,
           config: VerifyConfig = VerifyConfig()) -> Verdict:
    """Check a contribution's direction, magnitude and spread against ``reference``.

    Zero norms or variances never divide: a ratio x / 0 is 1 when x is 0 too and inf otherwise,
    and the cosine with a zero vector is 1 if both are zero and 0 otherwise. So a zero reference
    (its replicas did not move) accepts only an exactly zero contribution: anything that moved is
    not comparable with it. A NaN or inf anywhere is rejected, and so is a contribution whose
    float32 norm or dot product overflows (an inf or NaN figure never passes a check).
    ValueError if the tensors are not 1-D float32 of one length.
    """
    _check_contributions([contribution, reference])
    if not (all_finite(contribution) and all_finite(reference)):
        nan = math.nan
        return Verdict(False, "non-finite values", nan, nan, nan)
    norm_c = float(torch.linalg.vector_norm(contribution))
    norm_r = float(torch.linalg.vector_norm(reference))
    dot = float(torch.dot(contribution, reference)) if norm_c and norm_r else 0.0
    if norm_c == 0.0 or norm_r == 0.0:
        cosine = 1.0 if norm_c == norm_r else 0.0
    else:
        cosine = dot / (norm_c * norm_r)
        cosine = min(1.0, max(-1.0, cosine)) if math.isfinite(cosine) else cosine  # (float32: -1.0000001)
    projection = dot / norm_r / norm_r if norm_r else 0.0
    norm_ratio = _ratio(norm_c, norm_r)
    var_ratio = _ratio(_variance(contribution), _variance(reference))
    failed = []
    if not cosine >= config.min_cosine:  # written so that a NaN (an overflowed dot) fails
        failed.append(f"cosine {cosine:.3g} < {config.min_cosine:g}")
    if not projection >= config.min_projection:
        failed.append(f"projection {projection:.3g} < {config.min_projection:g}")
    for name, ratio, bound in (("norm", norm_ratio, config.max_norm_ratio),
                               ("variance", var_ratio, config.max_var_ratio)):
        low = 1.0 / bound if config.refuse_short else 0.0
        if not low <= ratio <= bound:
            failed.append(f"{name} ratio {ratio:.3g} outside [{low:.3g}, {bound:g}]")
    return Verdict(not failed, "; ".join(failed), cosine, norm_ratio, var_ratio, projection)


@dataclass(frozen=True)
class Combined:
    """The outcome of ``combine``."""

    result: torch.Tensor
    accepted: tuple[str, ...]  # contributors used, sorted
    rejected: dict[str, str]  # contributor -> why it was left out (the failed checks)


def combine(contributions: dict[str, torch.Tensor], own: str, method: str = DEFAULT_AGGREGATOR,
            verify_config: VerifyConfig | None = VerifyConfig()) -> Combined:
    """Verify every peer's contribution, then aggregate the accepted ones with ``method``.

    ``own`` names the local replica's contribution: it is never verified, always used, and must
    be finite. Verification needs a majority to judge by, so it runs only with at least
    ``MIN_VERIFIED`` contributions: the reference direction is their coordinate-wise median, and
    its length the median of their norms (an honest replica's pseudo-gradient is about as long as
    the others', while the median vector itself is shorter than any of them). With fewer, nothing
    can tell an honest replica from a liar, and a replica's own pseudo-gradient is no reference:
    honest replicas' pseudo-gradients after a few dozen Adam steps are nearly orthogonal (cosine
    ~0 measured in the demo). The cosine bar follows the group's own agreement (``_group_bar``).
    A pair is judged only by what our own contribution can say of the other's: finite, its norm and
    variance within the ratios of ours (no direction: honest ones are nearly orthogonal); noise of
    an honest norm passes, and ``status`` says such a round could not be judged.
    Sparse contributions (``chunk_clip``) are judged against the others' sum instead
    (``sparse_aggregate.refused_sparse``). ``verify_config=None`` aggregates everything unchecked.
    ValueError on local misuse (missing or non-finite own, unknown method, tensors that do not match).
    """
    if own not in contributions:
        raise ValueError(f"own contribution {own!r} is missing")
    if method not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {method!r}, expected one of {AGGREGATORS}")
    names = sorted(contributions)
    tensors = [contributions[name] for name in names]
    _check_contributions(tensors)
    if not all_finite(contributions[own]):
        raise ValueError("own contribution holds non-finite values")
    rejected: dict[str, str] = {}
    unrejected = None  # the coordinate-wise result over every contribution, when the sort made it
    if verify_config is not None and len(tensors) >= MIN_VERIFIED and method == "chunk_clip":  # sparse ones
        judged = [i for i, name in enumerate(names) if name != own]
        found = refused_sparse(tensors, judged, max_norm_ratio=verify_config.max_norm_ratio, floor=COSINE_FLOOR)
        rejected = {names[i]: reason for i, reason in found.items()}
    elif verify_config is not None and len(tensors) >= MIN_VERIFIED:
        median, unrejected = _median_and(tensors, method)  # one sort serves the reference and the result
        reference = _scaled_to_median_norm(median, tensors)
        config = _group_bar(verify_config, [verify(tensor, reference, verify_config).cosine for tensor in tensors])
        for name, tensor in zip(names, tensors):
            if name != own:
                verdict = verify(tensor, reference, config)
                if not verdict.accepted:
                    rejected[name] = verdict.reason
    if verify_config is not None and len(tensors) == 2:  # a pair: what one replica can judge alone
        other = next(name for name in names if name != own)
        verdict = verify(contributions[other], contributions[own], replace(verify_config, min_cosine=-1.0))
        if not verdict.accepted:
            rejected[other] = f"{verdict.reason} (judged against our own: a round of 2)"
    accepted = tuple(name for name in names if name not in rejected)
    if rejected or unrejected is None:
        unrejected = aggregate([contributions[name] for name in accepted], method)
    return Combined(unrejected, accepted, rejected)


# --- helpers ----------------------------------------------------------------------------


def _group_bar(config: VerifyConfig, cosines: list[float]) -> VerifyConfig:
    """``config`` with its cosine bar lowered to ``COSINE_SHARE`` of the group's median cosine
    with the reference when that is lower, and to ``COSINE_FLOOR`` in a group whose median
    cosine is below ``AGREEING``. Honest pseudo-gradients that disagree (pairwise cosine 0 or
    below: a cold start, skewed data) agree with their own median only a little (down to cosine
    ~0 measured for 6 to 8 of them at pairwise -1/(n-1)), so a fixed bar refuses honest ones. A
    bar relative to the group's own agreement refuses only what agrees far less than a typical
    member (a minority cannot move the median); in a group that does not agree, only what points
    against it is refused. (Noise of an honest norm then passes in such a group: there it is
    what an honest orthogonal member looks like, and it harms no more.)"""
    finite = sorted(c for c in cosines if math.isfinite(c))
    if not finite:
        return config
    typical = statistics.median(finite)
    bar = min(config.min_cosine, COSINE_SHARE * typical if typical >= AGREEING else COSINE_FLOOR)
    return config if bar >= config.min_cosine else replace(config, min_cosine=bar)


def _median_and(tensors: list[torch.Tensor], method: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The coordinate-wise median and, when ``method`` is coordinate-wise too, its result: from
    one sort of each block (the same bits as ``aggregate``, which sorts the same blocks)."""
    if method not in ("trimmed_mean", "median"):
        return _median(tensors), None
    if method == "median":
        median = _median(tensors)
        return median, median
    median = torch.empty_like(tensors[0])
    trimmed = torch.empty_like(tensors[0])
    for start in range(0, median.numel(), BLOCK_ELEMENTS):
        ordered = _sorted([tensor[start: start + BLOCK_ELEMENTS] for tensor in tensors])
        median[start: start + BLOCK_ELEMENTS] = _median_of_sorted(ordered)
        trimmed[start: start + BLOCK_ELEMENTS] = _trimmed_mean_of_sorted(ordered)
    return median, trimmed


def _scaled_to_median_norm(median: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The reference: the coordinate-wise median, scaled to the median of the contributions' norms."""
    norms = sorted(_norm(t) for t in tensors)
    middle = len(norms) // 2
    length = norms[middle] if len(norms) % 2 else (norms[middle - 1] + norms[middle]) / 2
    current = _norm(median)
    return median * (length / current) if 0 < current < math.inf and math.isfinite(length) else median


def _norm(tensor: torch.Tensor) -> float:
    """The L2 norm: float32 (fast), or float64 when the float32 one overflows."""
    norm = float(torch.linalg.vector_norm(tensor))
    return norm if math.isfinite(norm) else float(torch.linalg.vector_norm(tensor, dtype=torch.float64))


def _check_contributions(tensors: list[torch.Tensor]) -> None:
    """ValueError unless ``tensors`` is a non-empty list of 1-D float32 tensors of one length."""
    if not tensors:
        raise ValueError("nothing to aggregate")
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or tensor.dtype != torch.float32:
            raise ValueError("contributions must be 1-D float32 tensors")
    if len({tensor.numel() for tensor in tensors}) != 1:
        raise ValueError(f"contributions differ in length: {sorted({t.numel() for t in tensors})}")


def _ratio(a: float, b: float) -> float:
    """a / b, with 0 / 0 = 1 (both absent: alike) and x / 0 = inf (not comparable)."""
    if b == 0.0:
        return 1.0 if a == 0.0 else math.inf
    return a / b


def _variance(tensor: torch.Tensor) -> float:
    """The population variance of the elements (0 for an empty tensor)."""
    return float(torch.var(tensor, correction=0)) if tensor.numel() else 0.0


def _mean(contributions: list[torch.Tensor]) -> torch.Tensor:
    """The plain mean."""
    return _blockwise(contributions, lambda block: _mean_of_rows(block, len(block)))


def _blockwise(contributions: list[torch.Tensor],
               reduce: Callable[[list[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
    """Apply ``reduce`` to each block of ``BLOCK_ELEMENTS`` coordinates (one slice per contribution)."""
    numel = contributions[0].numel()
    result = torch.empty(numel, dtype=torch.float32)
    for start in range(0, numel, BLOCK_ELEMENTS):
        result[start: start + BLOCK_ELEMENTS] = reduce(
            [tensor[start: start + BLOCK_ELEMENTS] for tensor in contributions])
    return result


def _sorted(block: list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    """The slices sorted across contributions: row i holds each coordinate's i-th value.

    For up to NETWORK_MAX contributions an odd-even transposition network of elementwise
    min/max does it: the same values as ``torch.sort`` (for finite inputs), but ~10x faster,
    because torch sorts along a short strided dimension slowly (165 ms for 4 x 4M here)."""
    if len(block) > NETWORK_MAX:
        return torch.sort(torch.stack(block), dim=0).values
    rows = list(block)
    for phase in range(len(rows)):
        for i in range(phase % 2, len(rows) - 1, 2):
            rows[i], rows[i + 1] = torch.minimum(rows[i], rows[i + 1]), torch.maximum(rows[i], rows[i + 1])
    return rows


def _mean_of_rows(rows: list[torch.Tensor] | torch.Tensor, count: int) -> torch.Tensor:
    """The mean of the first ``count`` rows, summed in float64 one row at a time.

    Elementwise adds make each coordinate's result depend on its own values only (a reduction
    kernel's vectorised order would depend on the block's width); float64 cannot overflow, and
    equal values average to themselves exactly.
    """
    total = rows[0].double()
    for row in rows[1:count]:
        total.add_(row)
    return total.div_(count).to(torch.float32)


def _trimmed_mean_of_sorted(ordered) -> torch.Tensor:
    """The mean of the middle rows of ``ordered``, ``floor(n * TRIM_FRACTION)`` dropped per side."""
    n = len(ordered)
    trim = math.floor(n * TRIM_FRACTION)
    return _mean_of_rows(ordered[trim:], n - 2 * trim)


def _median_of_sorted(ordered) -> torch.Tensor:
    """The middle row of ``ordered``, or the mean of the two middle rows for an even count."""
    n = len(ordered)
    return ordered[n // 2] if n % 2 else _mean_of_rows(ordered[n // 2 - 1:], 2)


def _median(contributions: list[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise median."""
    return _blockwise(contributions, lambda block: _median_of_sorted(_sorted(block)))


def _centered_clip(contributions: list[torch.Tensor]) -> torch.Tensor:
    """Centered clipping from the coordinate-wise median, ``CLIP_ITERATIONS`` times.

    Each step moves the center v by the mean of clip(c_i - v, tau), clip(x, tau) = x *
    min(1, tau / ||x||), with tau = CLIP_TAU * median_i ||c_i - v||. Why the median distance:
    when most contributions are honest it measures their spread, so tau is scale-free
    (pseudo-gradients shrink as training goes on) and needs no tuning. In high dimension the
    honest distances concentrate around that median, so clipping at CLIP_TAU = 1 barely
    changes them, while a contribution far away moves v by at most tau / n per step however
    far it is.
    """
    center = _median(contributions)
    n = len(contributions)
    for _ in range(CLIP_ITERATIONS):
        distances = [float(torch.linalg.vector_norm(tensor - center)) for tensor in contributions]
        tau = CLIP_TAU * statistics.median(distances)  # even n: the mean of the middle two
        step = torch.zeros_like(center)
        for tensor, distance in zip(contributions, distances):
            weight = 1.0 if distance <= tau else tau / distance  # also 1 when both are 0
            if weight > 0.0:
                step.add_(tensor - center, alpha=weight / n)
        center.add_(step)
    return center
