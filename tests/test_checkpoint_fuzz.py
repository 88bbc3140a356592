"""The snapshot decoder is total: arbitrary bytes, mutations of real snapshots and forged safetensors
headers (with a valid digest, so the parser itself is reached) decode or raise RemoteProtocolError,
nothing else; whatever it accepts, the safetensors library reads the same way."""

from __future__ import annotations

import hashlib
import json

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.diloco.checkpoint import (
    FORMAT,
    HEADER_START,
    MAX_DEPTH,
    MAX_HEADER_BYTES,
    MAX_TENSORS,
    SAFETENSORS_DTYPES,
    decode_state,
    encode_state,
)
from p2pswarm.errors import RemoteProtocolError
from tests.test_checkpoint import same, states, tensors_in

FAST = settings(max_examples=60)
SLOW = settings(max_examples=25)
ZERO = "0" * 64
DIGEST_AT = 8 + len(HEADER_START)


def redigest(blob: bytes) -> bytes:
    """``blob`` with the digest its header's fixed place should hold (if it has that place)."""
    if blob[8:DIGEST_AT] != HEADER_START or len(blob) < DIGEST_AT + 64:
        return blob
    zeroed = blob[:DIGEST_AT] + ZERO.encode() + blob[DIGEST_AT + 64:]
    return blob[:DIGEST_AT] + hashlib.sha256(zeroed).hexdigest().encode() + blob[DIGEST_AT + 64:]


def forge(tree, table=(), data=b"", *, meta=None, raw_tree=None, pad=None, length=None, ascii=False) -> bytes:
    """A file around a header built from ``tree`` and ``table`` ((name, info) pairs), digest made valid."""
    metadata = {"format": FORMAT, "sha256": ZERO,
                "tree": raw_tree if raw_tree is not None else json.dumps(tree, separators=(",", ":"))}
    if meta is not None:
        metadata = meta
    body = json.dumps({"__metadata__": metadata, **dict(table)}, separators=(",", ":"), ensure_ascii=ascii)
    return frame(body.encode("utf-8"), data, pad=pad, length=length)


def frame(header: bytes, data: bytes = b"", *, pad=None, length=None) -> bytes:
    header += pad if pad is not None else b" " * (-len(header) % 8)
    return redigest((len(header) if length is None else length).to_bytes(8, "little") + header + data)


def decodes_or_refuses(blob: bytes) -> None:
    """The decoder's contract; when it accepts, the safetensors library reads the same tensors."""
    try:
        state = decode_state(blob)
    except RemoteProtocolError:
        return
    assert type(state) is dict
    loaded = safetensors.torch.load(bytes(blob))
    assert len(loaded) == len(tensors_in(state))


def info(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# --- arbitrary bytes and mutations -------------------------------------------------------------

PREFIXED = st.binary(max_size=300).map(lambda b: len(b).to_bytes(8, "little") + HEADER_START + b)


@FAST
@given(blob=st.binary(max_size=300) | PREFIXED | st.binary(max_size=300).map(lambda b: b"P2PSNAP1" + b))
def test_arbitrary_bytes_raise_remote_protocol_error(blob):
    with pytest.raises(RemoteProtocolError):
        decode_state(blob)
    decodes_or_refuses(redigest(blob))


@FAST
@given(state=states, change=st.data())
def test_a_flipped_byte_a_truncation_or_an_extension_is_refused(state, change):
    data = encode_state(state)
    how = change.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if how == "flip":
        index = change.draw(st.integers(0, len(data) - 1))
        bad = bytearray(data)
        bad[index] ^= change.draw(st.integers(1, 255))
        with pytest.raises(RemoteProtocolError) as err:
            decode_state(bytes(bad))
        if index >= DIGEST_AT:
            assert "digest" in str(err.value)  # caught by the hash, before anything is parsed
    elif how == "truncate":
        with pytest.raises(RemoteProtocolError):
            decode_state(data[:change.draw(st.integers(0, len(data) - 1))])
    else:
        with pytest.raises(RemoteProtocolError):
            decode_state(data + change.draw(st.binary(min_size=1, max_size=40)))


@SLOW
@given(state=states, change=st.data())
def test_mutations_with_a_repaired_digest_decode_or_raise_remote_protocol_error(state, change):
    """Past the digest: bit flips, cuts and insertions anywhere, the digest made to match again."""
    blob = bytearray(encode_state(state))
    for _ in range(change.draw(st.integers(1, 4))):
        at = change.draw(st.integers(0, len(blob)))
        how = change.draw(st.sampled_from(["flip", "cut", "insert"]))
        if how == "flip" and at < len(blob):
            blob[at] ^= 1 << change.draw(st.integers(0, 7))
        elif how == "cut":
            del blob[at:at + change.draw(st.integers(1, 16))]
        else:
            blob[at:at] = change.draw(st.binary(min_size=1, max_size=8) | st.sampled_from([b'"', b"[", b"0", b" "]))
    decodes_or_refuses(redigest(bytes(blob)))


# --- forged headers ----------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=4),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c, max_size=3),
    max_leaves=12,
)
node_like = st.recursive(
    json_values | st.builds(lambda kind, s: [kind, s], st.integers(3, 5), st.text(max_size=8)),
    lambda c: st.builds(lambda kind, rest: [kind, *rest], st.integers(-1, 6), st.lists(c, max_size=4)),
    max_leaves=12,
)
names = st.sampled_from(["a", "b", "a/0", "__metadata__", ""]) | st.text(max_size=4)
infos = st.builds(info, st.sampled_from([*SAFETENSORS_DTYPES.values(), "F8_E4M3", "U64", 3, None]),
                  st.lists(st.integers(-1, 2**33), max_size=3), st.integers(-8, 72), st.integers(-8, 72))
entries = st.lists(st.tuples(names, infos | json_values), max_size=4)


@SLOW
@given(tree=node_like, table=entries, data=st.binary(max_size=72), raw=st.none() | st.text(max_size=40))
def test_forged_headers_with_a_valid_digest_decode_or_raise_remote_protocol_error(tree, table, data, raw):
    decodes_or_refuses(forge(tree, table, data, raw_tree=raw))


@SLOW
@given(state=states, table=entries, data=st.binary(max_size=32))
def test_a_real_tree_with_a_forged_table_decodes_or_raises_remote_protocol_error(state, table, data):
    real = json.loads(json.loads(_header(encode_state(state)))["__metadata__"]["tree"])
    decodes_or_refuses(forge(real, table, data))


def _header(data: bytes) -> str:
    return data[8:8 + int.from_bytes(data[:8], "little")].decode()


TREE = [2, "a", [3, "a"], "b", [3, "b"]]
TABLE = [("b", info("I64", [1], 0, 8)), ("a", info("F32", [3], 8, 20))]  # 8-byte items first
DATA = bytes(range(8)) + bytes(range(12))


def deep(n):
    """A tree of ``n`` containers: a dict holding n - 1 nested lists."""
    node = [0]
    for _ in range(n - 2):
        node = [0, node]
    return [2, "x", node]


def with_info(name, **changes):
    return [(n, {**i, **changes} if n == name else i) for n, i in TABLE]


CRAFTED = {  # name: the blob; each breaks exactly one rule
    "unknown dtype": forge(TREE, with_info("a", dtype="F8_E4M3"), DATA),
    "dtype not a str": forge(TREE, with_info("a", dtype=4), DATA),
    "negative dim": forge(TREE, with_info("a", shape=[-3]), DATA),
    "bool dim": forge(TREE, with_info("a", shape=[True, 3]), DATA),
    "too many dims": forge(TREE, with_info("a", shape=[1] * 17 + [3]), DATA),
    "overlap": forge(TREE, with_info("a", data_offsets=[4, 16]), DATA),
    "gap": forge(TREE, with_info("a", data_offsets=[12, 24]), DATA + bytes(4)),
    "canonical order broken": forge(TREE, [("a", info("F32", [3], 0, 12)), ("b", info("I64", [1], 12, 20))],
                                    DATA[8:] + DATA[:8]),
    "offsets out of the header's order": forge(TREE, TABLE[::-1], DATA),
    "offsets not the shape's": forge(TREE, with_info("a", data_offsets=[8, 19]), DATA[:-1]),
    "offsets of 3": forge(TREE, with_info("a", data_offsets=[8, 20, 20]), DATA),
    "offsets not ints": forge(TREE, with_info("a", data_offsets=[8.0, 20]), DATA),
    "data short": forge(TREE, TABLE, DATA[:-1]),
    "data long": forge(TREE, TABLE, DATA + bytes(8)),
    "huge tensor": forge([2, "a", [3, "a"]], [("a", info("F32", [2**20, 2**20], 0, 2**42))]),
    "huge empty tensor": forge([2, "a", [3, "a"]], [("a", info("F32", [0, 2**40, 2**40], 0, 0))]),
    "too many tensors": forge([2], [(f"t{i}", info("U8", [0], 0, 0)) for i in range(MAX_TENSORS + 1)]),
    "entry with an extra key": forge(TREE, with_info("a", extra=1), DATA),
    "entry not a map": forge(TREE, [TABLE[0], ("a", [1, 2])], DATA),
    "duplicate tensor name": frame(_header(forge(TREE, TABLE, DATA)).rstrip().encode()[:-1]
                                   + b',"a":' + json.dumps(TABLE[1][1], separators=(",", ":")).encode() + b"}", DATA),
    "bool byte 2": forge([2, "a", [3, "a"]], [("a", info("BOOL", [2], 0, 2))], b"\x01\x02"),
    "reference not its path": forge([2, "a", [3, "b"], "b", [3, "a"]], TABLE, DATA),
    "reference twice": forge([2, "a", [3, "a"], "b", [3, "a"]], TABLE, DATA),
    "reference missing": forge([2, "a", [3, "a"]], TABLE, DATA),
    "reference to no tensor": forge([2, "a", [3, "a"], "b", [3, "b"], "c", [3, "c"]], TABLE, DATA),
    "reference not a str": forge([2, "a", [3, 0]], [("a", info("F32", [3], 0, 12))], DATA[8:]),
    "top level not a dict": forge([0, 1, 2]),
    "top level a tensor": forge([3, "a"], [("a", info("U8", [1], 0, 1))], b"\x01"),
    "unknown kind": forge([2, "a", [7, 1]]),
    "kind not an int": forge([2, "a", ["list", 1]]),
    "kind a bool": forge([2, "a", [True, 1]]),
    "empty node": forge([2, "a", []]),
    "odd dict": forge([2, "a"]),
    "duplicate key": forge([2, "a", 1, "a", 2]),
    "bool key": forge([2, True, 1]),
    "float key": forge([2, [4, "0x1.8000000000000p+0"], 1]),
    "map in the tree": forge([2, "a", {"b": 1}]),
    "bare JSON float": forge([2, "a", 1.5]),
    "JSON float past the range": forge(None, raw_tree='[2,"a",1e999]'),
    "NaN constant": forge(None, raw_tree='[2,"a",NaN]'),
    "float not canonical": forge([2, "a", [4, "0x1p0"]]),
    "float not hex": forge([2, "a", [4, "one"]]),
    "float exponent overflow": forge([2, "a", [4, "0x1p99999"]]),
    "bytes not canonical": forge([2, "a", [5, "AQ"]]),
    "bytes not base64": forge([2, "a", [5, "!!!!"]]),
    "int past 64 bits": forge([2, "a", 2**63]),
    "int below 64 bits": forge([2, "a", -(2**63) - 1]),
    "key past 64 bits": forge([2, 2**63, 1]),
    "int of 5000 digits": forge(None, raw_tree='[2,"a",' + "9" * 5000 + "]"),
    "too deep": forge(deep(MAX_DEPTH + 1)),
    "JSON nested past recursion": forge(None, raw_tree="[" * 100_000),
    "tree not canonical": forge(None, raw_tree='[2, "a", 1]'),
    "tree escape not canonical": forge(None, raw_tree='[2,"\\u0061",1]'),
    "tree not JSON": forge(None, raw_tree="[2,"),
    "lone surrogate in a str": forge(None, raw_tree='[2,"a","\\ud800"]'),
    "lone surrogate in a name": forge([2, "\ud800", [3, "\ud800"]], [("\ud800", TABLE[0][1])], DATA[:8], ascii=True),
    "metadata with an extra key": forge([2], meta={"format": FORMAT, "sha256": ZERO, "tree": "[2]", "x": ""}),
    "metadata without the tree": forge([2], meta={"format": FORMAT, "sha256": ZERO, "trees": "[2]"}),
    "metadata tree not a str": forge([2], meta={"format": FORMAT, "sha256": ZERO, "tree": [2]}),
    "header not canonical": frame(_header(forge([2])).rstrip().encode()[:-1] + b' }'),
    "padding with a tab": forge([2], pad=b"\t" * (-len(_header(forge([2])).rstrip()) % 8 or 8)),
    "padding of 8 more": forge([2], pad=b" " * ((-len(_header(forge([2])).rstrip()) % 8) + 8)),
    "header not JSON": frame(HEADER_START + ZERO.encode() + b'","tree":"[2]"}{'),
    "header length past the end": forge([2], length=2**63),
    "header length one past": forge([2], length=len(_header(forge([2]))) + 1),
    "header length too small": forge([2], length=8),
    "header length past the limit": forge([2], length=MAX_HEADER_BYTES + 1),
    "other format": frame(HEADER_START.replace(FORMAT.encode(), b"p2pswarm-snapshot/3") + ZERO.encode()
                          + b'","tree":"[2]"}}'),
    "a safetensors file of no format": safetensors.torch.save({"w": torch.zeros(2)}),
    "older format": b"P2PSNAP1" + bytes(100),
    "empty": b"",
}


def test_the_crafted_baseline_decodes():
    state = decode_state(forge(TREE, TABLE, DATA))
    assert torch.equal(state["a"], torch.frombuffer(bytearray(DATA[8:]), dtype=torch.float32))
    assert state["b"].tolist() == [int.from_bytes(DATA[:8], "little")]
    lists = []
    for _ in range(MAX_DEPTH - 2):
        lists = [lists]
    assert same({"x": lists}, decode_state(forge(deep(MAX_DEPTH))))
    assert decode_state(forge([2, "f", [4, "0x1.8000000000000p+0"], "b", [5, "AQ=="]])) == {"f": 1.5, "b": b"\x01"}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_snapshots_with_a_valid_digest_are_refused(name):
    with pytest.raises(RemoteProtocolError):
        decode_state(CRAFTED[name])


def test_the_size_limit_is_checked_before_anything_else():
    data = encode_state({"w": torch.zeros(100)})
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        decode_state(data, max_bytes=len(data) - 1)
    assert decode_state(data, max_bytes=len(data))["w"].shape == (100,)
