"""The DiLoCo protocol's messages (p2pswarm.diloco.messages) on the wire, and its shard and group helpers.

Every message round-trips through ``wire.encode_frame``/``decode_frame``; truncated, corrupted
and mutated frames decode to a message or raise RemoteProtocolError, nothing else; each field
out of its range is refused on receipt (RemoteProtocolError) and on sending (LocalProtocolError);
a Part or Result whose payload is not ``expected_bytes(codec, numel)`` is refused. The encoded
size formula and the codec list must equal those of ``diloco.compression``; ``shard_bounds``
must tile [0, numel) evenly; ``group_digest`` must name exactly (stage, round, set of members).
"""

from __future__ import annotations

import hashlib
import itertools
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm import wire
from p2pswarm.dht.records import MAX_STAGES
from p2pswarm.diloco import messages as m
from p2pswarm.diloco.messages import (
    CODECS,
    DIGEST_BYTES,
    INT8_CHUNK,
    MAX_MEMBERS,
    MAX_NUMEL,
    MAX_REASON_CHARS,
    Hello,
    Part,
    Reply,
    Result,
    expected_bytes,
    group_digest,
    shard_bounds,
)
from p2pswarm.errors import LocalProtocolError, RemoteProtocolError
from p2pswarm.testing.strategies import decodes_or_raises_remote_error, register_frames, run_bytes, unchecked_frame

FAST = settings(max_examples=150)
BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
PEER_IDS = st.text(alphabet=BASE58, min_size=1, max_size=64)
STAGES = st.integers(0, MAX_STAGES - 1)
ROUNDS = st.integers(0, m.MAX_ROUND)
SMALL_NUMEL = st.integers(0, 3000)  # spans several int8 chunks; payloads stay small
DIGESTS = st.binary(min_size=DIGEST_BYTES, max_size=DIGEST_BYTES)

HELLOS = st.builds(
    Hello, STAGES, ROUNDS, st.integers(1, MAX_NUMEL), st.sampled_from(CODECS), st.booleans(), st.booleans(),
    st.lists(PEER_IDS, max_size=MAX_MEMBERS, unique=True).map(lambda ids: tuple(sorted(ids))), run_bytes,
).map(lambda msg: (msg, b""))


@st.composite
def shard_frames(draw, cls):
    shards = draw(st.integers(2, MAX_MEMBERS))
    codec, numel = draw(st.sampled_from(CODECS)), draw(SMALL_NUMEL)
    extra = (draw(st.integers(1, shards)),) if cls is Result else ()
    msg = cls(draw(STAGES), draw(ROUNDS), draw(DIGESTS), draw(st.integers(0, shards - 1)), shards, codec, numel, *extra)
    size = expected_bytes(codec, numel, extra[0] if extra else 1)  # a sparse Result holds its contributors' entries
    return msg, draw(st.binary(min_size=size, max_size=size))


REPLIES = st.builds(Reply, ROUNDS, st.integers(0, MAX_MEMBERS - 1), st.booleans(),
                    st.text(max_size=MAX_REASON_CHARS)).map(lambda msg: (msg, b""))
STRATEGIES = {Hello: HELLOS, Part: shard_frames(Part), Result: shard_frames(Result), Reply: REPLIES}
for _cls, _strategy in STRATEGIES.items():  # tests/test_wire.py then covers these types too
    register_frames(_cls, _strategy)
FRAMES = st.one_of(*STRATEGIES.values())


def test_registered_under_their_names():
    types = wire.registered_types()
    assert [types[n] for n in ("diloco.hello", "diloco.part", "diloco.result", "diloco.reply")] == [
        Hello, Part, Result, Reply]
    assert m.PROTOCOL_ID == "/p2pswarm/diloco/1.0.0"


@FAST
@given(FRAMES)
def test_round_trip(pair):
    msg, payload = pair
    assert wire.decode_frame(wire.encode_frame(msg, payload)) == (msg, payload)


@settings(max_examples=40)
@given(FRAMES, st.data())
def test_every_truncation_is_refused(pair, data):
    frame = wire.encode_frame(*pair)
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(frame[:cut])


@FAST
@given(FRAMES, st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=3))
def test_corrupted_frames_decode_or_raise_remote_error(pair, flips):
    frame = bytearray(wire.encode_frame(*pair))
    for pos, byte in flips:
        frame[pos % len(frame)] = byte
    decodes_or_raises_remote_error(bytes(frame))


FIELDS = ["stage", "round", "numel", "codec", "ready", "closed", "members", "group", "shard", "shards",
          "contributors", "accepted", "reason"]


@FAST
@given(FRAMES, st.sampled_from(FIELDS),
       st.none() | st.integers() | st.binary(max_size=40) | st.text(max_size=8) | st.booleans()
       | st.lists(st.text(max_size=70), max_size=70) | st.lists(st.integers(-2, 2**40), max_size=4))
def test_mutated_fields_decode_or_raise_remote_error(pair, field, value):
    decodes_or_raises_remote_error(unchecked_frame(pair, fields={field: value}))


# --- field bounds -----------------------------------------------------------------------------

GOOD_HELLO = dict(stage=0, round=0, numel=10, codec="int8", ready=True, closed=True, members=("a", "b"))
GOOD_PART = dict(stage=0, round=0, group=b"g" * DIGEST_BYTES, shard=1, shards=2, codec="float32", numel=3)
BAD_HELLOS = {
    "negative stage": dict(stage=-1), "stage too large": dict(stage=MAX_STAGES),
    "negative round": dict(round=-1), "zero numel": dict(numel=0),
    "numel too large": dict(numel=m.MAX_STAGE_NUMEL + 1),  # a stage's numel: pieces stay within MAX_NUMEL
    "codec": dict(codec="float64"), "codec case": dict(codec="INT8"),
    "unsorted members": dict(members=("b", "a")), "duplicate members": dict(members=("a", "a")),
    "empty member": dict(members=("",)), "long member": dict(members=("x" * 65,)),
    "short run": dict(run=b"\0" * 7), "long run": dict(run=b"\0" * 9),
    "non-ascii member": dict(members=("é",)), "unprintable member": dict(members=("a\n",)),
    "too many members": dict(members=tuple(f"p{i:03}" for i in range(MAX_MEMBERS + 1))),
}
BAD_SHARDS = {
    "negative stage": dict(stage=-1), "stage too large": dict(stage=MAX_STAGES), "negative round": dict(round=-1),
    "short digest": dict(group=b"g" * 31), "long digest": dict(group=b"g" * 33),
    "one shard": dict(shards=1, shard=0), "too many shards": dict(shards=MAX_MEMBERS + 1),
    "negative shard": dict(shard=-1), "shard past shards": dict(shard=2), "codec": dict(codec="fp8"),
    "negative numel": dict(numel=-1), "numel too large": dict(numel=MAX_NUMEL + 1),
    "negative piece": dict(piece=-1), "piece too large": dict(piece=m.MAX_PIECES),
}


def refused(msg, payload=b""):
    with pytest.raises(RemoteProtocolError):
        msg.check(len(payload))
    with pytest.raises(LocalProtocolError):
        wire.encode_frame(msg, payload)


@pytest.mark.parametrize("name", sorted(BAD_HELLOS))
def test_out_of_range_hellos_are_refused(name):
    wire.encode_frame(Hello(**GOOD_HELLO))  # the good one passes
    refused(Hello(**dict(GOOD_HELLO, **BAD_HELLOS[name])))


@pytest.mark.parametrize("cls", [Part, Result])
@pytest.mark.parametrize("name", sorted(BAD_SHARDS))
def test_out_of_range_shard_messages_are_refused(cls, name):
    extra = {"contributors": 1} if cls is Result else {}
    wire.encode_frame(cls(**GOOD_PART, **extra), b"\0" * 12)
    refused(cls(**dict(GOOD_PART, **BAD_SHARDS[name]), **extra), b"\0" * 12)


@pytest.mark.parametrize("contributors", [-1, 0, 3])
def test_result_contributors_within_one_and_shards(contributors):
    refused(Result(**GOOD_PART, contributors=contributors), b"\0" * 12)


@pytest.mark.parametrize("reply", [Reply(-1, 0, True, ""), Reply(0, -1, True, ""), Reply(0, MAX_MEMBERS, True, ""),
                                   Reply(0, 0, False, "x" * (MAX_REASON_CHARS + 1))])
def test_out_of_range_replies_are_refused(reply):
    refused(reply)


@pytest.mark.parametrize("msg", [Hello(**GOOD_HELLO), Reply(0, 0, True, "")])
def test_status_messages_carry_no_payload(msg):
    refused(msg, b"x")


@given(st.sampled_from([Part, Result]).flatmap(shard_frames), st.integers(-64, 64).filter(bool))
def test_payload_not_matching_codec_and_numel_is_refused(pair, delta):
    msg, payload = pair
    wrong = payload + b"\0" * delta if delta > 0 else payload[:delta]
    if len(wrong) == len(payload):  # cutting an empty payload leaves it as it was
        return
    with pytest.raises(RemoteProtocolError, match="payload"):
        wire.decode_frame(unchecked_frame(pair, wrong))
    with pytest.raises(LocalProtocolError):
        wire.encode_frame(msg, wrong)


# --- sizes, shards, digests -------------------------------------------------------------------


def test_codecs_and_sizes_match_the_codecs():
    compression = pytest.importorskip("p2pswarm.diloco.compression")
    codec = pytest.importorskip("p2pswarm.diloco.codec")
    sparse = pytest.importorskip("p2pswarm.diloco.sparse")
    assert CODECS == codec.CODECS
    assert INT8_CHUNK == compression.INT8_CHUNK
    assert (m.SPARSE_CHUNK, m.SPARSE_TOP, m.SPARSE_SCALE_BYTES) == (sparse.SPARSE_CHUNK, sparse.SPARSE_TOP,
                                                                    sparse.SCALE_BYTES)
    assert MAX_NUMEL == compression.MAX_ELEMENTS and MAX_MEMBERS == codec.MAX_WIDTH
    for name in CODECS:
        for numel in [0, 1, 2, INT8_CHUNK - 1, INT8_CHUNK, INT8_CHUNK + 1, 5 * INT8_CHUNK + 7, 3 * m.SPARSE_CHUNK + 65,
                      MAX_NUMEL]:
            for width in (1, 2, 4, 63, MAX_MEMBERS):
                assert expected_bytes(name, numel, width) == codec.encoded_size(name, numel, width), (name, numel)


def test_a_sparse_part_is_under_one_percent_of_float32_and_a_result_holds_its_contributors_entries():
    n = 256 * m.SPARSE_CHUNK
    assert expected_bytes("sparse", n) / expected_bytes("float32", n) < 0.0075
    assert expected_bytes("sparse", n, 4) < 4 * expected_bytes("sparse", n)  # the scales are not repeated
    assert expected_bytes("sparse", n, MAX_MEMBERS) == expected_bytes("sparse", n, m.SPARSE_CHUNK // m.SPARSE_TOP)
    with pytest.raises(ValueError):
        expected_bytes("sparse", n, 0)


@given(st.sampled_from([c for c in CODECS if c != "sparse"]), st.integers(0, MAX_NUMEL))
def test_expected_bytes_formula(codec, numel):
    size = expected_bytes(codec, numel)
    per_element = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}[codec]
    scales = 4 * -(-numel // INT8_CHUNK) if codec == "int8" else 0
    assert size == per_element * numel + scales


@pytest.mark.parametrize("codec, numel", [("float64", 1), ("", 0), ("int8", -1), ("float32", 1.0)])
def test_expected_bytes_refuses_misuse(codec, numel):
    with pytest.raises(ValueError):
        expected_bytes(codec, numel)


@given(st.integers(0, 10**6), st.integers(1, MAX_MEMBERS))
def test_shard_bounds_tile_evenly(numel, n):
    bounds = shard_bounds(numel, n)
    assert len(bounds) == n and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("numel, n", [(-1, 2), (4, 0), (4, -1), (4.0, 2)])
def test_shard_bounds_refuses_misuse(numel, n):
    with pytest.raises(ValueError):
        shard_bounds(numel, n)


def test_shard_bounds_examples():
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]
    assert shard_bounds(0, 2) == [(0, 0), (0, 0)]


def test_group_digest_known_answer():
    expected = hashlib.sha256(
        b"p2pswarm/diloco-group/v1\n" + (3).to_bytes(8, "big") + (7).to_bytes(8, "big") + (2).to_bytes(2, "big")
        + (1).to_bytes(2, "big") + b"A" + (2).to_bytes(2, "big") + b"bc").digest()
    assert group_digest(3, 7, ["bc", "A"]) == expected
    assert len(expected) == DIGEST_BYTES


@given(STAGES, ROUNDS, st.lists(PEER_IDS, min_size=1, max_size=8, unique=True), st.randoms(use_true_random=False))
def test_group_digest_names_stage_round_and_member_set(stage, round, members, rnd):
    digest = group_digest(stage, round, members)
    shuffled = list(members)
    rnd.shuffle(shuffled)
    assert group_digest(stage, round, shuffled) == digest
    assert group_digest((stage + 1) % MAX_STAGES, round, members) != digest
    assert group_digest(stage, round ^ 1, members) != digest
    assert group_digest(stage, round, [*members, "zz" * 20]) != digest
    if len(members) > 1:
        assert group_digest(stage, round, members[1:]) != digest
    # member boundaries are length-prefixed: joining two ids never collides with one
    if len(members) == 2 and len(members[0] + members[1]) <= 64:
        assert group_digest(stage, round, [members[0] + members[1]]) != digest


@pytest.mark.parametrize("members", [[], ["a", "a"], [""], ["x" * 65], ["é"],
                                     [f"p{i}" for i in range(MAX_MEMBERS + 1)]])
def test_group_digest_refuses_invalid_groups(members):
    with pytest.raises(ValueError):
        group_digest(0, 0, members)


def test_imports_neither_torch_nor_trio():
    code = "import p2pswarm.diloco.messages, sys; assert not {'torch', 'trio'} & set(sys.modules), sys.modules.keys()"
    subprocess.run([sys.executable, "-c", code], check=True)
