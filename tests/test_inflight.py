"""Properties of the in-flight book (p2pswarm.swarm.inflight.InFlight), checked against a dict model.

A state machine adds, acks, finishes, gives up, fails peers and expires micro-batches; after
every step the book must hold exactly the model's entries, never more than ``capacity``, and
count in ``finished + given_up`` every entry that left. ``expire`` must give up exactly the
entries at least ``deadline`` old, ``peer_failed(p)`` exactly those whose activations went to p.
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from p2pswarm.swarm.inflight import IN_FLIGHT_CAPACITY, IN_FLIGHT_DEADLINE, InFlight, Pending, RecentKeys

KEYS = st.tuples(st.sampled_from([b"s0", b"s1", b"s2"]), st.integers(0, 4))
UPSTREAMS = [None, "up0", "up1", "up2"]
DOWNSTREAMS = ["down0", "down1", "down2"]
steps = st.floats(0.0, 12.0, allow_nan=False)


class InFlightMachine(RuleBasedStateMachine):
    """The book and a dict model of it; time only moves forward."""

    @initialize(deadline=st.sampled_from([0.5, 5.0, 10.0]), capacity=st.integers(1, 6))
    def start(self, deadline, capacity):
        self.book = InFlight(deadline=deadline, capacity=capacity)
        self.model: dict[tuple[bytes, int], Pending] = {}
        self.now = 0.0
        self.added = 0
        self.finished = 0
        self.given_up = 0

    @rule(key=KEYS, upstream=st.sampled_from(UPSTREAMS), dt=steps)
    def add(self, key, upstream, dt):
        self.now += dt
        expected = len(self.model) < self.book.capacity and key not in self.model
        assert self.book.add(key, upstream, self.now) == expected
        if expected:
            self.model[key] = Pending(upstream, self.now)
            self.added += 1
        assert (key in self.book) == (key in self.model)

    @rule(key=KEYS, peer=st.sampled_from(DOWNSTREAMS))
    def sent_to(self, key, peer):
        self.book.sent_to(key, peer)
        if key in self.model:
            self.model[key] = Pending(self.model[key].upstream, self.model[key].started, peer)
        else:
            assert key not in self.book

    @rule(key=KEYS)
    def finish(self, key):
        got = self.book.finish(key)
        assert got == self.model.pop(key, None)
        self.finished += got is not None
        assert key not in self.book

    @rule(key=KEYS)
    def give_up(self, key):
        got = self.book.give_up(key)
        assert got == self.model.pop(key, None)
        self.given_up += got is not None
        assert key not in self.book

    @rule(peer=st.sampled_from([*DOWNSTREAMS, "nobody"]))
    def peer_failed(self, peer):
        keys = self.book.peer_failed(peer)
        expected = {k for k, e in self.model.items() if e.sent_to == peer}
        assert len(keys) == len(set(keys)) and set(keys) == expected
        for key in expected:
            del self.model[key]
        self.given_up += len(expected)

    @rule(dt=steps)
    def expire(self, dt):
        self.now += dt
        keys = [key for key, _ in self.book.expire(self.now)]
        expected = {k for k, e in self.model.items() if self.now - e.started >= self.book.deadline}
        assert len(keys) == len(set(keys)) and set(keys) == expected
        for key in expected:
            del self.model[key]
        self.given_up += len(expected)
        # whatever is left is younger than the deadline
        assert all(self.now - e.started < self.book.deadline for e in self.book.entries())

    @invariant()
    def matches_the_model(self):
        if not hasattr(self, "book"):
            return
        book = self.book
        assert len(book) == len(self.model) <= book.capacity
        assert book.full == (len(self.model) >= book.capacity)
        assert sorted(book.entries(), key=repr) == sorted(self.model.values(), key=repr)
        for key in self.model:
            assert key in book

    @invariant()
    def counts_every_departure(self):
        if not hasattr(self, "book"):
            return
        assert (self.book.finished, self.book.given_up) == (self.finished, self.given_up)
        assert self.book.finished + self.book.given_up == self.added - len(self.model)

    @invariant()
    def waiting_from_matches_the_model(self):
        if not hasattr(self, "book"):
            return
        for upstream in [*UPSTREAMS, "stranger"]:
            expected = sum(1 for e in self.model.values() if e.upstream == upstream)
            assert self.book.waiting_from(upstream) == expected


TestInFlightMachine = InFlightMachine.TestCase


def test_add_is_refused_when_full_or_already_waiting():
    book = InFlight(deadline=1.0, capacity=2)
    assert book.add((b"s", 0), None, 0.0)
    assert not book.add((b"s", 0), "other", 0.5)  # already waiting: the first entry stays
    assert book.entries() == [Pending(None, 0.0)]
    assert book.add((b"s", 1), "up", 0.0)
    assert book.full
    assert not book.add((b"s", 2), None, 0.0)
    assert (b"s", 2) not in book and len(book) == 2
    assert book.finish((b"s", 0)) == Pending(None, 0.0)
    assert not book.full and book.add((b"s", 2), None, 0.0)


def test_expire_gives_up_exactly_at_the_deadline():
    book = InFlight(deadline=2.0, capacity=4)
    book.add((b"s", 0), None, 0.0)
    book.add((b"s", 1), None, 1.0)
    assert book.expire(1.999) == []
    assert book.expire(2.0) == [((b"s", 0), Pending(None, 0.0))]
    assert book.expire(3.0) == [((b"s", 1), Pending(None, 1.0))]
    assert (book.finished, book.given_up, len(book)) == (0, 2, 0)


def test_peer_failed_gives_up_only_what_was_sent_to_that_peer():
    book = InFlight()
    book.add((b"s", 0), "up", 0.0)
    book.add((b"s", 1), "up", 0.0)
    book.add((b"s", 2), None, 0.0)
    book.sent_to((b"s", 0), "a")
    book.sent_to((b"s", 1), "b")
    book.sent_to((b"s", 9), "a")  # not waiting: nothing to record
    assert book.peer_failed("a") == [(b"s", 0)]
    assert book.peer_failed("a") == []
    assert book.waiting_from("up") == 1 and book.waiting_from(None) == 1
    assert book.finish((b"s", 0)) is None and book.give_up((b"s", 0)) is None
    assert (book.finished, book.given_up) == (0, 1)


def test_defaults_and_rejected_constructor_arguments():
    book = InFlight()
    assert (book.deadline, book.capacity) == (IN_FLIGHT_DEADLINE, IN_FLIGHT_CAPACITY)
    for deadline, capacity in [(0.0, 4), (-1.0, 4), (1.0, 0), (1.0, -3)]:
        with pytest.raises(ValueError):
            InFlight(deadline=deadline, capacity=capacity)


def test_recent_keys_remember_the_last_capacity_and_forget_the_oldest():
    keys = RecentKeys(capacity=3)
    assert [keys.add(("forward", (b"s", i))) for i in range(4)] == [True] * 4
    assert ("forward", (b"s", 0)) not in keys and len(keys) == 3  # the oldest went first
    assert not keys.add(("forward", (b"s", 3)))  # a duplicate
    assert keys.add(("backward", (b"s", 3)))  # another kind is another item
    keys.discard(("backward", (b"s", 3)))
    assert keys.add(("backward", (b"s", 3)))


@given(st.lists(st.tuples(st.sampled_from(["forward", "backward"]), st.integers(0, 20)), max_size=200),
       st.integers(1, 16))
def test_recent_keys_stay_bounded_and_match_a_model(items, capacity):
    keys, model = RecentKeys(capacity), []
    for kind, n in items:
        item = (kind, (b"s", n))
        assert keys.add(item) == (item not in model)  # a duplicate exactly when remembered
        if item not in model:
            model = [*model, item][-capacity:]
        assert len(keys) == len(model) <= capacity and all(m in keys for m in model)


def test_only_the_peer_that_acked_a_forward_may_answer_it():
    """A gradient is bound to the peer the forward went to: before its ack any peer may answer (the ack and
    the gradient race), after it only the acking peer; a key we do not wait for is answered by nobody."""
    book = InFlight()
    key = (b"s", 1)
    book.add(key, upstream="up", now=0.0)
    assert key in book.awaiting("down") and key in book.awaiting("stranger")
    book.sent_to(key, "down")
    assert key in book.awaiting("down") and key not in book.awaiting("stranger")
    assert (b"s", 2) not in book.awaiting("down")
