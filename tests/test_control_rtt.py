"""A control request's wait (``net/control_rtt.py``): the caller's bound on a fast line, the measured
round trip on a slow one, a backoff while a peer does not answer, and a bounded memory."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from p2pswarm.net.control_rtt import MAX_BACKOFF, MAX_PEERS, MAX_REQUEST_TIMEOUT, PeerRtt, RttBook

bounds = st.floats(0.5, 60.0)
events = st.lists(st.none() | st.floats(0.0, 100.0, allow_subnormal=False), max_size=40)  # None: unanswered


def replay(seen) -> PeerRtt:
    rtt = PeerRtt()
    for seconds in seen:
        rtt = rtt.unanswered() if seconds is None else rtt.answered(seconds)
    return rtt


@given(bound=bounds, seen=events)
def test_a_request_waits_at_least_its_callers_bound_and_at_most_the_cap(bound, seen):
    waited = replay(seen).timeout(bound)
    assert bound <= waited <= max(bound, MAX_REQUEST_TIMEOUT)


@given(bound=bounds, answers=st.lists(st.floats(0.0, 0.1), min_size=1, max_size=40))
def test_on_a_fast_line_the_callers_bound_is_the_wait(bound, answers):
    assert replay(answers).timeout(bound) == bound


@given(seconds=st.floats(3.0, 6.0), bound=st.floats(0.5, 3.0))
def test_on_a_steady_slow_line_a_request_waits_longer_than_its_usual_round_trip(seconds, bound):
    rtt = replay([seconds] * 40)
    assert rtt.timeout(bound) >= seconds  # a reply as slow as the others is never given up on


@given(seen=events, misses=st.integers(0, 10))
def test_unanswered_requests_back_off_and_an_answer_resets(seen, misses):
    rtt = replay([*seen, 1.0, *[None] * misses])
    assert rtt.backoff == min(MAX_BACKOFF, 2.0 ** misses)
    assert rtt.answered(1.0).backoff == 1.0


def test_the_book_remembers_at_most_max_peers_the_least_recent_forgotten_first():
    book = RttBook()
    for n in range(MAX_PEERS + 10):
        book.answered(f"p{n}", 1.0)
    book.answered("p10", 2.0)  # used again: kept
    book.answered("new", 1.0)
    assert len(book) == MAX_PEERS and book.get("p10").srtt is not None and book.get("p11").srtt is None
