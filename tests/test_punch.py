"""The pure part of DCUtR in ``p2pswarm/nat/punch.py``: who initiates, and the PunchBook.

``initiates`` is checked on its whole truth table, in both id orders, and for the property the
tie-break exists for: when each side dialed the other through a relay, exactly one initiates.
``PunchBook`` is driven by a hypothesis state machine that keeps its own account of tries,
running punches, backoff deadlines and outcomes, and checks the book against it.
"""

from __future__ import annotations

import itertools
import os
import string
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from p2pswarm.nat.punch import (
    FAILED,
    MAX_PUNCH_ATTEMPTS,
    PUNCH_BACKOFF,
    PUNCHED,
    UNILATERAL,
    PunchBook,
    initiates,
)

ROOT = Path(__file__).resolve().parent.parent
OUTCOMES = (UNILATERAL, PUNCHED, FAILED)
ids = st.text(string.ascii_letters + string.digits, min_size=1, max_size=8)

# --- initiates --------------------------------------------------------------------------


def expected_initiates(inbound: bool, outbound: bool, direct: bool, ours: str, theirs: str) -> bool:
    if direct or not inbound:
        return False
    if not outbound:
        return True
    return ours < theirs


@pytest.mark.parametrize("inbound,outbound,direct", list(itertools.product([False, True], repeat=3)))
@pytest.mark.parametrize("ours,theirs", [("QmAlice", "QmBob"), ("QmBob", "QmAlice")])
def test_initiates_truth_table(inbound, outbound, direct, ours, theirs):
    got = initiates(inbound_relayed=inbound, outbound_relayed=outbound, direct=direct,
                    our_id=ours, their_id=theirs)
    assert got is expected_initiates(inbound, outbound, direct, ours, theirs)


def test_initiates_plain_cases():
    def run(**kw):
        return initiates(our_id="a", their_id="b", **kw)

    assert run(inbound_relayed=True, outbound_relayed=False, direct=False)  # we received: we punch
    assert not run(inbound_relayed=False, outbound_relayed=True, direct=False)  # we dialed: they punch
    assert not run(inbound_relayed=False, outbound_relayed=False, direct=False)  # no relayed connection
    for inbound, outbound in itertools.product([False, True], repeat=2):  # already direct: nothing to do
        assert not run(inbound_relayed=inbound, outbound_relayed=outbound, direct=True)


@given(ids, ids)
def test_exactly_one_side_initiates_when_both_dialed_through_relays(x, y):
    if x == y:
        return
    ours = initiates(inbound_relayed=True, outbound_relayed=True, direct=False, our_id=x, their_id=y)
    theirs = initiates(inbound_relayed=True, outbound_relayed=True, direct=False, our_id=y, their_id=x)
    assert ours != theirs


@given(ids, ids)
def test_one_relayed_connection_has_exactly_one_initiator(x, y):
    """x dialed y through a relay: y received it (inbound) and initiates; x (outbound) does not."""
    assert initiates(inbound_relayed=True, outbound_relayed=False, direct=False, our_id=y, their_id=x)
    assert not initiates(inbound_relayed=False, outbound_relayed=True, direct=False, our_id=x, their_id=y)


# --- PunchBook --------------------------------------------------------------------------

PEERS = ("QmA", "QmB", "QmC")


class PunchBookMachine(RuleBasedStateMachine):
    """Drive a PunchBook the way nat/holepunch.py does, with a model kept alongside."""

    @initialize(max_attempts=st.integers(1, 4), backoff=st.sampled_from([0.0, 0.5, PUNCH_BACKOFF]))
    def setup(self, max_attempts, backoff):
        self.book = PunchBook(max_attempts=max_attempts, backoff=backoff)
        self.now = 0.0
        self.tries = {}  # peer -> punches started since the last forget
        self.running = set()
        self.not_before = {}  # peer -> earliest time it may be due again
        self.finished_calls = 0
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.upgrade_seconds = []

    @rule(dt=st.floats(0, 2 * PUNCH_BACKOFF, allow_nan=False))
    def advance(self, dt):
        self.now += dt

    @rule(peer=st.sampled_from(PEERS))
    def maybe_start(self, peer):
        due = self.book.due(peer, self.now)
        # The model's view: free, under budget, past the backoff.
        assert due == (peer not in self.running and self.tries.get(peer, 0) < self.book.max_attempts
                       and self.now >= self.not_before.get(peer, 0.0))
        if not due:
            return
        assert peer not in self.running, "a running peer was due"
        self.book.started(peer, self.now)
        self.running.add(peer)
        self.tries[peer] = self.tries.get(peer, 0) + 1
        self.not_before[peer] = self.now + self.book.backoff

    @precondition(lambda self: self.running)
    @rule(data=st.data(), outcome=st.sampled_from(OUTCOMES), seconds=st.floats(0, 30, allow_nan=False))
    def finish(self, data, outcome, seconds):
        peer = data.draw(st.sampled_from(sorted(self.running)))
        self.book.finished(peer, self.now, outcome, seconds)
        self.running.discard(peer)
        self.not_before[peer] = self.now + self.book.backoff
        self.finished_calls += 1
        self.outcomes[outcome] += 1
        if outcome != FAILED:
            self.upgrade_seconds.append(seconds)
        if self.book.backoff > 0:  # the backoff starts again at the end of the punch
            assert not self.book.due(peer, self.now)

    @rule(peer=st.sampled_from(PEERS))
    def forget(self, peer):
        self.book.forget(peer)
        if peer in self.running:  # a running punch keeps its budget and its place
            assert peer in self.book.running and peer in self.book.known()
        else:
            self.tries.pop(peer, None)
            self.not_before.pop(peer, None)
            assert peer not in self.book.known()

    @rule(peer=st.sampled_from(PEERS), early=st.floats(0, 1, exclude_max=True))
    def not_due_during_backoff(self, peer, early):
        """Some time before the backoff deadline a peer is never due."""
        deadline = self.not_before.get(peer)
        if deadline is not None and deadline > self.now:
            instant = self.now + early * (deadline - self.now)
            if instant < deadline:  # early < 1, yet the float sum can round up onto the deadline
                assert not self.book.due(peer, instant)

    @invariant()
    def budget_respected(self):
        for peer, tries in self.book.tries.items():
            assert 0 < tries <= self.book.max_attempts, (peer, tries)
        assert self.book.tries == self.tries

    @invariant()
    def running_matches(self):
        assert self.book.running == self.running
        assert self.book.summary()["running"] == len(self.running)
        assert set(self.book.known()) == set(self.tries) | self.running

    @invariant()
    def counts_match(self):
        summary = self.book.summary()
        assert summary["attempts"] == self.finished_calls
        assert summary["attempts"] == sum(summary[o] for o in OUTCOMES)
        assert {o: summary[o] for o in OUTCOMES} == self.outcomes
        assert summary["refused_second_initiator"] == 0
        assert (summary["upgrade_p50_ms"] is None) == (not self.upgrade_seconds)


PunchBookMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestPunchBook = PunchBookMachine.TestCase


def test_punch_book_example():
    """Three tries at ten-second intervals, then nothing until the peer is forgotten."""
    book = PunchBook()
    assert (book.max_attempts, book.backoff) == (MAX_PUNCH_ATTEMPTS, PUNCH_BACKOFF)
    now = 0.0
    for attempt in range(MAX_PUNCH_ATTEMPTS):
        assert book.due("p", now)
        book.started("p", now)
        assert not book.due("p", now + 100)  # running
        now += 2.0
        book.finished("p", now, FAILED if attempt < 2 else PUNCHED, 2.0)
        assert not book.due("p", now + PUNCH_BACKOFF - 0.001)
        now += PUNCH_BACKOFF
    assert not book.due("p", now + 1000)  # budget spent
    summary = book.summary()
    assert summary["attempts"] == 3 and summary[FAILED] == 2 and summary[PUNCHED] == 1
    assert summary["upgrade_p50_ms"] == summary["upgrade_p95_ms"] == 2000.0
    assert book.punched == {"p"}  # its direct connection shows as holepunched (net.connect.path_kinds)
    book.forget("p")  # a new relayed connection from it: a fresh budget; the punched direct one may still be there
    assert book.due("p", now) and book.known() == [] and book.punched == {"p"}
    book.gone("p")
    assert not book.punched


def test_the_machine_never_asks_for_an_instant_that_rounds_onto_the_deadline():
    """``now + early * (deadline - now)`` with ``early`` just below 1 can round to the deadline
    itself, where the peer IS due (the core and the model agree: ``now >= next_try``). The
    machine's rule must only ask about instants strictly before the deadline."""
    early = 0.9999999999999999
    now = 3.7
    assert now + early * PUNCH_BACKOFF == now + PUNCH_BACKOFF  # the rounding this guards against
    machine = PunchBookMachine()
    machine.setup(max_attempts=2, backoff=PUNCH_BACKOFF)
    machine.advance(now)
    machine.maybe_start("QmA")
    machine.finish(_Draws("QmA"), FAILED, 1.0)  # backoff deadline: now + PUNCH_BACKOFF; one try left
    assert machine.book.due("QmA", now + PUNCH_BACKOFF)  # due again exactly at the deadline
    machine.not_due_during_backoff("QmA", early)
    machine.teardown()


class _Draws:
    """Stands in for hypothesis's ``data`` when a test replays the machine's rules by hand."""

    def __init__(self, value) -> None:
        self.value = value

    def draw(self, strategy):
        return self.value


# --- the suite's hypothesis profiles (tests/conftest.py) ----------------------------------------


@pytest.mark.parametrize("profile, derandomized", [("ci", True), (None, False)])
def test_hypothesis_profile_follows_the_environment(profile, derandomized):
    """HYPOTHESIS_PROFILE=ci (what .ci/run exports) makes runs derandomized; unset, they explore."""
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_PROFILE"}
    if profile:
        env["HYPOTHESIS_PROFILE"] = profile
    code = ("import tests.conftest; from hypothesis import HealthCheck, settings; d = settings.default; "
            "print(d.derandomize, d.database is None, d.deadline, HealthCheck.too_slow in d.suppress_health_check)")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == [str(derandomized), str(derandomized), "None", "True"]
