"""The stage-sliceable transformer: deterministic init, stages that compose, causality, learning."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch

from p2pswarm.errors import ConfigError
from p2pswarm.model.catalog import (
    MODELS,
    SIZING_VOCAB,
    STAGE_MEMORY_BUDGET,
    ModelSpec,
    default_rows,
    get_model,
    model_param_count,
    param_count,
    stage_memory,
)
from p2pswarm.model.transformer import StageModule, build_model, build_stage, run_stages

TINY = get_model("tiny-lm")
# two stages of one block, small enough that a few hundred steps take a second or two on a CPU
LITTLE = ModelSpec("little-lm", n_layers=2, stage_size=1, width=64, heads=4, ffn=176, context=32)
GQA = ModelSpec("gqa-lm", n_layers=4, stage_size=2, width=64, heads=4, kv_heads=2, ffn=160, context=32)
TIERS = ["nano", "micro", "small", "medium", "large", "xl"]


def _ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("stage", range(TINY.n_stages))
def test_initial_weights_are_a_function_of_model_seed_and_stage(stage):
    first, again, other = build_stage(TINY, stage, 7), build_stage(TINY, stage, 7), build_stage(TINY, stage, 8)
    assert _same_state(first, again)
    assert not _same_state(first, other)


def test_stages_hold_their_parts():
    first, middle, last = build_stage(TINY, 0, 0), build_stage(TINY, 1, 0), build_stage(TINY, 3, 0)
    assert first.embed_tokens is not None and first.lm_head is None and len(first.layers) == 2
    assert middle.embed_tokens is None and middle.lm_head is None and len(middle.layers) == 2
    assert last.embed_tokens is None and last.lm_head is not None and len(last.layers) == 2
    assert not any("bias" in name for s in (first, middle, last) for name in s.state_dict())
    assert all(len(list(s.buffers())) == 0 for s in (first, middle, last))  # rope is computed, not stored
    with pytest.raises(ValueError):
        middle.loss(torch.zeros(1, 1, 256), torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ConfigError):
        build_stage(TINY, TINY.n_stages, 0)


def test_chained_stages_give_byte_logits_and_a_uniform_loss_at_init():
    stages = build_model(TINY, seed=1)
    ids = _ids(2, 64)
    with torch.no_grad():
        hidden = stages[0](ids)
        assert hidden.shape == (2, 64, TINY.width)
        logits = run_stages(stages, ids)
        loss = stages[-1].loss(logits[:, :-1], ids[:, 1:])
    assert logits.shape == (2, 64, 256)
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(256)) < 0.1


def test_separately_built_stages_compose_to_the_one_stage_model():
    whole = build_stage(dataclasses.replace(TINY, stage_size=TINY.n_layers), 0, seed=3)
    assert whole.is_first and whole.is_last
    ids = _ids(2, 32)
    with torch.no_grad():
        torch.testing.assert_close(run_stages(build_model(TINY, seed=3), ids), whole(ids), rtol=0, atol=0)


def test_a_later_token_does_not_change_earlier_logits():
    stages = build_model(TINY, seed=0)
    ids = _ids(1, 48)
    changed = ids.clone()
    changed[0, 30:] = (changed[0, 30:] + 1) % 256
    with torch.no_grad():
        before, after = run_stages(stages, ids), run_stages(stages, changed)
    torch.testing.assert_close(before[:, :30], after[:, :30])
    assert not torch.allclose(before[:, 30:], after[:, 30:])


def test_bad_inputs_are_refused():
    first, middle = build_stage(TINY, 0, 0), build_stage(TINY, 1, 0)
    with pytest.raises(ValueError):
        first(_ids(1, TINY.context + 1))
    with pytest.raises(ValueError):
        first(torch.zeros(1, 4))  # float ids
    with pytest.raises(ValueError):
        middle(_ids(1, 4))  # ids on a middle stage


def train_two_stages(boundary=lambda tensor: tensor.detach(), steps: int = 200) -> list[float]:
    """Stage by stage as the swarm does it: activations forward through ``boundary`` (what crosses the
    wire), their gradient back through it too; the training losses."""
    torch.manual_seed(0)
    stages = build_model(LITTLE, seed=0)
    optimizers = [torch.optim.AdamW(s.parameters(), lr=3e-3) for s in stages]
    text = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 4), dtype=torch.int64)
    batch = torch.stack([text[i:i + LITTLE.context + 1] for i in range(0, 64, 8)])
    inputs, targets = batch[:, :-1], batch[:, 1:]
    losses = []
    for _ in range(steps):
        for opt in optimizers:
            opt.zero_grad()
        sent = stages[0](inputs)
        received = boundary(sent).requires_grad_()  # what crosses the wire to the next stage
        loss = stages[1].loss(stages[1](received), targets)
        loss.backward()
        sent.backward(boundary(received.grad))  # the gradient that comes back
        for opt in optimizers:
            opt.step()
        losses.append(loss.item())
    return losses


def test_training_across_two_stages_drives_the_loss_down():
    losses = train_two_stages()
    assert losses[0] > 5.0 and losses[-1] < 0.5, (losses[0], losses[-1])


@pytest.mark.parametrize("spec", [TINY, LITTLE, GQA, dataclasses.replace(TINY, stage_size=TINY.n_layers),
                                  dataclasses.replace(GQA, name="gqa-32k", vocab=32000),
                                  ModelSpec("odd", n_layers=5, stage_size=2, width=48, heads=3, ffn=80, context=20),
                                  ModelSpec("mqa", n_layers=3, stage_size=2, width=48, heads=6, kv_heads=1, ffn=72)],
                         ids=lambda s: f"{s.name}-{s.n_stages}")
def test_param_count_formula_matches_the_built_stages(spec):
    for stage in range(spec.n_stages):
        module = build_stage(spec, stage, 0)
        assert param_count(spec, stage) == module.param_count()
        for precision, working in (("fp32", 4), ("bf16", 2)):
            memory = stage_memory(spec, stage, 2, spec.context, precision)
            numel = sum(p.numel() for p in module.parameters())
            assert memory.weights == numel * working and memory.grads == numel * 4 and memory.adam == numel * 8
            assert memory.stash == numel * 4 and memory.master == (numel * 4 if precision == "bf16" else 0)


def test_gqa_shares_each_kv_head_among_a_group_of_query_heads():
    """A GQA model equals the multi-head model whose k/v heads are the GQA ones, each repeated per group."""
    gqa = build_stage(dataclasses.replace(GQA, stage_size=GQA.n_layers), 0, seed=2)
    mha = build_stage(dataclasses.replace(GQA, stage_size=GQA.n_layers, kv_heads=GQA.heads), 0, seed=2)
    group = GQA.heads // GQA.kv_heads
    state = gqa.state_dict()
    for name, tensor in state.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):  # [kv_heads x head_dim, width] -> [heads x ...]
            heads = tensor.view(GQA.kv_heads, GQA.head_dim, GQA.width)
            state[name] = heads.repeat_interleave(group, dim=0).reshape(GQA.width, GQA.width)
    mha.load_state_dict(state)
    ids = _ids(2, GQA.context)
    with torch.no_grad():
        torch.testing.assert_close(gqa(ids), mha(ids))


def test_tiers_grow_have_the_seed_shapes_and_fit_a_24_gb_gpu():
    totals = [model_param_count(MODELS[name]) for name in TIERS]
    assert totals == sorted(totals) and len(set(totals)) == len(totals)
    assert 20e6 < totals[0] < 40e6 and 30e9 < totals[-1] < 50e9  # nano ~28M, xl ~34B
    for name in TIERS:
        spec = MODELS[name]
        assert spec.head_dim == 128 and spec.context == 1024 and spec.vocab == 256
        assert spec.ffn % 256 == 0 and abs(spec.ffn - 8 * spec.width / 3) < 256
        assert spec.n_layers % spec.stage_size == 0
        for vocab in (spec.vocab, SIZING_VOCAB):
            sized = dataclasses.replace(spec, vocab=vocab)
            for stage in {0, sized.n_stages // 2, sized.last_stage}:
                memory = stage_memory(sized, stage, default_rows(sized), sized.context, "bf16")
                assert memory.total <= STAGE_MEMORY_BUDGET == 22e9, (name, vocab, stage, memory)


@pytest.mark.parametrize("name", TIERS)
def test_every_tiers_largest_stage_builds_on_the_meta_device_as_counted(name):
    spec = MODELS[name]
    largest = max(range(spec.n_stages), key=lambda stage: param_count(spec, stage))
    with torch.device("meta"):
        module = StageModule(spec, largest)
    assert module.param_count() == param_count(spec, largest)
    assert stage_memory(spec, largest, default_rows(spec), spec.context).total <= 22e9
    with torch.device("meta"):  # and the forward's shapes hold at full context
        logits = module(_ids(1, spec.context).to("meta") if module.is_first
                        else torch.empty(1, spec.context, spec.width))
    assert logits.shape[-1] == (spec.vocab if module.is_last else spec.width)


def test_catalog_imports_without_torch():
    code = "import sys, p2pswarm.model.catalog; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_rmsnorm_backward_is_the_derivative_of_its_forward():
    from p2pswarm.model.transformer import RMSNorm

    norm = RMSNorm(8, 1e-5).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    weight = norm.weight.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: torch.func.functional_call(norm, {"weight": w}, (x,)), (x, weight))
    expected = norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x), expected)
