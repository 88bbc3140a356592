"""The wire format: round trips, totality of the decoder on garbage, truncation, limits, tensors."""

import subprocess
import sys

import cbor2
import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm import wire
from p2pswarm.errors import LocalProtocolError, RemoteProtocolError
from p2pswarm.swarm import codec  # tensors as frames and back: the activation codec's
from p2pswarm.testing.strategies import frames, messages
from p2pswarm.wire import ErrorReply, Message, Ping, Pong, TensorFrame, message

FAST = settings(max_examples=60, deadline=None)


@message("test-wire.kitchen-sink")
class KitchenSink(Message):
    """Every supported field type, so the registry-wide round trip covers all of them."""

    i: int
    x: float
    b: bool
    s: str
    raw: bytes
    maybe: int | None
    ints: tuple[int, ...]
    strs: tuple[str, ...]
    blobs: tuple[bytes, ...] | None


class FakeStream:
    """An in-memory stream: reads return at most ``chunk`` bytes, ``pos`` counts bytes read."""

    def __init__(self, data=b"", chunk=1 << 30):
        self.data, self.pos, self.chunk, self.written = bytes(data), 0, chunk, []

    async def read(self, n):
        out = self.data[self.pos : self.pos + min(n, self.chunk)]
        self.pos += len(out)
        return out

    async def write(self, data):
        self.written.append(bytes(data))


def read_all(data, chunk=1 << 30):
    async def main():
        stream, out = FakeStream(data, chunk), []
        while (frame := await wire.read_frame(stream)) is not None:
            out.append(frame)
        return out

    return trio.run(main)


def header(t="ping", v=1, n=0, f=None, **extra):
    fields = {"nonce": 1} if f is None else f
    return cbor2.dumps({"t": t, "v": v, "n": n, "f": fields, **extra}, canonical=True)


def bytes_frame(payload):
    return TensorFrame("raw", "uint8", (len(payload),)), payload


def framed(head):
    return len(head).to_bytes(4, "big") + head


def decodes_canonically_or_raises_remote_error(data, decode=wire.decode_frame):
    try:
        msg, rest = decode(data)
    except RemoteProtocolError:
        return
    if decode is wire.decode_frame:  # whatever is accepted has exactly this one encoding
        assert wire.encode_frame(msg, rest) == data


@FAST
@given(frames())
def test_round_trip_every_registered_type(pair):
    assert wire.decode_frame(wire.encode_frame(*pair)) == pair


@pytest.mark.parametrize("cls", [Ping, Pong, ErrorReply, TensorFrame, KitchenSink])
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_round_trip_each_type(cls, data):
    msg, payload = data.draw(frames(cls))
    assert data.draw(messages(cls)).TYPE == cls.TYPE
    assert wire.decode_frame(wire.encode_frame(msg, payload)) == (msg, payload)
    assert read_all(wire.encode_frame(msg, payload), chunk=1) == [(msg, payload)]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_only_remote_error(data):
    decodes_canonically_or_raises_remote_error(data)
    decodes_canonically_or_raises_remote_error(data, wire.decode_header)


SINK = dict(i=1, x=1.0, b=True, s="", raw=b"", maybe=None, ints=[], strs=[], blobs=None)
BAD_HEADERS = {  # name: (header bytes, what the error must say)
    "unknown type": (header(t="no-such-type"), "unknown message type"),
    "wrong version": (header(v=2), "version"),
    "bool version": (header(v=True), "version"),
    "extra key": (header(x=1), "exactly the keys"),
    "missing key": (cbor2.dumps({"t": "ping", "v": 1, "n": 0}, canonical=True), "exactly the keys"),
    "not a map": (cbor2.dumps([1, 2]), "exactly the keys"),
    "extra field": (header(f={"nonce": 1, "x": 2}), "schema"),
    "missing field": (header(f={}), "schema"),
    "fields not a map": (header(f=[1]), "schema"),
    "bool in int field": (header(f={"nonce": True}), "expected int, got bool"),
    "float in int field": (header(f={"nonce": 1.0}), "expected int, got float"),
    "null field": (header(f={"nonce": None}), "may not be None"),
    "int too big": (header(f={"nonce": 2**63}), "signed 64-bit"),
    "int in float field": (header(t="test-wire.kitchen-sink", f=dict(SINK, x=1)), "expected float"),
    "nan in float field": (header(t="test-wire.kitchen-sink", f=dict(SINK, x=float("nan"))), "finite"),
    "str not tuple": (header(t="test-wire.kitchen-sink", f=dict(SINK, strs="ab")), "expected a tuple"),
    "too many items": (header(t="test-wire.kitchen-sink", f=dict(SINK, ints=[0] * 1025)), "items"),
    "tuple not str": (header(t="error", f={"code": ["a"], "detail": "x"}), "expected str, got list"),
    "negative length": (header(n=-1), "payload length"),
    "length over limit": (header(n=wire.MAX_PAYLOAD_BYTES + 1), "payload length"),
    "epoch tag": (header(f={"nonce": cbor2.CBORTag(1, 0)}), "not valid CBOR"),
    "bignum tag": (header(f={"nonce": cbor2.CBORTag(2, b"\x01")}), "not valid CBOR"),
    "set tag": (header(n=cbor2.CBORTag(258, [1])), "not valid CBOR"),
    "unknown tag": (header(f={"nonce": cbor2.CBORTag(9999, 1)}), "not valid CBOR"),
    "self-describe tag": (cbor2.dumps(cbor2.CBORTag(55799, cbor2.loads(header()))), "not valid CBOR"),
    "undefined": (header(f={"nonce": cbor2.undefined}), "got UndefinedType"),
    "simple value": (header(f={"nonce": cbor2.CBORSimpleValue(16)}), "got CBORSimpleValue"),
    "non-shortest int": (header()[:-1] + b"\x18\x01", "canonical"),
    "key order": (cbor2.dumps({"v": 1, "t": "ping", "n": 0, "f": {"nonce": 1}}), "canonical"),
    "trailing byte": (header() + b"\x00", "canonical"),
    "indefinite array": (bytes.fromhex("a1616e9f00ff"), "not valid CBOR"),
    "duplicate key": (bytes.fromhex("a2616e00616e00"), "not valid CBOR"),
    "huge declared array": (bytes.fromhex("a1616e9b7fffffffffffffff"), "not valid CBOR"),
    "deeply nested": (b"\x81" * 5000 + b"\x00", "not valid CBOR"),
    "invalid utf-8": (bytes.fromhex("a1617462fffe"), "not valid CBOR"),
    "empty": (b"", "not valid CBOR"),
    "ping payload": (header(n=1), "no payload"),
    "tensor size": (header(t="tensor", n=3, f={"name": "", "dtype": "int32", "shape": [1]}), "not 3"),
}


@pytest.mark.parametrize("name", sorted(BAD_HEADERS))
def test_structured_garbage_is_rejected(name):
    head, reason = BAD_HEADERS[name]
    with pytest.raises(RemoteProtocolError, match=reason):
        wire.decode_header(head)
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(framed(head))


VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


@FAST
@given(frames(), st.sampled_from(["t", "v", "n", "f", "x"]), st.text(max_size=6), VALUES)
def test_mutated_headers_raise_only_remote_error(pair, key, field, value):
    raw = cbor2.loads(wire.encode_frame(*pair)[4:])
    for mutated in (dict(raw, **{key: value}), dict(raw, f=dict(raw["f"], **{field: value}))):
        decodes_canonically_or_raises_remote_error(cbor2.dumps(mutated, canonical=True), wire.decode_header)


@FAST
@given(frames(), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=3))
def test_corrupted_frames_raise_only_remote_error(pair, flips):
    frame = bytearray(wire.encode_frame(*pair))
    for pos, byte in flips:
        frame[pos % len(frame)] = byte
    decodes_canonically_or_raises_remote_error(bytes(frame))


@settings(max_examples=30, deadline=None)
@given(frames())
def test_every_strict_prefix_is_rejected(pair):
    frame = wire.encode_frame(*pair)

    async def read_prefix(n):
        return await wire.read_frame(FakeStream(frame[:n]))

    async def main():
        assert await read_prefix(0) is None
        for n in range(1, len(frame)):
            with pytest.raises(RemoteProtocolError):
                await read_prefix(n)

    for n in range(len(frame)):
        with pytest.raises(RemoteProtocolError):
            wire.decode_frame(frame[:n])
    trio.run(main)


def test_oversize_lengths_are_rejected_before_reading():
    too_long = FakeStream((wire.MAX_HEADER_BYTES + 1).to_bytes(4, "big") + b"\xa0" * 100)
    frame = wire.encode_frame(*bytes_frame(b"x" * 100))
    too_big = FakeStream(frame)
    for stream, max_payload, stops_at in [(too_long, 100, 4), (too_big, 99, len(frame) - 100)]:
        with pytest.raises(RemoteProtocolError):
            trio.run(lambda stream=stream, max_payload=max_payload: wire.read_frame(stream, max_payload=max_payload))
        assert stream.pos == stops_at  # nothing read (or allocated) past the offending length
        with pytest.raises(RemoteProtocolError):
            wire.decode_frame(stream.data, max_payload=max_payload)


@FAST
@given(st.lists(frames(), max_size=4))
def test_back_to_back_frames_byte_by_byte(pairs):
    data = b"".join(wire.encode_frame(m, p) for m, p in pairs)
    assert read_all(data) == read_all(data, chunk=1) == pairs
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(data + data[:1])  # trailing bytes after one frame


def test_write_frame_small_and_large_payloads():
    small, big = bytes_frame(b"abc"), bytes_frame(b"y" * (wire.COALESCE_BYTES + 1))

    async def main():
        stream = FakeStream()
        await wire.write_frame(stream, *small)
        await wire.write_frame(stream, *big)
        return stream.written

    written = trio.run(main)
    assert written[0] == wire.encode_frame(*small) and len(written) == 3
    assert written[2] is big[1]  # the large payload is written as is, not copied
    assert read_all(b"".join(written)) == [small, big]


@pytest.mark.parametrize("msg, payload", [
    (Ping(True), b""), (Ping(1.0), b""), (Ping(2**63), b""), (Ping(None), b""),
    (ErrorReply("x" * (wire.MAX_STR_BYTES + 1), ""), b""), (ErrorReply("\ud800", ""), b""),
    (TensorFrame("w", "float32", (2,)), b"\x00" * 7), (TensorFrame("w", "complex64", ()), b""),
    (KitchenSink(1, 1, True, "", b"", None, (), (), None), b""),  # int in a float field
    (KitchenSink(1, 1.0, True, "", b"", None, [1], (), None), b""),  # list, not tuple
    (KitchenSink(1, 1.0, True, "", b"", None, (1,) * (wire.MAX_ITEMS + 1), (), None), b""),
    (KitchenSink(1, 1.0, True, "", b"", None, (), ("s" * 4000,) * 5, None), b""),  # header size
    (Ping(1), "not bytes"), (Ping(1), b"x"), (object(), b""),
])
def test_encode_rejects_invalid_messages(msg, payload):
    with pytest.raises(LocalProtocolError):
        wire.encode_frame(msg, payload)


def test_registration_rules():
    with pytest.raises(ValueError):
        message("ping")(type("Dup", (Message,), {"__annotations__": {"nonce": int}}))
    for bad in (list, dict[str, int], tuple[float, ...], int | str, tuple[int, int]):
        with pytest.raises(TypeError):
            message("test-wire.bad")(type("Bad", (Message,), {"__annotations__": {"x": bad}}))
    assert "test-wire.bad" not in wire.registered_types()
    assert wire.registered_types()["ping"] is Ping and Ping.VERSION == 1


@pytest.mark.parametrize("dtype", sorted(wire.DTYPE_SIZES))
def test_tensor_round_trip(dtype):
    for shape in [(), (0,), (3,), (2, 3, 4), (2, 0, 5)]:
        tensor = (torch.randn(shape) * 100).to(getattr(torch, dtype))
        frame, payload = tensor_frame = codec.tensor_to_frame("w", tensor)
        assert (frame.dtype, frame.shape, len(payload)) == (dtype, shape, tensor.nbytes)
        msg, got = wire.decode_frame(wire.encode_frame(*tensor_frame))
        out = codec.frame_to_tensor(msg, got)
        assert out.dtype == tensor.dtype and torch.equal(out, tensor)
        out.zero_()  # the tensor owns writable memory; the payload is untouched
        assert got == payload
    strided = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()
    assert torch.equal(codec.frame_to_tensor(*codec.tensor_to_frame("t", strided)), strided)
    assert codec.tensor_to_frame("x", torch.tensor([1.0]))[1] == b"\x00\x00\x80\x3f"  # little-endian
    with pytest.raises(LocalProtocolError):
        codec.tensor_to_frame("b", torch.tensor([True]))


@pytest.mark.parametrize("dtype, shape, nbytes", [
    ("float32", (2,), 7), ("float32", (2,), 9), ("complex64", (1,), 8), ("float32", (-1, -1), 4),
    ("int8", (1,) * 9, 1), ("int8", (True,), 1), ("int8", [1], 1), ("int64", (2**62, 2**62), 8),
    ("int8", (0, 2**63), 1),
])
def test_check_tensor_rejects(dtype, shape, nbytes):
    with pytest.raises(RemoteProtocolError):
        wire.check_tensor(dtype, shape, nbytes)
    with pytest.raises(RemoteProtocolError):
        codec.frame_to_tensor(TensorFrame("w", dtype, shape), b"\x00" * nbytes)


def test_import_pulls_in_neither_torch_nor_trio():
    code = "import p2pswarm.wire, sys; assert not {'torch', 'trio'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


HUGE_DIMS = [2**31 - 1, 2**31, 2**32, 3036988439, 3037012561, 2**62, wire.INT_MAX]
dims = st.one_of(st.integers(0, 6), st.sampled_from(HUGE_DIMS), st.integers(0, wire.INT_MAX), st.integers(-3, -1))
dtypes = st.one_of(st.sampled_from(sorted(wire.DTYPE_SIZES)), st.text(max_size=10),
                   st.sampled_from(["bool", "complex64"]))


def small_size(dtype: str, shape: tuple[int, ...]) -> int | None:
    """The payload size the shape asks for, when it is small enough to allocate in a test."""
    size = wire.DTYPE_SIZES.get(dtype, 1)
    for dim in shape:
        size *= max(dim, 0)
    return size if size <= 4096 else None


@settings(max_examples=500, deadline=None)
@given(dtypes, st.lists(dims, max_size=wire.MAX_TENSOR_DIMS + 1).map(tuple), st.data())
def test_frame_to_tensor_is_total(dtype, shape, data):
    """Any dtype string, shape (zeros, huge dims) and payload length: a tensor of exactly that
    shape, or RemoteProtocolError, nothing else."""
    fitting = small_size(dtype, shape)
    nbytes = data.draw(st.integers(0, 64) if fitting is None else st.sampled_from([fitting, fitting + 1, 0]))
    try:
        tensor = codec.frame_to_tensor(TensorFrame("w", dtype, shape), bytes(nbytes))
    except RemoteProtocolError:
        return
    assert tuple(tensor.shape) == shape and str(tensor.dtype) == f"torch.{dtype}"
    assert tensor.nbytes == nbytes


@pytest.mark.parametrize("dtype", sorted(wire.DTYPE_SIZES))
def test_empty_tensor_with_huge_other_dims_is_refused(dtype):
    """One dim 0 and the others near 2**31: torch's stride arithmetic overflows; we refuse first."""
    frame = TensorFrame("w", dtype, (0, 3036988439, 3037012561))
    with pytest.raises(RemoteProtocolError, match="too large"):
        codec.frame_to_tensor(frame, b"")
    with pytest.raises(RemoteProtocolError, match="too large"):
        wire.decode_frame(framed(header(
            t="tensor", n=0, f={"name": "w", "dtype": dtype, "shape": [0, 3036988439, 3037012561]})))
