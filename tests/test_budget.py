"""The pure budgets of the stream pool: inbound bytes per peer, and relayed-circuit accounting."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from p2pswarm import wire
from p2pswarm.nat.relay_service import RelayConfig
from p2pswarm.net.budget import (
    CIRCUIT_HEADROOM_BYTES,
    CIRCUIT_TIME_MARGIN,
    WIRE_OVERHEAD,
    BudgetConfig,
    CircuitLedger,
    CircuitLimit,
    InboundBudget,
    Ticket,
    Verdict,
    frame_deadline,
)

SMALL = BudgetConfig(peer_bytes=1000, max_peers=3, streams_per_peer=2, min_charge=10)
PEERS = st.sampled_from(["a", "b", "c", "d", "e"])
SIZES = st.integers(0, 1200)


class BudgetMachine(RuleBasedStateMachine):
    """A model of the rules next to the real core: shares are guaranteed, nothing is over-granted."""

    tickets = Bundle("tickets")

    def __init__(self) -> None:
        super().__init__()
        self.budget = InboundBudget(SMALL)
        self.streams: dict[str, int] = {}
        self.held: dict[str, int] = {}

    def _active(self) -> set[str]:
        return {p for p in set(self.streams) | set(self.held) if self.streams.get(p) or self.held.get(p)}

    @rule(peer=PEERS)
    def open_stream(self, peer):
        expected = (peer in self._active() or len(self._active()) < SMALL.max_peers) and \
            self.streams.get(peer, 0) < SMALL.streams_per_peer
        assert self.budget.open_stream(peer) == expected
        if expected:
            self.streams[peer] = self.streams.get(peer, 0) + 1

    @precondition(lambda self: any(self.streams.values()))
    @rule(data=st.data())
    def close_stream(self, data):
        peer = data.draw(st.sampled_from(sorted(p for p, n in self.streams.items() if n)))
        self.budget.close_stream(peer)
        self.streams[peer] -= 1

    @rule(target=tickets, peer=PEERS, nbytes=SIZES)
    def reserve(self, peer, nbytes):
        charged = max(nbytes, SMALL.min_charge)
        result = self.budget.reserve(peer, nbytes)
        if not self.streams.get(peer) or charged > SMALL.peer_bytes:
            assert result is Verdict.REFUSE
        elif self.held.get(peer, 0) + charged > SMALL.peer_bytes:
            assert result is Verdict.WAIT  # over its own share: it waits for its own frames
        else:
            # under its own share: granted, whatever the other peers hold (the fairness rule)
            assert isinstance(result, Ticket) and result.charged == charged
            self.held[peer] = self.held.get(peer, 0) + charged
            return result
        return None

    @rule(ticket=consumes(tickets))
    def release(self, ticket):
        if ticket is None:
            return
        self.budget.release(ticket)
        self.held[ticket.peer] -= ticket.charged
        with pytest.raises(ValueError):
            self.budget.release(ticket)

    @invariant()
    def accounting_matches_the_model(self):
        assert self.budget.in_use == sum(self.held.values()) <= SMALL.global_bytes
        assert self.budget.high_water <= SMALL.global_bytes
        assert self.budget.in_use <= self.budget.high_water
        assert set(self.budget.peers()) == self._active()
        assert len(self.budget.peers()) <= SMALL.max_peers
        for peer in self._active():
            assert self.budget.peer_in_use(peer) == self.held.get(peer, 0) <= SMALL.peer_bytes
        stats = self.budget.stats()
        assert stats["in_use"] == self.budget.in_use and set(stats["peers"]) == self._active()

    @invariant()
    def only_an_idle_unpreferred_peer_gives_way_and_only_when_every_slot_is_taken(self):
        preferred = set(sorted(self._active())[::2])  # some peers worked with us
        victim = self.budget.idle_victim(preferred.__contains__)
        idle = {p for p in self._active() if not self.held.get(p) and p not in preferred}
        if len(self._active()) < SMALL.max_peers or not idle:
            assert victim is None
        else:
            assert victim in idle


TestBudgetMachine = BudgetMachine.TestCase


def test_a_greedy_peer_waits_and_others_do_not():
    budget = InboundBudget(SMALL)
    assert budget.open_stream("greedy") and budget.open_stream("honest")
    first = budget.reserve("greedy", 900)
    assert isinstance(first, Ticket)
    assert budget.reserve("greedy", 200) is Verdict.WAIT
    budget.note_wait("greedy")
    assert isinstance(budget.reserve("honest", 1000), Ticket)  # its whole share, at once
    budget.release(first)
    assert isinstance(budget.reserve("greedy", 200), Ticket)
    budget.refuse("greedy", "timeout")
    assert budget.reserve("honest", 1001) is Verdict.REFUSE
    assert budget.reserve("stranger", 1) is Verdict.REFUSE
    stats = budget.stats()
    assert stats["waits"] == 1 and stats["refused"] == {"no_stream": 1, "timeout": 1, "too_large": 1}
    assert stats["peers"]["greedy"] == {"in_use": 200, "streams": 1, "waits": 1, "refused": 1}
    assert stats["high_water"] == 1900 and stats["global_bytes"] == 3000
    assert budget.frames_held() == 2  # greedy's 200 and honest's 1000: the queue depth a node publishes


def test_slots_and_streams_are_bounded_and_a_slot_outlives_its_streams_while_bytes_are_held():
    budget = InboundBudget(SMALL)
    assert all(budget.open_stream(p) for p in "abc")
    assert not budget.open_stream("d")  # all three slots taken
    assert budget.open_stream("a") and not budget.open_stream("a")  # two streams each
    ticket = budget.reserve("c", 5)
    assert isinstance(ticket, Ticket) and ticket.charged == SMALL.min_charge
    budget.close_stream("c")
    assert not budget.open_stream("d")  # c still holds bytes, hence its slot
    budget.release(ticket)
    assert budget.open_stream("d")
    assert budget.stats()["refused"] == {"peers": 2, "streams": 1}
    with pytest.raises(ValueError):
        budget.close_stream("c")


def test_a_preferred_newcomer_takes_the_slot_of_the_least_recently_active_idle_peer():
    budget = InboundBudget(SMALL)
    assert all(budget.open_stream(p) for p in ("worker", "idle-early", "idle-late"))
    assert budget.idle_victim(lambda peer: False) == "worker"  # every slot taken: the least recent first
    held = budget.reserve("worker", 5)  # active again, and holding bytes
    assert budget.idle_victim(lambda peer: peer == "worker") == "idle-early"
    assert budget.open_stream("idle-early")  # active again
    assert budget.idle_victim(lambda peer: peer == "worker") == "idle-late"
    assert budget.idle_victim(lambda peer: peer != "worker") is None  # a peer holding bytes never gives way
    budget.close_stream("idle-late")
    assert budget.idle_victim(lambda peer: False) is None and isinstance(held, Ticket)  # a slot is free


def test_config_is_checked():
    assert BudgetConfig().global_bytes == 16 * (64 * 1024 * 1024 + 4 + 16 * 1024)
    bad_configs = [dict(peer_bytes=0), dict(max_peers=-1), dict(streams_per_peer=1.5),
                   dict(min_charge=2000, peer_bytes=1000)]
    for bad in bad_configs:
        with pytest.raises(ValueError):
            BudgetConfig(**bad)


# ---------------------------------------------------------------- relay circuits

def test_default_circuit_limit_is_our_relays():
    relay = RelayConfig()
    assert CircuitLimit() == CircuitLimit(seconds=relay.circuit_duration, bytes=relay.circuit_bytes)


frames = st.lists(st.tuples(st.integers(1, 3_000_000), st.floats(0, 40), st.booleans()), max_size=40)


@given(frames, st.integers(2 * 1024 * 1024, 32 * 1024 * 1024), st.floats(20, 300))
def test_admitted_frames_always_finish_inside_the_circuit(steps, limit_bytes, limit_seconds):
    """Whatever the order of frames and pauses, what the ledger admits fits the relay's limits
    with the headroom and wire overhead, and finishes before the duration at the minimum rate."""
    ledger, now, key = CircuitLedger(), 1000.0, object()
    ledger.track(key, CircuitLimit(seconds=limit_seconds, bytes=limit_bytes), opened_at=now)
    admitted = 0
    for nbytes, pause, outbound in steps:
        now += pause
        if ledger.check(key, nbytes, now) is None:
            admitted += nbytes
            ledger.record(key, sent=nbytes if outbound else 0, received=0 if outbound else nbytes)
            assert admitted * WIRE_OVERHEAD + CIRCUIT_HEADROOM_BYTES <= limit_bytes
            # even a frame that takes its whole deadline ends before the relay's clock does
            assert now - 1000.0 + frame_deadline(nbytes) <= limit_seconds - CIRCUIT_TIME_MARGIN
            now += frame_deadline(nbytes)
    usage = ledger.circuits[key]
    assert usage.sent + usage.received == admitted


def test_refusals_say_why_and_what_is_left():
    ledger, key = CircuitLedger(), "conn"
    ledger.track(key, CircuitLimit(seconds=60, bytes=4 * 1024 * 1024), opened_at=0.0)
    ledger.track(key, CircuitLimit(seconds=1, bytes=1), opened_at=50.0)  # idempotent: first limit stays
    usable = int((4 * 1024 * 1024 - CIRCUIT_HEADROOM_BYTES) / WIRE_OVERHEAD)
    assert ledger.check(key, usable, now=0.0) is None
    refusal = ledger.check(key, usable + 1, now=0.0)
    assert refusal.reason == "bytes" and refusal.remaining_bytes == usable
    assert refusal.remaining_seconds == 60 - CIRCUIT_TIME_MARGIN
    assert ledger.check(key, 1, now=60 - CIRCUIT_TIME_MARGIN - frame_deadline(1) - 0.01) is None
    assert ledger.check(key, 1, now=60 - CIRCUIT_TIME_MARGIN - frame_deadline(1) + 0.01).reason == "time"
    assert ledger.check("untracked", 10**9, now=0.0) is None
    unlimited = CircuitLedger()
    unlimited.track(key, CircuitLimit(seconds=0, bytes=0), opened_at=0.0)
    assert unlimited.check(key, 10**12, now=10**6) is None
    stats = ledger.stats(now=5.0)
    assert stats["refused"] == {"bytes": 1, "time": 1}
    assert stats["circuits"][0]["remaining_bytes"] == usable and stats["circuits"][0]["age_s"] == 5.0
    ledger.forget(key)
    assert ledger.stats(0.0)["circuits"] == []


def test_the_default_share_admits_the_largest_frame_wire_allows():
    budget = InboundBudget()
    assert budget.open_stream("p")
    largest = wire.HEADER_LENGTH_BYTES + wire.MAX_HEADER_BYTES + wire.MAX_PAYLOAD_BYTES
    assert isinstance(budget.reserve("p", largest), Ticket)
