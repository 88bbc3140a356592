"""An honest replica's DiLoCo contribution, and an honest owner's result, are never refused.

The defences of an outer round (``aggregation.combine``'s verification of the parts an owner
receives, ``policy.result_check`` of the results a member receives) must tell poison from
honest work that merely disagrees: early in training, or with replicas that read different
data, honest pseudo-gradients are nearly orthogonal or even slightly opposed, and their norms
differ (one replica took more inner steps while it waited in the gather). These tests run
honest pseudo-gradients through the exact check path of a round (int8 with error feedback over
several rounds, the owners' ``offload.combine_shard``, the members' ``offload.assemble``; and the
same with issue 27's sparse codec and its chunk-clipped mean) and require that nothing is refused;
the attacks of ``tests/attacking_peer.poisoned`` are still refused.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.diloco import codec as codecs
from p2pswarm.diloco import offload
from p2pswarm.diloco.messages import expected_bytes, shard_plan
from p2pswarm.diloco.policy import result_check
from p2pswarm.diloco.round_actions import Outcome
from tests.attacking_peer import poisoned

CODECS = [("int8", "trimmed_mean"), ("sparse", "chunk_clip")]  # (codec, aggregator): the packaged and issue 27's
MIN_PIECE = 2000  # elements of the smallest piece drawn: a real stage's shards hold 1e5 and more
MIN_HONEST_COSINE = -0.2  # the least pairwise cosine of honest pseudo-gradients the defences must accept
MAX_HONEST_NORM_RATIO = 3.0  # honest pseudo-gradients' norms lie within this factor of each other
PSD_MARGIN = 0.02  # n vectors cannot all have pairwise cosine -1/(n-1) or less: stay this far above


def correlated(n: int, d: int, cosine: float, scales: list[float], gen: torch.Generator) -> list[torch.Tensor]:
    """``n`` random vectors of ``d`` elements with pairwise cosine about ``cosine``, norms in
    proportion to ``scales``: rows of F @ Z, F F^T = (1 - c) I + c 11^T (from its eigenvectors:
    at c = 1 the matrix is singular and Cholesky fails)."""
    gram = (1 - cosine) * torch.eye(n, dtype=torch.float64) + cosine * torch.ones(n, n, dtype=torch.float64)
    values, vectors = torch.linalg.eigh(gram)
    factor = vectors * values.clamp(min=0).sqrt()
    mixed = factor @ torch.randn(n, d, generator=gen, dtype=torch.float64)
    return [(row / row.norm() * scale).to(torch.float32) for row, scale in zip(mixed, scales)]


@st.composite
def honest_rounds(draw):
    """Several rounds of one group of honest replicas: each round's pseudo-gradients."""
    n = draw(st.integers(2, 8))
    low = max(MIN_HONEST_COSINE, -1 / (n - 1) + PSD_MARGIN)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    d = draw(st.integers(MIN_PIECE * n, 4 * MIN_PIECE * n))
    pieces = draw(st.sampled_from([None, 3 * MIN_PIECE // 2]))  # one piece a shard, or several of unequal size
    scale = math.exp(draw(st.floats(-12, 2)))  # pseudo-gradients shrink as training goes on
    rounds = []
    for _ in range(draw(st.integers(1, 4))):
        cosine = draw(st.floats(low, 1.0))
        scales = [scale * draw(st.floats(1.0, MAX_HONEST_NORM_RATIO)) for _ in range(n)]
        rounds.append(correlated(n, d, cosine, scales, gen))
    return n, d, pieces, rounds


def run_rounds(rounds, names, d, pieces, poison=None, codec="int8", aggregator="trimmed_mean"):
    """The check path of ``len(rounds)`` outer rounds; the refusals: (round, by, whom, why).

    ``poison`` (an attack of ``attacking_peer.poisoned``) makes the last member send poisoned parts."""
    plan = shard_plan(d, len(names), codec, size=expected_bytes,
                      **({} if pieces is None else {"max_elements": pieces}))
    residuals = {name: torch.zeros(d) for name in names}
    refusals = []
    for number, pseudos in enumerate(rounds):
        own, parts = {}, {}
        for name, pseudo in zip(names, pseudos):
            own[name] = pseudo + residuals[name]
            parts[name] = [codecs.encode(own[name][a:b], codec, error_out=residuals[name][a:b])
                           for a, b in plan.bounds]
        if poison is not None:
            bad = names[-1]
            parts[bad] = [codecs.encode(poisoned(own[bad][a:b], poison), codec) for a, b in plan.bounds]
        results, contributors = {}, {}
        for index, (a, b) in enumerate(plan.bounds):
            owner = names[plan.owner(index)]
            results[index], refused = offload.combine_shard({n: parts[n][index] for n in names}, owner, b - a,
                                                            codec=codec, aggregator=aggregator, verify=True)
            contributors[index] = len(names) - len(refused)
            refusals += [(number, owner, peer, why) for peer, why in refused.items()]
        outcome = Outcome(tuple(names), results, (), contributors, False, plan.pieces)
        for name in names:
            done = offload.assemble(outcome, own[name], plan.bounds, me=name, codec=codec,
                                    verify=result_check(len(names)), residual=residuals[name])
            residuals[name] = done.residual
            refusals += [(number, name, outcome.owner(i), why) for i, why in done.refused.items()]
    return refusals


@pytest.mark.parametrize("codec, aggregator", CODECS)
@given(drawn=honest_rounds())
@settings(max_examples=60)
def test_honest_contributions_and_results_are_never_refused(codec, aggregator, drawn):
    n, d, pieces, rounds = drawn
    names = [f"r{i}" for i in range(n)]
    assert run_rounds(rounds, names, d, pieces, codec=codec, aggregator=aggregator) == []


def test_two_orthogonal_replicas_three_times_apart_accept_each_others_result():
    """The refusal reported as 'rejected 1' with two honest replicas: pseudo-gradients at cosine
    ~0 (early training) and norms ~2.7x or more apart (one replica kept stepping in the gather)
    give an aggregate at cosine 1/sqrt(10) = 0.316 with the shorter one, under the old bar
    0.5/sqrt(2) = 0.354; every round of it was a strike against an honest owner."""
    gen = torch.Generator().manual_seed(5)
    names = ["r0", "r1"]
    rounds = [correlated(2, 20_000, 0.0, [3.0, 1.0], gen), correlated(2, 20_000, -0.2, [1.0, 1.8], gen)]
    assert run_rounds(rounds, names, 20_000, None) == []


@pytest.mark.parametrize("codec, aggregator", CODECS)
@pytest.mark.parametrize("members", [2, 3, 4])
def test_a_negate10_replica_is_still_refused(members, codec, aggregator):
    """-10x its own pseudo-gradient: refused by the owners (3 or more members: norm ratio) or by the
    members judging the result it owns (its own part is in it: projection and norm ratio)."""
    gen = torch.Generator().manual_seed(6)
    names = [f"r{i}" for i in range(members)]
    rounds = [correlated(members, 8000, 0.3, [1.0] * members, gen)]
    honest = [r for r in run_rounds(rounds, names, 8000, None, poison="negate10", codec=codec, aggregator=aggregator)
              if r[1] != names[-1]]
    assert honest and {whom for _, _, whom, _ in honest} == {names[-1]}  # (what the liar refuses is moot)
