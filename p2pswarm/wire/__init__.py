"""The wire format: how every p2pswarm message becomes bytes on a stream, and back.

Every protocol speaks in frames, ``u32 big-endian header length | CBOR header | payload``.
Putting the rules in one module gives every protocol the same strict, total decoder. A
peer's bytes become a registered ``Message`` or a ``RemoteProtocolError``, and no other
exception escapes. It also gives one set of limits, checked before anything is read or
allocated, and exactly one encoding per message (the decoder re-encodes and compares).
``docs/protocols.md`` is the normative description; the constants below are its limits.

Pure: no trio, no torch, so any process can use it cheaply. ``schema`` says what may travel
(message classes, fields, limits), ``messages`` holds the generic messages (``TensorFrame``,
``Ping``, ``Pong``, ``ErrorReply``); this module turns them into frames and back. Turning tensors
into frames is ``swarm/codec.py``'s.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any

import cbor2

from p2pswarm.errors import LocalProtocolError, RemoteProtocolError
from p2pswarm.wire.messages import (
    QUANTIZED_BITS,
    SCALE_BYTES,
    ErrorReply,
    Ping,
    Pong,
    TensorFrame,
    check_tensor,
    quantized_row_bytes,
)
from p2pswarm.wire.schema import (
    DTYPE_SIZES,
    INT_MAX,
    INT_MIN,
    MAX_BYTES_FIELD,
    MAX_ITEMS,
    MAX_PAYLOAD_BYTES,
    MAX_STR_BYTES,
    MAX_TENSOR_DIMS,
    Field,
    Message,
    check_value,
    fields_of,
    lookup,
    message,
    registered_types,
)

__all__ = [  # the wire's whole interface: every protocol uses these as ``wire.NAME``
    "COALESCE_BYTES", "DTYPE_SIZES", "HEADER_LENGTH_BYTES", "INT_MAX", "INT_MIN", "MAX_BYTES_FIELD",
    "MAX_CBOR_DEPTH", "MAX_HEADER_BYTES", "MAX_ITEMS", "MAX_PAYLOAD_BYTES", "MAX_STR_BYTES", "MAX_TENSOR_DIMS",
    "QUANTIZED_BITS", "SCALE_BYTES",
    "ErrorReply", "Field", "Message", "Ping", "Pong", "TensorFrame", "check_outgoing", "check_tensor",
    "decode_frame", "decode_header", "encode_frame", "fields_of", "message", "quantized_row_bytes", "read_exactly",
    "read_frame", "read_header", "read_rest_of_header", "registered_types", "write_frame",
]

HEADER_LENGTH_BYTES = 4  # u32 length prefix: far more than MAX_HEADER_BYTES, fixed width
MAX_HEADER_BYTES = 16 * 1024  # a header holds small metadata; bulk data belongs in the payload
MAX_CBOR_DEPTH = 3  # header map > field map > tuple: anything nested deeper is not a header
COALESCE_BYTES = 64 * 1024  # payloads up to this size go out in the same write as the header

_HEADER_KEYS = frozenset({"t", "v", "n", "f"})


# --- encoding -------------------------------------------------------------------------


def _dump_header(msg: Message, payload_len: int) -> bytes:
    values = {f.name: getattr(msg, f.name) for f in fields_of(type(msg))}
    header = {"t": msg.TYPE, "v": msg.VERSION, "n": payload_len, "f": values}
    return cbor2.dumps(header, canonical=True)


def _encode_prefix(msg: Message, payload: bytes) -> bytes:
    """Validate an outgoing message; return its length prefix and header."""
    if not isinstance(msg, Message) or lookup(getattr(msg, "TYPE", "")) is not type(msg):
        raise LocalProtocolError(f"{type(msg).__name__} is not a registered message")
    fields = fields_of(type(msg))
    if not isinstance(payload, (bytes, bytearray)):
        raise LocalProtocolError(f"payload must be bytes, not {type(payload).__name__}")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise LocalProtocolError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    for field in fields:
        check_value(field, getattr(msg, field.name), LocalProtocolError)
    try:
        msg.check(len(payload))
    except RemoteProtocolError as e:
        raise LocalProtocolError(f"refusing to send an invalid {msg.TYPE}: {e}") from e
    header = _dump_header(msg, len(payload))
    if len(header) > MAX_HEADER_BYTES:
        raise LocalProtocolError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    return len(header).to_bytes(HEADER_LENGTH_BYTES, "big") + header


def check_outgoing(msg: Message, payload: bytes = b"") -> None:
    """LocalProtocolError if the protocol forbids sending ``msg`` with ``payload`` (too big, say);
    builds the header only, never a copy of the payload."""
    _encode_prefix(msg, payload)


def encode_frame(msg: Message, payload: bytes = b"") -> bytes:
    """The complete frame for ``msg``; LocalProtocolError if the protocol forbids sending it."""
    return _encode_prefix(msg, payload) + payload


async def write_frame(stream: Any, msg: Message, payload: bytes = b"") -> None:
    """Send one frame on ``stream`` (any object with ``async write(data)``)."""
    prefix = _encode_prefix(msg, payload)
    if len(payload) <= COALESCE_BYTES:
        await stream.write(prefix + payload)
    else:  # do not copy a large payload just to join it to the header
        await stream.write(prefix)
        await stream.write(payload)


# --- decoding -------------------------------------------------------------------------


def _reject_tag(*args: Any) -> typing.NoReturn:
    raise ValueError("CBOR tags are not allowed in a header")


class _NoTags(Mapping):
    """A semantic-decoder table that maps every tag to a rejection, overriding cbor2's own."""

    def __getitem__(self, tag: int) -> Any:
        return _reject_tag

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


_NO_TAGS = _NoTags()


def _loads(header: bytes) -> Any:
    try:
        return cbor2.loads(
            header, semantic_decoders=_NO_TAGS, tag_hook=_reject_tag, max_depth=MAX_CBOR_DEPTH,
            allow_indefinite=False, allow_duplicate_keys=False, strict_hashable_types=True,
        )
    # The boundary to cbor2: whatever it raises on a peer's bytes means the peer sent garbage.
    except (cbor2.CBORError, ValueError, TypeError, LookupError, ArithmeticError, RecursionError,
            MemoryError) as e:
        raise RemoteProtocolError(f"header is not valid CBOR: {e}") from e


def _lookup(type_name: Any, version: Any) -> type[Message]:
    cls = lookup(type_name) if type(type_name) is str else None
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {type_name!r:.80}")
    if type(version) is not int or version != cls.VERSION:
        raise RemoteProtocolError(f"{type_name} version {version!r:.40} is not {cls.VERSION}")
    return cls


def _build(cls: type[Message], raw: Any) -> Message:
    fields = fields_of(cls)
    if type(raw) is not dict or raw.keys() != {f.name for f in fields}:
        raise RemoteProtocolError(f"{cls.TYPE}: the field map does not match the schema")
    values = {}
    for field in fields:
        value = raw[field.name]
        if field.is_tuple and type(value) is list:
            value = tuple(value)
        check_value(field, value, RemoteProtocolError)
        values[field.name] = value
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:  # a __post_init__ that rejects the values
        raise RemoteProtocolError(f"{cls.TYPE}: {e}") from e


def decode_header(header: bytes, *, max_payload: int = MAX_PAYLOAD_BYTES) -> tuple[Message, int]:
    """Decode a CBOR header into (message, payload length); RemoteProtocolError otherwise."""
    if len(header) > MAX_HEADER_BYTES:
        raise RemoteProtocolError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    raw = _loads(header)
    if type(raw) is not dict or raw.keys() != _HEADER_KEYS:
        raise RemoteProtocolError("header is not a map with exactly the keys t, v, n, f")
    cls = _lookup(raw["t"], raw["v"])
    n = raw["n"]
    if type(n) is not int or not 0 <= n <= min(max_payload, MAX_PAYLOAD_BYTES):
        raise RemoteProtocolError(f"payload length {n!r:.40} is out of bounds")
    msg = _build(cls, raw["f"])
    if _dump_header(msg, n) != header:  # one encoding per message: also rejects trailing bytes
        raise RemoteProtocolError(f"{cls.TYPE} header is not in canonical CBOR encoding")
    msg.check(n)
    return msg, n


def _header_length(prefix: bytes) -> int:
    if len(prefix) < HEADER_LENGTH_BYTES:
        raise RemoteProtocolError("frame truncated inside the header length")
    length = int.from_bytes(prefix[:HEADER_LENGTH_BYTES], "big")
    if length > MAX_HEADER_BYTES:
        raise RemoteProtocolError(f"header length {length} exceeds {MAX_HEADER_BYTES}")
    return length


def decode_frame(frame: bytes, *, max_payload: int = MAX_PAYLOAD_BYTES) -> tuple[Message, bytes]:
    """Decode a buffer holding exactly one frame; RemoteProtocolError otherwise."""
    end = HEADER_LENGTH_BYTES + _header_length(frame)
    if len(frame) < end:
        raise RemoteProtocolError("frame truncated inside the header")
    msg, n = decode_header(bytes(frame[HEADER_LENGTH_BYTES:end]), max_payload=max_payload)
    if len(frame) - end != n:
        raise RemoteProtocolError(f"frame holds {len(frame) - end} payload bytes, header says {n}")
    return msg, bytes(frame[end:])


async def read_exactly(stream: Any, n: int) -> bytes:
    """Read exactly ``n`` bytes; RemoteProtocolError if the stream ends first."""
    chunks, got = [], 0
    while got < n:
        chunk = await stream.read(n - got)
        if not chunk:  # a reset peer looks like a clean EOF, so EOF here is an error
            raise RemoteProtocolError(f"stream ended after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


async def read_header(
    stream: Any, *, max_payload: int = MAX_PAYLOAD_BYTES
) -> tuple[Message, int, int] | None:
    """Read a frame up to its payload: (message, payload length, bytes read so far).

    None on EOF before the first byte, RemoteProtocolError if invalid. A reader that must
    account for a payload before reading it (the stream pool's budget) reads it afterwards
    with ``read_exactly``.
    """
    first = await stream.read(HEADER_LENGTH_BYTES)
    return await read_rest_of_header(stream, first, max_payload=max_payload) if first else None


async def read_rest_of_header(stream: Any, first: bytes, *, max_payload: int = MAX_PAYLOAD_BYTES
                              ) -> tuple[Message, int, int]:
    """``read_header`` once its ``first`` bytes (1 to HEADER_LENGTH_BYTES) came: a reader that waits
    for a frame without a deadline bounds the rest of its header by one (net/pool_inbound.py)."""
    prefix = first + await read_exactly(stream, HEADER_LENGTH_BYTES - len(first))
    length = _header_length(prefix)
    msg, n = decode_header(await read_exactly(stream, length), max_payload=max_payload)
    return msg, n, HEADER_LENGTH_BYTES + length


async def read_frame(
    stream: Any, *, max_payload: int = MAX_PAYLOAD_BYTES
) -> tuple[Message, bytes] | None:
    """Read one frame; None on EOF before its first byte, RemoteProtocolError if invalid."""
    head = await read_header(stream, max_payload=max_payload)
    if head is None:
        return None
    msg, n, _ = head
    return msg, await read_exactly(stream, n)
