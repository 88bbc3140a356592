"""The link lab shapes for real: a bulk TCP transfer out of a host on a 20 Mbit/s uplink runs at
about 20 Mbit/s, a delayed line's round trips take twice its one-way delay, and no lab namespace
outlives the lab."""

from __future__ import annotations

import statistics

import pytest

from p2pswarm.testing.linklab import LinkLab, delay_line_available, link_lab_available, round_trips, transfer_mbit
from p2pswarm.testing.natlab import netns_names

pytestmark = pytest.mark.timeout(30)

UP_MBIT = 20
NBYTES = 6_000_000  # ~2.4 s at 20 Mbit/s: long enough that the 64 KiB burst is noise
TRANSFER_TIMEOUT = 15.0  # 3x the time at half the shaped rate
DELAY_MS = 50.0  # one way, each host's line: the lab check at 20-100 ms
PINGS = 21  # the first also resolves ARP (one more round trip)
RTT_TOLERANCE = 0.10  # the lab's target: a round trip within 10 % of the set delay


@pytest.fixture(autouse=True)
def _needs_link_lab():
    reason = link_lab_available()
    if reason:
        pytest.skip(reason)


def test_a_bulk_transfer_runs_at_the_shaped_uplink_rate_and_teardown_leaves_nothing():
    with LinkLab() as lab:  # torn down before the last assertion
        sender, receiver = lab.host("sender", up_mbit=UP_MBIT), lab.host("receiver")
        namespaces = list(lab.namespaces)
        received, mbit = transfer_mbit(lab, sender, receiver, NBYTES, TRANSFER_TIMEOUT)
    print(f"{received} bytes, the second half at {mbit:.1f} Mbit/s through a {UP_MBIT} Mbit/s uplink")
    assert received == NBYTES
    assert 0.5 * UP_MBIT < mbit < 1.3 * UP_MBIT
    assert len(namespaces) == 3 and not set(namespaces) & set(netns_names())


def test_a_delayed_line_holds_each_direction_its_delay_and_keeps_its_rate():
    """Two hosts whose lines delay what they send 50 ms: a round trip is 100 ms (within 10 %), never less,
    and a bulk transfer still runs at the shaped rate; the delay lines go with the lab."""
    reason = delay_line_available()
    if reason:
        pytest.skip(reason)
    with LinkLab() as lab:
        a, b = (lab.host(label, up_mbit=UP_MBIT, delay_ms=DELAY_MS) for label in "ab")
        rtts = round_trips(lab, a, b, PINGS)[1:]
        received, mbit = transfer_mbit(lab, a, b, NBYTES, TRANSFER_TIMEOUT)
        namespaces, lines = list(lab.namespaces), [p for p in lab.processes if p.poll() is None]
    target = 2 * DELAY_MS
    print(f"round trips {min(rtts):.1f}-{max(rtts):.1f} ms (median {statistics.median(rtts):.1f}) for {target:g} ms; "
          f"{received} bytes, the second half at {mbit:.1f} Mbit/s")
    assert min(rtts) >= target  # a delay line never delivers early
    assert statistics.median(rtts) <= target * (1 + RTT_TOLERANCE)
    assert received == NBYTES and 0.5 * UP_MBIT < mbit < 1.3 * UP_MBIT
    assert lines and all(p.poll() is not None for p in lines)
    assert not set(namespaces) & set(netns_names())
