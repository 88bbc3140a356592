"""Robust aggregation and verification: hand cases, reference implementations, bounds under attack."""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.diloco import aggregation
from p2pswarm.diloco.aggregation import (
    AGGREGATORS,
    CLIP_ITERATIONS,
    CLIP_TAU,
    TRIM_FRACTION,
    Combined,
    Verdict,
    VerifyConfig,
    aggregate,
    combine,
    verify,
)
from p2pswarm.diloco.sparse import SPARSE_CHUNK

FAST = settings(max_examples=40)
ATTACKS = ("flip", "noise", "scaled", "constant")
finite = st.floats(-1e6, 1e6, width=32)


def rows(*columns):
    """Contributions given column by column: rows(a, b) -> [tensor(a), tensor(b)]."""
    return [torch.tensor(column, dtype=torch.float32) for column in columns]


@st.composite
def stacks(draw, min_n=1, max_n=9):
    """n contributions of one length, values chosen by hypothesis (ties and extremes included)."""
    n = draw(st.integers(min_n, max_n))
    length = draw(st.integers(0, 12))
    values = draw(st.lists(st.lists(finite, min_size=length, max_size=length), min_size=n, max_size=n))
    return [torch.tensor(v, dtype=torch.float32).reshape(length) for v in values]


@st.composite
def swarms(draw, min_honest=3, max_honest=7):
    """Honest contributions (a shared direction plus noise, at any scale) and one attacker."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    d = draw(st.integers(1000, 4000))  # random noise then has |cosine| ~ 1/sqrt(d) << MIN_COSINE
    scale = math.exp(draw(st.floats(-15, 5)))  # pseudo-gradients shrink as training goes on
    sigma = draw(st.floats(0.01, 0.2))
    direction = torch.randn(d, generator=gen)
    honest = [(direction + sigma * torch.randn(d, generator=gen)) * scale
              for _ in range(draw(st.integers(min_honest, max_honest)))]
    kind = draw(st.sampled_from(ATTACKS))
    norm = float(torch.linalg.vector_norm(honest[0]))
    if kind == "flip":
        attacker = -10 * honest[0]
    elif kind == "noise":
        noise = torch.randn(d, generator=gen)
        attacker = noise * (norm * draw(st.sampled_from([1.0, 100.0])) / float(torch.linalg.vector_norm(noise)))
    elif kind == "scaled":
        attacker = 100 * honest[0]
    else:
        attacker = torch.full((d,), -1e4 * scale)
    return honest, attacker, kind


def magnitude(contributions):
    """The largest |value| among the contributions (float32 rounding errors scale with it)."""
    return max((float(c.abs().max()) for c in contributions if c.numel()), default=0.0)


def within(result, honest):
    """Every coordinate of ``result`` inside the range of the honest ones (up to float32 rounding)."""
    low, high = honest.min(0).values.double(), honest.max(0).values.double()
    slack = 1e-6 * torch.maximum(low.abs(), high.abs())
    return bool(((result.double() >= low - slack) & (result.double() <= high + slack)).all())


def plain_median(stack):
    """The median along dim 0 of a float64 stack: the middle value, or the mean of the middle two."""
    ordered, n = stack.sort(0).values, stack.shape[0]
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def naive_centered_clip(contributions):
    """Centered clipping written plainly in float64, one contribution at a time."""
    stack = torch.stack(contributions).double()
    center = plain_median(stack)
    for _ in range(CLIP_ITERATIONS):
        diffs = [c - center for c in stack]
        norms = [float(torch.linalg.vector_norm(x)) for x in diffs]
        tau = CLIP_TAU * statistics.median(norms)
        center = center + sum(x * (min(1.0, tau / nrm) if nrm else 1.0) for x, nrm in zip(diffs, norms)) / len(diffs)
    return center


# --- aggregate: hand cases ----------------------------------------------------------------


def test_hand_cases():
    four = rows([1.0, 10.0], [2.0, -10.0], [3.0, 0.0], [100.0, 5.0])
    assert aggregate(four, "mean").tolist() == [26.5, 1.25]
    assert aggregate(four, "trimmed_mean").tolist() == [2.5, 2.5]
    assert aggregate(four, "median").tolist() == [2.5, 2.5]
    assert aggregate(rows([3.0], [1.0], [2.0]), "median").tolist() == [2.0]
    assert aggregate(rows([3.0], [1.0], [2.0]), "trimmed_mean").tolist() == [2.0]  # n < 4: nothing trimmed
    assert aggregate(rows([3.0], [1.0], [8.0]), "trimmed_mean").tolist() == [4.0]
    eight = rows(*([v] for v in (-1e6, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 1e6)))
    assert aggregate(eight, "trimmed_mean").tolist() == [3.5]  # 2 dropped per side
    assert aggregate(rows([1.0], [4.0]), "median").tolist() == [2.5]


def test_centered_clip_hand_case():
    # median 0; distances 1, 1, 100, so tau = 1: the far one pulls by 1/3 of a unit, not 33
    contributions = rows([1.0, 0.0], [-1.0, 0.0], [0.0, 100.0])
    result = aggregate(contributions, "centered_clip")
    assert abs(float(result[0])) < 1e-6
    assert 0.3 < float(result[1]) < 1.5
    assert torch.allclose(result.double(), naive_centered_clip(contributions), atol=1e-5)


def test_trim_fraction_is_a_quarter_per_side():
    assert TRIM_FRACTION == 0.25
    for n, trimmed in [(1, 0), (3, 0), (4, 1), (7, 1), (8, 2), (16, 4)]:
        values = [float(i) for i in range(n)]
        values[0], values[-1] = -1000.0, 1000.0
        kept = sorted(values)[trimmed: n - trimmed]
        assert aggregate(rows(*([v] for v in values)), "trimmed_mean").item() == pytest.approx(sum(kept) / len(kept))


# --- aggregate: properties -----------------------------------------------------------------


@given(contributions=stacks(), seed=st.integers(0, 1000))
@FAST
def test_permutation_invariance(contributions, seed):
    order = torch.randperm(len(contributions), generator=torch.Generator().manual_seed(seed)).tolist()
    shuffled = [contributions[i] for i in order]
    for method in ("trimmed_mean", "median"):  # sorting first makes them exact
        assert torch.equal(aggregate(contributions, method), aggregate(shuffled, method))
    for method in ("mean", "centered_clip"):  # float sums in another order: equal to rounding
        assert torch.allclose(aggregate(contributions, method), aggregate(shuffled, method),
                              rtol=1e-5, atol=1e-5 * magnitude(contributions))


def plain_chunk_clip(stack: torch.Tensor) -> torch.Tensor:
    """The mean, each member's chunk first clipped to the members' lower-median largest magnitude (n >= 3)."""
    out = stack.clone()
    if len(stack) >= 3:
        for start in range(0, stack.shape[1], SPARSE_CHUNK):
            block = out[:, start: start + SPARSE_CHUNK]
            bound = sorted(float(row.abs().max()) for row in block)[(len(stack) - 1) // 2]
            block.clamp_(-bound, bound)
    return out.mean(0)


@given(contributions=stacks())
@FAST
def test_matches_plain_implementations(contributions):
    stack = torch.stack(contributions).double()
    n = len(contributions)
    trim = math.floor(n * TRIM_FRACTION)
    expected = {
        "mean": stack.mean(0),
        "trimmed_mean": stack.sort(0).values[trim: n - trim].mean(0),
        "median": plain_median(stack),
        "centered_clip": naive_centered_clip(contributions),
        "chunk_clip": plain_chunk_clip(stack),
    }
    for method in AGGREGATORS:
        result = aggregate(contributions, method)
        assert result.dtype == torch.float32 and result.shape == contributions[0].shape
        assert torch.allclose(result.double(), expected[method], rtol=1e-5,
                              atol=1e-5 * magnitude(contributions)), method


@given(contributions=stacks(min_n=3), block=st.integers(1, 5))
@settings(max_examples=20)
def test_blocks_do_not_change_the_result(contributions, block):
    whole = {method: aggregate(contributions, method) for method in AGGREGATORS}
    saved = aggregation.BLOCK_ELEMENTS
    aggregation.BLOCK_ELEMENTS = block
    try:
        for method in AGGREGATORS:
            assert torch.equal(aggregate(contributions, method), whole[method])
    finally:
        aggregation.BLOCK_ELEMENTS = saved


@given(value=st.lists(finite, min_size=0, max_size=20), n=st.integers(1, 9))
@FAST
def test_equal_contributions_give_themselves(value, n):
    x = torch.tensor(value, dtype=torch.float32).reshape(len(value))
    for method in AGGREGATORS:  # exactly: sums are taken in float64
        assert torch.equal(aggregate([x.clone() for _ in range(n)], method), x), method


@given(contributions=stacks(min_n=4, max_n=12), data=st.data())
@FAST
def test_robust_methods_stay_in_the_honest_range(contributions, data):
    # floor(n/4) arbitrary values per coordinate cannot take trimmed mean or median outside the
    # range of the others; fewer than half cannot move the median out of it.
    n = len(contributions)
    for method, bad in [("trimmed_mean", math.floor(n * TRIM_FRACTION)), ("median", (n - 1) // 2)]:
        attacked = list(contributions)
        for index in data.draw(st.lists(st.integers(0, n - 1), min_size=bad, max_size=bad, unique=True)):
            attacked[index] = torch.full_like(contributions[0], data.draw(st.sampled_from([-3e38, 3e38, 0.0])))
        honest = torch.stack([c for c, a in zip(contributions, attacked) if c is a])
        assert within(aggregate(attacked, method), honest), method


@given(swarm=swarms(max_honest=3))
@FAST
def test_one_attacker_of_four(swarm):
    honest, attacker, kind = swarm
    contributions = [*honest, attacker]
    center = torch.stack(honest).mean(0)
    spread = max(float(torch.linalg.vector_norm(h - center)) for h in honest)
    for method in ("trimmed_mean", "median"):  # coordinate by coordinate, inside the honest values
        assert within(aggregate(contributions, method), torch.stack(honest)), method
    clipped = aggregate(contributions, "centered_clip")  # as a whole, inside the honest spread
    assert float(torch.linalg.vector_norm(clipped - center)) <= spread
    if kind != "noise" or float(torch.linalg.vector_norm(attacker)) > 10 * spread:
        assert float(torch.linalg.vector_norm(aggregate(contributions, "mean") - center)) > 2 * spread


@pytest.mark.parametrize("bad", [[], [torch.zeros(3), torch.zeros(4)], [torch.zeros(2, 2)],
                                 [torch.zeros(3, dtype=torch.float64)], [torch.tensor(1.0)], [[1.0, 2.0]]])
def test_aggregate_rejects_local_misuse(bad):
    with pytest.raises(ValueError):
        aggregate(bad, "mean")


def test_aggregate_rejects_unknown_method():
    with pytest.raises(ValueError):
        aggregate([torch.zeros(3)], "krum")


def test_aggregate_returns_a_new_tensor_and_keeps_its_inputs():
    contributions = rows([1.0, 2.0], [3.0, 5.0], [0.0, -1.0], [7.0, 7.0])
    copies = [c.clone() for c in contributions]
    for method in AGGREGATORS:
        for group in (contributions, contributions[:1]):
            result = aggregate(group, method)
            result.add_(1000.0)
            assert all(torch.equal(c, k) for c, k in zip(contributions, copies))


# --- verify ---------------------------------------------------------------------------------


@given(swarm=swarms())
@FAST
def test_verify_accepts_honest_and_rejects_attacks(swarm):
    honest, attacker, kind = swarm
    reference = aggregation._median([*honest, attacker])
    for contribution in honest:
        verdict = verify(contribution, reference)
        assert verdict.accepted and verdict.reason == "", verdict
    verdict = verify(attacker, reference)
    assert not verdict.accepted
    expected = {"flip": "cosine", "noise": "cosine", "scaled": "norm ratio", "constant": "variance ratio"}[kind]
    assert expected in verdict.reason, verdict


def test_verify_figures():
    gen = torch.Generator().manual_seed(0)
    reference = torch.randn(5000, generator=gen)
    flipped = verify(-10 * reference, reference)
    assert not flipped.accepted and flipped.cosine == pytest.approx(-1.0, abs=1e-5)
    assert flipped.norm_ratio == pytest.approx(10.0, rel=1e-5) and flipped.var_ratio == pytest.approx(100.0, rel=1e-4)
    assert flipped.reason.startswith("cosine -1 < 0.2")
    scaled = verify(100 * reference, reference)
    assert not scaled.accepted and scaled.cosine == pytest.approx(1.0, abs=1e-5)
    assert scaled.reason.startswith("norm ratio 100 outside")
    small = verify(0.01 * reference, reference)
    assert not small.accepted and "norm ratio 0.01 outside" in small.reason
    same = verify(reference.clone(), reference)
    assert same == Verdict(True, "", same.cosine, same.norm_ratio, same.var_ratio, same.projection)
    assert same.cosine == pytest.approx(1.0) and same.norm_ratio == 1.0 and same.var_ratio == 1.0
    assert same.projection == pytest.approx(1.0) and flipped.projection == pytest.approx(-10.0, rel=1e-5)
    # a result check: no cosine bar, no lower bounds, only pulling back too far or growing too long
    results = VerifyConfig(min_cosine=-1.0, min_projection=-1.0, refuse_short=False)
    assert verify(0.01 * reference, reference, results).accepted
    assert verify(-0.5 * reference, reference, results).accepted
    assert "projection -2 < -1" in verify(-2 * reference, reference, results).reason


def test_verify_variance_check_alone():
    # same norm and a passing cosine (0.22), but most of the norm moved into a constant offset
    reference = torch.randn(10000, generator=torch.Generator().manual_seed(1))
    reference -= reference.mean()
    norm = float(torch.linalg.vector_norm(reference))
    offset = math.sqrt(1 - 0.22**2) * norm / math.sqrt(reference.numel())
    verdict = verify(0.22 * reference + offset, reference)
    assert verdict.cosine == pytest.approx(0.22, abs=1e-3) and verdict.norm_ratio == pytest.approx(1.0, abs=1e-3)
    assert not verdict.accepted and verdict.reason.startswith("variance ratio 0.0484 outside")


def test_verify_zero_and_constant_vectors():
    zero = torch.zeros(100)
    ones = torch.ones(100)
    assert verify(zero, zero) == Verdict(True, "", 1.0, 1.0, 1.0, 0.0)
    moved = verify(ones * 1e-6, zero)
    assert not moved.accepted and moved.norm_ratio == math.inf and moved.cosine == 0.0
    still = verify(zero, ones)
    assert not still.accepted and still.norm_ratio == 0.0 and still.cosine == 0.0
    constant = verify(1.5 * ones, ones)  # no variance on either side: alike
    assert constant.accepted and constant.var_ratio == 1.0
    assert not verify(ones + torch.linspace(-0.5, 0.5, 100), ones).accepted  # variance from none
    assert verify(torch.zeros(0), torch.zeros(0)).accepted


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_verify_rejects_non_finite(value):
    good = torch.ones(10)
    bad = good.clone()
    bad[3] = value
    for contribution, reference in [(bad, good), (good, bad), (bad, bad)]:
        verdict = verify(contribution, reference)
        assert not verdict.accepted and verdict.reason == "non-finite values" and math.isnan(verdict.cosine)


def test_verify_rejects_overflowing_values_without_crashing():
    reference = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    verdict = verify(torch.full((1000,), 3e38), reference)  # float32 norms and dot overflow: inf, NaN
    assert not verdict.accepted and "norm ratio inf" in verdict.reason
    assert math.isnan(verdict.cosine) and "cosine nan" in verdict.reason  # a NaN figure never passes


def test_verify_config():
    reference = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    assert verify(50 * reference, reference, VerifyConfig(max_norm_ratio=100, max_var_ratio=1e4)).accepted
    nudged = reference + 0.1 * torch.randn(1000, generator=torch.Generator().manual_seed(4))
    assert verify(nudged, reference).accepted
    assert "cosine" in verify(nudged, reference, VerifyConfig(min_cosine=0.999)).reason
    for bad in [dict(min_cosine=1.5), dict(min_cosine=float("nan")), dict(max_norm_ratio=0.5), dict(max_var_ratio=0.0)]:
        with pytest.raises(ValueError):
            VerifyConfig(**bad)
    with pytest.raises(ValueError):
        verify(torch.zeros(3), torch.zeros(4))


# --- combine ----------------------------------------------------------------------------------


@given(swarm=swarms(), method=st.sampled_from(AGGREGATORS), data=st.data())
@FAST
def test_combine_leaves_the_attacker_out(swarm, method, data):
    honest, attacker, _ = swarm
    names = [f"peer-{i}" for i in range(len(honest))]
    contributions = dict(zip(names, honest)) | {"mallory": attacker}
    own = data.draw(st.sampled_from(names))
    combined = combine(contributions, own, method)
    assert set(combined.rejected) == {"mallory"} and combined.rejected["mallory"]
    assert combined.accepted == tuple(sorted(names))
    assert torch.equal(combined.result, aggregate([contributions[n] for n in sorted(names)], method))


@given(swarm=swarms(), method=st.sampled_from(AGGREGATORS), block=st.integers(1, 5))
@FAST
def test_combine_with_nothing_refused_is_aggregate_of_everything(swarm, method, block):
    """One sort serves the reference and the result: the same bits as aggregating afresh."""
    honest, _, _ = swarm
    contributions = {f"peer-{i}": t for i, t in enumerate(honest)}
    saved = aggregation.BLOCK_ELEMENTS
    aggregation.BLOCK_ELEMENTS = block
    try:
        combined = combine(contributions, "peer-0", method)
        expected = aggregate([contributions[n] for n in sorted(contributions)], method)
    finally:
        aggregation.BLOCK_ELEMENTS = saved
    assert not combined.rejected and torch.equal(combined.result, expected)


def test_combine_result_is_the_mean_of_the_rest():
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(1000, generator=gen)
    contributions = {name: base + 0.1 * torch.randn(1000, generator=gen) for name in "bcde"}
    contributions["a"] = -10 * contributions["b"]
    combined = combine(contributions, "c", "mean")
    assert combined.accepted == ("b", "c", "d", "e") and "cosine" in combined.rejected["a"]
    expected = torch.stack([contributions[n] for n in "bcde"]).mean(0)
    assert torch.allclose(combined.result, expected, atol=1e-6)
    trimmed = combine(contributions, "c")  # trimmed mean of 4: the middle two per coordinate
    middle = torch.stack([contributions[n] for n in "bcde"]).sort(0).values[1:3].mean(0)
    assert torch.allclose(trimmed.result, middle, atol=1e-6)


def test_combine_never_rejects_its_own():
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(1000, generator=gen)
    contributions = {name: base + 0.1 * torch.randn(1000, generator=gen) for name in "abc"}
    contributions["me"] = -10 * base
    combined = combine(contributions, "me")
    assert combined.rejected == {} and combined.accepted == ("a", "b", "c", "me")
    # with two there is no majority to judge by: the other is judged by its norm and variance against
    # ours alone (a tenth of our norm: refused), never by its direction (honest pairs are near orthogonal)
    pair = combine({"me": contributions["me"], "a": contributions["a"]}, "me", "mean")
    assert pair.accepted == ("me",) and "norm ratio" in pair.rejected["a"] and "round of 2" in pair.rejected["a"]
    against = combine({"me": contributions["a"], "b": -contributions["b"]}, "me", "mean")
    assert against.accepted == ("b", "me") and against.rejected == {}


def test_combine_small_groups():
    x = torch.randn(100, generator=torch.Generator().manual_seed(6))
    single = combine({"only": x}, "only")
    assert single.accepted == ("only",) and single.rejected == {} and torch.equal(single.result, x)
    assert single.result is not x
    pair = combine({"b": x * 1.1, "a": x}, "a", "mean")
    assert pair.accepted == ("a", "b") and pair.rejected == {}
    assert torch.allclose(pair.result, x * 1.05)
    three = combine({"a": x, "b": 1.2 * x, "c": -x}, "b", "median")
    assert three.accepted == ("a", "b") and "cosine" in three.rejected["c"]
    assert torch.allclose(three.result, 1.1 * x)


def test_honest_but_unrelated_pseudo_gradients_are_not_refused():
    """After a few dozen Adam steps honest replicas' pseudo-gradients are nearly orthogonal
    (measured in the demo); they all still pass, while -10x and a 10x-long one do not."""
    gen = torch.Generator().manual_seed(8)
    honest = {name: torch.randn(20_000, generator=gen) * (1 + 0.3 * i) for i, name in enumerate("abc")}
    own_d = torch.randn(20_000, generator=gen)
    assert combine({**honest, "d": own_d}, "a").rejected == {}
    attacked = combine({**honest, "d": -10 * own_d}, "a")  # the attacker's own, negated and scaled
    assert list(attacked.rejected) == ["d"] and "norm ratio" in attacked.rejected["d"]


def test_combine_without_verification_uses_everything():
    gen = torch.Generator().manual_seed(7)
    contributions = {name: torch.randn(500, generator=gen) for name in "abcd"}
    contributions["z"] = 1e6 * torch.ones(500)
    combined = combine(contributions, "a", "mean", verify_config=None)
    assert combined.accepted == ("a", "b", "c", "d", "z") and combined.rejected == {}
    assert torch.equal(combined.result, aggregate([contributions[n] for n in "abcdz"], "mean"))


@given(st.data())
@settings(max_examples=20)
def test_combine_is_deterministic_whatever_the_order(data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))
    names = data.draw(st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=6, unique=True))
    contributions = {name: torch.randn(300, generator=gen) for name in names}
    shuffled = dict(data.draw(st.permutations(list(contributions.items()))))
    own = data.draw(st.sampled_from(names))
    method = data.draw(st.sampled_from(AGGREGATORS))
    first, second = combine(contributions, own, method), combine(shuffled, own, method)
    assert torch.equal(first.result, second.result)
    assert first.accepted == second.accepted and first.rejected == second.rejected
    assert isinstance(first, Combined) and own in first.accepted


def test_combine_rejects_local_misuse():
    x = torch.ones(4)
    with pytest.raises(ValueError):
        combine({"a": x}, "b")
    with pytest.raises(ValueError):
        combine({"a": x}, "a", "krum")
    with pytest.raises(ValueError):
        combine({"a": x, "b": torch.ones(5)}, "a")
    with pytest.raises(ValueError):
        combine({"a": torch.tensor([1.0, float("nan"), 0.0, 0.0])}, "a")
    with pytest.raises(ValueError):
        combine({}, "a")
