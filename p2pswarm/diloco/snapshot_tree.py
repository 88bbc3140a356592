"""A snapshot's state tree as canonical compact JSON, its tensors referenced by their path.

``checkpoint.py`` keeps the tree in the safetensors metadata (``docs/protocols.md``). A node is None,
a bool, a str or an int (signed 64-bit) as itself, or an array whose first item says what it is:
``[0, item...]`` a list, ``[1, item...]`` a tuple, ``[2, key, value, ...]`` a dict (keys str or
int, kept in order), ``[3, name]`` a tensor, ``[4, hex]`` a float (``float.hex``: exact, NaN and
infinities too), ``[5, base64]`` bytes. A tensor's name is its path, its parts joined by "/"
(``_component``): ``engine/module/layers.0.mlp.up_proj.weight``. One spelling per tree: the decoder
requires the JSON, floats and base64 to be exactly as the encoder writes them, and each tensor's
name to be its path.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable
from typing import Any

import torch

from p2pswarm.errors import RemoteProtocolError

MAX_TENSORS = 65536  # far above any stage's parameters x optimizer states; bounds the table
MAX_DEPTH = 16  # containers deep; real snapshots are 5 deep (snapshot>engine>optimizer>state>param)
INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # ints are signed 64-bit, as on the wire
LIST, TUPLE, DICT, TENSOR, FLOAT, BYTES = 0, 1, 2, 3, 4, 5  # the first item of a node array: what it is
RESERVED_NAME = "__metadata__"  # safetensors' metadata key: never a tensor's name

_INT_LIKE = re.compile(r"-?[0-9]+")
_MAY_ESCAPE_FIRST = frozenset("-0123456789_")  # how an int-like key or RESERVED_NAME starts: a cheap first test


def _is_key(key: Any) -> bool:
    """Dict keys are str or signed 64-bit int (not bool: torch's optimizer state uses int keys)."""
    return type(key) is str or (type(key) is int and INT_MIN <= key <= INT_MAX)


def _component(key: str | int) -> str:
    """A dict key or list index as one part of a tensor's name: injective, never containing "/".

    "%" and "/" in a str key are percent-escaped; a str key that reads as an int (or is empty, or
    is the safetensors metadata key) has its first character escaped too, so "5" and 5 differ.
    """
    if type(key) is int:
        return str(key)
    assert isinstance(key, str)  # _is_key: a str, or an int that is not a bool
    part = key.replace("%", "%25").replace("/", "%2F") if "%" in key or "/" in key else key
    if not part:
        return "%"
    if part[0] in _MAY_ESCAPE_FIRST and (_INT_LIKE.fullmatch(part) or part == RESERVED_NAME):
        return f"%{ord(part[0]):02X}{part[1:]}"
    return part


def _child(prefix: str | None, key: str | int) -> str:
    return _component(key) if prefix is None else f"{prefix}/{_component(key)}"


def dumps(value: Any) -> str:
    """``value`` as compact JSON, exactly as snapshots spell it."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


# --- encoding ---------------------------------------------------------------------------------


def _encode_node(node: Any, depth: int, name: str | None, tensors: list) -> Any:
    """The tree node for ``node`` at path ``name``; its tensors are appended to ``tensors``."""
    if node is None or type(node) in (bool, str):
        return node
    if type(node) is int:
        if not INT_MIN <= node <= INT_MAX:
            raise ValueError(f"int {node} is outside signed 64-bit")
        return node
    if type(node) is float:
        return [FLOAT, node.hex()]
    if type(node) is bytes:
        return [BYTES, base64.b64encode(node).decode("ascii")]
    if isinstance(node, torch.Tensor):
        if len(tensors) >= MAX_TENSORS:
            raise ValueError(f"a snapshot holds at most {MAX_TENSORS} tensors")
        tensors.append((name, node))
        return [TENSOR, name]
    if depth > MAX_DEPTH:
        raise ValueError(f"state nested deeper than {MAX_DEPTH} containers")
    if isinstance(node, dict):  # OrderedDict too (state_dict() returns one): decoded as a dict
        items: list[Any] = [DICT]
        for key, value in node.items():
            if not _is_key(key):
                raise ValueError(f"dict key {key!r:.40} is not a str or a signed 64-bit int")
            items += [key, _encode_node(value, depth + 1, _child(name, key), tensors)]
        return items
    if type(node) in (list, tuple):
        kind = LIST if type(node) is list else TUPLE
        return [kind, *(_encode_node(item, depth + 1, _child(name, i), tensors) for i, item in enumerate(node))]
    raise ValueError(f"a snapshot cannot hold a {type(node).__name__}")


def encode_tree(state: dict) -> tuple[str, list[tuple[str, torch.Tensor]]]:
    """(the tree JSON of ``state``, its (name, tensor) pairs in tree order); ValueError if unsupported."""
    named: list[tuple[str, torch.Tensor]] = []
    return dumps(_encode_node(state, 1, None, named)), named


# --- decoding ---------------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(text: str | bytes, what: str) -> Any:
    """Parsed JSON (no NaN or Infinity); RemoteProtocolError naming ``what`` if it is not JSON."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    # The boundary to json: whatever it raises on these bytes means they are not a header.
    except (ValueError, TypeError, RecursionError, MemoryError) as e:
        raise RemoteProtocolError(f"snapshot {what} is not valid JSON: {e}") from e


def _redumps(tree: Any) -> str | None:
    """``tree`` as the encoder writes it; None if it holds what no encoder writes (a JSON float)."""
    try:
        return dumps(tree)
    except (ValueError, TypeError, RecursionError):  # 1e999 parses as inf, refused here
        return None


def _decode_leaf(kind: int, value: Any) -> Any:
    """A float or bytes node's value, if ``value`` is its one canonical spelling."""
    try:
        if kind == FLOAT and type(value) is str:
            number = float.fromhex(value)
            if number.hex() == value:
                return number
        elif kind == BYTES and type(value) is str:
            raw = base64.b64decode(value, validate=True)
            if base64.b64encode(raw).decode("ascii") == value:
                return raw
    except (ValueError, OverflowError, binascii.Error) as e:
        raise RemoteProtocolError(f"snapshot node [{kind}, {value!r:.40}]: {e}") from e
    raise RemoteProtocolError(f"snapshot node [{kind}, {value!r:.40}] is not a canonical float or bytes")


def _decode_node(node: Any, depth: int, parent: str | None, key: str | int | None,
                 take: Callable[[str], torch.Tensor]) -> Any:
    """The value of ``node``, the item ``key`` of the container at path ``parent`` (None: the root)."""
    if node is None or type(node) in (bool, str):
        return node
    if type(node) is int:
        if not INT_MIN <= node <= INT_MAX:
            raise RemoteProtocolError(f"int {node} is outside signed 64-bit")
        return node
    if type(node) is not list or not node or type(node[0]) is not int:
        raise RemoteProtocolError("a snapshot node is a scalar or a [kind, ...] array")
    kind, name = node[0], None if key is None else _child(parent, key)  # named only when it may need it
    if kind in (TENSOR, FLOAT, BYTES) and len(node) == 2:
        if kind != TENSOR:
            return _decode_leaf(kind, node[1])
        if name is None or node[1] != name:  # the root is no tensor reference
            raise RemoteProtocolError(f"tensor reference {node[1]!r:.60} is not its path {name!r:.60}")
        return take(name)
    if depth > MAX_DEPTH:
        raise RemoteProtocolError(f"snapshot state nested deeper than {MAX_DEPTH} containers")
    if kind in (LIST, TUPLE):
        items = [_decode_node(item, depth + 1, name, i, take) for i, item in enumerate(node[1:])]
        return items if kind == LIST else tuple(items)
    if kind != DICT or len(node) % 2 != 1:
        raise RemoteProtocolError(f"snapshot node of unknown kind {kind} or length {len(node)}")
    out = {}
    for i in range(1, len(node), 2):
        item_key = node[i]
        if not _is_key(item_key):
            raise RemoteProtocolError(f"dict key {item_key!r:.40} is not a str or a signed 64-bit int")
        if item_key in out:
            raise RemoteProtocolError(f"duplicate dict key {item_key!r:.40}")
        out[item_key] = _decode_node(node[i + 1], depth + 1, name, item_key, take)
    return out


def decode_tree(tree_json: str, take: Callable[[str], torch.Tensor]) -> Any:
    """The state ``tree_json`` spells, ``take(name)`` building its tensors; RemoteProtocolError otherwise."""
    tree = loads(tree_json, "tree")
    if _redumps(tree) != tree_json:
        raise RemoteProtocolError("snapshot tree is not in its canonical form")
    return _decode_node(tree, 1, None, None, take)
