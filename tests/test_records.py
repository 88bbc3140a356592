"""Signed stage records: round trips, and every kind of bad input refused as RemoteProtocolError."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import random

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pswarm.dht.record_codec import (
    MAX_BODY_KEYS,
    MAX_CAPACITY_KEYS,
    MAX_RECORD_BYTES,
    RECORD_VERSION,
    SIGNATURE_DOMAIN,
    sign_record,
    verify_record,
)
from p2pswarm.dht.records import (
    DIGEST_BYTES,
    FLAG_PINNED,
    FLAG_RELAYED,
    FLAG_SNAPSHOT,
    FLAG_TRAINING,
    FLAGS_LIMIT,
    MAX_ADDR_CHARS,
    MAX_ADDRS,
    MAX_BACKUP_CLAIMS,
    MAX_FREE_MEMORY_MB,
    MAX_LAYERS,
    MAX_LOSS_BPB,
    MAX_MODEL_CHARS,
    MAX_PEER_ID_CHARS,
    MAX_QUEUE_DEPTH,
    MAX_STAGES,
    MAX_THROUGHPUT,
    MAX_TIMESTAMP,
    MAX_TTL,
    MIN_TTL,
    PLAUSIBLE_FREE_MEMORY_MB,
    PLAUSIBLE_QUEUE_DEPTH,
    PLAUSIBLE_THROUGHPUT,
    UNNAMED_RUN,
    BackupClaim,
    Capacity,
    StageRecord,
    best_first,
    routing_rank,
    stage_key,
)
from p2pswarm.errors import LocalProtocolError, RemoteProtocolError
from p2pswarm.identity import generate_identity
from p2pswarm.testing.strategies import run_ids

IDENTITIES = [generate_identity() for _ in range(3)]  # key generation is slow-ish: once per module
ALICE, BOB = IDENTITIES[0], IDENTITIES[1]
BY_PEER = {identity.peer_id_text: identity for identity in IDENTITIES}

addrs_st = st.lists(
    st.one_of(
        st.builds(
            "/ip4/10.0.{}.{}/tcp/{}".format, st.integers(0, 255), st.integers(0, 255), st.integers(1, 65535)
        ),
        st.sampled_from(["/ip6/::1/udp/4001/quic-v1", "/dns4/example.org/tcp/443/wss"]),
    ),
    max_size=4,
).map(tuple)
models_st = st.text(st.characters(categories=("L", "N", "P")), min_size=1, max_size=MAX_MODEL_CHARS)
layers_st = st.integers(0, MAX_LAYERS - 1).flatmap(
    lambda start: st.tuples(st.just(start), st.integers(start + 1, MAX_LAYERS))
)
capacity_st = st.builds(
    Capacity,
    st.integers(0, MAX_FREE_MEMORY_MB),
    st.integers(0, MAX_QUEUE_DEPTH),
    st.integers(0, FLAGS_LIMIT - 1),
    st.floats(0, MAX_THROUGHPUT),
    st.integers(0, 2**63 - 1),
    st.floats(0, MAX_LOSS_BPB),
    st.floats(0, MAX_LOSS_BPB),
)
timestamps_st = st.one_of(st.floats(0, MAX_TIMESTAMP), st.integers(0, int(MAX_TIMESTAMP)))
ttls_st = st.one_of(st.floats(MIN_TTL, MAX_TTL), st.integers(int(MIN_TTL), int(MAX_TTL)))


rounds_st = st.integers(0, 2**63 - 1)
digests_st = st.binary(min_size=DIGEST_BYTES, max_size=DIGEST_BYTES)
agreed_st = st.none() | st.tuples(rounds_st, digests_st)


def claims_st(own_stage: int):
    """Backup claims a record of ``own_stage`` may carry: other stages, each at most once."""
    other_stages = st.integers(0, MAX_STAGES - 1).filter(lambda stage: stage != own_stage)
    return st.lists(st.builds(BackupClaim, other_stages, rounds_st, digests_st), max_size=MAX_BACKUP_CLAIMS,
                    unique_by=lambda claim: claim.stage).map(tuple)


peer_ids_st = st.sampled_from(sorted(BY_PEER))


def records(peer_ids=peer_ids_st):
    def build(stage):
        return st.builds(
            lambda peer, addrs, model, layers, cap, ts, ttl, run, agreed, backups: StageRecord(
                peer, addrs, model, stage, *layers, cap, ts, ttl, run, agreed, backups
            ),
            peer_ids, addrs_st, models_st, layers_st, capacity_st, timestamps_st, ttls_st, run_ids, agreed_st,
            claims_st(stage),
        )

    return st.integers(0, MAX_STAGES - 1).flatmap(build)


def sign(record: StageRecord) -> bytes:
    return sign_record(record, BY_PEER[record.peer_id])


BASE = StageRecord(
    ALICE.peer_id_text, ("/ip4/10.0.0.1/tcp/4001",), "tiny-llama", 1, 3, 7,
    Capacity(2048, 1, FLAG_TRAINING, 1234.5), 1_700_000_000.25, 60.0, "fdd1f91421b0282a",
)


def base_body() -> dict:
    return cbor2.loads(sign_record(BASE, ALICE))["r"]


def resign(body: dict, identity=ALICE, **outer) -> bytes:
    """A message around ``body`` with a genuine signature by ``identity``, outer keys overridable."""
    signature = identity.sign(SIGNATURE_DOMAIN + cbor2.dumps(body, canonical=True))
    return cbor2.dumps({"v": RECORD_VERSION, "r": body, "s": signature, **outer}, canonical=True)


def test_resign_helper_makes_valid_records():
    assert verify_record(resign(base_body())) == BASE


@given(records())
def test_round_trip(record):
    result = verify_record(sign(record))
    assert result == record
    assert type(result.timestamp) is float and type(result.ttl) is float


@given(st.binary(max_size=MAX_RECORD_BYTES + 16))
def test_arbitrary_bytes_only_raise_remote_protocol_error(data):
    with pytest.raises(RemoteProtocolError):
        verify_record(data)


plain_cbor_st = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(
        st.sampled_from(["v", "r", "s", "peer", "addrs", "cap", "ts", "mem", "stage", "tput"]), inner, max_size=4
    ),
    max_leaves=12,
)


@given(plain_cbor_st)
def test_arbitrary_cbor_values_only_raise_remote_protocol_error(value):
    with pytest.raises(RemoteProtocolError):
        verify_record(cbor2.dumps(value, canonical=True))


@given(st.dictionaries(st.sampled_from(sorted({*base_body(), "agreed", "backups"})), plain_cbor_st, max_size=8))
def test_arbitrary_signed_bodies_only_raise_remote_protocol_error(overrides):
    body = {**base_body(), **overrides}
    try:
        result = verify_record(resign(body))
    except RemoteProtocolError:
        return
    assert result.peer_id == ALICE.peer_id_text  # only a body that really is valid verifies


@settings(max_examples=10)
@given(records())
def test_every_truncation_is_refused(record):
    data = sign(record)
    for length in range(len(data)):
        with pytest.raises(RemoteProtocolError):
            verify_record(data[:length])


@settings(max_examples=10, suppress_health_check=[HealthCheck.too_slow])
@given(records(), st.integers(1, 255))
def test_every_single_byte_flip_is_refused(record, mask):
    data = sign(record)
    for index in range(len(data)):
        flipped = bytearray(data)
        flipped[index] ^= mask
        try:
            result = verify_record(bytes(flipped))
        except RemoteProtocolError:
            continue
        assert result == record  # a flip that still verifies must not change the record


BAD_FIELDS = [
    ("start", True), ("start", "3"), ("start", -1), ("start", 3.0), ("start", None), ("start", MAX_LAYERS),
    ("end", 3), ("end", 2), ("end", MAX_LAYERS + 1), ("end", False), ("end", 2**64),
    ("ts", True), ("ts", "1700000000"), ("ts", math.nan), ("ts", math.inf), ("ts", -1.0), ("ts", None),
    ("ts", MAX_TIMESTAMP * 2), ("ts", [1.0]),
    ("ttl", False), ("ttl", 0.5), ("ttl", 0), ("ttl", MAX_TTL + 1), ("ttl", -60.0),
    ("ttl", math.nan), ("ttl", b"60"),
    ("model", ""), ("model", "m" * (MAX_MODEL_CHARS + 1)), ("model", b"tiny"),
    ("model", "bad\nname"), ("model", 7),
    ("addrs", ["/ip4/10.0.0.1/tcp/1"] * (MAX_ADDRS + 1)), ("addrs", "/ip4/10.0.0.1/tcp/1"), ("addrs", [5]),
    ("addrs", ["/" + "a" * MAX_ADDR_CHARS]), ("addrs", ["ip4/10.0.0.1"]), ("addrs", [""]), ("addrs", ["/a b"]),
    ("addrs", ["/dns4/ex\u00e4mple.org"]), ("addrs", [b"/ip4/10.0.0.1"]), ("addrs", {"a": "/x"}),
    ("peer", 5), ("peer", ""), ("peer", "not-base58-0OIl"), ("peer", "Qm" + "1" * 44),
    ("peer", BOB.peer_id_text + "1"), ("peer", "1" * (MAX_PEER_ID_CHARS + 1)),
    ("cap", {"mem": True, "queue": 0, "flags": 0}), ("cap", {"mem": -1, "queue": 0, "flags": 0}),
    ("cap", {"mem": 0, "queue": 2.0, "flags": 0}), ("cap", {"mem": 0, "queue": -5, "flags": 0}),
    ("cap", {"mem": 0, "queue": 0, "flags": FLAGS_LIMIT}), ("cap", {"mem": 0, "queue": 0, "flags": -1}),
    ("cap", {"mem": 0, "queue": 0}), ("cap", {"mem": 0, "queue": 0, "flags": 0, "tput": -1.0}),
    ("cap", {"mem": 0, "queue": 0, "flags": 0, "tput": math.inf}),
    ("cap", {"mem": 0, "queue": 0, "flags": 0, "tput": "1"}),
    ("cap", {"mem": 0, "queue": 0, "flags": 0, "round": -1}),
    ("cap", {"mem": 0, "queue": 0, "flags": 0, "round": 2**63}),
    ("cap", {"mem": 0, "queue": 0, "flags": 0, "round": 1.0}),
    ("cap", {"mem": 0, "queue": 0, "flags": 0, "round": True}),
    ("cap", {"mem": 0, "queue": 0, "flags": 0, 7: 1}), ("cap", {"mem": 0, "queue": 0, "flags": 0, "x" * 33: 1}),
    ("cap", {"mem": 0, "queue": 0, "flags": 0, **{f"k{i}": i for i in range(MAX_CAPACITY_KEYS)}}),
    ("stage", -1), ("stage", MAX_STAGES), ("stage", True), ("stage", "1"), ("stage", None),
    ("cap", {"mem": MAX_FREE_MEMORY_MB + 1, "queue": 0, "flags": 0}), ("cap", [0, 0, 0]), ("cap", None),
    ("agreed", None), ("agreed", [1]), ("agreed", [1, b"d" * 32, 2]), ("agreed", [-1, b"d" * 32]),
    ("agreed", [2**63, b"d" * 32]), ("agreed", [True, b"d" * 32]), ("agreed", [1, b"d" * 31]),
    ("agreed", [1, "d" * 32]), ("agreed", {"round": 1}), ("agreed", [[1], b"d" * 32]),
    ("backups", None), ("backups", [0, 1]), ("backups", [0, 1, b"d" * 32, 2]), ("backups", [1, 1, b"d" * 32]),
    ("backups", [0, 1, b"d" * 32, 0, 2, b"e" * 32]), ("backups", [0, -1, b"d" * 32]), ("backups", [0, 1, b"d"]),
    ("backups", [MAX_STAGES, 1, b"d" * 32]), ("backups", [True, 1, b"d" * 32]), ("backups", [[0, 1, b"d" * 32]]),
    ("backups", [x for s in range(2, MAX_BACKUP_CLAIMS + 3) for x in (s, 1, b"d" * 32)]), ("backups", {"0": 1}),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS,
                         ids=[f"{field}-{i}" for i, (field, _) in enumerate(BAD_FIELDS)])  # ids: no random key in them
def test_bad_field_is_refused_even_when_signed(field, value):
    with pytest.raises(RemoteProtocolError):
        verify_record(resign({**base_body(), field: value}))


@pytest.mark.parametrize("field", ["peer", "addrs", "model", "stage", "start", "end", "cap", "ts", "ttl"])
def test_missing_body_key_is_refused(field):
    body = base_body()
    del body[field]
    with pytest.raises(RemoteProtocolError):
        verify_record(resign(body))


def test_fields_this_version_does_not_know_are_ignored():
    """The format can gain a field without breaking older peers: unknown body and capacity keys
    are ignored (the signed bytes, served as received, keep them)."""
    body = base_body()
    body["gpu"] = {"name": "a100", "mem": 80}
    body["cap"] = {**body["cap"], "tflops": 312.0}
    assert verify_record(resign(body)) == BASE


def test_a_record_without_the_optional_throughput_verifies_with_zero():
    body = base_body()
    del body["cap"]["tput"]
    assert verify_record(resign(body)).capacity.throughput == 0.0


def test_the_outer_round_travels_and_is_left_out_when_zero():
    from dataclasses import replace

    assert "round" not in base_body()["cap"]  # older readers see the record they always saw
    later = replace(BASE, capacity=replace(BASE.capacity, outer_round=17))
    assert cbor2.loads(sign_record(later, ALICE))["r"]["cap"]["round"] == 17
    assert verify_record(sign_record(later, ALICE)) == later


def test_a_last_stage_s_losses_travel_and_are_left_out_when_zero():
    from dataclasses import replace

    assert "loss" not in base_body()["cap"] and "held" not in base_body()["cap"]  # older readers: as always
    later = replace(BASE, capacity=replace(BASE.capacity, train_loss_bpb=2.5, heldout_bpb=2.75))
    assert cbor2.loads(sign_record(later, ALICE))["r"]["cap"]["loss"] == 2.5
    assert verify_record(sign_record(later, ALICE)) == later
    for bad in (-1.0, math.nan, math.inf, MAX_LOSS_BPB * 2):
        body = base_body()
        body["cap"] = {**body["cap"], "loss": bad}
        with pytest.raises(RemoteProtocolError):
            verify_record(resign(body))


def test_agreed_and_backups_travel_and_are_left_out_when_empty():
    from dataclasses import replace

    assert "agreed" not in base_body() and "backups" not in base_body()  # older readers see what they always saw
    claims = (BackupClaim(0, 4, b"a" * 32), BackupClaim(2, 5, b"b" * 32))
    later = replace(BASE, agreed=(7, b"c" * 32), backups=claims)
    body = cbor2.loads(sign_record(later, ALICE))["r"]
    assert body["agreed"] == [7, b"c" * 32]
    assert body["backups"] == [0, 4, b"a" * 32, 2, 5, b"b" * 32]  # flat: the depth limit stays 3
    assert verify_record(sign_record(later, ALICE)) == later


def test_a_full_record_with_every_backup_claim_fits():
    from dataclasses import replace

    claims = tuple(BackupClaim(stage, 2**63 - 1, b"d" * 32) for stage in range(2, 2 + MAX_BACKUP_CLAIMS))
    full = replace(BASE, addrs=("/dns4/" + "a" * 120 + "/tcp/4001",) * 8, agreed=(2**63 - 1, b"c" * 32),
                   backups=claims)
    assert verify_record(sign_record(full, ALICE)) == full


def test_records_differing_only_in_agreed_or_backups_still_rank_in_a_total_order():
    from dataclasses import replace

    variants = [replace(BASE, backups=(BackupClaim(0, 2, b"b" * 32),)),
                replace(BASE, backups=(BackupClaim(0, 1, b"b" * 32),)), replace(BASE, agreed=(3, b"a" * 32)), BASE]
    assert best_first(variants) == best_first(variants[::-1])


def test_our_record_leaves_out_a_held_backup_of_its_own_stage():
    """Right after a move into a stage, the backup service may still hold (and claim) that stage's backup."""
    from p2pswarm.dht.announce import stage_record
    from p2pswarm.model.catalog import get_model

    claims = (BackupClaim(0, 3, b"a" * 32), BackupClaim(1, 4, b"b" * 32))
    record = stage_record(ALICE.peer_id_text, [], (), get_model("tiny-lm"), 1, Capacity(1, 0), 5.0, 15.0,
                          agreed=(4, b"b" * 32), backups=claims)
    assert record.backups == claims[:1] and record.agreed == (4, b"b" * 32)
    assert verify_record(sign_record(record, ALICE)) == record


def test_pinned_is_its_own_flag():
    assert FLAG_PINNED == 32 and FLAG_PINNED & (FLAG_SNAPSHOT | FLAG_TRAINING | FLAG_RELAYED) == 0


@pytest.mark.parametrize("extra", [{"x" * 33: 1}, {5: 1}, {f"k{i}": i for i in range(MAX_BODY_KEYS)}])
def test_unknown_keys_stay_bounded(extra):
    with pytest.raises(RemoteProtocolError):
        verify_record(resign({**base_body(), **extra}))


@pytest.mark.parametrize(
    "outer",
    [{"v": 1}, {"v": 2}, {"v": 4}, {"v": True}, {"v": 3.0}, {"v": "3"}, {"s": b"\x00" * 63}, {"s": b"\x00" * 64},
     {"s": "sig"}, {"s": None}, {"extra": 0}, {"r": None}, {"r": [1, 2]}],
)
def test_bad_message_envelope_is_refused(outer):
    with pytest.raises(RemoteProtocolError):
        verify_record(resign(base_body(), **outer))


def test_integer_timestamp_and_ttl_are_accepted_as_floats():
    record = verify_record(resign({**base_body(), "ts": 1_700_000_000, "ttl": 60}))
    assert record.timestamp == 1_700_000_000.0 and type(record.timestamp) is float
    assert record.ttl == 60.0 and type(record.ttl) is float


@pytest.mark.parametrize(
    "place",
    ["message", "ts_datetime", "start_bignum", "addrs_set", "model_unknown", "peer_stringref", "cap_shared"],
)
def test_cbor_tags_are_refused(place):
    body = base_body()
    if place == "ts_datetime":
        body["ts"] = cbor2.CBORTag(1, body["ts"])
    elif place == "start_bignum":
        body["start"] = cbor2.CBORTag(2, b"\x03")
    elif place == "addrs_set":
        body["addrs"] = cbor2.CBORTag(258, body["addrs"])
    elif place == "model_unknown":
        body["model"] = cbor2.CBORTag(40000, body["model"])
    elif place == "peer_stringref":
        body["peer"] = cbor2.CBORTag(256, body["peer"])
    elif place == "cap_shared":
        body["cap"] = cbor2.CBORTag(28, body["cap"])
    data = resign(body)
    if place == "message":
        data = cbor2.dumps(cbor2.CBORTag(55799, cbor2.loads(data)))
    # cbor2 counts a tag as a nesting level, so tagged containers may trip the depth limit first
    reason = "tag" if place in ("ts_datetime", "start_bignum", "model_unknown", "peer_stringref") else "CBOR"
    with pytest.raises(RemoteProtocolError, match=reason):
        verify_record(data)


@pytest.mark.parametrize("tag", [0, 1, 2, 3, 4, 5, 25, 28, 29, 30, 35, 37, 256, 258, 55799, 40000, 2**40])
def test_every_tag_is_refused_by_the_decoder(tag):
    with pytest.raises(RemoteProtocolError, match="tag"):
        verify_record(cbor2.dumps(cbor2.CBORTag(tag, 1)))


def test_non_canonical_encodings_are_refused():
    message = cbor2.loads(resign(base_body()))
    reordered = {"s": message["s"], "v": RECORD_VERSION, "r": message["r"]}  # keys out of canonical order
    for data in [
        cbor2.dumps(reordered),
        cbor2.dumps(message, canonical=True) + b"\x00",  # trailing bytes
        cbor2.dumps(message, canonical=True, indefinite_containers=True),
    ]:
        with pytest.raises(RemoteProtocolError, match=r"canonical|CBOR"):
            verify_record(data)


def test_float64_where_float16_suffices_is_refused():
    body = {**base_body(), "ttl": 60.0}
    data = resign(body)
    canonical_ttl = cbor2.dumps(60.0, canonical=True)
    assert canonical_ttl in data and len(canonical_ttl) == 3
    widened = data.replace(b"cttl" + canonical_ttl, b"cttl" + b"\xfb" + cbor2.dumps(60.0)[1:])
    assert widened != data and cbor2.loads(widened) == cbor2.loads(data)
    with pytest.raises(RemoteProtocolError):
        verify_record(widened)


def test_record_signed_by_another_peer_is_refused():
    with pytest.raises(RemoteProtocolError, match="not signed by"):
        verify_record(resign(base_body(), identity=BOB))  # names Alice, signed by Bob


def test_signature_over_a_different_body_is_refused():
    signed = cbor2.loads(resign(base_body()))
    other = {**base_body(), "cap": {"mem": 2048, "queue": 0, "flags": FLAG_TRAINING}}
    data = cbor2.dumps({"v": RECORD_VERSION, "r": other, "s": signed["s"]}, canonical=True)
    with pytest.raises(RemoteProtocolError, match="not signed by"):
        verify_record(data)


def test_signature_without_domain_prefix_is_refused():
    body = base_body()
    signature = ALICE.sign(cbor2.dumps(body, canonical=True))
    with pytest.raises(RemoteProtocolError, match="not signed by"):
        verify_record(cbor2.dumps({"v": RECORD_VERSION, "r": body, "s": signature}, canonical=True))


def test_peer_id_with_non_ed25519_inlined_key_is_refused():
    from libp2p.crypto.secp256k1 import create_new_key_pair
    from libp2p.peer.id import ID

    key_pair = create_new_key_pair()
    peer = ID.from_pubkey(key_pair.public_key)
    assert peer.extract_public_key() is not None  # libp2p inlines this key too
    body = {**base_body(), "peer": peer.to_base58()}
    signature = key_pair.private_key.sign(SIGNATURE_DOMAIN + cbor2.dumps(body, canonical=True))
    with pytest.raises(RemoteProtocolError, match="Ed25519"):
        verify_record(cbor2.dumps({"v": RECORD_VERSION, "r": body, "s": signature}, canonical=True))


def test_peer_id_spelling_the_signers_key_non_canonically_is_refused():
    from libp2p.peer.id import ID

    key_bytes = ALICE.peer_id.to_bytes()[2:] + b"\x10\x01"  # protobuf with a duplicate field
    peer = ID(bytes([0, len(key_bytes)]) + key_bytes)
    assert peer.extract_public_key().to_bytes() == ALICE.key_pair.public_key.to_bytes()
    with pytest.raises(RemoteProtocolError, match="Ed25519"):
        verify_record(resign({**base_body(), "peer": peer.to_base58()}))


def test_oversize_input_is_refused_before_decoding():
    with pytest.raises(RemoteProtocolError, match="over"):
        verify_record(b"\x00" * (MAX_RECORD_BYTES + 1))
    big = {**base_body(), "addrs": ["/dns4/" + "a" * (MAX_ADDR_CHARS - 6)] * MAX_ADDRS}
    with pytest.raises(RemoteProtocolError, match="over"):
        verify_record(resign(big))


def test_non_bytes_input_is_refused():
    with pytest.raises(RemoteProtocolError):
        verify_record("not bytes")  # type: ignore[arg-type]


def test_sign_refuses_another_peers_record():
    with pytest.raises(LocalProtocolError):
        sign_record(BASE, BOB)


@pytest.mark.parametrize(
    "changes",
    [{"start": 7}, {"start": True}, {"end": MAX_LAYERS + 1}, {"ttl": 0.0}, {"ttl": math.nan},
     {"timestamp": -1.0}, {"timestamp": False}, {"model": ""}, {"addrs": ["/ip4/10.0.0.1/tcp/1"]},
     {"addrs": ("x",)}, {"addrs": ("/ip4/10.0.0.1/tcp/1",) * (MAX_ADDRS + 1)},
     {"capacity": Capacity(-1, 0)}, {"capacity": Capacity(0, 0, FLAGS_LIMIT)}, {"capacity": (0, 0, 0)},
     {"agreed": (1, b"d" * 31)}, {"agreed": [1, b"d" * 32]}, {"agreed": (-1, b"d" * 32)},
     {"backups": (BackupClaim(1, 1, b"d" * 32),)}, {"backups": [BackupClaim(0, 1, b"d" * 32)]},
     {"backups": (BackupClaim(0, 1, b"d" * 32), BackupClaim(0, 2, b"e" * 32))},
     {"backups": ((0, 1, b"d" * 32),)}, {"backups": (BackupClaim(0, 1, bytearray(32)),)},
     {"backups": tuple(BackupClaim(s, 1, b"d" * 32) for s in range(2, MAX_BACKUP_CLAIMS + 3))}],
)
def test_sign_refuses_invalid_fields(changes):
    from dataclasses import replace

    with pytest.raises(LocalProtocolError):
        sign_record(replace(BASE, **changes), ALICE)


def test_sign_refuses_oversize_record():
    from dataclasses import replace

    big = replace(BASE, addrs=("/dns4/" + "a" * (MAX_ADDR_CHARS - 6),) * MAX_ADDRS)
    with pytest.raises(LocalProtocolError, match="over"):
        sign_record(big, ALICE)


def test_record_helpers():
    assert BASE.expires_at == BASE.timestamp + 60.0
    assert [layer for layer in range(10) if BASE.serves(layer)] == [3, 4, 5, 6]
    assert BASE.is_fresh(BASE.timestamp) and BASE.is_fresh(BASE.expires_at - 0.001)
    assert not BASE.is_fresh(BASE.expires_at)
    assert FLAG_RELAYED & FLAG_TRAINING == 0


def test_stage_key_is_the_documented_hash():
    expected = hashlib.sha256(b"p2pswarm/stage/fdd1f91421b0282a/tiny-llama/12").digest()
    assert stage_key("tiny-llama", 12, "fdd1f91421b0282a") == expected
    assert expected == stage_key("tiny-llama", 12, "fdd1f91421b0282a")
    assert stage_key("tiny-llama", 12) == hashlib.sha256(b"p2pswarm/stage/" + UNNAMED_RUN.encode()
                                                         + b"/tiny-llama/12").digest()


@given(models_st, st.integers(0, MAX_LAYERS - 1), run_ids, models_st, st.integers(0, MAX_LAYERS - 1), run_ids)
def test_stage_key_differs_across_runs_models_and_layers(model_a, layer_a, run_a, model_b, layer_b, run_b):
    same = (model_a, layer_a, run_a) == (model_b, layer_b, run_b)
    assert (stage_key(model_a, layer_a, run_a) == stage_key(model_b, layer_b, run_b)) == same


@pytest.mark.parametrize(("model", "layer", "run"), [("m", -1, UNNAMED_RUN), ("m", MAX_LAYERS, UNNAMED_RUN),
                                                     ("m", True, UNNAMED_RUN), ("m", "1", UNNAMED_RUN),
                                                     ("", 0, UNNAMED_RUN), ("m", 0, "0" * 15),
                                                     ("m", 0, "F" * 16), ("m", 0, b"0" * 16), ("m", 0, "g" * 16)])
def test_stage_key_refuses_invalid_input(model, layer, run):
    with pytest.raises(LocalProtocolError):
        stage_key(model, layer, run)


@pytest.mark.parametrize("run", ["", "0" * 15, "0" * 17, "ABCDEF0123456789", "zzzzzzzzzzzzzzzz", 12, None, b"0" * 16])
def test_a_record_whose_run_is_not_an_identity_is_refused(run):
    from dataclasses import replace

    with pytest.raises(RemoteProtocolError, match="run"):
        verify_record(resign({**base_body(), "run": run}))
    with pytest.raises(LocalProtocolError, match="run"):
        sign_record(replace(BASE, run=run), ALICE)


def test_a_record_without_a_run_is_refused():
    body = base_body()
    del body["run"]
    with pytest.raises(RemoteProtocolError):
        verify_record(resign(body))


def test_the_run_is_signed():
    signed = cbor2.loads(sign_record(BASE, ALICE))
    other = {**signed["r"], "run": "0123456789abcdef"}
    with pytest.raises(RemoteProtocolError, match="not signed"):
        verify_record(cbor2.dumps({"v": RECORD_VERSION, "r": other, "s": signed["s"]}, canonical=True))


@given(st.lists(records(peer_ids=st.sampled_from(["a", "b", "c"])), max_size=8), st.randoms())
def test_best_first_ranks_and_ignores_input_order(items, rng):
    ranked = best_first(items)
    assert sorted(map(repr, ranked)) == sorted(map(repr, items))
    shuffled = list(items)
    rng.shuffle(shuffled)
    assert best_first(shuffled) == ranked
    def claims(record):
        cap = record.capacity
        return (cap.flags & FLAG_RELAYED > 0, min(cap.queue_depth, PLAUSIBLE_QUEUE_DEPTH),
                -min(cap.free_memory_mb, PLAUSIBLE_FREE_MEMORY_MB), -min(cap.throughput, PLAUSIBLE_THROUGHPUT),
                -record.timestamp, record.peer_id)

    for better, worse in itertools.pairwise(ranked):
        assert claims(better) <= claims(worse)
        assert routing_rank(better) <= routing_rank(worse)


@given(st.lists(records(peer_ids=st.sampled_from(["a", "b", "c", "d"])), max_size=6, unique_by=lambda r: r.peer_id))
def test_claims_beyond_plausible_rank_like_the_plausible_bound(items):
    """4 PB free, 10^12 tokens/s or a queue of 4 billion rank exactly like the PLAUSIBLE_* bounds."""
    def bounded(record):
        cap = record.capacity
        return dataclasses.replace(record, capacity=dataclasses.replace(
            cap, free_memory_mb=min(cap.free_memory_mb, PLAUSIBLE_FREE_MEMORY_MB),
            queue_depth=min(cap.queue_depth, PLAUSIBLE_QUEUE_DEPTH),
            throughput=min(cap.throughput, PLAUSIBLE_THROUGHPUT)))

    assert [r.peer_id for r in best_first(items)] == [r.peer_id for r in best_first(map(bounded, items))]


def test_best_first_example():
    def rec(peer, queue, mem, ts, flags=0):
        return StageRecord(peer, (), "m", 0, 0, 1, Capacity(mem, queue, flags), ts, 60.0)

    idle_small, busy_big = rec("a", 0, 100, 10.0), rec("b", 5, 10_000, 10.0)
    idle_big, idle_big_newer = rec("c", 0, 900, 10.0), rec("d", 0, 900, 11.0)
    idle_big_newer_z = rec("z", 0, 900, 11.0)
    idle_relayed = rec("r", 0, 10_000, 12.0, FLAG_RELAYED)
    items = [busy_big, idle_small, idle_big_newer_z, idle_big, idle_big_newer, idle_relayed]
    random.Random(0).shuffle(items)
    assert best_first(items) == [idle_big_newer, idle_big_newer_z, idle_big, idle_small, busy_big, idle_relayed]
