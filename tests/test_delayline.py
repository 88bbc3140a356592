"""The link lab's delay line (``testing/delayline.py``): frames leave in order, never early, all of them
by their time, within the line's buffer."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm.testing.delayline import DelayLine, Pair

events = st.lists(st.tuples(st.floats(0, 0.5), st.binary(min_size=1, max_size=64)), max_size=60)


@given(st.floats(0, 0.2), events, st.integers(64, 2048))
def test_frames_leave_in_order_never_before_their_delay_and_all_by_it(delay, arrivals, buffer):
    line, now, sent, got = DelayLine(delay, max_held_bytes=buffer), 0.0, [], []
    for gap, frame in arrivals:
        now += gap
        got += [(now, f) for f in line.due(now)]
        if line.push(frame, now):
            sent.append((now, frame))
        assert line.held_bytes <= buffer
    got += [(now + delay, f) for f in line.due(now + delay)]  # everything held is due by then
    assert [f for _, f in got] == [f for _, f in sent] and line.held_bytes == 0 and line.next_due() is None
    assert all(left >= came + delay for (left, _), (came, _) in zip(got, sent))
    assert line.dropped == len(arrivals) - len(sent)


def test_a_full_line_drops_and_a_pair_reads_back_as_written():
    line = DelayLine(0.05, max_held_bytes=10)
    assert line.push(b"x" * 6, 0.0) and not line.push(b"y" * 6, 0.0) and line.dropped == 1
    assert line.due(0.049) == [] and line.due(0.05) == [b"x" * 6]
    pair = Pair("ns1", "eth0", "core", "p1", 30.0)
    assert Pair.parse(pair.arg()) == pair
    with pytest.raises(ValueError):
        Pair.parse("ns1:eth0:core:30")
    with pytest.raises(ValueError):
        DelayLine(-1.0)
