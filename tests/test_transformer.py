"""The stage-sliceable transformer: deterministic init, stages that compose, causality, learning."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch

from p2pswarm.errors import ConfigError
from p2pswarm.model.catalog import MODELS, ModelSpec, get_model, model_param_count, param_count
from p2pswarm.model.transformer import build_model, build_stage, run_stages

TINY = get_model("tiny-lm")
# two stages of one block, small enough that a few hundred steps take a second or two on a CPU
LITTLE = ModelSpec("little-lm", n_layers=2, stage_size=1, width=64, heads=4, ffn=256, context=32)
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
    assert first.embed is not None and first.head is None and len(first.blocks) == 2
    assert middle.embed is None and middle.head is None and len(middle.blocks) == 2
    assert last.embed is None and last.head is not None and len(last.blocks) == 2
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


def test_training_across_two_stages_drives_the_loss_down():
    """Stage by stage as the swarm does it: activations forward, their gradient backward."""
    torch.manual_seed(0)
    stages = build_model(LITTLE, seed=0)
    optimizers = [torch.optim.AdamW(s.parameters(), lr=3e-3) for s in stages]
    text = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 4), dtype=torch.int64)
    batch = torch.stack([text[i:i + LITTLE.context + 1] for i in range(0, 64, 8)])
    inputs, targets = batch[:, :-1], batch[:, 1:]
    losses = []
    for _ in range(200):
        for opt in optimizers:
            opt.zero_grad()
        sent = stages[0](inputs)
        received = sent.detach().requires_grad_()  # what crosses the wire to the next stage
        loss = stages[1].loss(stages[1](received), targets)
        loss.backward()
        sent.backward(received.grad)  # the gradient that comes back
        for opt in optimizers:
            opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0 and losses[-1] < 0.5, (losses[0], losses[-1])


@pytest.mark.parametrize("spec", [TINY, LITTLE, dataclasses.replace(TINY, stage_size=TINY.n_layers),
                                  ModelSpec("odd", n_layers=5, stage_size=2, width=48, heads=3, ffn=80, context=20)],
                         ids=lambda s: f"{s.name}-{s.n_stages}")
def test_param_count_formula_matches_the_built_stages(spec):
    for stage in range(spec.n_stages):
        assert param_count(spec, stage) == build_stage(spec, stage, 0).param_count()


def test_tiers_grow_and_have_the_seed_shapes():
    totals = [model_param_count(MODELS[name]) for name in TIERS]
    assert totals == sorted(totals) and len(set(totals)) == len(totals)
    assert 20e6 < totals[0] < 40e6 and 30e9 < totals[-1] < 50e9  # nano ~26M, xl ~39B with this formula
    for name in TIERS:
        spec = MODELS[name]
        assert spec.ffn == 4 * spec.width and spec.head_dim == 128 and spec.context == 1024 and spec.vocab == 256
        assert spec.n_layers % spec.stage_size == 0


def test_catalog_imports_without_torch():
    code = "import sys, p2pswarm.model.catalog; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
