"""The pure inbound-stream book of ``p2pswarm/net/limits.py``: limits, balance, isolation, deadlines.

A ``RuleBasedStateMachine`` drives one book with admissions, protocol choices, I/O, expiries and
releases from a handful of peers, against a plain model of who holds what; ``@given`` properties
check that one peer's use never refuses another peer below its own limit, and the deadlines.
"""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from p2pswarm.net.limits import (
    MAX_INBOUND_PER_PEER,
    MAX_INBOUND_STREAMS,
    RELAY_STOP_PROTOCOL,
    Closure,
    ProtocolLimits,
    Refusal,
    StreamBook,
    StreamLimits,
)

PEERS = ["alice", "bob", "carol", "mallory"]
PROTOCOLS = ["/control", "/pool", "/quiet"]
SMALL = StreamLimits(max_inbound=10, max_inbound_per_peer=4, negotiation_timeout=2.0,
                     default_protocol=ProtocolLimits(2, idle_timeout=5.0),
                     protocols=(("/quiet", ProtocolLimits(3, idle_timeout=None)),))


def test_defaults_let_no_single_peer_fill_the_node():
    assert MAX_INBOUND_STREAMS >= 4 * MAX_INBOUND_PER_PEER
    assert StreamBook().protocol_limits(RELAY_STOP_PROTOCOL).idle_timeout is None


class BookMachine(RuleBasedStateMachine):
    """Random admissions, choices, I/O and releases; the model says what must be held."""

    def __init__(self) -> None:
        super().__init__()
        self.book = StreamBook(SMALL)
        self.now = 0.0
        self.held: dict[int, tuple[str, str | None]] = {}  # ticket -> (peer, protocol)
        self.released = 0
        self.refusals = Counter()

    def per_peer(self, peer: str) -> int:
        return sum(1 for p, _ in self.held.values() if p == peer)

    def per_protocol(self, peer: str, protocol: str) -> int:
        return sum(1 for p, proto in self.held.values() if (p, proto) == (peer, protocol))

    @rule(dt=st.floats(min_value=0, max_value=3, allow_nan=False))
    def wait(self, dt):
        self.now += dt

    @rule(peer=st.sampled_from(PEERS))
    def admit(self, peer):
        node_full = len(self.held) >= SMALL.max_inbound
        peer_full = self.per_peer(peer) >= SMALL.max_inbound_per_peer
        ticket = self.book.admit(peer, self.now)
        if node_full:
            assert ticket is None
            self.refusals[Refusal.NODE] += 1
        elif peer_full:
            assert ticket is None
            self.refusals[Refusal.PEER] += 1
        else:  # below both limits: whatever the other peers hold, this one is admitted
            assert ticket is not None and ticket not in self.held
            self.held[ticket] = (peer, None)

    @precondition(lambda self: any(proto is None for _, proto in self.held.values()))
    @rule(data=st.data(), protocol=st.sampled_from(PROTOCOLS))
    def choose(self, data, protocol):
        ticket = data.draw(st.sampled_from(sorted(t for t, (_, proto) in self.held.items() if proto is None)))
        peer = self.held[ticket][0]
        full = self.per_protocol(peer, protocol) >= self.book.protocol_limits(protocol).max_inbound_per_peer
        assert self.book.choose(ticket, protocol, self.now) is not full
        if full:
            self.refusals[Refusal.PROTOCOL] += 1
        else:
            self.held[ticket] = (peer, protocol)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), start=st.booleans())
    def io(self, data, start):
        ticket = data.draw(st.sampled_from(sorted(self.held)))
        (self.book.io_started if start else self.book.io_done)(ticket, self.now)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def expire_overdue(self, data):
        overdue = self.book.overdue(self.now)
        if overdue:
            ticket = data.draw(st.sampled_from(overdue))
            assert self.book.expire(ticket) in (Closure.NEGOTIATION, Closure.IDLE)
            self.release_ticket(ticket)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        self.release_ticket(data.draw(st.sampled_from(sorted(self.held))))

    def release_ticket(self, ticket: int) -> None:
        self.book.release(ticket)
        self.book.release(ticket)  # twice is harmless
        del self.held[ticket]
        self.released += 1

    @invariant()
    def counts_match_the_model_and_never_exceed_limits(self):
        assert self.book.open_streams() == len(self.held) <= SMALL.max_inbound
        for peer in PEERS:
            assert self.book.open_streams(peer) == self.per_peer(peer) <= SMALL.max_inbound_per_peer
            for protocol in PROTOCOLS:
                held = self.per_protocol(peer, protocol)
                assert self.book.open_streams(peer, protocol) == held
                assert held <= self.book.protocol_limits(protocol).max_inbound_per_peer

    @invariant()
    def releases_balance_admissions(self):
        stats = self.book.stats()
        assert stats["admitted"] - self.released == stats["open"]
        assert all(stats[f"refused_{r.value}"] == self.refusals[r] for r in Refusal)

    @invariant()
    def negotiating_streams_have_a_deadline(self):
        for ticket, (_, protocol) in self.held.items():
            if protocol is None:
                assert self.book.deadline(ticket) < math.inf


TestBookMachine = BookMachine.TestCase
TestBookMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


@given(held=st.integers(0, 3 * MAX_INBOUND_PER_PEER), want=st.integers(1, MAX_INBOUND_PER_PEER))
def test_one_peer_never_refuses_another_below_its_own_limit(held, want):
    book = StreamBook()
    for _ in range(held):
        book.admit("mallory", 0.0)
    assert book.open_streams("mallory") == min(held, MAX_INBOUND_PER_PEER)
    assert all(book.admit("alice", 0.0) is not None for _ in range(want))


@given(protocol_held=st.integers(0, 80))
def test_a_protocol_full_for_one_peer_is_open_to_another(protocol_held):
    book = StreamBook()
    for _ in range(protocol_held):
        ticket = book.admit("mallory", 0.0)
        if not book.choose(ticket, "/control", 0.0):
            book.release(ticket)
    ticket = book.admit("alice", 0.0)
    assert book.choose(ticket, "/control", 0.0)


@given(opened=st.floats(0, 1e6), dt=st.floats(0, 100), idle=st.floats(0.1, 1000))
def test_deadlines(opened, dt, idle):
    book = StreamBook(StreamLimits(default_protocol=ProtocolLimits(idle_timeout=idle)))
    ticket = book.admit("alice", opened)
    assert book.deadline(ticket) == opened + book.limits.negotiation_timeout
    assert book.choose(ticket, "/p", opened + dt)
    assert book.deadline(ticket) == math.inf  # the handler is not waiting on the peer
    book.io_started(ticket, opened + dt)
    assert book.deadline(ticket) == opened + dt + idle
    assert book.overdue(opened + dt + idle) == [ticket]
    book.io_done(ticket, opened + dt + 1)
    assert book.deadline(ticket) == math.inf
    assert book.expire(ticket) is Closure.IDLE and book.stats()["closed_idle"] == 1
    book.release(ticket)
    assert book.deadline(ticket) == math.inf and book.expire(ticket) is None
    book.io_started(ticket, 0.0)  # a released ticket is ignored (a handler that handed its stream on)
    assert book.open_streams() == 0


def test_concurrent_io_waits_from_the_first_start_and_progress_moves_it():
    book = StreamBook(StreamLimits(default_protocol=ProtocolLimits(idle_timeout=10.0)))
    ticket = book.admit("alice", 0.0)
    book.choose(ticket, "/p", 0.0)
    book.io_started(ticket, 1.0)  # a read waits
    book.io_started(ticket, 5.0)  # a write starts: not progress
    assert book.deadline(ticket) == 11.0
    book.io_done(ticket, 6.0)  # the write went through: progress
    assert book.deadline(ticket) == 16.0
