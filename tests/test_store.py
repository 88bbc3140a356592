"""The record store: a unit test per rule, and a state machine against a reference model."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from p2pswarm.dht.records import Capacity, LayerRecord, best_first
from p2pswarm.dht.store import MAX_CLOCK_SKEW, RecordStore, StoredRecord
from p2pswarm.errors import ConfigError

KEY, OTHER_KEY = b"k" * 32, b"o" * 32
NOW = 1_000_000.0


def rec(peer: str, timestamp=NOW, ttl=60.0, queue=0, mem=0) -> LayerRecord:
    return LayerRecord(peer, (), "m", 0, 1, Capacity(mem, queue), timestamp, ttl)


def stored(*args, **kwargs) -> StoredRecord:
    return StoredRecord(rec(*args, **kwargs), b"x")  # the store trusts its caller to have verified


def peers_of(store: RecordStore, key: bytes, now: float) -> list[str]:
    return [s.record.peer_id for s in store.get(key, now)]


def test_put_then_get_returns_the_stored_bytes():
    store = RecordStore()
    entry = StoredRecord(rec("a"), b"signed bytes")
    assert store.put(KEY, entry, NOW)
    assert store.get(KEY, NOW) == [entry]
    assert store.get(OTHER_KEY, NOW) == []
    assert len(store) == 1 and store.entry_count() == 1


def test_expired_record_is_refused():
    store = RecordStore()
    assert not store.put(KEY, stored("a", timestamp=NOW - 60.0, ttl=60.0), NOW)  # now == expires_at
    assert store.put(KEY, stored("a", timestamp=NOW - 59.0, ttl=60.0), NOW)


def test_future_timestamp_beyond_skew_is_refused():
    store = RecordStore()
    assert not store.put(KEY, stored("a", timestamp=NOW + MAX_CLOCK_SKEW + 0.001), NOW)
    assert store.put(KEY, stored("a", timestamp=NOW + MAX_CLOCK_SKEW), NOW)
    assert not RecordStore(max_clock_skew=0.0).put(KEY, stored("a", timestamp=NOW + 0.5), NOW)


def test_older_or_equal_timestamp_for_same_peer_is_refused():
    store = RecordStore()
    assert store.put(KEY, stored("a", timestamp=NOW, queue=1), NOW)
    assert not store.put(KEY, stored("a", timestamp=NOW, queue=2), NOW)
    assert not store.put(KEY, stored("a", timestamp=NOW - 1.0, queue=3), NOW)
    assert [s.record.capacity.queue_depth for s in store.get(KEY, NOW)] == [1]


def test_newer_timestamp_for_same_peer_replaces():
    store = RecordStore()
    assert store.put(KEY, stored("a", timestamp=NOW, queue=1), NOW)
    assert store.put(KEY, stored("a", timestamp=NOW + 1.0, queue=2), NOW)
    assert [s.record.capacity.queue_depth for s in store.get(KEY, NOW)] == [2]
    assert store.entry_count() == 1


def test_expired_entry_does_not_block_its_peer():
    store = RecordStore()
    assert store.put(KEY, stored("a", timestamp=NOW, ttl=10.0), NOW)
    later = NOW + 20.0
    assert store.put(KEY, stored("a", timestamp=NOW - 5.0, ttl=100.0), later)  # held one expired
    assert [s.record.timestamp for s in store.get(KEY, later)] == [NOW - 5.0]


def test_peers_share_a_key():
    store = RecordStore()
    for peer in "abc":
        assert store.put(KEY, stored(peer), NOW)
    assert sorted(peers_of(store, KEY, NOW)) == ["a", "b", "c"]
    assert len(store) == 1 and store.entry_count() == 3


def test_full_key_evicts_the_entry_expiring_soonest_for_a_longer_lived_record():
    store = RecordStore(max_entries_per_key=2)
    assert store.put(KEY, stored("a", ttl=30.0), NOW)
    assert store.put(KEY, stored("b", ttl=20.0), NOW)
    assert store.put(KEY, stored("c", ttl=40.0), NOW)
    assert sorted(peers_of(store, KEY, NOW)) == ["a", "c"]


def test_full_key_refuses_a_record_expiring_no_later_than_every_entry():
    store = RecordStore(max_entries_per_key=2)
    assert store.put(KEY, stored("a", ttl=30.0), NOW)
    assert store.put(KEY, stored("b", ttl=20.0), NOW)
    assert not store.put(KEY, stored("c", ttl=20.0), NOW)  # ties keep the incumbent
    assert not store.put(KEY, stored("c", ttl=10.0), NOW)
    assert sorted(peers_of(store, KEY, NOW)) == ["a", "b"]


def test_full_key_still_accepts_updates_from_held_peers():
    store = RecordStore(max_entries_per_key=2)
    assert store.put(KEY, stored("a"), NOW)
    assert store.put(KEY, stored("b"), NOW)
    assert store.put(KEY, stored("a", timestamp=NOW + 1.0, ttl=1.0), NOW)  # no eviction involved
    assert sorted(peers_of(store, KEY, NOW)) == ["a", "b"]


def test_full_key_reuses_room_left_by_expired_entries():
    store = RecordStore(max_entries_per_key=1)
    assert store.put(KEY, stored("a", ttl=10.0), NOW)
    assert store.put(KEY, stored("b", timestamp=NOW + 20.0, ttl=5.0), NOW + 20.0)
    assert peers_of(store, KEY, NOW + 20.0) == ["b"]


def test_new_key_beyond_max_keys_is_refused():
    store = RecordStore(max_keys=1)
    assert store.put(KEY, stored("a"), NOW)
    assert not store.put(OTHER_KEY, stored("a"), NOW)
    assert store.put(KEY, stored("b"), NOW)  # existing keys still take entries
    assert len(store) == 1


def test_max_keys_prunes_expired_keys_first():
    store = RecordStore(max_keys=1)
    assert store.put(KEY, stored("a", ttl=10.0), NOW)
    later = NOW + 10.0
    assert store.put(OTHER_KEY, stored("a", timestamp=later), later)
    assert len(store) == 1 and store.get(KEY, later) == [] and len(store.get(OTHER_KEY, later)) == 1


def test_get_returns_fresh_entries_best_first():
    store = RecordStore()
    entries = [stored("a", queue=3), stored("b", queue=0, mem=10), stored("c", queue=0, mem=99),
               stored("d", ttl=5.0)]
    for entry in entries:
        assert store.put(KEY, entry, NOW)
    assert peers_of(store, KEY, NOW) == ["c", "b", "d", "a"]
    assert peers_of(store, KEY, NOW + 5.0) == ["c", "b", "a"]  # d expired, still held
    assert store.entry_count() == 4
    assert [s.record for s in store.get(KEY, NOW)] == best_first(e.record for e in entries)


def test_prune_drops_expired_entries_and_empty_keys():
    store = RecordStore()
    assert store.put(KEY, stored("a", ttl=10.0), NOW)
    assert store.put(KEY, stored("b", ttl=20.0), NOW)
    assert store.put(OTHER_KEY, stored("a", ttl=10.0), NOW)
    assert store.prune(NOW) == 0
    assert store.prune(NOW + 10.0) == 2
    assert len(store) == 1 and store.entry_count() == 1
    assert store.prune(NOW + 20.0) == 1
    assert len(store) == 0 and store.entry_count() == 0


@pytest.mark.parametrize(
    "limits", [{"max_keys": 0}, {"max_entries_per_key": 0}, {"max_clock_skew": -1.0}]
)
def test_bad_limits_are_refused(limits):
    with pytest.raises(ConfigError):
        RecordStore(**limits)


# ---------------------------------------------------------------- state machine

MACHINE_MAX_KEYS = 4  # small limits so eviction and key refusal happen often
MACHINE_MAX_ENTRIES = 3
MACHINE_SKEW = 10.0
MACHINE_KEYS = [bytes([k]) * 32 for k in range(6)]
MACHINE_PEERS = ["p0", "p1", "p2", "p3", "p4"]


class ReferenceStore:
    """The store's rules restated as simply as possible: expired records simply do not exist."""

    def __init__(self) -> None:
        self.held: dict[bytes, dict[str, LayerRecord]] = {}

    def live(self, key: bytes, now: float) -> dict[str, LayerRecord]:
        return {p: r for p, r in self.held.get(key, {}).items() if now < r.expires_at}

    def put(self, key: bytes, record: LayerRecord, now: float) -> bool:
        if now >= record.expires_at or record.timestamp > now + MACHINE_SKEW:
            return False
        live = self.live(key, now)
        live_keys = [k for k in self.held if self.live(k, now)]
        if not live and len(live_keys) >= MACHINE_MAX_KEYS:
            return False
        old = live.get(record.peer_id)
        if old is not None and old.timestamp >= record.timestamp:
            return False
        if old is None and len(live) >= MACHINE_MAX_ENTRIES:
            victim = min(live.values(), key=lambda r: (r.expires_at, r.peer_id))
            if record.expires_at <= victim.expires_at:
                return False
            del live[victim.peer_id]
        live[record.peer_id] = record
        self.held[key] = live
        return True


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = RecordStore(MACHINE_MAX_KEYS, MACHINE_MAX_ENTRIES, MACHINE_SKEW)
        self.model = ReferenceStore()
        self.now = 1000.0
        self.last_accepted: dict[tuple[bytes, str], LayerRecord] = {}

    @rule(
        key=st.sampled_from(MACHINE_KEYS[:1]) | st.sampled_from(MACHINE_KEYS),  # crowd one key
        peer=st.sampled_from(MACHINE_PEERS),
        age=st.integers(-15, 40),  # negative: from the future, sometimes beyond the skew
        ttl=st.sampled_from([1, 5, 10, 20, 30, 45]),  # few values, so expiries often tie
        queue=st.integers(0, 2),
    )
    def put(self, key, peer, age, ttl, queue):
        record = rec(peer, timestamp=self.now - age, ttl=float(ttl), queue=queue)
        accepted = self.store.put(key, StoredRecord(record, b"x"), self.now)
        assert accepted == self.model.put(key, record, self.now)
        if accepted:
            self.last_accepted[(key, peer)] = record

    @rule(seconds=st.integers(0, 30))
    def advance_time(self, seconds):
        self.now += seconds

    @rule(key=st.sampled_from(MACHINE_KEYS))
    def get(self, key):
        expected = best_first(self.model.live(key, self.now).values())
        assert [s.record for s in self.store.get(key, self.now)] == expected

    @precondition(lambda self: self.store.entry_count() > 0)
    @rule()
    def prune(self):
        before = self.store.entry_count()
        dropped = self.store.prune(self.now)
        live = {k: self.model.live(k, self.now) for k in MACHINE_KEYS}
        assert self.store.entry_count() == before - dropped == sum(map(len, live.values()))
        assert len(self.store) == sum(1 for entries in live.values() if entries)

    @invariant()
    def answers_match_the_model_and_the_rules(self):
        assert len(self.store) <= MACHINE_MAX_KEYS
        for key in MACHINE_KEYS:
            got = [s.record for s in self.store.get(key, self.now)]
            assert got == best_first(self.model.live(key, self.now).values())
            assert len(got) <= MACHINE_MAX_ENTRIES
            assert all(r.is_fresh(self.now) for r in got)
            assert len({r.peer_id for r in got}) == len(got)
            assert all(r == self.last_accepted[(key, r.peer_id)] for r in got)


StoreMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestStoreMachine = StoreMachine.TestCase
