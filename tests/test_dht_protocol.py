"""The stage-record protocol handlers: pure functions of (store, message, now, sender)."""

from __future__ import annotations

import dataclasses

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm import wire
from p2pswarm.dht.protocol import (
    FETCH_REPLY_BUDGET,
    FetchRecords,
    FetchReply,
    StoreRecord,
    StoreReply,
    handle_fetch,
    handle_store,
)
from p2pswarm.dht.record_codec import sign_record, verify_record
from p2pswarm.dht.records import Capacity, StageRecord
from p2pswarm.dht.store import RecordStore
from p2pswarm.errors import RemoteProtocolError
from p2pswarm.identity import generate_identity
from p2pswarm.testing.strategies import frames, register_frames, run_ids

ALICE, BOB = generate_identity(), generate_identity()
NOW = 1_000_000.0


def record(identity, stage=0, ts=NOW, ttl=15.0, queue=0) -> StageRecord:
    return StageRecord(peer_id=identity.peer_id_text, addrs=("/ip4/127.0.0.1/tcp/1",), model="tiny-lm",
                       stage=stage, start=2 * stage, end=2 * stage + 2,
                       capacity=Capacity(free_memory_mb=100, queue_depth=queue),
                       timestamp=ts, ttl=ttl)


def store_own(store, identity, rec, now=NOW, ip="192.0.2.1") -> StoreReply:
    """``identity`` stores its own record, as the announcer does over its own connection."""
    return handle_store(store, StoreRecord(record=sign_record(rec, identity)), now, identity.peer_id_text, ip)


def test_store_then_fetch():
    store = RecordStore()
    assert store_own(store, ALICE, record(ALICE, stage=1)).accepted
    reply = handle_fetch(store, FetchRecords(model="tiny-lm", stage=1, limit=8), NOW + 1)
    assert [verify_record(r) for r in reply.records] == [record(ALICE, stage=1)]
    assert handle_fetch(store, FetchRecords(model="tiny-lm", stage=0, limit=8), NOW).records == ()
    assert handle_fetch(store, FetchRecords(model="tiny-lm", stage=1, limit=8), NOW + 15).records == ()


def test_store_refuses_a_record_sent_by_another_peer_than_it_names():
    """The attack review: one connection stored 3,000 validly signed records of 3,000 made-up
    identities. A record is accepted only from the peer it names."""
    store = RecordStore()
    fakes = [generate_identity() for _ in range(20)]
    for fake in fakes:
        raw = sign_record(record(fake), fake)
        with pytest.raises(RemoteProtocolError, match="stores only its own"):
            handle_store(store, StoreRecord(record=raw), NOW, BOB.peer_id_text, "203.0.113.66")
    assert store.entry_count() == 0


def test_store_refuses_a_forged_record():
    forged = sign_record(record(BOB), BOB).replace(BOB.peer_id_text.encode(), ALICE.peer_id_text.encode())
    with pytest.raises(RemoteProtocolError):
        handle_store(RecordStore(), StoreRecord(record=forged), NOW, ALICE.peer_id_text)


def test_stale_announcement_is_not_accepted():
    store = RecordStore()
    assert store_own(store, ALICE, record(ALICE, ts=NOW)).accepted
    assert not store_own(store, ALICE, record(ALICE, ts=NOW - 1)).accepted


def test_fetch_reply_respects_limit_and_fits_a_header():
    store = RecordStore()
    peers = [generate_identity() for _ in range(40)]
    for i, peer in enumerate(peers):
        store_own(store, peer, record(peer, queue=i), ip=f"192.0.2.{i}")
    assert len(handle_fetch(store, FetchRecords(model="tiny-lm", stage=0, limit=3), NOW).records) == 3
    reply = handle_fetch(store, FetchRecords(model="tiny-lm", stage=0, limit=1000), NOW)
    assert sum(map(len, reply.records)) <= FETCH_REPLY_BUDGET
    assert wire.decode_frame(wire.encode_frame(reply))[0] == reply
    queues = [verify_record(r).capacity.queue_depth for r in reply.records]
    assert queues == sorted(queues)  # best (shortest queue) first


@pytest.mark.parametrize("model,stage", [("", 0), ("tiny-lm", 4096), ("a\x00b", 0), ("tiny-lm", -1)])
def test_fetch_for_impossible_keys_is_a_remote_error(model, stage):
    """A fetch a peer sends for a key no record can have is refused as that peer's error."""
    header = {"t": "stage.fetch", "v": 1, "n": 0, "f": {"model": model, "stage": stage, "limit": 1}}
    encoded = cbor2.dumps(header, canonical=True)
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(len(encoded).to_bytes(4, "big") + encoded)


register_frames(FetchRecords, st.builds(
    FetchRecords,
    model=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=64),
    stage=st.integers(0, 4095),
    limit=st.integers(0, 1000),
    run=run_ids,
).map(lambda message: (message, b"")))

DHT_MESSAGES = [StoreRecord, StoreReply, FetchRecords, FetchReply]


@settings(max_examples=200)
@given(st.sampled_from(DHT_MESSAGES).flatmap(frames))
def test_dht_messages_round_trip(frame):
    message, payload = frame
    assert wire.decode_frame(wire.encode_frame(message, payload)) == (message, payload)


@settings(max_examples=200)
@given(st.sampled_from(DHT_MESSAGES).flatmap(frames), st.data())
def test_truncated_dht_frames_are_remote_errors(frame, data):
    encoded = wire.encode_frame(*frame)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(encoded[:cut])


def test_each_run_has_its_own_key():
    """Peers of another run store and fetch under another key: a fetch never returns their records."""
    store, ours, theirs = RecordStore(), "fdd1f91421b0282a", "22c34b20d1f30067"
    assert store_own(store, ALICE, dataclasses.replace(record(ALICE), run=ours)).accepted
    assert store_own(store, BOB, dataclasses.replace(record(BOB), run=theirs)).accepted
    for run, identity in ((ours, ALICE), (theirs, BOB)):
        reply = handle_fetch(store, FetchRecords(model="tiny-lm", stage=0, limit=8, run=run), NOW)
        assert [verify_record(r).peer_id for r in reply.records] == [identity.peer_id_text]
    assert handle_fetch(store, FetchRecords(model="tiny-lm", stage=0, limit=8), NOW).records == ()


@pytest.mark.parametrize("run", ["", "0" * 15, "ABCDEF0123456789"])
def test_fetch_for_a_run_that_is_no_identity_is_a_remote_error(run):
    header = {"t": "stage.fetch", "v": 1, "n": 0, "f": {"model": "tiny-lm", "stage": 0, "limit": 1, "run": run}}
    encoded = cbor2.dumps(header, canonical=True)
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(len(encoded).to_bytes(4, "big") + encoded)


def test_a_lookup_drops_a_record_of_another_run_that_comes_back_anyway():
    """A storing peer could serve any record under any key: the reader checks the run itself."""
    from types import SimpleNamespace

    from p2pswarm.dht.discovery import StageIndex

    index = SimpleNamespace(stats=SimpleNamespace(invalid_records=0))
    ours, theirs = "fdd1f91421b0282a", "22c34b20d1f30067"
    newest: dict = {}
    for identity, run in ((ALICE, ours), (BOB, theirs)):
        raw = sign_record(dataclasses.replace(record(identity), run=run), identity)
        StageIndex._merge(index, newest, raw, (ours, "tiny-lm", 0), NOW)
    assert list(newest) == [ALICE.peer_id_text] and index.stats.invalid_records == 1


def test_a_lookup_drops_a_record_dated_past_the_clock_skew_that_a_store_serves_anyway():
    """A store checks timestamps, but a hostile one could serve a record its author dated far ahead: fresh
    for good, and the newest of its author forever. The reader bounds it as a store does (issue 25)."""
    from types import SimpleNamespace

    from p2pswarm.dht.discovery import StageIndex
    from p2pswarm.dht.store import MAX_CLOCK_SKEW

    index = SimpleNamespace(stats=SimpleNamespace(invalid_records=0))
    newest: dict = {}
    for identity, ahead in ((ALICE, MAX_CLOCK_SKEW - 1), (BOB, MAX_CLOCK_SKEW + 1), (BOB, 2.0**40 - NOW)):
        raw = sign_record(record(identity, ts=NOW + ahead), identity)
        StageIndex._merge(index, newest, raw, (record(ALICE).run, "tiny-lm", 0), NOW)
    assert list(newest) == [ALICE.peer_id_text] and index.stats.invalid_records == 2
