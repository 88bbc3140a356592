"""Model catalog: layer ranges from the command line and the least-served stage rule."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm.errors import ConfigError
from p2pswarm.model.catalog import (MODELS, ModelSpec, block_param_count, get_model, least_served_stage,
                                   model_param_count, param_count, parse_layers)

TINY = get_model("tiny-lm")


def test_parse_layers_takes_exactly_one_stage():
    assert parse_layers("0:2", TINY) == (0, 2)
    assert parse_layers("6:8", TINY) == (6, 8)
    assert parse_layers("auto", TINY) is None
    for bad in ["2:2", "3:1", "0:9", "-1:2", "a:b", "1", "1:2:3", "", "1:3", "0:4", "0:1"]:
        with pytest.raises(ConfigError):
            parse_layers(bad, TINY)
    with pytest.raises(ConfigError, match="0:2, 2:4, 4:6, 6:8"):
        parse_layers("1:3", TINY)


@given(st.sampled_from(sorted(MODELS)), st.integers(0, 64), st.integers(0, 64))
def test_stage_of_inverts_stage_range(name, start, end):
    model = get_model(name)
    stage = model.stage_of(start, end)
    if stage is None:
        assert (start, end) not in [model.stage_range(s) for s in range(model.n_stages)]
    else:
        assert model.stage_range(stage) == (start, end)


@given(st.sampled_from(sorted(MODELS)), st.dictionaries(st.integers(0, 30), st.integers(0, 5)), st.integers())
def test_least_served_stage_is_a_stage_with_fewest_replicas(name, replicas, seed):
    model = get_model(name)
    stage = least_served_stage(model, replicas, random.Random(seed))
    assert 0 <= stage < model.n_stages
    assert replicas.get(stage, 0) == min(replicas.get(s, 0) for s in range(model.n_stages))


def test_specs_carry_their_dimensions():
    assert (TINY.n_layers, TINY.stage_size, TINY.n_stages) == (8, 2, 4)
    assert (TINY.width, TINY.heads, TINY.ffn, TINY.context, TINY.vocab) == (128, 4, 512, 128, 256)
    tiers = {name: (MODELS[name].n_layers, MODELS[name].width, MODELS[name].heads)
             for name in ["nano", "micro", "small", "medium", "large", "xl"]}
    assert tiers == {"nano": (8, 512, 4), "micro": (16, 1024, 8), "small": (24, 2048, 16),
                     "medium": (32, 3072, 24), "large": (48, 5120, 40), "xl": (64, 7168, 56)}
    assert ModelSpec("old-style", 8, 2).vocab == 256  # the dimensions have defaults


@pytest.mark.parametrize("fields", [{"n_layers": 0}, {"stage_size": -1}, {"width": 130}, {"heads": 0},
                                    {"ffn": 0}, {"context": 0}, {"vocab": 0}, {"width": 2.5}])
def test_a_spec_with_impossible_dimensions_is_refused(fields):
    with pytest.raises(ConfigError):
        dataclasses.replace(TINY, **fields)


@given(st.sampled_from(sorted(MODELS)))
def test_param_count_sums_the_stages_and_ends_carry_embeddings_and_head(name):
    model = get_model(name)
    counts = [param_count(model, stage) for stage in range(model.n_stages)]
    assert sum(counts) == model_param_count(model)
    per_block = block_param_count(model)
    assert counts[0] - (model.stage_range(0)[1] * per_block) >= model.vocab * model.width
    with pytest.raises(ConfigError):
        param_count(model, model.n_stages)
