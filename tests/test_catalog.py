"""Model catalog: layer ranges from the command line and the least-served stage rule."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm.errors import ConfigError
from p2pswarm.model.catalog import MODELS, get_model, least_served_stage, parse_layers

TINY = get_model("tiny-lm")


def test_parse_layers():
    assert parse_layers("0:2", TINY) == (0, 2)
    assert parse_layers("auto", TINY) is None
    for bad in ["2:2", "3:1", "0:9", "-1:2", "a:b", "1", "1:2:3", ""]:
        with pytest.raises(ConfigError):
            parse_layers(bad, TINY)


@given(st.sampled_from(sorted(MODELS)), st.dictionaries(st.integers(0, 30), st.integers(0, 5)), st.integers())
def test_least_served_stage_is_a_stage_with_fewest_replicas(name, replicas, seed):
    model = get_model(name)
    start, end = least_served_stage(model, replicas, random.Random(seed))
    assert (start, end) in [model.stage_range(s) for s in range(model.n_stages)]

    def stage_min(s):
        a, b = model.stage_range(s)
        return min(replicas.get(layer, 0) for layer in range(a, b))

    assert min(replicas.get(layer, 0) for layer in range(start, end)) == min(map(stage_min, range(model.n_stages)))
