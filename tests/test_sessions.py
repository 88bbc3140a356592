"""The session table of one replica (swarm/sessions.py): limits, contiguity, expiry, against a model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from p2pswarm.errors import ConfigError
from p2pswarm.swarm.sessions import Limits, SessionBusy, SessionOverloaded, SessionTable, UnknownSession, WrongPosition

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


def _table(**kw) -> SessionTable:
    return SessionTable(Limits(**{"bytes_per_token": 10, "max_sessions": 2, "session_bytes": 100,
                                  "total_bytes": 150, "idle_s": 60.0, **kw}))


def _step(table, session, position, n, now=0.0):
    table.begin(session, position, n, now)
    table.finish(session, f"cache{position + n}", now)


def test_a_session_grows_by_contiguous_steps_and_refuses_others():
    table = _table()
    _step(table, A, 0, 3)
    _step(table, A, 3, 1)
    assert table.sessions[A].length == 4 and table.sessions[A].cache == "cache4"
    with pytest.raises(WrongPosition):
        table.begin(A, 3, 1, 0.0)
    with pytest.raises(WrongPosition):
        table.begin(A, 5, 1, 0.0)
    with pytest.raises(UnknownSession):
        table.begin(B, 2, 1, 0.0)


def test_too_many_sessions_and_budgets_are_overloaded():
    table = _table()
    _step(table, A, 0, 9)
    with pytest.raises(SessionOverloaded):  # 11 positions x 10 bytes > the session's 100
        table.begin(A, 9, 2, 0.0)
    _step(table, B, 0, 5)
    with pytest.raises(SessionOverloaded):  # a third session
        table.begin(C, 0, 1, 0.0)
    with pytest.raises(SessionOverloaded):  # 9 + 5 + 2 positions x 10 > the total of 150
        table.begin(B, 5, 2, 0.0)
    _step(table, B, 5, 1)


def test_idle_sessions_expire_and_a_step_in_progress_is_one_at_a_time():
    table = _table(idle_s=60.0)
    _step(table, A, 0, 2, now=0.0)
    table.begin(B, 0, 1, now=10.0)
    with pytest.raises(SessionBusy):
        table.begin(B, 1, 1, now=10.0)
    assert table.expire(59.9) == 0
    assert table.expire(60.0) == 1  # A; B has a step under way
    with pytest.raises(UnknownSession):
        table.begin(A, 2, 1, 61.0)
    table.abandon(B)
    assert not table.sessions and table.used_bytes() == 0


def test_position_zero_replays_a_session_from_nothing():
    table = _table()
    _step(table, A, 0, 5)
    _step(table, A, 0, 2)
    assert table.sessions[A].length == 2
    assert table.close(A) and not table.close(A)


def test_limits_must_be_positive():
    with pytest.raises(ConfigError):
        Limits(bytes_per_token=0)


def test_one_peer_holds_its_share_and_no_other_peer_can_use_or_close_its_sessions():
    """Issue 25: a peer that floods a replica with sessions gets its share; others still open theirs, and a
    peer that learnt a session's id can neither step nor close it."""
    table = _table(max_sessions=3, max_per_peer=2, total_bytes=1000)
    table.begin(A, 0, 1, 0.0, "flood"), table.finish(A, None, 0.0)
    table.begin(B, 0, 1, 0.0, "flood"), table.finish(B, None, 0.0)
    with pytest.raises(SessionOverloaded, match="share"):
        table.begin(C, 0, 1, 0.0, "flood")
    table.begin(C, 0, 1, 0.0, "honest"), table.finish(C, None, 0.0)
    with pytest.raises(UnknownSession):
        table.begin(A, 1, 1, 0.0, "honest")
    with pytest.raises(SessionBusy):
        table.begin(A, 0, 1, 0.0, "honest")
    assert not table.close(A, "honest") and table.sessions[A].length == 1
    assert table.close(A, "flood")
    with pytest.raises(ConfigError):
        Limits(bytes_per_token=1, max_per_peer=0)


@given(st.lists(st.tuples(st.sampled_from([A, B, C]), st.integers(0, 12), st.integers(1, 4),
                          st.floats(0, 200)), max_size=40))
def test_the_accounting_never_passes_the_limits(steps):
    table, now = _table(), 0.0
    for session, position, n, dt in steps:
        now += dt
        try:
            table.begin(session, position, n, now)
        except (UnknownSession, WrongPosition, SessionOverloaded, SessionBusy):
            continue
        table.finish(session, None, now)
        assert len(table.sessions) <= 2
        assert table.used_bytes() <= 150
        assert all(e.length * 10 <= 100 for e in table.sessions.values())


class SessionModel(RuleBasedStateMachine):
    """The table against a dict of session -> length, with the limits written out again; two peers, one
    session each at most (``max_per_peer`` = 1), each session its opener's."""

    def __init__(self) -> None:
        super().__init__()
        self.table, self.model, self.now = _table(max_per_peer=1), {}, 0.0
        self.last_used: dict[bytes, float] = {}
        self.owner: dict[bytes, str] = {}

    def _expire_model(self) -> None:
        for s in [s for s, t in self.last_used.items() if self.now - t >= 60.0]:
            del self.model[s], self.last_used[s], self.owner[s]

    def _drop(self, session: bytes) -> None:
        self.model.pop(session, None), self.last_used.pop(session, None), self.owner.pop(session, None)

    @rule(dt=st.floats(0, 40))
    def wait(self, dt):
        self.now += dt

    @rule(session=st.sampled_from([A, B, C]), n=st.integers(1, 4), fresh=st.booleans(), peer=st.sampled_from("pq"))
    def step(self, session, n, fresh, peer):
        self._expire_model()
        position = 0 if fresh or session not in self.model else self.model[session]
        if session in self.model and self.owner[session] != peer:  # another peer's session: nothing changes
            with pytest.raises(SessionBusy if position == 0 else UnknownSession):
                self.table.begin(session, position, n, self.now, peer)
            return
        others = {s: v for s, v in self.model.items() if s != session}
        share = sum(self.owner[s] == peer for s in others) < 1
        ok = len(others) < 2 and share and (position + n) * 10 <= 100 if position == 0 else (position + n) * 10 <= 100
        ok = ok and (sum(others.values()) + position + n) * 10 <= 150
        try:
            self.table.begin(session, position, n, self.now, peer)
        except SessionOverloaded:
            assert not ok
            if position == 0:  # a refused restart still dropped the old session
                self._drop(session)
            return
        assert ok
        self.table.finish(session, None, self.now)
        self.model[session], self.last_used[session], self.owner[session] = position + n, self.now, peer

    @rule(session=st.sampled_from([A, B, C]), position=st.integers(1, 12))
    def wrong_step(self, session, position):
        self._expire_model()
        if self.model.get(session) == position:
            return
        with pytest.raises(UnknownSession if session not in self.model else WrongPosition):
            self.table.begin(session, position, 1, self.now, self.owner.get(session, "p"))

    @rule(session=st.sampled_from([A, B, C]), peer=st.sampled_from("pq"))
    def close(self, session, peer):
        self.table.expire(self.now)
        self._expire_model()
        mine = session in self.model and self.owner[session] == peer
        assert self.table.close(session, peer) == mine
        if mine:
            self._drop(session)

    @invariant()
    def same_accounting(self):
        self.table.expire(self.now)
        self._expire_model()
        assert {s: e.length for s, e in self.table.sessions.items()} == self.model
        assert self.table.used_bytes() == 10 * sum(self.model.values())


TestSessionModel = SessionModel.TestCase
