"""What may travel in a frame: the message classes and their fields, with the limits of each field.

``@message`` makes a frozen dataclass a registered wire message; ``fields_of`` says how each of its
fields travels, and ``check_value`` checks a value against it. The limits below are
``docs/protocols.md``'s. Pure: no I/O, no torch.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

MAX_PAYLOAD_BYTES = 64 * 1024 * 1024  # default and ceiling per frame: a big layer, still bufferable
MAX_ITEMS = 1024  # longest tuple field: bounds per-item work and memory for one header
MAX_STR_BYTES = 4096  # longest str field (UTF-8): names, addresses, error details
MAX_BYTES_FIELD = 8 * 1024  # longest bytes field: keys, signatures, small records
MAX_TENSOR_DIMS = 8  # deeper shapes do not occur in our models; bounds the size arithmetic
INT_MIN = -(2**63)  # ints are signed 64-bit so that any implementation can hold them
INT_MAX = 2**63 - 1  # (see INT_MIN)
DTYPE_SIZES = {  # bytes per element of each tensor dtype allowed on the wire
    "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "int32": 4, "int64": 8,
}
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
class Field:
    """How one dataclass field travels: its scalar type, and whether it is a tuple or nullable."""

    name: str
    kind: type
    is_tuple: bool
    optional: bool


_M = TypeVar("_M", bound=Message)

_REGISTRY: dict[str, type[Message]] = {}
_FIELDS: dict[type, tuple[Field, ...]] = {}


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


def _field_specs(cls: type) -> tuple[Field, ...]:
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


def _field_spec(where: str, name: str, hint: Any) -> Field:
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        rest = [a for a in args if a is not type(None)]
        if len(args) != 2 or len(rest) != 1:
            raise TypeError(f"{where}: only `X | None` unions are supported, not {hint!r}")
        hint, optional = rest[0], True
    if hint in _SCALARS:
        return Field(name, hint, False, optional)
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        if args[0] in _TUPLE_ITEMS:
            return Field(name, args[0], True, optional)
    raise TypeError(f"{where}: unsupported field type {hint!r}")


# --- field values ---------------------------------------------------------------------


def check_value(field: Field, value: Any, error: type[Exception]) -> None:
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


def fields_of(cls: type[Message]) -> tuple[Field, ...]:
    """How each field of a registered message class travels; KeyError for an unregistered class."""
    return _FIELDS[cls]


def lookup(type_name: str) -> type[Message] | None:
    """The registered message class of ``type_name``, or None."""
    return _REGISTRY.get(type_name)
