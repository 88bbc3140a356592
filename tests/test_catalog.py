"""Model catalog: layer ranges from the command line and the least-served stage rule."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm.errors import ConfigError
from p2pswarm.model.catalog import MODELS, get_model, least_served_stage, parse_layers

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
