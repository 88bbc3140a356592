"""The chunk-clipped mean of sparse contributions (``diloco/sparse_aggregate.py``): a liar's pull is
bounded by the honest members' scales, an honest round is a plain mean, and blocks change nothing; and the
verification of sparse parts against the others' sum refuses a liar and no honest member."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.diloco import aggregation, offload, sparse
from p2pswarm.diloco import codec as codecs
from p2pswarm.diloco.offload import refuse_result
from p2pswarm.diloco.policy import result_check
from p2pswarm.diloco.round_actions import Outcome
from p2pswarm.diloco.sparse_aggregate import BLOCK_CHUNKS, chunk_clipped_mean, refused_sparse

CHUNK = 16  # small chunks: many of them, and blocks, in small vectors


def honest_sparse(n: int, numel: int, seed: int) -> list[torch.Tensor]:
    """n members' decoded sparse contributions: each the top entries of its own noisy copy of one direction."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn(numel, generator=g)
    return [sparse.decode(sparse.encode(direction + 0.5 * torch.randn(numel, generator=g), top=4), numel, top=4)
            for _ in range(n)]


def chunk_max(vector: torch.Tensor, chunk: int) -> torch.Tensor:
    padded = torch.nn.functional.pad(vector, (0, -vector.numel() % chunk))
    return padded.view(-1, chunk).abs().amax(dim=1)


@given(st.integers(3, 7), st.integers(1, 200), st.integers(0, 2**31 - 1), st.data())
@settings(max_examples=80, deadline=None)
def test_a_liar_minority_never_pulls_a_coordinate_past_the_largest_honest_scale_of_its_chunk(n, numel, seed, data):
    liars = data.draw(st.integers(1, (n - 1) // 2))
    honest = honest_sparse(n - liars, numel, seed)
    g = torch.Generator().manual_seed(seed + 1)
    scale = data.draw(st.sampled_from([1e-30, 1.0, 1e6, 3e38]))
    lies = [(torch.randn(numel, generator=g) * scale).clamp(-3e38, 3e38) for _ in range(liars)]
    order = data.draw(st.permutations(range(n)))  # the liars anywhere in the member order
    members = [(honest + lies)[i] for i in order]
    result = chunk_clipped_mean(members, CHUNK)
    bound = torch.stack([chunk_max(h, CHUNK) for h in honest]).amax(dim=0)
    assert bool(torch.isfinite(result).all())
    assert bool((chunk_max(result, CHUNK) <= bound * (1 + 1e-6)).all())


@given(st.integers(1, 2), st.integers(1, 100), st.integers(0, 2**31 - 1))
@settings(max_examples=30, deadline=None)
def test_one_or_two_members_are_averaged_plainly(n, numel, seed):
    g = torch.Generator().manual_seed(seed)
    members = [torch.randn(numel, generator=g) * (10 ** i) for i in range(n)]
    expected = (torch.stack(members).to(torch.float64).mean(dim=0)).to(torch.float32)
    assert torch.equal(chunk_clipped_mean(members, CHUNK), expected)


def test_members_of_one_scale_are_averaged_plainly_and_one_member_is_itself():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(CHUNK * 5, generator=g)
    members = [base, -base, base.clone(), -base]  # every chunk's largest magnitude the same in each: no clip
    expected = (torch.stack(members).to(torch.float64).mean(dim=0)).to(torch.float32)
    assert torch.equal(chunk_clipped_mean(members, CHUNK), expected)
    assert torch.equal(chunk_clipped_mean([base], CHUNK), base)


def test_blocks_change_nothing():
    members = honest_sparse(4, CHUNK * BLOCK_CHUNKS * 3 + 5, seed=9)  # three blocks and a bit
    members[1] = members[1] * 50  # a loud one, clipped
    whole = chunk_clipped_mean(members, CHUNK * BLOCK_CHUNKS * 4)  # one chunk as large as everything: no blocks
    per_chunk = torch.cat([chunk_clipped_mean([m[a:a + CHUNK] for m in members], CHUNK)
                           for a in range(0, members[0].numel(), CHUNK)])
    assert torch.equal(chunk_clipped_mean(members, CHUNK), per_chunk)
    assert not torch.equal(whole, per_chunk)  # the chunk size matters: the bound is per chunk


def test_an_honest_sparse_round_keeps_what_one_member_sent_alone():
    """The reason for this aggregate: a trimmed mean of four drops a coordinate only one member sent."""
    from p2pswarm.diloco.aggregation import aggregate

    members = [torch.zeros(CHUNK) for _ in range(4)]
    for i, member in enumerate(members):
        member[i] = 1.0  # each sent one coordinate nobody else did, all of one scale
    assert float(aggregate(members, "trimmed_mean").abs().sum()) == 0.0
    assert torch.equal(chunk_clipped_mean(members, CHUNK)[:4], torch.full((4,), 0.25))


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError):
        chunk_clipped_mean([])
    with pytest.raises(ValueError):
        chunk_clipped_mean([torch.zeros(3), torch.zeros(4)])
    with pytest.raises(ValueError):
        chunk_clipped_mean([torch.zeros(3, dtype=torch.float64)])
    with pytest.raises(ValueError):
        chunk_clipped_mean([torch.zeros(3)], chunk=0)


# --- judging sparse contributions against the others' sum ---------------------------------------------------


def members(n: int, numel: int, seed: int, spread: float) -> list[torch.Tensor]:
    """n members' decoded sparse parts (the top 64 of each 4,096-element chunk) of one direction plus their own
    noise of ``spread`` times its size (0.5: replicas that agree; 50: a cold start, nearly orthogonal)."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn(numel, generator=g)
    return [sparse.decode(sparse.encode(direction + spread * torch.randn(numel, generator=g)), numel)
            for _ in range(n)]


def liar(kind: str, honest: torch.Tensor, seed: int) -> torch.Tensor:
    """What a lying member sends in sparse form: -10 times an honest part, or noise of an honest norm."""
    if kind == "negate":
        return -10 * honest
    noise = torch.randn(honest.numel(), generator=torch.Generator().manual_seed(seed + 1))
    part = sparse.decode(sparse.encode(noise), noise.numel())
    return part * (honest.norm() / part.norm())


@given(st.integers(3, 6), st.sampled_from(["negate", "noise"]), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_a_lying_member_of_an_agreeing_group_is_refused_and_no_honest_one_is(n, kind, seed):
    honest = members(n, 3 * sparse.SPARSE_CHUNK, seed, spread=0.5)
    contributions = [*honest, liar(kind, honest[0], seed)]
    refused = refused_sparse(contributions, list(range(len(contributions))), max_norm_ratio=4.0, floor=-0.1)
    assert list(refused) == [n], refused


@given(st.integers(3, 6), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_a_group_that_does_not_agree_refuses_no_honest_member_and_still_the_negated_one(n, seed):
    """A cold start: honest parts nearly orthogonal. Only what points against the others is refused then (noise
    of an honest norm passes: there it looks like an honest member, and does no more harm than one)."""
    honest = members(n, 3 * sparse.SPARSE_CHUNK, seed, spread=50.0)
    assert refused_sparse(honest, list(range(n)), max_norm_ratio=4.0, floor=-0.1) == {}
    refused = refused_sparse([*honest, liar("negate", honest[0], seed)], list(range(n + 1)), max_norm_ratio=4.0,
                             floor=-0.1)
    assert list(refused) == [n] and "norm ratio" in refused[n]


def test_combine_judges_sparse_parts_against_the_others():
    honest = members(3, 3 * sparse.SPARSE_CHUNK, 5, spread=0.5)
    parts = {"a": honest[0], "b": honest[1], "c": honest[2], "m": liar("noise", honest[0], 5)}
    combined = aggregation.combine(parts, "a", "chunk_clip")
    assert list(combined.rejected) == ["m"] and "agreement" in combined.rejected["m"]
    assert torch.equal(combined.result, chunk_clipped_mean([honest[0], honest[1], honest[2]]))


@given(st.integers(2, 6), st.sampled_from([0.5, 50.0]), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_a_member_accepts_an_honest_sparse_aggregate_and_refuses_an_owners_noise(n, spread, seed):
    """The chunk-clipped mean of n parts holds each member's own part's direction (agreeing or orthogonal
    members alike), an owner's noise of the same length does not: only the noise is refused by every member."""
    parts = members(n, 3 * sparse.SPARSE_CHUNK, seed, spread)
    honest = chunk_clipped_mean(parts)
    noise = liar("noise", honest, seed)
    check = result_check(n)
    for own in parts:
        assert refuse_result(honest, own, check, own, n) is None
        assert "agreement with our part" in refuse_result(noise, own, check, own, n)
    assert refuse_result(noise, parts[0], check, torch.zeros_like(parts[0]), n) is None  # our zeros: no direction


def test_every_owner_is_held_to_our_parts_direction_even_one_that_says_it_refused_our_part():
    """An owner's word that it refused our part (its Reply) is not believed: a liar that refused every part
    and sent noise would pass every member's check. So an aggregate without our part is refused like noise,
    the cost of an honest owner's false refusal (orthogonal members, a cold start: the others' aggregate
    holds none of our direction). No member is told otherwise (``offload.assemble`` has no such input)."""
    n, numel = 4, 2 * sparse.SPARSE_CHUNK
    parts = members(n, numel, 11, spread=50.0)
    others = chunk_clipped_mean(parts[1:])  # the owner (member 1) left our part (member 0's) out
    half = numel // 2
    result = {0: codecs.encode(chunk_clipped_mean(parts)[:half], "sparse", width=n),
              1: codecs.encode(others[half:], "sparse", width=n - 1)}
    noise = {**result, 1: codecs.encode(liar("noise", others, 11)[half:], "sparse", width=n - 1)}
    for results in (result, noise):
        outcome = Outcome(("r0", "r1"), results, (), {0: n, 1: n - 1}, False, 1)
        done = offload.assemble(outcome, parts[0].clone(), [(0, half), (half, numel)], me="r0", codec="sparse",
                                verify=result_check(n), residual=torch.zeros(numel))
        assert list(done.refused) == [1] and "agreement with our part" in done.refused[1]
