"""The record store: a unit test per rule, and a state machine against a reference model."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from p2pswarm.dht.protocol import FetchRecords, handle_fetch
from p2pswarm.dht.ranking import MAX_PER_IP, MAX_PER_SUBNET
from p2pswarm.dht.records import Capacity, StageRecord, best_first, stage_key
from p2pswarm.dht.store import (
    LOCAL_SOURCE,
    MAX_CLOCK_SKEW,
    MAX_ENTRIES_PER_IP_PER_KEY,
    MAX_LOOPBACK_ENTRIES_PER_KEY,
    REFRESH_DEADLINE,
    RecordStore,
    StoredRecord,
)
from p2pswarm.errors import ConfigError

KEY, OTHER_KEY = b"k" * 32, b"o" * 32
NOW = 1_000_000.0


def rec(peer: str, timestamp=NOW, ttl=60.0, queue=0, mem=0) -> StageRecord:
    return StageRecord(peer, (), "m", 0, 0, 1, Capacity(mem, queue), timestamp, ttl)


def stored(*args, ip: str = "192.0.2.1", **kwargs) -> StoredRecord:
    return StoredRecord(rec(*args, **kwargs), b"x", ip)  # the store trusts its caller to have verified


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


def test_full_key_refuses_newcomers_while_every_entry_keeps_refreshing():
    store = RecordStore(max_entries_per_key=2)
    assert store.put(KEY, stored("a", ttl=15.0), NOW)
    assert store.put(KEY, stored("b", ttl=15.0), NOW)
    assert not store.put(KEY, stored("c", ttl=60.0), NOW + 1.0)  # a longer TTL buys no place
    later = NOW + REFRESH_DEADLINE  # a and b re-announce on time
    assert store.put(KEY, stored("a", timestamp=later, ttl=15.0), later)
    assert store.put(KEY, stored("b", timestamp=later, ttl=15.0), later)
    assert not store.put(KEY, stored("c", timestamp=later, ttl=60.0), later + REFRESH_DEADLINE)
    assert sorted(peers_of(store, KEY, later + REFRESH_DEADLINE)) == ["a", "b"]


def test_full_key_gives_the_place_of_the_entry_refreshed_least_recently_once_overdue():
    store = RecordStore(max_entries_per_key=2)
    assert store.put(KEY, stored("a", ttl=60.0), NOW)  # long-lived, but never refreshed
    assert store.put(KEY, stored("b", ttl=15.0), NOW + 5.0)
    overdue = NOW + REFRESH_DEADLINE + 1.0
    assert store.put(KEY, stored("c", timestamp=overdue, ttl=15.0), overdue)
    assert sorted(peers_of(store, KEY, overdue)) == ["b", "c"]


def test_64_fake_identities_cannot_push_out_an_honest_re_announcer():
    """The attack review: 64 self-made identities with 3,600 s TTLs emptied a key of its honest
    15 s record. Now the honest peer keeps its place (and the fakes get 4 places per IP)."""
    store = RecordStore()
    honest = "honest"
    assert store.put(KEY, stored(honest, ttl=15.0, ip="198.51.100.7"), NOW)
    accepted = sum(store.put(KEY, stored(f"fake{i}", ttl=60.0, ip="203.0.113.66"), NOW) for i in range(3000))
    assert accepted == MAX_ENTRIES_PER_IP_PER_KEY
    for beat in range(1, 40):  # the honest peer re-announces every 5 s; the fakes keep trying
        now = NOW + 5.0 * beat
        assert store.put(KEY, stored(honest, timestamp=now, ttl=15.0, ip="198.51.100.7"), now)
        for i in range(3000, 3100):
            store.put(KEY, stored(f"fake{i}", timestamp=now, ttl=60.0, ip="203.0.113.66"), now)
        assert honest in peers_of(store, KEY, now)


CGNAT, NEIGHBOUR = "100.64.0.1", "198.51.100.9"


def test_a_cgnat_s_honest_peers_take_places_from_its_identities_once_a_neighbour_attests_them():
    """64 identities behind a CGNAT hold the address's places first; its 3 honest peers, named as workers
    by a neighbour's record from another address, take places of unattested identities and keep them."""
    store = RecordStore()
    fakes = [f"fake{i:02d}" for i in range(64)]
    assert sum(store.put(KEY, stored(f, ip=CGNAT), NOW) for f in fakes) == MAX_ENTRIES_PER_IP_PER_KEY
    honest = ["honest0", "honest1", "honest2"]
    assert not any(store.put(KEY, stored(h, ip=CGNAT), NOW) for h in honest)  # nobody vouches for them yet
    self_vouching = dataclasses.replace(rec("fake00"), worked=tuple((f, 0) for f in fakes[4:12]))
    assert store.put(OTHER_KEY, StoredRecord(self_vouching, b"x", CGNAT), NOW)
    assert not any(store.put(KEY, stored(f, ip=CGNAT), NOW) for f in fakes[4:12])  # one address vouches for none
    neighbour = dataclasses.replace(rec("neighbour"), worked=tuple((h, 0) for h in honest))
    assert store.put(OTHER_KEY, StoredRecord(neighbour, b"x", NEIGHBOUR), NOW)
    for beat in range(1, 13):  # every identity re-announces every 5 s, the honest peers too
        now = NOW + 5.0 * beat
        if beat % 2 == 0:
            store.put(OTHER_KEY, StoredRecord(dataclasses.replace(neighbour, timestamp=now), b"x", NEIGHBOUR), now)
        for peer in honest + fakes:
            store.put(KEY, stored(peer, timestamp=now, ip=CGNAT), now)
        held = peers_of(store, KEY, now)
        assert set(honest) <= set(held) and len(held) == MAX_ENTRIES_PER_IP_PER_KEY, held
    assert not store.put(KEY, stored("fake00", timestamp=now + 1, ip=CGNAT), now + 1)


def test_one_ip_holds_a_bounded_number_of_entries():
    store = RecordStore(max_entries_per_ip_per_key=2, max_entries_per_ip=3)
    assert store.put(KEY, stored("a"), NOW) and store.put(KEY, stored("b"), NOW)
    assert not store.put(KEY, stored("c"), NOW)  # per key
    assert store.put(OTHER_KEY, stored("c"), NOW)
    assert not store.put(OTHER_KEY, stored("d"), NOW)  # in all
    assert store.put(OTHER_KEY, stored("d", ip="192.0.2.2"), NOW)  # another address has its own room
    assert store.put(KEY, stored("a", timestamp=NOW + 1.0), NOW)  # refreshing a held entry is no new room
    assert store.put(KEY, stored("e", timestamp=NOW + 60.0), NOW + 60.0)  # expired entries free their room
    assert store.put(KEY, stored("f", ip=LOCAL_SOURCE), NOW)  # our own records are not limited by IP


def test_a_loopback_source_is_this_machine_and_holds_a_whole_local_swarm():
    """Only this machine's own processes connect from loopback: a local swarm (the demo, the tests)
    shares 127.0.0.1, so it gets MAX_LOOPBACK_ENTRIES_PER_KEY places; a LAN address is one machine."""
    store = RecordStore()
    for n, ip in enumerate(("127.0.0.1", "::1", "192.168.1.20", "203.0.113.66")):
        accepted = sum(store.put(bytes([n]) * 32, stored(f"{ip}-{i}", ip=ip), NOW) for i in range(64))
        assert accepted == (MAX_LOOPBACK_ENTRIES_PER_KEY if ip in ("127.0.0.1", "::1") else MAX_ENTRIES_PER_IP_PER_KEY)


def test_one_source_cannot_fill_the_top_of_a_reply():
    """A reply gives each source address MAX_PER_IP places (its /24 MAX_PER_SUBNET) before the
    others' entries, however much its records claim; the rest come after, not never."""
    store, key = RecordStore(max_entries_per_ip_per_key=8), stage_key("m", 0)
    for i in range(8):
        assert store.put(key, stored(f"fake{i}", mem=2**32 - 1, ip="203.0.113.66"), NOW)
    for i in range(4):
        assert store.put(key, stored(f"neighbour{i}", mem=2**31 - i, ip=f"203.0.113.{70 + i}"), NOW)
    assert store.put(key, stored("honest", mem=1024, ip="198.51.100.7"), NOW)
    assert store.put(key, stored("mine", mem=0, ip=LOCAL_SOURCE), NOW)
    order = peers_of(store, key, NOW)
    assert MAX_PER_IP == 2 and MAX_PER_SUBNET == 3  # as the expected order spells out:
    assert order[:5] == ["fake0", "fake1", "neighbour0", "honest", "mine"]  # equal claims: by peer id
    assert order[5:] == [f"fake{i}" for i in range(2, 8)] + ["neighbour1", "neighbour2", "neighbour3"]
    reply = handle_fetch(store, FetchRecords(model="m", stage=0, limit=5), NOW)
    assert list(reply.records) == [s.raw for s in store.get(key, NOW)[:5]]


def test_one_peer_holds_entries_under_a_bounded_number_of_keys():
    store = RecordStore(max_keys_per_peer=2)
    keys = [bytes([k]) * 32 for k in range(3)]
    assert store.put(keys[0], stored("a"), NOW) and store.put(keys[1], stored("a"), NOW)
    assert not store.put(keys[2], stored("a"), NOW)
    assert store.put(keys[2], stored("b"), NOW)
    assert store.put(keys[2], stored("a", timestamp=NOW + 60.0), NOW + 60.0)  # after its others expired


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
    entries = [stored("a", queue=3, ip="192.0.2.1"), stored("b", queue=0, mem=10, ip="198.51.100.1"),
               stored("c", queue=0, mem=99, ip="203.0.113.1"), stored("d", ttl=5.0, ip=LOCAL_SOURCE)]
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
    "limits", [{"max_keys": 0}, {"max_entries_per_key": 0}, {"max_clock_skew": -1.0}, {"max_keys_per_peer": 0},
               {"max_entries_per_ip_per_key": 0}, {"max_entries_per_ip": 0}, {"refresh_deadline": -1.0}]
)
def test_bad_limits_are_refused(limits):
    with pytest.raises(ConfigError):
        RecordStore(**limits)


# ---------------------------------------------------------------- state machine

MACHINE_MAX_KEYS = 4  # small limits so eviction and every refusal happen often
MACHINE_MAX_ENTRIES = 5  # above MAX_PER_IP and MAX_PER_SUBNET, so replies get reordered
MACHINE_SKEW = 10.0
MACHINE_KEYS_PER_PEER = 2
MACHINE_PER_IP_KEY = 3
MACHINE_LOOPBACK_KEY = 4
MACHINE_PER_IP = 6
MACHINE_DEADLINE = 10.0
MACHINE_KEYS = [bytes([k]) * 32 for k in range(6)]
MACHINE_PEERS = ["p0", "p1", "p2", "p3", "p4"]
MACHINE_IPS = [LOCAL_SOURCE, "192.0.2.1", "192.0.2.2", "192.0.2.3", "198.51.100.1", "127.0.0.1"]


def reference_order(entries) -> list[StageRecord]:
    """Best first; an entry beyond its address's MAX_PER_IP or its /24's MAX_PER_SUBNET goes after."""
    head, tail, per_ip, per_net = [], [], Counter(), Counter()
    order = best_first(e[0] for e in entries)
    ips = {e[0].peer_id: e[1] for e in entries}
    for record in order:
        ip = ips[record.peer_id]
        net = ip.rsplit(".", 1)[0]
        if ip != LOCAL_SOURCE and (per_ip[ip] >= MAX_PER_IP or per_net[net] >= MAX_PER_SUBNET):
            tail.append(record)
            continue
        if ip != LOCAL_SOURCE:
            per_ip[ip] += 1
            per_net[net] += 1
        head.append(record)
    return head + tail


class ReferenceStore:
    """The store's rules restated as simply as possible: expired records simply do not exist."""

    def __init__(self) -> None:
        self.held: dict[bytes, dict[str, tuple[StageRecord, str, float]]] = {}

    def live(self, key: bytes, now: float) -> dict[str, tuple[StageRecord, str, float]]:
        return {p: e for p, e in self.held.get(key, {}).items() if now < e[0].expires_at}

    def put(self, key: bytes, record: StageRecord, ip: str, now: float) -> bool:
        if now >= record.expires_at or record.timestamp > now + MACHINE_SKEW:
            return False
        live, peer = self.live(key, now), record.peer_id
        everything = [(k, p, e) for k in self.held for p, e in self.live(k, now).items()]
        old = live.get(peer)
        if old is not None and old[0].timestamp >= record.timestamp:
            return False
        if old is None and sum(p == peer for _, p, _ in everything) >= MACHINE_KEYS_PER_PEER:
            return False
        if (old is None or old[1] != ip) and ip != LOCAL_SOURCE:
            same_ip = [k for k, _, e in everything if e[1] == ip]
            per_key = MACHINE_LOOPBACK_KEY if ip == "127.0.0.1" else MACHINE_PER_IP_KEY
            if len(same_ip) >= MACHINE_PER_IP or same_ip.count(key) >= per_key:
                return False
        if not live and len({k for k, _, _ in everything}) >= MACHINE_MAX_KEYS:
            return False
        if old is None and len(live) >= MACHINE_MAX_ENTRIES:
            victim = min(live, key=lambda p: (live[p][2], p))
            if now - live[victim][2] <= MACHINE_DEADLINE:
                return False
            del live[victim]
        live[peer] = (record, ip, now)
        self.held[key] = live
        return True


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = RecordStore(MACHINE_MAX_KEYS, MACHINE_MAX_ENTRIES, MACHINE_SKEW,
                                 max_keys_per_peer=MACHINE_KEYS_PER_PEER, max_entries_per_ip_per_key=MACHINE_PER_IP_KEY,
                                 max_entries_per_ip=MACHINE_PER_IP, max_loopback_entries_per_key=MACHINE_LOOPBACK_KEY,
                                 refresh_deadline=MACHINE_DEADLINE)
        self.model = ReferenceStore()
        self.now = 1000.0
        self.last_accepted: dict[tuple[bytes, str], StageRecord] = {}

    @rule(
        key=st.sampled_from(MACHINE_KEYS[:1]) | st.sampled_from(MACHINE_KEYS),  # crowd one key
        peer=st.sampled_from(MACHINE_PEERS),
        age=st.integers(-15, 40),  # negative: from the future, sometimes beyond the skew
        ttl=st.sampled_from([1, 5, 10, 20, 30, 45]),  # few values, so expiries often tie
        queue=st.integers(0, 2),
        ip=st.just(MACHINE_IPS[1]) | st.sampled_from(MACHINE_IPS),  # crowd one address, so replies reorder
    )
    def put(self, key, peer, age, ttl, queue, ip):
        record = rec(peer, timestamp=self.now - age, ttl=float(ttl), queue=queue)
        accepted = self.store.put(key, StoredRecord(record, b"x", ip), self.now)
        assert accepted == self.model.put(key, record, ip, self.now)
        if accepted:
            self.last_accepted[(key, peer)] = record

    @rule(seconds=st.integers(0, 30))
    def advance_time(self, seconds):
        self.now += seconds

    @rule(key=st.sampled_from(MACHINE_KEYS))
    def get(self, key):
        expected = reference_order(self.model.live(key, self.now).values())
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
            assert got == reference_order(self.model.live(key, self.now).values())
            assert len(got) <= MACHINE_MAX_ENTRIES
            assert all(r.is_fresh(self.now) for r in got)
            assert len({r.peer_id for r in got}) == len(got)
            assert all(r == self.last_accepted[(key, r.peer_id)] for r in got)
        held = [(key, s) for key in MACHINE_KEYS for s in self.store.get(key, self.now)]
        assert max(Counter(s.record.peer_id for _, s in held).values(), default=0) <= MACHINE_KEYS_PER_PEER
        per_ip = Counter(s.source_ip for _, s in held if s.source_ip != LOCAL_SOURCE)
        assert max(per_ip.values(), default=0) <= MACHINE_PER_IP
        per_ip_key = Counter((key, s.source_ip) for key, s in held if s.source_ip not in (LOCAL_SOURCE, "127.0.0.1"))
        assert max(per_ip_key.values(), default=0) <= MACHINE_PER_IP_KEY
        loopback_key = Counter(key for key, s in held if s.source_ip == "127.0.0.1")
        assert max(loopback_key.values(), default=0) <= MACHINE_LOOPBACK_KEY


StoreMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestStoreMachine = StoreMachine.TestCase
