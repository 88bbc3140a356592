"""Properties of the evaluation rounds (p2pswarm.swarm.evaluation.EvalBook).

A round completes exactly when ``expected`` micro-batches arrived, in bits per byte of what
arrived (total nats / total tokens / ln 2); a later round of the same session closes an open
earlier one with what it had; sessions do not interfere; a non-finite loss or a micro-batch
without tokens is ignored; history and open rounds stay bounded; latest() and best() agree
with the history.
"""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm.swarm.evaluation import HISTORY, MAX_OPEN_ROUNDS, EvalBook, EvalRound, agreement

SESSIONS = [b"alice", b"bob", b"carol"]
nats = st.floats(0.0, 1e4, allow_nan=False)
tokens = st.integers(1, 4096)
batches = st.lists(st.tuples(nats, tokens), min_size=1, max_size=12)
expecteds = st.integers(1, 8)


def bpb(parts) -> float:
    return sum(n for n, _ in parts) / sum(t for _, t in parts) / math.log(2)


def check(done: EvalRound, session: bytes, round_: int, parts, at: float) -> None:
    assert (done.session, done.round, done.batches, done.at) == (session, round_, len(parts), at)
    assert done.tokens == sum(t for _, t in parts)
    assert math.isclose(done.bits_per_byte, bpb(parts), rel_tol=1e-9, abs_tol=1e-12)


@given(expecteds, batches, st.integers(0, 1000))
def test_a_round_completes_exactly_when_expected_batches_arrived(expected, parts, round_):
    book = EvalBook(expected)
    for i, (n, t) in enumerate(parts[:expected]):
        done = book.record(b"alice", round_, n, t, float(i))
        if i + 1 < expected:
            assert done is None and book.history == [] and book.latest() is None
        else:
            check(done, b"alice", round_, parts[:expected], float(i))
            assert book.history == [done] and book.latest() == done == book.best()
    if len(parts) < expected:
        assert book.history == []


@given(expecteds, batches, nats, tokens, st.integers(0, 100), st.integers(1, 5))
def test_a_later_round_closes_the_earlier_one_with_what_it_had(expected, parts, n, t, round_, gap):
    parts = parts[:expected - 1]  # not enough to complete on their own
    book = EvalBook(expected)
    for n0, t0 in parts:
        assert book.record(b"bob", round_, n0, t0, 1.0) is None
    done = book.record(b"bob", round_ + gap, n, t, 2.0)
    if expected == 1:
        check(done, b"bob", round_ + gap, [(n, t)], 2.0)
        assert book.history == [done]
    elif parts:
        check(done, b"bob", round_, parts, 2.0)
        assert book.history == [done]
    else:
        assert done is None and book.history == []


@given(expecteds, st.lists(st.tuples(st.sampled_from(SESSIONS), nats, tokens), max_size=40))
def test_sessions_do_not_interfere(expected, arrivals):
    """Each session sends round 0 then round 1; interleaved, each completes with its own batches."""
    book = EvalBook(expected)
    sent: dict[bytes, list] = {s: [] for s in SESSIONS}
    for i, (session, n, t) in enumerate(arrivals):
        round_ = len(sent[session]) // expected
        if round_ > 1:
            continue
        sent[session].append((n, t))
        done = book.record(session, round_, n, t, float(i))
        if len(sent[session]) % expected == 0:
            check(done, session, round_, sent[session][-expected:], float(i))
        else:
            assert done is None
    for session in SESSIONS:
        mine = [r for r in book.history if r.session == session]
        assert [r.round for r in mine] == list(range(len(sent[session]) // expected))


@given(expecteds, batches, st.sampled_from([math.nan, math.inf, -math.inf]), st.integers(-5, 0), nats)
def test_a_non_finite_loss_or_no_tokens_is_ignored(expected, parts, bad_nats, bad_tokens, n):
    book = EvalBook(expected)
    parts = parts[:expected]
    for i, (n0, t0) in enumerate(parts):
        before = list(book.history)
        assert book.record(b"carol", 0, bad_nats, t0, 0.0) is None
        assert book.record(b"carol", 1, n, bad_tokens, 0.0) is None  # not even a later round's start
        assert book.history == before
        done = book.record(b"carol", 0, n0, t0, 0.0)
        assert (done is None) == (i + 1 < expected)
    if len(parts) == expected:
        check(book.latest(), b"carol", 0, parts, 0.0)


@given(st.integers(0, 40), nats)
def test_history_keeps_the_last_rounds_only(extra, n):
    book = EvalBook(1)
    for r in range(HISTORY + extra):
        assert book.record(b"alice", r, n + r, 100, float(r)) is not None
    assert len(book.history) == min(HISTORY, HISTORY + extra)
    assert [r.round for r in book.history] == list(range(extra, HISTORY + extra))
    assert book.latest().round == HISTORY + extra - 1


@given(st.integers(1, 30), st.integers(2, 4))
def test_open_rounds_stay_bounded_and_evicted_ones_still_count(extra, expected):
    book = EvalBook(expected)
    for i in range(MAX_OPEN_ROUNDS + extra):  # one batch of one round from ever more sessions
        book.record(b"s%d" % i, i, 1.0, 10, float(i))
        assert len(book._open) <= MAX_OPEN_ROUNDS  # the bound is internal: no public view of it
    assert [(r.session, r.round, r.batches) for r in book.history] == [(b"s%d" % i, i, 1) for i in range(extra)]


@given(st.lists(st.tuples(st.sampled_from(SESSIONS), st.integers(0, 200), nats, tokens, st.floats(0, 1e6)),
                max_size=80), expecteds)
def test_latest_and_best_follow_the_history(arrivals, expected):
    book = EvalBook(expected)
    for session, round_, n, t, now in arrivals:
        done = book.record(session, round_, n, t, now)
        assert len(book.history) <= HISTORY and len(book._open) <= MAX_OPEN_ROUNDS
        if done is not None:
            assert done in book.history
        if book.history:
            assert book.latest() is book.history[-1]
            assert book.best().bits_per_byte == min(r.bits_per_byte for r in book.history)
        else:
            assert book.latest() is None and book.best() is None


def test_constructor_rejects_a_round_without_micro_batches():
    for expected in (0, -1):
        with pytest.raises(ValueError):
            EvalBook(expected)


def test_a_straggler_of_a_round_already_over_makes_no_second_round():
    book = EvalBook(2)
    book.record(b"alice", 0, 10.0, 10, 0.0)
    book.record(b"alice", 1, 10.0, 10, 1.0)  # round 0 closed with 1 batch of 2: it is over
    book.record(b"alice", 0, 99.0, 10, 2.0)  # its missing micro-batch, late (reordered or retried)
    book.record(b"alice", 1, 10.0, 10, 3.0)  # round 1 completes
    book.record(b"alice", 2, 10.0, 10, 4.0)  # round 2 starts
    assert [r.round for r in book.history] == [0, 1]


def test_a_rounds_chain_and_outer_rounds_are_kept_only_while_its_micro_batches_agree():
    book = EvalBook(expected=2)
    book.record(b"a", 0, 1.0, 8, 0.0, rounds=(3, 3), chain=("p", "q"))
    same = book.record(b"a", 0, 1.0, 8, 1.0, rounds=(3, 3), chain=("p", "q"))
    assert (same.rounds, same.chain, same.agreed_round) == ((3, 3), ("p", "q"), 3)
    book.record(b"a", 1, 1.0, 8, 2.0, rounds=(4, 4), chain=("p", "q"))
    mixed = book.record(b"a", 1, 1.0, 8, 3.0, rounds=(4, 3), chain=("p", "r"))
    assert mixed.rounds is None and mixed.chain is None and mixed.agreed_round is None
    live = EvalRound(b"a", 2, 5.0, 8, 1, 4.0, rounds=(-1, -1), chain=("p", "q"))
    assert live.agreed_round is None  # live weights are no agreed round


figures = st.floats(0.5, 8.0, allow_nan=False)


@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["p", "q", "r"]), figures,
                          st.booleans()), max_size=30))
def test_agreement_groups_chains_by_the_outer_round_every_stage_evaluated(evals):
    rounds = [EvalRound(b"s" + chain.encode(), i, bpb_, 8, 1, float(i),
                        rounds=(r, r) if uniform else (r, r + 1), chain=(chain, "last"))
              for i, (r, chain, bpb_, uniform) in enumerate(evals)]
    found = agreement(rounds)
    assert [a.round for a in found] == sorted({r for r, _, _, u in evals if u})
    for a in found:
        newest = {}
        for r, chain, bpb_, uniform in evals:
            if uniform and r == a.round:
                newest[(chain, "last")] = bpb_  # the newest evaluation of each chain counts
        assert a.chains == newest
        assert a.spread == max(newest.values()) - min(newest.values()) >= 0
        assert min(newest.values()) <= a.bits_per_byte <= max(newest.values())
    assert agreement(list(reversed(rounds))) == found


def test_a_round_cut_short_is_no_figure_of_its_outer_round():
    book = EvalBook(expected=2)
    book.record(b"a", 0, 1.0, 8, 0.0, rounds=(1, 1), chain=("p", "q"))  # its second micro-batch was lost
    short = book.record(b"a", 1, 2.0, 8, 1.0, rounds=(2, 2), chain=("p", "q"))  # round 1 starts: round 0 closes
    assert short.round == 0 and not short.complete
    assert agreement(book.history) == []
