"""The wire format: how every p2pswarm message becomes bytes on a stream, and back.

Every protocol speaks in frames, ``u32 big-endian header length | CBOR header | payload``.
Putting the rules in one module gives every protocol the same strict, total decoder. A
peer's bytes become a registered ``Message`` or a ``RemoteProtocolError``, and no other
exception escapes. It also gives one set of limits, checked before anything is read or
allocated, and exactly one encoding per message (the decoder re-encodes and compares).
``docs/protocols.md`` is the normative description; the constants below are its limits.

This module is pure: it imports neither trio nor torch, so any process can use it cheaply. A
``TensorFrame`` is checked here; turning tensors into frames and back is ``swarm/codec.py``'s.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

import cbor2

from p2pswarm.errors import LocalProtocolError, RemoteProtocolError

HEADER_LENGTH_BYTES = 4  # u32 length prefix: far more than MAX_HEADER_BYTES, fixed width
MAX_HEADER_BYTES = 16 * 1024  # a header holds small metadata; bulk data belongs in the payload
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024  # default and ceiling per frame: a big layer, still bufferable
MAX_ITEMS = 1024  # longest tuple field: bounds per-item work and memory for one header
MAX_STR_BYTES = 4096  # longest str field (UTF-8): names, addresses, error details
MAX_BYTES_FIELD = 8 * 1024  # longest bytes field: keys, signatures, small records
MAX_TENSOR_DIMS = 8  # deeper shapes do not occur in our models; bounds the size arithmetic
MAX_CBOR_DEPTH = 3  # header map > field map > tuple: anything nested deeper is not a header
INT_MIN = -(2**63)  # ints are signed 64-bit so that any implementation can hold them
INT_MAX = 2**63 - 1  # (see INT_MIN)
COALESCE_BYTES = 64 * 1024  # payloads up to this size go out in the same write as the header
DTYPE_SIZES = {  # bytes per element of each tensor dtype allowed on the wire
    "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "int32": 4, "int64": 8,
}

_HEADER_KEYS = frozenset({"t", "v", "n", "f"})
_SCALARS = (int, float, bool, str, bytes)
_TUPLE_ITEMS = (int, str, bytes)


class Message:
    """Base class of every message; subclasses are frozen dataclasses made by ``@message``."""

    TYPE: ClassVar[str]
    VERSION: ClassVar[int]

    def check(self, payload_len: int) -> None:
        """Raise RemoteProtocolError if this message with a payload of that size is invalid.

        Called after decoding, and before encoding (where the error becomes a
        LocalProtocolError). Must raise nothing but RemoteProtocolError.
        """


@dataclasses.dataclass(frozen=True)
class _Field:
    """How one dataclass field travels: its scalar type, and whether it is a tuple or nullable."""

    name: str
    kind: type
    is_tuple: bool
    optional: bool


_M = TypeVar("_M", bound=Message)

_REGISTRY: dict[str, type[Message]] = {}
_FIELDS: dict[type, tuple[_Field, ...]] = {}


@typing.dataclass_transform(frozen_default=True)
def message(type_name: str, version: int = 1) -> Callable[[type[_M]], type[_M]]:
    """Class decorator: make ``cls`` a frozen dataclass and register it under ``type_name``."""
    if not isinstance(type_name, str) or not type_name:
        raise ValueError(f"message type name must be a non-empty str, not {type_name!r}")
    if type(version) is not int or not 1 <= version <= INT_MAX:
        raise ValueError(f"message version must be a positive int, not {version!r}")

    def register(cls: type[_M]) -> type[_M]:
        if not (isinstance(cls, type) and issubclass(cls, Message)):
            raise TypeError(f"{cls!r} must subclass p2pswarm.wire.Message")
        if type_name in _REGISTRY:
            raise ValueError(f"message type {type_name!r} is already registered")
        if "__dataclass_fields__" not in cls.__dict__:
            cls = dataclasses.dataclass(frozen=True)(cls)
        elif not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]  # set by @dataclass
            raise TypeError(f"{cls.__name__} must be a frozen dataclass")
        fields = _field_specs(cls)
        cls.TYPE, cls.VERSION = type_name, version
        _REGISTRY[type_name] = cls
        _FIELDS[cls] = fields
        return cls

    return register


def registered_types() -> dict[str, type[Message]]:
    """A copy of the registry: type name -> message class."""
    return dict(_REGISTRY)


def _field_specs(cls: type) -> tuple[_Field, ...]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception as e:  # an unresolvable annotation, whatever it raised
        raise TypeError(f"cannot resolve the annotations of {cls.__name__}: {e}") from e
    specs = []
    for field in dataclasses.fields(cls):
        if not field.init:
            raise TypeError(f"{cls.__name__}.{field.name}: every field must be an init field")
        specs.append(_field_spec(f"{cls.__name__}.{field.name}", field.name, hints[field.name]))
    return tuple(specs)


def _field_spec(where: str, name: str, hint: Any) -> _Field:
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        rest = [a for a in args if a is not type(None)]
        if len(args) != 2 or len(rest) != 1:
            raise TypeError(f"{where}: only `X | None` unions are supported, not {hint!r}")
        hint, optional = rest[0], True
    if hint in _SCALARS:
        return _Field(name, hint, False, optional)
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        if args[0] in _TUPLE_ITEMS:
            return _Field(name, args[0], True, optional)
    raise TypeError(f"{where}: unsupported field type {hint!r}")


# --- field values ---------------------------------------------------------------------


def _check_value(field: _Field, value: Any, error: type[Exception]) -> None:
    """Raise ``error`` unless ``value`` is what ``field`` may hold on the wire."""
    if value is None:
        if not field.optional:
            raise error(f"field {field.name!r} may not be None")
    elif not field.is_tuple:
        _check_scalar(field.name, field.kind, value, error)
    elif type(value) is not tuple:
        raise error(f"field {field.name!r}: expected a tuple, got {type(value).__name__}")
    elif len(value) > MAX_ITEMS:
        raise error(f"field {field.name!r}: {len(value)} items exceeds {MAX_ITEMS}")
    else:
        for item in value:
            _check_scalar(field.name, field.kind, item, error)


def _check_scalar(name: str, kind: type[Any], value: Any, error: type[Exception]) -> None:
    # `type(x) is kind`, not isinstance: a bool is not an int, an int is not a float.
    if type(value) is not kind:
        raise error(f"field {name!r}: expected {kind.__name__}, got {type(value).__name__}")
    if kind is int and not INT_MIN <= value <= INT_MAX:
        raise error(f"field {name!r}: int {value} is outside signed 64-bit")
    elif kind is float and not math.isfinite(value):
        raise error(f"field {name!r}: float {value} is not finite")
    elif kind is bytes and len(value) > MAX_BYTES_FIELD:
        raise error(f"field {name!r}: {len(value)} bytes exceeds {MAX_BYTES_FIELD}")
    elif kind is str and _utf8_length(value, error) > MAX_STR_BYTES:
        raise error(f"field {name!r}: string exceeds {MAX_STR_BYTES} UTF-8 bytes")


def _utf8_length(text: str, error: type[Exception]) -> int:
    if len(text) > MAX_STR_BYTES:  # every character takes at least one byte
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:  # lone surrogates have no UTF-8 form
        raise error(f"string is not valid Unicode: {e}") from e


# --- encoding -------------------------------------------------------------------------


def _dump_header(msg: Message, payload_len: int) -> bytes:
    values = {f.name: getattr(msg, f.name) for f in _FIELDS[type(msg)]}
    header = {"t": msg.TYPE, "v": msg.VERSION, "n": payload_len, "f": values}
    return cbor2.dumps(header, canonical=True)


def _encode_prefix(msg: Message, payload: bytes) -> bytes:
    """Validate an outgoing message; return its length prefix and header."""
    fields = _FIELDS.get(type(msg))
    if fields is None:
        raise LocalProtocolError(f"{type(msg).__name__} is not a registered message")
    if not isinstance(payload, (bytes, bytearray)):
        raise LocalProtocolError(f"payload must be bytes, not {type(payload).__name__}")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise LocalProtocolError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    for field in fields:
        _check_value(field, getattr(msg, field.name), LocalProtocolError)
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
    cls = _REGISTRY.get(type_name) if type(type_name) is str else None
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {type_name!r:.80}")
    if type(version) is not int or version != cls.VERSION:
        raise RemoteProtocolError(f"{type_name} version {version!r:.40} is not {cls.VERSION}")
    return cls


def _build(cls: type[Message], raw: Any) -> Message:
    fields = _FIELDS[cls]
    if type(raw) is not dict or raw.keys() != {f.name for f in fields}:
        raise RemoteProtocolError(f"{cls.TYPE}: the field map does not match the schema")
    values = {}
    for field in fields:
        value = raw[field.name]
        if field.is_tuple and type(value) is list:
            value = tuple(value)
        _check_value(field, value, RemoteProtocolError)
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
    if not first:
        return None
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


# --- tensors --------------------------------------------------------------------------


def check_tensor(dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
    """RemoteProtocolError unless ``nbytes`` is exactly a ``dtype`` tensor of ``shape``.

    The shape's non-zero dims times the item size must stay within MAX_PAYLOAD_BYTES even when
    another dim is 0: torch computes strides from them, and an empty (0, 2**32, 2**32) overflows.
    """
    itemsize = DTYPE_SIZES.get(dtype) if type(dtype) is str else None
    if itemsize is None:
        raise RemoteProtocolError(f"unsupported tensor dtype {dtype!r:.40}")
    if type(shape) is not tuple or len(shape) > MAX_TENSOR_DIMS:
        raise RemoteProtocolError(f"tensor shape must be a tuple of <= {MAX_TENSOR_DIMS} dims")
    if any(type(d) is not int or d < 0 for d in shape):
        raise RemoteProtocolError("tensor dims must be non-negative ints")
    extent = itemsize  # bytes of the shape with its zero dims left out: bounds every stride
    for dim in shape:
        extent *= dim or 1
        if extent > MAX_PAYLOAD_BYTES:  # stop early: never multiply far past the limit
            raise RemoteProtocolError(f"{dtype} tensor of shape {shape} is too large (even if empty)")
    size = 0 if 0 in shape else extent
    if size != nbytes:
        raise RemoteProtocolError(f"{dtype} tensor of shape {shape} is not {nbytes} bytes")


@message("tensor")
class TensorFrame(Message):
    """One named tensor; the payload holds its elements, row-major, little-endian."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def check(self, payload_len: int) -> None:
        check_tensor(self.dtype, self.shape, payload_len)


# --- generic messages -----------------------------------------------------------------


class _NoPayload(Message):
    """A message whose frame must carry no payload."""

    def check(self, payload_len: int) -> None:
        if payload_len:
            raise RemoteProtocolError(f"{self.TYPE} carries no payload, got {payload_len} bytes")


@message("ping")
class Ping(_NoPayload):
    """Liveness probe; the peer answers with a Pong carrying the same nonce."""

    nonce: int


@message("pong")
class Pong(_NoPayload):
    """Answer to a Ping."""

    nonce: int


@message("error")
class ErrorReply(_NoPayload):
    """A request failed: a machine-readable ``code`` and a human-readable ``detail``."""

    code: str
    detail: str
