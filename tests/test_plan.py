"""The size plans of ``p2pswarm.run.plan``: pure arithmetic, held to its rules by properties.

``rows_that_fit`` is the most rows whose message fits the frame budget (one more does not, or
its targets pass MAX_TARGETS); ``activation_problem`` is None exactly when the plan is admitted
and otherwise one line naming the rows that fit; ``fitting_rows`` never asks for more than was
asked or than fits, and never for none; a snapshot is six fp32 copies of the stage plus headers.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm import wire
from p2pswarm.errors import ConfigError
from p2pswarm.model import catalog
from p2pswarm.run import plan
from p2pswarm.swarm.activation import MAX_TARGETS

SPECS = st.builds(
    lambda width, heads, vocab: dataclasses.replace(catalog.MODELS["tiny-lm"], width=2 * width * heads, heads=heads,
                                                    kv_heads=heads, vocab=vocab),
    st.integers(1, 256), st.sampled_from([1, 2, 4, 8]), st.sampled_from([256, 32768, 1 << 20]))
DTYPES = st.sampled_from(["float32", "bfloat16", "float16"])


@given(SPECS, st.integers(1, 300), st.integers(1, 4096), DTYPES)
def test_rows_that_fit_is_the_most_that_fit(spec, rows, seq, dtype):
    p = plan.activation_plan(spec, rows, seq, dtype)
    targets = seq * plan.target_bytes(spec)
    assert p.row_bytes == seq * spec.width * wire.DTYPE_SIZES[dtype] + targets
    assert p.message_bytes == rows * p.row_bytes
    fit = p.rows_that_fit
    assert fit * p.row_bytes <= plan.FRAME_BUDGET and fit * targets <= MAX_TARGETS
    assert (fit + 1) * p.row_bytes > plan.FRAME_BUDGET or (fit + 1) * targets > MAX_TARGETS
    assert p.admitted == (rows <= fit) == (plan.activation_problem(spec, rows, seq, dtype) is None)
    assert 1 <= plan.fitting_rows(spec, rows, seq, dtype) <= rows
    assert plan.max_message_bytes(spec, rows, seq, dtype) == min(plan.FRAME_BUDGET, p.message_bytes)


def test_the_problem_is_one_line_that_says_what_fits():
    small = catalog.MODELS["small"]
    problem = plan.activation_problem(small, 8, 1024, "float32")  # 8 x 8 MiB + targets: past 64 MiB
    assert problem is not None and "\n" not in problem and "at most 7 rows" in problem
    assert plan.activation_problem(small, 8, 1024, "bfloat16") is None
    wide = dataclasses.replace(small, width=1 << 16, heads=512, kv_heads=512)
    assert "one row" in plan.activation_problem(wide, 1, 1024, "float32")  # not even one row fits


@pytest.mark.parametrize("rows, seq, dtype", [(0, 8, "float32"), (1, 0, "float32"), (1, 8, "float64")])
def test_bad_shapes_and_dtypes_are_config_errors(rows, seq, dtype):
    with pytest.raises(ConfigError):
        plan.activation_plan(catalog.MODELS["nano"], rows, seq, dtype)


def test_a_snapshot_is_six_fp32_copies_and_its_headers():
    spec = catalog.MODELS["nano"]
    for stage in range(spec.n_stages):
        p = plan.snapshot_plan(spec, stage)
        assert p.params == catalog.param_count(spec, stage)
        assert p.total_bytes == 6 * 4 * p.params + plan.SNAPSHOT_OVERHEAD
    assert plan.MAX_SNAPSHOT_BYTES % plan.GIB == 0
    assert (plan.MAX_SNAPSHOT_BYTES - plan.GIB < plan.largest_snapshot(catalog.MODELS.values())
            <= plan.MAX_SNAPSHOT_BYTES)
