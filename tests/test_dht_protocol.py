"""The layer-record protocol handlers: pure functions of (store, message, now)."""

from __future__ import annotations

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm import wire
from p2pswarm.dht.protocol import (FETCH_REPLY_BUDGET, FetchRecords, FetchReply, StoreRecord, StoreReply,
                                   handle_fetch, handle_store)
from p2pswarm.dht.records import Capacity, LayerRecord, sign_record, verify_record
from p2pswarm.dht.store import RecordStore
from p2pswarm.errors import RemoteProtocolError
from p2pswarm.identity import generate_identity
from p2pswarm.testing.strategies import frames, register_frames

ALICE, BOB = generate_identity(), generate_identity()
NOW = 1_000_000.0


def record(identity, start=0, end=2, ts=NOW, ttl=15.0, queue=0) -> LayerRecord:
    return LayerRecord(peer_id=identity.peer_id_text, addrs=("/ip4/127.0.0.1/tcp/1",), model="tiny-lm",
                       start=start, end=end, capacity=Capacity(free_memory_mb=100, queue_depth=queue),
                       timestamp=ts, ttl=ttl)


def test_store_then_fetch():
    store = RecordStore()
    raw = sign_record(record(ALICE), ALICE)
    assert handle_store(store, StoreRecord(layer=1, record=raw), NOW).accepted
    reply = handle_fetch(store, FetchRecords(model="tiny-lm", layer=1, limit=8), NOW + 1)
    assert [verify_record(r) for r in reply.records] == [record(ALICE)]
    assert handle_fetch(store, FetchRecords(model="tiny-lm", layer=0, limit=8), NOW).records == ()
    assert handle_fetch(store, FetchRecords(model="tiny-lm", layer=1, limit=8), NOW + 15).records == ()


def test_store_refuses_a_layer_the_record_does_not_serve():
    with pytest.raises(RemoteProtocolError):
        handle_store(RecordStore(), StoreRecord(layer=5, record=sign_record(record(ALICE), ALICE)), NOW)


def test_store_refuses_a_forged_record():
    forged = sign_record(record(BOB), BOB).replace(BOB.peer_id_text.encode(), ALICE.peer_id_text.encode())
    with pytest.raises(RemoteProtocolError):
        handle_store(RecordStore(), StoreRecord(layer=0, record=forged), NOW)


def test_stale_announcement_is_not_accepted():
    store = RecordStore()
    assert handle_store(store, StoreRecord(layer=0, record=sign_record(record(ALICE, ts=NOW), ALICE)), NOW).accepted
    older = sign_record(record(ALICE, ts=NOW - 1), ALICE)
    assert not handle_store(store, StoreRecord(layer=0, record=older), NOW).accepted


def test_fetch_reply_respects_limit_and_fits_a_header():
    store = RecordStore()
    peers = [generate_identity() for _ in range(40)]
    for i, peer in enumerate(peers):
        handle_store(store, StoreRecord(layer=0, record=sign_record(record(peer, queue=i), peer)), NOW)
    assert len(handle_fetch(store, FetchRecords(model="tiny-lm", layer=0, limit=3), NOW).records) == 3
    reply = handle_fetch(store, FetchRecords(model="tiny-lm", layer=0, limit=1000), NOW)
    assert sum(map(len, reply.records)) <= FETCH_REPLY_BUDGET
    assert wire.decode_frame(wire.encode_frame(reply))[0] == reply
    queues = [verify_record(r).capacity.queue_depth for r in reply.records]
    assert queues == sorted(queues)  # best (shortest queue) first


@pytest.mark.parametrize("model,layer", [("", 0), ("tiny-lm", 4096), ("a\x00b", 0), ("tiny-lm", -1)])
def test_fetch_for_impossible_keys_is_a_remote_error(model, layer):
    """A fetch a peer sends for a key no record can have is refused as that peer's error."""
    header = {"t": "layer.fetch", "v": 1, "n": 0, "f": {"model": model, "layer": layer, "limit": 1}}
    encoded = cbor2.dumps(header, canonical=True)
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(len(encoded).to_bytes(4, "big") + encoded)


register_frames(FetchRecords, st.builds(
    FetchRecords,
    model=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=64),
    layer=st.integers(0, 4095),
    limit=st.integers(0, 1000),
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
