"""The learning-rate schedule (pure) and the engine's use of it: param groups, the step counter."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm.model.catalog import get_model
from p2pswarm.run.training import TrainConfig
from p2pswarm.swarm.engine import StageEngine, param_groups
from p2pswarm.swarm.schedule import lr_at

schedules = st.tuples(st.floats(1e-6, 1.0), st.integers(0, 2000), st.integers(0, 5000), st.floats(0.0, 1.0))


@given(schedules, st.integers(0, 20_000))
def test_lr_is_within_0_and_the_peak(schedule, step):
    lr, warmup, decay, floor = schedule
    assert 0 <= lr_at(step, lr, warmup, decay, floor) <= lr * (1 + 1e-12)


@given(schedules, st.integers(0, 20_000))
def test_lr_rises_in_warmup_falls_in_decay_and_is_constant_after(schedule, step):
    lr, warmup, decay, floor = schedule
    now, after = lr_at(step, lr, warmup, decay, floor), lr_at(step + 1, lr, warmup, decay, floor)
    if step + 1 < warmup:
        assert after > now
    elif step >= warmup + decay:
        assert after == now == (lr * floor if decay else lr)
    else:
        assert after <= now * (1 + 1e-12)


@given(schedules)
def test_lr_is_continuous_at_the_joins(schedule):
    lr, warmup, decay, floor = schedule
    if warmup:
        assert math.isclose(lr_at(warmup - 1, lr, warmup, decay, floor), lr)  # the last warm-up step is the peak
    assert math.isclose(lr_at(warmup, lr, warmup, decay, floor), lr)  # and the first decay step too
    if decay:
        end = lr_at(warmup + decay, lr, warmup, decay, floor)
        assert math.isclose(end, lr * floor, abs_tol=1e-15)
        near = lr_at(warmup + decay - 1, lr, warmup, decay, floor)
        assert near - end <= (lr - lr * floor) * (math.pi / decay) ** 2  # no jump onto the floor


def test_weight_decay_on_matrices_only():
    spec = get_model("tiny-lm/2")
    for stage in (0, 1):
        engine = StageEngine(spec, stage, TrainConfig(weight_decay=0.1))
        names = {id(p): n for n, p in engine.module.named_parameters()}
        decayed, plain = ({names[id(p)] for p in g["params"]} for g in param_groups(engine.module, 0.1))
        assert decayed and plain and not decayed & plain and decayed | plain == set(engine.params)
        for name in decayed:
            assert engine.params[name].ndim == 2 and "embed" not in name and "pos" not in name, name
        for name in plain:
            param = engine.params[name]
            assert param.ndim == 1 or isinstance(_owner(engine.module, name), torch.nn.Embedding), name
        assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.1, 0.0]
    last = StageEngine(spec, 1)
    decayed = set(_names(last.module, param_groups(last.module, 0.1)[0]["params"]))
    heads = {n for n in last.params if n.startswith(("head", "lm_head"))}
    assert heads and heads <= decayed  # the untied LM head decays


def _owner(module, name):
    return module.get_submodule(name.rpartition(".")[0])


def _names(module, params):
    ids = {id(p) for p in params}
    return [n for n, p in module.named_parameters() if id(p) in ids]


def test_the_schedule_follows_the_step_counter_across_a_snapshot():
    spec = get_model("tiny-lm/4")
    config = TrainConfig(lr=1e-2, warmup_steps=4, decay_steps=10, min_lr_ratio=0.1)
    engine = StageEngine(spec, 0, config)
    for param in engine.params.values():
        param.grad = torch.zeros_like(param)
    engine._pending_grads = 1
    for _ in range(6):
        engine._step()
        for param in engine.params.values():
            param.grad = torch.zeros_like(param)
        engine._pending_grads = 1
    state = engine.state_dict()
    replica = StageEngine(spec, 0, config)
    replica.load_state_dict(state)
    for param in replica.params.values():
        param.grad = torch.zeros_like(param)
    replica._pending_grads = 1
    replica._step()
    assert replica.step == 7
    assert math.isclose(replica.optimizer.param_groups[0]["lr"], lr_at(6, 1e-2, 4, 10, 0.1))
    assert replica.optimizer.param_groups[0]["lr"] < 1e-2  # past the warm-up, decaying
