"""A subspace-constrained model (model/subspace.py): K numbers a token cross a boundary, exactly, both ways,
and the model exports to a plain Llama computing the same logits."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from p2pswarm.model import subspace  # noqa: E402
from p2pswarm.model.catalog import ModelSpec  # noqa: E402
from p2pswarm.model.hf_names import hf_state_dict  # noqa: E402
from p2pswarm.model.transformer import build_model, run_stages  # noqa: E402

SPEC = ModelSpec("sub-test", n_layers=4, stage_size=2, width=32, heads=4, kv_heads=2, ffn=64, context=16)
RANK = 6
TOLERANCE = 1e-5  # float32, only summation order differs


def _ids(spec: ModelSpec, rows: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, spec.vocab, (rows, spec.context), generator=torch.Generator().manual_seed(seed))


def _nudge(stages, seed: int = 3) -> None:
    """Weights away from their start, out of the span too: as AdamW and DiLoCo leave them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for stage in stages:
            for param in stage.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)


def test_the_fixed_parts_are_a_pure_function_of_the_run():
    first, again = subspace.build(SPEC, 7, RANK), subspace.build(SPEC, 7, RANK)
    assert torch.equal(first.basis, again.basis) and torch.equal(first.fixed, again.fixed)
    assert not torch.equal(first.basis, subspace.build(SPEC, 8, RANK).basis)
    eye = first.basis.T @ first.basis
    assert torch.allclose(eye, torch.eye(RANK), atol=1e-6)
    assert torch.equal(first.fixed, build_model(SPEC, 7)[0].embed_tokens.weight.detach())  # the initial embedding
    for bad in (0, SPEC.width + 1):
        with pytest.raises(ValueError):
            subspace.build(SPEC, 7, bad)


def test_a_boundary_carries_rank_numbers_and_the_stages_chain_to_the_whole_model():
    stages, whole = build_model(SPEC, 2, RANK), build_model(dataclasses.replace(SPEC, stage_size=4), 2, RANK)[0]
    ids = _ids(SPEC)
    z = stages[0](ids)
    assert z.shape == (2, SPEC.context, RANK)
    with torch.no_grad():
        assert (run_stages(stages, ids) - whole(ids)).abs().max().item() <= TOLERANCE
    with pytest.raises(ValueError):
        stages[1](z)  # no ids: a later stage cannot rebuild its input


def test_the_gradient_through_the_boundary_is_exact():
    """Stage 0's gradients from the K-number gradient that comes back equal the whole model's."""
    stages = build_model(SPEC, 4, RANK)
    twin = build_model(SPEC, 4, RANK)
    _nudge(stages)
    _nudge(twin)
    ids, targets = _ids(SPEC), _ids(SPEC, seed=9)
    stages[1].loss(run_stages(stages, ids), targets).backward()  # one graph: autograd through h
    z = twin[0](ids)
    sent = z.detach().requires_grad_(True)  # what crosses the boundary, both ways
    twin[1].loss(twin[1](sent, ids=ids), targets).backward()
    assert sent.grad is not None and sent.grad.shape == (2, SPEC.context, RANK)
    z.backward(sent.grad)
    for (name, ours), theirs in zip(stages[0].named_parameters(), twin[0].parameters()):
        assert torch.allclose(ours.grad, theirs.grad, atol=1e-6), name


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 3), st.integers(1, SPEC.context), st.integers(0, 2**31))
def test_coordinates_round_trip(rows, seq, seed):
    sub = subspace.build(SPEC, 1, RANK)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SPEC.vocab, (rows, seq), generator=generator)
    z = torch.randn(rows, seq, RANK, generator=generator)
    h = subspace.from_coords(z, ids, sub.basis, sub.fixed)
    assert torch.allclose(subspace.to_coords(h, ids, sub.basis, sub.fixed), z, atol=1e-5)


def test_folded_weights_make_a_plain_llama_of_the_same_function():
    stages = build_model(SPEC, 5, RANK)
    _nudge(stages)
    plain = build_model(SPEC, 5)
    folded = subspace.effective_weights(hf_state_dict(stages), subspace.build(SPEC, 5, RANK))
    for stage, weights in zip(plain, _split(folded, plain)):
        stage.load_state_dict(weights)
    ids = _ids(SPEC)
    with torch.no_grad():
        assert (run_stages(stages, ids) - run_stages(plain, ids)).abs().max().item() <= 1e-4


def _split(folded: dict, plain) -> list[dict]:
    """HF-named weights back to each stage's own names (the inverse of hf_state_dict)."""
    from p2pswarm.model.hf_names import hf_name

    return [{name: folded[hf_name(name, stage.start)] for name in stage.state_dict()} for stage in plain]


def test_transformers_computes_the_same_logits_from_the_folded_weights():
    transformers = pytest.importorskip("transformers", reason="the reference Llama is transformers' (dev extra)")
    from p2pswarm.model.hf_names import llama_config

    stages = build_model(SPEC, 6, RANK)
    _nudge(stages)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config(SPEC))).eval()
    model.load_state_dict(subspace.effective_weights(hf_state_dict(stages), subspace.build(SPEC, 6, RANK)),
                          strict=True)
    ids = _ids(SPEC)
    with torch.no_grad():
        assert (run_stages(stages, ids) - model(input_ids=ids).logits).abs().max().item() <= 1e-4
