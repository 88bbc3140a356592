"""The DiLoCo outer optimizer: hand-computed Nesterov rounds, torch SGD equivalence, the overlap rule,
plain averaging, flat views, counters and the state_dict round trip."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.diloco.checkpoint import decode_state, encode_state
from p2pswarm.diloco.outer import (
    INNER_STEPS,
    OUTER_LR,
    OUTER_MOMENTUM,
    OuterConfig,
    OuterOptimizer,
    flatten,
    shift_flat,
)
from p2pswarm.errors import ConfigError

FAST = settings(max_examples=40)
PAPER = OuterConfig(inner_steps=3, lr=0.7, momentum=0.9, nesterov=True)
AVERAGING = OuterConfig(lr=1.0, momentum=0.0, nesterov=False)


def tiny_params(a=(1.0, 2.0), b=(0.5, -1.0, 3.0)):
    return {"a": torch.tensor(a, requires_grad=True), "b": torch.tensor(b, requires_grad=True)}


def vec(*values):
    return torch.tensor(values, dtype=torch.float32)


def set_live(params, flat):
    shift_flat(params, flatten(params), torch.as_tensor(flat, dtype=torch.float32))  # p - p + flat: exact


def close(actual, expected, atol=1e-6):
    return torch.allclose(actual, torch.as_tensor(expected, dtype=torch.float32), rtol=0, atol=atol)


# --- the outer step, by hand -------------------------------------------------------------------


def test_two_nesterov_rounds_match_the_hand_computed_numbers():
    params = tiny_params()  # start = [1, 2 | 0.5, -1, 3]
    outer = OuterOptimizer(params, PAPER, step=10)
    assert outer.numel == 5 and outer.rounds == 0 and outer.round_started_step == 10

    # Round 1, no overlap (the live params are still where the pseudo-gradient was taken).
    # g1 = [.1, -.2, 0, .4, 1]; m1 = g1; update = g1 + .9 m1 = 1.9 g1 = [.19, -.38, 0, .76, 1.9]
    # new start = start - .7 update = [1 - .133, 2 + .266, .5, -1 - .532, 3 - 1.33]
    set_live(params, [0.9, 2.1, 0.4, -1.2, 2.5])
    at = flatten(params)
    outer.outer_step(vec(0.1, -0.2, 0.0, 0.4, 1.0), at, params, step=13)
    assert close(outer.start, [0.867, 2.266, 0.5, -1.532, 1.67])
    assert close(flatten(params), [0.867, 2.266, 0.5, -1.532, 1.67])
    assert close(params["a"].detach(), [0.867, 2.266]) and close(params["b"].detach(), [0.5, -1.532, 1.67])
    assert outer.rounds == 1 and outer.round_started_step == 13

    # Round 2, and the live params moved on by [.01, 0, 0, 0, -.02] after `at`.
    # g2 = [.2, 0, -.1, 0, .5]; m2 = .9 m1 + g2 = [.29, -.18, -.1, .36, 1.4]
    # update = g2 + .9 m2 = [.461, -.162, -.19, .324, 1.76]; .7 update = [.3227, -.1134, -.133, .2268, 1.232]
    # new start = [.5443, 2.3794, .633, -1.7588, .438]; live = new start + [.01, 0, 0, 0, -.02]
    at = vec(0.8, 2.2, 0.6, -1.5, 1.5)
    set_live(params, at + vec(0.01, 0.0, 0.0, 0.0, -0.02))
    outer.outer_step(vec(0.2, 0.0, -0.1, 0.0, 0.5), at, params, step=16)
    assert close(outer.start, [0.5443, 2.3794, 0.633, -1.7588, 0.438])
    assert close(flatten(params), [0.5543, 2.3794, 0.633, -1.7588, 0.418])
    assert close(outer.momentum, [0.29, -0.18, -0.1, 0.36, 1.4])
    assert outer.rounds == 2 and outer.round_started_step == 16


def test_heavy_ball_momentum_by_hand():
    params = tiny_params(a=(1.0,), b=(0.0,))
    outer = OuterOptimizer(params, OuterConfig(lr=0.5, momentum=0.5, nesterov=False))
    # m1 = [1, 2]; new = [1, 0] - .5 [1, 2] = [.5, -1]
    outer.outer_step(vec(1.0, 2.0), flatten(params), params, step=0)
    assert close(outer.start, [0.5, -1.0])
    # m2 = .5 [1, 2] + [1, 0] = [1.5, 1]; new = [.5, -1] - .5 [1.5, 1] = [-.25, -1.5]
    outer.outer_step(vec(1.0, 0.0), flatten(params), params, step=0)
    assert close(outer.start, [-0.25, -1.5]) and close(flatten(params), [-0.25, -1.5])


@FAST
@given(seed=st.integers(0, 2**31), lr=st.floats(0.05, 2.0), momentum=st.floats(0.0, 0.99),
       nesterov=st.booleans(), rounds=st.integers(1, 6))
def test_outer_step_equals_torch_sgd_on_the_pseudo_gradient(seed, lr, momentum, nesterov, rounds):
    nesterov = nesterov and momentum > 0  # torch refuses Nesterov without momentum
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(5, generator=gen)}
    outer = OuterOptimizer(params, OuterConfig(lr=lr, momentum=momentum, nesterov=nesterov))
    reference = torch.nn.Parameter(flatten(params))
    sgd = torch.optim.SGD([reference], lr=lr, momentum=momentum, nesterov=nesterov)
    for _ in range(rounds):
        set_live(params, outer.start + 0.1 * torch.randn(outer.numel, generator=gen))  # an inner phase
        at = flatten(params)
        pseudo = outer.pseudo_gradient(at)
        outer.outer_step(pseudo, at, params, step=0)
        reference.grad = pseudo.clone()
        sgd.step()
        assert torch.allclose(outer.start, reference.detach(), rtol=1e-5, atol=1e-6)
        assert torch.allclose(flatten(params), reference.detach(), rtol=1e-5, atol=1e-6)


# --- the overlap rule, plain averaging ----------------------------------------------------------


def test_progress_after_the_pseudo_gradient_is_kept_and_counted_next_round():
    params = tiny_params()
    outer = OuterOptimizer(params, PAPER)
    set_live(params, [0.5, 1.5, 0.0, -0.5, 2.5])
    at = flatten(params)
    progress = vec(0.25, -0.5, 0.125, 0.0, 1.0)  # inner steps taken while the round ran
    set_live(params, at + progress)
    outer.outer_step(outer.pseudo_gradient(at), at, params, step=3)
    new_start = outer.start
    assert torch.allclose(flatten(params), new_start + progress, atol=1e-6)
    assert not torch.allclose(new_start, at + progress)  # the outer step did move the weights
    # With no further training, the next pseudo-gradient is exactly that progress (as start - current).
    assert torch.allclose(outer.pseudo_gradient(flatten(params)), -progress, atol=1e-6)


@pytest.mark.parametrize("config", [AVERAGING, OuterConfig(lr=1.0, momentum=0.0, nesterov=True)])
def test_momentum_zero_lr_one_is_plain_model_averaging(config):
    replicas = [tiny_params() for _ in range(3)]
    outers = [OuterOptimizer(p, config) for p in replicas]
    finals = [vec(1.5, 2.0, 0.0, -1.0, 3.5), vec(0.5, 2.5, 1.0, -2.0, 3.0), vec(1.0, 1.0, 0.5, 0.0, 2.0)]
    for params, final in zip(replicas, finals):
        set_live(params, final)
    pseudo = [o.pseudo_gradient(flatten(p)) for o, p in zip(outers, replicas)]
    aggregated = torch.stack(pseudo).mean(0)
    mean = torch.stack(finals).mean(0)
    for outer, params in zip(outers, replicas):
        start = outer.start.clone()
        outer.outer_step(aggregated, flatten(params), params, step=0)
        new_start = outer.start
        assert torch.allclose(new_start, start - aggregated) and torch.allclose(new_start, mean, atol=1e-6)
        assert torch.allclose(flatten(params), mean, atol=1e-6)  # every replica holds the average


def test_alone_in_a_round_applies_the_own_pseudo_gradient():
    params = tiny_params()
    outer = OuterOptimizer(params, AVERAGING)
    set_live(params, [0.0, 0.0, 0.0, 0.0, 0.0])
    at = flatten(params)
    outer.outer_step(outer.pseudo_gradient(at), at, params, step=0)
    assert torch.equal(outer.start, at) and torch.equal(flatten(params), at)


# --- counters and misuse ------------------------------------------------------------------------


def test_due_counts_inner_steps_since_the_round_began():
    params = tiny_params()
    outer = OuterOptimizer(params, PAPER, step=5)
    assert outer.inner_steps_done(7) == 2 and not outer.due(7) and outer.due(8) and outer.due(20)
    outer.outer_step(torch.zeros(5), flatten(params), params, step=9)
    assert outer.inner_steps_done(9) == 0 and not outer.due(11) and outer.due(12)


def test_defaults_are_the_papers():
    config = OuterConfig()
    assert (config.inner_steps, config.lr, config.momentum, config.nesterov) == (500, 0.7, 0.9, True)
    assert (INNER_STEPS, OUTER_LR, OUTER_MOMENTUM) == (500, 0.7, 0.9)


@pytest.mark.parametrize("bad", [dict(inner_steps=0), dict(inner_steps=2.0), dict(lr=0.0), dict(lr=math.inf),
                                 dict(lr=math.nan), dict(momentum=1.0), dict(momentum=-0.1),
                                 dict(nesterov=1)])
def test_config_refuses_values_that_cannot_train(bad):
    with pytest.raises(ConfigError):
        OuterConfig(**bad)


@pytest.mark.parametrize("case", ["short", "2-d", "nan", "at-short", "step-before"])
def test_outer_step_misuse_raises_and_changes_nothing(case):
    params = tiny_params()
    outer = OuterOptimizer(params, PAPER, step=4)
    outer.outer_step(vec(0.1, 0.2, 0.3, 0.4, 0.5), flatten(params), params, step=4)
    before = (outer.start.clone(), outer.momentum.clone(), flatten(params), outer.rounds)
    g, at, step = vec(1, 1, 1, 1, 1), flatten(params), 6
    if case == "short":
        g = vec(1, 1, 1, 1)
    elif case == "2-d":
        g = torch.ones(1, 5)
    elif case == "nan":
        g = vec(1, math.nan, 1, 1, 1)
    elif case == "at-short":
        at = vec(1, 1)
    else:
        step = 3
    with pytest.raises(ValueError):
        outer.outer_step(g, at, params, step=step)
    after = (outer.start, outer.momentum, flatten(params), outer.rounds)
    assert all(torch.equal(x, y) for x, y in zip(before[:3], after[:3])) and before[3] == after[3]


# --- flat views ---------------------------------------------------------------------------------

shapes = st.lists(st.lists(st.integers(0, 4), max_size=3).map(tuple), max_size=5)


@FAST
@given(shapes=shapes, seed=st.integers(0, 2**31))
def test_flatten_and_shift_round_trip(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    params = {f"p{i}": torch.randn(shape, generator=gen) for i, shape in enumerate(shapes)}
    originals = [p.clone() for p in params.values()]
    flat = flatten(params)
    assert flat.dtype == torch.float32 and flat.dim() == 1
    assert flat.numel() == sum(p.numel() for p in params.values())
    expected = torch.cat([p.reshape(-1) for p in params.values()]) if params else torch.zeros(0)
    assert torch.equal(flat, expected)  # the dict's order
    flat.add_(1.0)  # a new tensor: the parameters do not move
    assert all(torch.equal(a, b) for a, b in zip(params.values(), originals))
    assert torch.equal(flatten(params), expected)
    targets = {name: torch.zeros_like(p) for name, p in params.items()}
    shift_flat(targets, flatten(targets), expected)
    assert all(torch.equal(targets[n], params[n]) for n in params)
    shift_flat(targets, torch.zeros_like(expected), expected)
    assert torch.equal(flatten(targets), 2 * expected)
    with pytest.raises(ValueError):
        shift_flat(targets, torch.zeros(expected.numel() + 1), expected)
    with pytest.raises(ValueError):
        shift_flat(targets, expected, torch.zeros(expected.numel() + 1))


def test_shift_flat_works_on_leaf_parameters_that_require_grad():
    module = torch.nn.Linear(3, 2)
    params = dict(module.named_parameters())
    shift_flat(params, flatten(params), torch.arange(8, dtype=torch.float32))
    assert torch.equal(module.weight.detach(), torch.arange(6.0).reshape(2, 3))
    assert torch.equal(module.bias.detach(), vec(6, 7)) and module.weight.requires_grad


def test_flatten_converts_half_precision_to_float32():
    flat = flatten({"h": torch.tensor([1.5, 2.0], dtype=torch.float16)})
    assert flat.dtype == torch.float32 and torch.equal(flat, vec(1.5, 2.0))


# --- state --------------------------------------------------------------------------------------


def test_state_dict_round_trip_restores_identical_behaviour():
    gen = torch.Generator().manual_seed(1)
    config = OuterConfig(inner_steps=7, lr=0.5, momentum=0.8, nesterov=True)
    params = {"w": torch.randn(3, 2, generator=gen), "b": torch.randn(4, generator=gen)}
    outer = OuterOptimizer(params, config, step=2)
    for step in (9, 16):
        set_live(params, outer.start + 0.1 * torch.randn(outer.numel, generator=gen))
        at = flatten(params)
        outer.outer_step(outer.pseudo_gradient(at), at, params, step=step)
    state = decode_state(encode_state({"diloco": outer.state_dict()}))["diloco"]  # as a snapshot holds it

    twin_params = {name: p.clone() for name, p in params.items()}
    twin = OuterOptimizer(twin_params)  # default config: the state's config replaces it
    twin.load_state_dict(state)
    assert twin.config == config and twin.rounds == 2 and twin.round_started_step == 16
    for step in (23, 30):
        drift = 0.1 * torch.randn(outer.numel, generator=gen)
        for opt, p in ((outer, params), (twin, twin_params)):
            set_live(p, opt.start + drift)
            at = flatten(p)
            opt.outer_step(opt.pseudo_gradient(at), at, p, step=step)
        assert torch.equal(outer.start, twin.start) and torch.equal(outer.momentum, twin.momentum)
        assert torch.equal(flatten(params), flatten(twin_params)) and twin.due(step + 7)


def test_state_dict_is_a_copy():
    params = tiny_params()
    outer = OuterOptimizer(params, PAPER)
    state = outer.state_dict()
    state["start"].fill_(5.0)
    state["momentum"].fill_(5.0)
    assert torch.equal(outer.start, vec(1.0, 2.0, 0.5, -1.0, 3.0)) and not outer.momentum.any()


@pytest.mark.parametrize("change", [
    lambda s: s.update(start=torch.zeros(4)),
    lambda s: s.update(momentum=torch.zeros(5, dtype=torch.float64)),
    lambda s: s.update(momentum=[0.0] * 5),
    lambda s: s.update(rounds=-1),
    lambda s: s.update(round_started_step=True),
    lambda s: s.update(config={"inner_steps": 5}),
    lambda s: s["config"].update(momentum=2.0),
    lambda s: s.pop("rounds"),
    lambda s: s.update(extra=1),
])
def test_load_state_dict_refuses_what_does_not_fit(change):
    params = tiny_params()
    outer = OuterOptimizer(params, PAPER)
    state = OuterOptimizer(tiny_params(), OuterConfig()).state_dict()
    change(state)
    with pytest.raises(ValueError):
        outer.load_state_dict(state)
    assert outer.config == PAPER and torch.equal(outer.start, flatten(params))
