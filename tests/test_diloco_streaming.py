"""Streaming DiLoCo in the outer optimizer: F fragments, one synchronised per round, every H / F steps.

Each fragment's sequence of outer steps is exactly plain DiLoCo run on that fragment alone; a round
touches nothing outside its fragment; fragments cover the stage in turn; F = 1 is today's optimizer;
flat views of a range round-trip; settings and states that do not fit are refused."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.diloco.outer import MAX_FRAGMENTS, OuterConfig, OuterOptimizer, flatten, shift_flat
from p2pswarm.errors import ConfigError

FAST = settings(max_examples=30, deadline=None)


def random_params(sizes, gen):
    return {f"p{i}": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}


def set_live(params, flat):
    shift_flat(params, flatten(params), flat)


@FAST
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=4), fragments=st.integers(1, 5),
       rounds=st.integers(1, 12), momentum=st.sampled_from([0.0, 0.5, 0.9]), nesterov=st.booleans(),
       seed=st.integers(0, 2**31))
def test_each_fragment_follows_plain_diloco_on_its_own_elements(sizes, fragments, rounds, momentum, nesterov, seed):
    gen = torch.Generator().manual_seed(seed)
    params = random_params(sizes, gen)
    numel = sum(sizes)
    fragments = min(fragments, numel)
    config = OuterConfig(inner_steps=fragments * 2, lr=0.7, momentum=momentum, nesterov=nesterov, fragments=fragments)
    outer = OuterOptimizer(params, config)
    plain_config = OuterConfig(inner_steps=2, lr=0.7, momentum=momentum, nesterov=nesterov)
    bounds = [(numel * i // fragments, numel * (i + 1) // fragments) for i in range(fragments)]
    plain = [OuterOptimizer({"x": outer.start[a:b].clone()}, plain_config) for a, b in bounds]
    plain_live = [{"x": outer.start[a:b].clone()} for a, b in bounds]
    for r in range(rounds):
        index = r % fragments
        a, b = bounds[index]
        assert outer.fragment() == (a, b)
        live = flatten(params) + 0.1 * torch.randn(numel, generator=gen)  # an inner phase
        set_live(params, live)
        set_live(plain_live[index], live[a:b].clone())
        before_start, before_momentum = outer.start.clone(), outer.momentum.clone()
        at = flatten(params, bounds=(a, b))
        outer.outer_step(outer.pseudo_gradient(at), at, params, step=2 * (r + 1))
        p_at = flatten(plain_live[index])
        plain[index].outer_step(plain[index].pseudo_gradient(p_at), p_at, plain_live[index], step=2 * (r + 1))
        outside = torch.ones(numel, dtype=torch.bool)
        outside[a:b] = False
        assert torch.equal(outer.start[outside], before_start[outside])  # nothing outside the fragment
        assert torch.equal(outer.momentum[outside], before_momentum[outside])
        assert torch.equal(flatten(params)[outside], live[outside])
        assert torch.allclose(outer.start[a:b], plain[index].start, atol=1e-6)
        assert torch.allclose(flatten(params, bounds=(a, b)), flatten(plain_live[index]), atol=1e-6)
    assert outer.rounds == rounds


def test_one_fragment_is_plain_diloco_bit_for_bit():
    gen = torch.Generator().manual_seed(3)
    a_params, b_params = random_params([6, 4], gen), None
    b_params = {k: v.clone() for k, v in a_params.items()}
    plain = OuterOptimizer(a_params, OuterConfig(inner_steps=4))
    streaming = OuterOptimizer(b_params, OuterConfig(inner_steps=4, fragments=1))
    for step in (4, 8, 12):
        drift = 0.1 * torch.randn(10, generator=gen)
        for opt, p in ((plain, a_params), (streaming, b_params)):
            set_live(p, opt.start + drift)
            at = flatten(p)
            opt.outer_step(opt.pseudo_gradient(at), at, p, step=step)
    assert torch.equal(plain.start, streaming.start) and torch.equal(flatten(a_params), flatten(b_params))


def test_rounds_come_every_h_over_f_steps_and_cover_the_stage_in_turn():
    params = {"w": torch.zeros(10)}
    outer = OuterOptimizer(params, OuterConfig(inner_steps=10, fragments=3))
    assert outer.config.round_steps == 4 and not outer.due(3) and outer.due(4)
    seen = []
    for r in range(6):
        a, b = outer.fragment()
        seen.append((a, b))
        outer.adopt(flatten(params, bounds=(a, b)), step=4 * (r + 1))
    assert seen == [(0, 3), (3, 6), (6, 10)] * 2 and outer.rounds == 6


def test_a_round_refuses_vectors_of_another_fragment_size():
    params = {"w": torch.zeros(10)}
    outer = OuterOptimizer(params, OuterConfig(inner_steps=4, fragments=2))
    with pytest.raises(ValueError):
        outer.outer_step(torch.zeros(10), torch.zeros(10), params, step=2)
    with pytest.raises(ValueError):
        outer.pseudo_gradient(torch.zeros(10))
    assert outer.rounds == 0 and not outer.momentum.any()


@pytest.mark.parametrize("bad", [dict(fragments=0), dict(fragments=2.0), dict(fragments=MAX_FRAGMENTS + 1),
                                 dict(inner_steps=3, fragments=4)])
def test_config_refuses_fragments_that_do_not_fit(bad):
    with pytest.raises(ConfigError):
        OuterConfig(**bad)


def test_more_fragments_than_parameters_is_a_config_error():
    with pytest.raises(ConfigError):
        OuterOptimizer({"w": torch.zeros(3)}, OuterConfig(inner_steps=8, fragments=4))


def test_a_state_written_before_fragments_loads_as_one_fragment():
    params = {"w": torch.zeros(10)}
    outer = OuterOptimizer(params, OuterConfig(inner_steps=8, fragments=2))
    state = OuterOptimizer({"w": torch.ones(10)}, OuterConfig(inner_steps=5)).state_dict()
    del state["config"]["fragments"]
    outer.load_state_dict(state)
    assert outer.config == OuterConfig(inner_steps=5) and outer.fragment() == (0, 10)
    state["config"].update(fragments=11, inner_steps=20)
    with pytest.raises(ValueError):
        outer.load_state_dict(state)


@FAST
@given(sizes=st.lists(st.integers(0, 6), max_size=4), data=st.data())
def test_flatten_and_shift_of_a_range_round_trip(sizes, data):
    numel = sum(sizes)
    a = data.draw(st.integers(0, numel))
    b = data.draw(st.integers(a, numel))
    params = random_params(sizes, torch.Generator().manual_seed(numel))
    whole = flatten(params)
    assert torch.equal(flatten(params, bounds=(a, b)), whole[a:b])
    target = {k: torch.zeros_like(v) for k, v in params.items()}
    shift_flat(target, torch.zeros(b - a), whole[a:b], (a, b))
    expected = torch.zeros(numel)
    expected[a:b] = whole[a:b]
    assert torch.equal(flatten(target), expected)
    with pytest.raises(ValueError):
        flatten(params, bounds=(a, numel + 1))
    with pytest.raises(ValueError):
        shift_flat(target, torch.zeros(b - a + 1), torch.zeros(b - a + 1), (a, b))
