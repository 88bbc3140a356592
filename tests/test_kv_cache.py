"""The cached decode of a stage: a prefix, then one token at a time, equals the full forward."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.func import functional_call

from p2pswarm.model.catalog import ModelSpec
from p2pswarm.model.transformer import KVCache, build_model, kv_bytes

MHA = ModelSpec("kv-mha", n_layers=4, stage_size=2, width=64, heads=4, ffn=160, context=32)
GQA = ModelSpec("kv-gqa", n_layers=4, stage_size=2, width=64, heads=4, kv_heads=2, ffn=160, context=32)
TOLERANCE = 1e-5


def _ids(seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seed))


def _cached_logits(stages, ids: torch.Tensor, cuts: list[int], weights=None) -> torch.Tensor:
    """Logits at every position, from cached decodes of ids cut into pieces at ``cuts``."""
    caches = [KVCache() for _ in stages]
    out, bounds = [], [0, *cuts, ids.shape[1]]
    for start, end in itertools.pairwise(bounds):
        x = ids[:, start:end]
        for i, (module, cache) in enumerate(zip(stages, caches)):
            if weights is None:
                x = module(x, cache=cache)
            else:
                x = functional_call(module, weights[i], (x,), {"cache": cache})
        out.append(x)
    return torch.stack(out, dim=1)  # [1, pieces, vocab]: the last position of each piece


@pytest.mark.parametrize("spec", [MHA, GQA], ids=["mha", "gqa"])
def test_prefix_then_one_token_at_a_time_equals_the_full_forward(spec):
    stages = build_model(spec, seed=3)
    ids = _ids(spec.context)
    with torch.no_grad():
        full = ids
        for module in stages:
            full = module(full)
        prefix = 9
        cuts = list(range(prefix, spec.context))  # the prefix whole, then every later token alone
        cached = _cached_logits(stages, ids, cuts)
    expected = full[:, [prefix - 1, *range(prefix, spec.context)]]
    assert cached.shape == expected.shape
    assert (cached - expected).abs().max().item() <= TOLERANCE


def test_pieces_of_several_tokens_after_a_cache_use_the_right_mask_and_positions():
    stages = build_model(GQA, seed=4)
    ids = _ids(20, seed=1)
    with torch.no_grad():
        full = ids
        for module in stages:
            full = module(full)
        cached = _cached_logits(stages, ids, [5, 9, 10, 16])
    assert (cached - full[:, [4, 8, 9, 15, 19]]).abs().max().item() <= TOLERANCE


def test_a_cached_decode_runs_on_functional_call_weights():
    stages = build_model(MHA, seed=5)
    ids = _ids(12, seed=2)
    weights = [{n: p.detach() * 1.5 for n, p in m.named_parameters()} for m in stages]
    with torch.no_grad():
        full = ids
        for module, w in zip(stages, weights):
            full = functional_call(module, w, (full,))
        cached = _cached_logits(stages, ids, [6, 7], weights)
        plain = _cached_logits(stages, ids, [6, 7])
    assert (cached - full[:, [5, 6, 11]]).abs().max().item() <= TOLERANCE
    assert (plain - cached).abs().max().item() > TOLERANCE  # the weights given were used, not the module's


def test_the_cache_holds_what_kv_bytes_says_and_refuses_past_the_context():
    stages = build_model(GQA, seed=6)
    cache = KVCache()
    with torch.no_grad():
        stages[0](_ids(7), cache=cache)
    assert cache.length == 7
    assert cache.nbytes == kv_bytes(GQA, 0, 7, 4)
    with pytest.raises(ValueError), torch.no_grad():
        stages[0](_ids(GQA.context - 6), cache=cache)
    with pytest.raises(ValueError), torch.no_grad():
        stages[0](torch.zeros(2, 1, dtype=torch.int64), cache=KVCache())


def test_the_training_forward_is_unchanged_by_a_cached_decode_on_the_same_module():
    stages = build_model(MHA, seed=7)
    ids = _ids(16, seed=3).expand(2, 16)
    before = stages[0](ids)
    with torch.no_grad():
        stages[0](ids[:1, :4], cache=KVCache())
    after = stages[0](ids)
    assert torch.equal(before, after)
    after.sum().backward()  # the training forward still has a graph
    assert stages[0].embed_tokens.weight.grad is not None


def test_a_subspace_model_decodes_with_full_hidden_states_to_its_training_logits():
    """Generation passes full hidden states between a subspace model's stages (model/subspace.py): the
    same function as its training forward, which passes coordinates and token ids."""
    from p2pswarm.model.transformer import run_stages

    stages = build_model(MHA, seed=3, rank=8)
    ids = _ids(MHA.context)
    with torch.no_grad():
        full = run_stages(stages, ids)
        prefix = 9
        cached = _cached_logits(stages, ids, list(range(prefix, MHA.context)))
    expected = full[:, [prefix - 1, *range(prefix, MHA.context)]]
    assert (cached - expected).abs().max().item() <= TOLERANCE
