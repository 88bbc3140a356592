"""A snapshot fetch's pace (``diloco/fetch_pace.py``): chunks within bounds that follow the measured
rate, pauses that keep a background fetch to its share of the line, a deadline set by progress."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm.diloco.fetch_pace import (
    CHUNK_SECONDS,
    GROWTH,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    MIN_FETCH_RATE,
    ChunkPace,
)

shares = st.floats(0.05, 1.0)
chunks = st.lists(st.tuples(st.integers(1, MAX_CHUNK_BYTES), st.floats(0.0, 60.0, allow_subnormal=False)), max_size=30)


@given(share=shares, seen=chunks)
def test_a_chunk_is_within_its_bounds_and_grows_at_most_growth_times(share, seen):
    pace = ChunkPace(share)
    assert pace.next_length() == MIN_CHUNK_BYTES  # nothing measured yet: the smallest
    for nbytes, seconds in seen:
        pace.observe(nbytes, seconds)
        length = pace.next_length()
        assert MIN_CHUNK_BYTES <= length <= MAX_CHUNK_BYTES
        assert length <= max(MIN_CHUNK_BYTES, GROWTH * nbytes)


@given(rate=st.floats(1_000, 1e9), rtt=st.floats(0.0, 0.3))
def test_on_a_steady_line_chunks_settle_where_they_take_about_chunk_seconds(rate, rtt):
    pace = ChunkPace()
    for _ in range(40):
        length = pace.next_length()
        pace.observe(length, rtt + length / rate)
    settled = pace.next_length()
    if settled in (MIN_CHUNK_BYTES, MAX_CHUNK_BYTES):
        return  # a line too thin or too fast for the target: the bound holds
    took = rtt + settled / rate
    assert abs(took - CHUNK_SECONDS) < 0.05 * CHUNK_SECONDS  # it lasts the target (the round trip included)


@given(share=shares, seen=chunks)
def test_pauses_keep_a_fetch_to_its_share_of_the_lines_time(share, seen):
    pace = ChunkPace(share)
    busy = sum(seconds for _, seconds in seen)
    paused = sum(pace.observe(nbytes, seconds) for nbytes, seconds in seen)
    assert paused >= 0
    if busy > 0:
        assert busy / (busy + paused) == pytest.approx(share)
    if share == 1.0:
        assert paused == 0  # a joiner's load never waits


@given(share=shares, timeout=st.floats(1.0, 600.0), total=st.integers(1, 2**40))
def test_the_whole_fetch_may_take_what_its_size_needs_at_the_floor_rate(share, timeout, total):
    allowed = ChunkPace(share).allowed(timeout, total)
    assert allowed >= timeout
    assert allowed * MIN_FETCH_RATE * share >= total * (1 - 1e-9)  # progress, not size, cuts it off


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_share_outside_zero_to_one_is_refused(share):
    with pytest.raises(ValueError, match="share"):
        ChunkPace(share)
