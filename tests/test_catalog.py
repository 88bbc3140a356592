"""Model catalog: layer ranges from the command line and the least-served stage rule."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm.errors import ConfigError
from p2pswarm.model.catalog import (
    MODELS,
    STAGE_MEMORY_BUDGET,
    ModelSpec,
    activation_bytes,
    block_param_count,
    default_rows,
    format_tier_table,
    get_model,
    least_served_stage,
    llama_ffn,
    model_param_count,
    param_count,
    parse_layers,
    stage_memory,
    tier_table,
)

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
    assert (TINY.width, TINY.heads, TINY.ffn, TINY.context, TINY.vocab) == (128, 4, 256, 128, 256)
    assert (TINY.kv_heads, TINY.rope_theta, TINY.norm_eps) == (4, 10000.0, 1e-5)
    tiers = {name: (MODELS[name].n_layers, MODELS[name].width, MODELS[name].heads)
             for name in ["nano", "micro", "small", "medium", "large", "xl"]}
    assert tiers == {"nano": (8, 512, 4), "micro": (16, 1024, 8), "small": (24, 2048, 16),
                     "medium": (32, 3072, 24), "large": (48, 5120, 40), "xl": (64, 7168, 56)}
    assert ModelSpec("old-style", 8, 2).vocab == 256  # the dimensions have defaults
    assert ModelSpec("old-style", 8, 2, heads=2).kv_heads == 2  # kv_heads defaults to heads
    assert dataclasses.replace(TINY, vocab=32000).vocab == 32000  # a tokenizer sets the vocabulary
    assert [llama_ffn(w) for w in (512, 1024, 3072, 7168)] == [1536, 2816, 8192, 19200]


@pytest.mark.parametrize("fields", [{"n_layers": 0}, {"stage_size": -1}, {"width": 130}, {"heads": 0},
                                    {"ffn": 0}, {"context": 0}, {"vocab": 0}, {"width": 2.5}, {"kv_heads": 3},
                                    {"kv_heads": -1}, {"width": 132, "heads": 4, "kv_heads": 4},
                                    {"rope_theta": 0.0}, {"rope_theta": float("inf")}, {"norm_eps": -1e-5},
                                    {"norm_eps": "1e-5"}, {"kv_heads": True}])
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


@given(st.sampled_from(sorted(MODELS)), st.integers(1, 16), st.integers(1, 2048), st.sampled_from(["fp32", "bf16"]))
def test_stage_memory_adds_up_and_grows_with_the_micro_batch(name, rows, seq, precision):
    spec = get_model(name)
    for stage in {0, spec.last_stage}:
        memory = stage_memory(spec, stage, rows, seq, precision)
        parts = (memory.weights, memory.master, memory.grads, memory.adam, memory.stash, memory.activations,
                 memory.transient)
        assert memory.total == sum(parts) and min(parts[2:]) > 0
        assert memory.weights + memory.master == param_count(spec, stage) * (6 if precision == "bf16" else 4)
        assert stage_memory(spec, stage, rows + 1, seq, precision).activations > memory.activations
        bf16 = stage_memory(spec, stage, rows, seq).activations
        assert stage_memory(spec, stage, rows, seq, "fp32").activations >= bf16
    assert activation_bytes(spec, rows, seq, 2) == rows * seq * spec.width * 2


def test_bad_memory_questions_are_refused():
    with pytest.raises(ConfigError):
        stage_memory(TINY, 0, 8, 128, "fp16")
    with pytest.raises(ConfigError):
        stage_memory(TINY, 0, 0, 128)
    with pytest.raises(ConfigError):
        stage_memory(TINY, TINY.n_stages, 8, 128)


def test_the_tier_table_lists_every_model_within_the_budget():
    table = tier_table()
    assert [row.model for row in table] == list(MODELS)
    for row in table:
        spec = MODELS[row.model]
        assert row.stages * row.stage_size == row.n_layers == spec.n_layers and row.rows == default_rows(spec)
        assert row.memory <= row.memory_bpe <= STAGE_MEMORY_BUDGET
        assert row.activation_fp32 == 2 * row.activation_bf16 == activation_bytes(spec, row.rows, spec.context, 4)
        assert row.activation_bf16 <= 64 * 2**20  # one bf16 micro-batch fits one 64 MiB frame
    text = format_tier_table()
    assert len(text.splitlines()) == len(MODELS) + 2 and "| xl | 33.9B | 64 | 64 x 1 |" in text
