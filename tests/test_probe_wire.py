"""The probe stream's messages, ``ProbeData`` and ``ProbeAck`` of ``p2pswarm/net/probe.py``, on the wire.

Round trips through ``wire.encode_frame``/``decode_frame``, the decoder's totality on garbage and
on mutated probe frames (a message or RemoteProtocolError, nothing else), and each message's
``check()``: a ProbeData chunk over PROBE_CHUNK and a ProbeAck with a payload or a negative count
are refused on receipt (RemoteProtocolError) and on sending (LocalProtocolError).
"""

from __future__ import annotations

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm import wire
from p2pswarm.errors import LocalProtocolError, RemoteProtocolError
from p2pswarm.net.probe import PROBE_CHUNK, ProbeAck, ProbeData

FAST = settings(max_examples=200, deadline=None)


def raw_frame(type_name: str, fields: dict, payload: bytes, n: int | None = None) -> bytes:
    """A frame built by hand, bypassing encode_frame's checks (a misbehaving peer's frame)."""
    header = cbor2.dumps({"t": type_name, "v": 1, "n": len(payload) if n is None else n, "f": fields},
                         canonical=True)
    return len(header).to_bytes(wire.HEADER_LENGTH_BYTES, "big") + header + payload


def test_probe_messages_are_registered():
    assert wire.registered_types()["probe-data"] is ProbeData
    assert wire.registered_types()["probe-ack"] is ProbeAck


# --- round trips ----------------------------------------------------------------------


@FAST
@given(last=st.booleans(), payload=st.binary(max_size=512))
def test_probe_data_round_trip(last, payload):
    msg = ProbeData(last=last)
    frame = wire.encode_frame(msg, payload)
    assert wire.decode_frame(frame, max_payload=PROBE_CHUNK) == (msg, payload)
    assert wire.decode_frame(frame) == (msg, payload)


@pytest.mark.parametrize("size", [0, 1, PROBE_CHUNK - 1, PROBE_CHUNK])
def test_probe_data_round_trip_at_the_chunk_limit(size):
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    frame = wire.encode_frame(ProbeData(last=True), payload)
    msg, got = wire.decode_frame(frame, max_payload=PROBE_CHUNK)
    assert msg == ProbeData(last=True) and got == payload


@FAST
@given(st.integers(0, wire.INT_MAX))
def test_probe_ack_round_trip(received):
    frame = wire.encode_frame(ProbeAck(received=received))
    assert wire.decode_frame(frame, max_payload=0) == (ProbeAck(received=received), b"")


def test_frames_are_canonical():
    """One encoding per message: the same message always gives the same bytes."""
    assert wire.encode_frame(ProbeData(last=False), b"ab") == raw_frame("probe-data", {"last": False}, b"ab")
    assert wire.encode_frame(ProbeAck(received=7)) == raw_frame("probe-ack", {"received": 7}, b"")


# --- the decoder is total --------------------------------------------------------------


def decodes_or_rejects(data: bytes, **kw) -> None:
    """decode_frame gives a registered message and its payload, or RemoteProtocolError."""
    try:
        msg, payload = wire.decode_frame(data, **kw)
    except RemoteProtocolError:
        return
    assert isinstance(msg, wire.Message) and type(msg) in wire.registered_types().values()
    assert isinstance(payload, bytes)
    assert wire.encode_frame(msg, payload) == bytes(data)  # it was a valid frame after all


@FAST
@given(st.binary(max_size=200))
def test_decode_arbitrary_bytes(data):
    decodes_or_rejects(data)
    decodes_or_rejects(data, max_payload=PROBE_CHUNK)


valid_probe_frames = st.one_of(
    st.builds(lambda last, p: wire.encode_frame(ProbeData(last=last), p), st.booleans(), st.binary(max_size=64)),
    st.builds(lambda n: wire.encode_frame(ProbeAck(received=n)), st.integers(0, wire.INT_MAX)),
)


@st.composite
def mutated_frames(draw):
    frame = bytearray(draw(valid_probe_frames))
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "set", "truncate", "extend", "insert", "delete"]))
        if how in ("flip", "set", "delete") and frame:
            i = draw(st.integers(0, len(frame) - 1))
            if how == "flip":
                frame[i] ^= 1 << draw(st.integers(0, 7))
            elif how == "set":
                frame[i] = draw(st.integers(0, 255))
            else:
                del frame[i]
        elif how == "truncate":
            del frame[draw(st.integers(0, len(frame))):]
        elif how == "extend":
            frame += draw(st.binary(min_size=1, max_size=8))
        elif how == "insert":
            i = draw(st.integers(0, len(frame)))
            frame[i:i] = draw(st.binary(min_size=1, max_size=4))
    return bytes(frame)


@settings(max_examples=400, deadline=None)
@given(mutated_frames())
def test_decode_mutated_probe_frames(data):
    decodes_or_rejects(data)
    decodes_or_rejects(data, max_payload=PROBE_CHUNK)
    decodes_or_rejects(data, max_payload=0)


@FAST
@given(valid_probe_frames, st.data())
def test_every_truncation_is_rejected(frame, data):
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(frame[:cut])
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(frame + b"\x00")  # a trailing byte the header does not announce


# --- check() ----------------------------------------------------------------------------


def test_oversized_probe_chunk_is_rejected():
    payload = bytes(PROBE_CHUNK + 1)
    frame = raw_frame("probe-data", {"last": True}, payload)
    with pytest.raises(RemoteProtocolError, match="probe chunk"):  # past the size limit, check() refuses it
        wire.decode_frame(frame, max_payload=PROBE_CHUNK + 1)
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(frame)
    with pytest.raises(RemoteProtocolError):  # the reader's limit refuses it first
        wire.decode_frame(frame, max_payload=PROBE_CHUNK)
    with pytest.raises(LocalProtocolError):
        wire.encode_frame(ProbeData(last=True), payload)
    with pytest.raises(LocalProtocolError):
        wire.encode_frame(ProbeData(last=False), payload)


@pytest.mark.parametrize("payload", [b"x", bytes(100)])
def test_probe_ack_with_a_payload_is_rejected(payload):
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(raw_frame("probe-ack", {"received": 5}, payload))
    with pytest.raises(LocalProtocolError):
        wire.encode_frame(ProbeAck(received=5), payload)


@pytest.mark.parametrize("received", [-1, -(2**63)])
def test_probe_ack_with_a_negative_count_is_rejected(received):
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(raw_frame("probe-ack", {"received": received}, b""))
    with pytest.raises(LocalProtocolError):
        wire.encode_frame(ProbeAck(received=received))


@pytest.mark.parametrize("type_name,fields", [
    ("probe-data", {"last": 1}),  # an int is not a bool
    ("probe-data", {"last": None}),
    ("probe-data", {}),
    ("probe-data", {"last": True, "extra": 1}),
    ("probe-ack", {"received": True}),  # a bool is not an int
    ("probe-ack", {"received": 1.0}),
    ("probe-ack", {"received": "5"}),
    ("probe-ack", {"received": 2**63}),  # outside signed 64-bit
    ("probe-ack", {"count": 5}),
])
def test_fields_of_the_wrong_shape_are_rejected(type_name, fields):
    with pytest.raises(RemoteProtocolError):
        wire.decode_frame(raw_frame(type_name, fields, b""))


def test_sending_fields_of_the_wrong_type_is_refused():
    with pytest.raises(LocalProtocolError):
        wire.encode_frame(ProbeData(last=1))
    with pytest.raises(LocalProtocolError):
        wire.encode_frame(ProbeAck(received=True))
    with pytest.raises(LocalProtocolError):
        wire.encode_frame(ProbeAck(received=2**63))
