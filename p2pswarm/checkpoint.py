"""Hot snapshots: the whole state of a replica as one self-checking byte string, on disk and on the wire.

A replica that restarts, or a new one joining a stage, must start from the stage's current weights,
optimizer state and DiLoCo state, not from step 0. ``encode_state`` turns that nested state (dicts,
lists, tuples, tensors, scalars) into one byte string; ``decode_state`` turns a byte string, from
our own disk or from a peer, back into the state or into a ``RemoteProtocolError`` (nothing else
escapes, and nothing is allocated before the declared sizes are checked against the data).
``SnapshotStore`` keeps the newest few on disk, written atomically, so that a crash at any instant
leaves a loadable snapshot. No pickle: a snapshot is data, never code.

Layout (``docs/protocols.md``), all integers little-endian::

    MAGIC "P2PSNAP1" | u64 header length | header: canonical CBOR, no tags | zero padding to 8
    | tensor data: each tensor's raw little-endian bytes, at 8-aligned offsets, zero-padded to 8
    | sha256 of everything before it (32 bytes: the snapshot's digest)

The header is the map ``{"tree": node, "tensors": [[dtype, shape, offset, nbytes], ...]}``; offsets
count from the start of the tensor data. A node is None, a bool, an int (signed 64-bit), a float,
a str or bytes as itself, or an array whose first item says what it is: ``[0, item...]`` a list,
``[1, item...]`` a tuple, ``[2, key, value, key, value...]`` a dict (keys str or int, kept in
order), ``[3, i]`` the i-th tensor of the table. Exactly one encoding per state: the decoder
requires canonical CBOR, tensors referenced once each in table order, the tightest layout and
zero padding, so equal states have equal digests.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import re
import sys
import threading
from collections.abc import Mapping
from typing import Any, NoReturn

import cbor2
import torch

from p2pswarm.errors import RemoteProtocolError
from p2pswarm.files import write_atomic
from p2pswarm.model import plan

SNAPSHOT_MAGIC = b"P2PSNAP1"  # format and version at once: a new layout gets a new magic
LENGTH_BYTES = 8  # u64 header length: fixed width, never the limit
DIGEST_BYTES = 32  # sha256
ALIGN = 8  # tensor data offsets: a multiple of every dtype's item size
MAX_SNAPSHOT_BYTES = plan.MAX_SNAPSHOT_BYTES  # the largest catalog stage's snapshot (model/plan.py), ~18 GiB
MAX_HEADER_BYTES = 16 * 1024 * 1024  # ~6x MAX_TENSORS tensors' header (~40 B each); bounds the CBOR work
MAX_TENSORS = 65536  # far above any stage's parameters x optimizer states; bounds the table
MAX_DEPTH = 16  # containers deep; real snapshots are 5 deep (snapshot>engine>optimizer>state>param)
MAX_TENSOR_DIMS = 16  # model tensors have <= 4 dims; bounds the shape arithmetic
KEEP = 5  # snapshots kept on disk: enough to step back past a few bad ones, bounded disk use
SNAPSHOT_PERIOD = 120.0  # seconds between snapshots: a crash costs at most ~2 minutes of training
INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # ints are signed 64-bit, as on the wire
DTYPES = {  # the tensor dtypes a snapshot holds, by their name in the header
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
LIST, TUPLE, DICT, TENSOR = 0, 1, 2, 3  # the first item of a node array: what the node is

_PREFIX = len(SNAPSHOT_MAGIC) + LENGTH_BYTES
_MIN_BYTES = _PREFIX + DIGEST_BYTES
_CBOR_DEPTH = MAX_DEPTH + 2  # the header map, then a [3, i] tensor node inside the deepest container
_SCALARS = (bool, float, str, bytes)
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

log = logging.getLogger(__name__)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _tensor_size(dtype: Any, shape: Any, error: type[Exception]) -> int:
    """The byte size of a ``dtype`` tensor of ``shape`` (a list); ``error`` if it is not one we allow.

    The non-zero dims times the item size must stay within MAX_SNAPSHOT_BYTES even when another
    dim is 0: torch computes strides from them (as ``wire.check_tensor``).
    """
    torch_dtype = DTYPES.get(dtype) if type(dtype) is str else None
    if torch_dtype is None:
        raise error(f"unsupported tensor dtype {dtype!r:.40}")
    if type(shape) is not list or len(shape) > MAX_TENSOR_DIMS:
        raise error(f"a tensor shape is a list of at most {MAX_TENSOR_DIMS} dims")
    extent = torch_dtype.itemsize
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise error("tensor dims must be non-negative ints")
        extent *= dim or 1
        if extent > MAX_SNAPSHOT_BYTES:  # stop early: never multiply far past the limit
            raise error(f"{dtype} tensor of shape {shape} is too large (even if empty)")
    return 0 if 0 in shape else extent


def _is_key(key: Any) -> bool:
    """Dict keys are str or signed 64-bit int (not bool: torch's optimizer state uses int keys)."""
    return type(key) is str or (type(key) is int and INT_MIN <= key <= INT_MAX)


def _swap_to_little_endian(raw: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Byte-swap a flat uint8 tensor of ``itemsize`` elements on big-endian hosts (an involution)."""
    if sys.byteorder == "little" or itemsize == 1:
        return raw
    return raw.reshape(-1, itemsize).flip(-1).reshape(-1).contiguous()


# --- encoding ---------------------------------------------------------------------------------


def _encode_node(node: Any, depth: int, tensors: list[torch.Tensor]) -> Any:
    """The header node for ``node``; its tensors are appended to ``tensors``. ValueError if unsupported."""
    if node is None or type(node) in _SCALARS:
        return node
    if type(node) is int:
        if not INT_MIN <= node <= INT_MAX:
            raise ValueError(f"int {node} is outside signed 64-bit")
        return node
    if isinstance(node, torch.Tensor):
        if len(tensors) >= MAX_TENSORS:
            raise ValueError(f"a snapshot holds at most {MAX_TENSORS} tensors")
        tensors.append(node)
        return [TENSOR, len(tensors) - 1]
    if depth > MAX_DEPTH:
        raise ValueError(f"state nested deeper than {MAX_DEPTH} containers")
    if isinstance(node, dict):  # OrderedDict too (state_dict() returns one): decoded as a dict
        items: list[Any] = [DICT]
        for key, value in node.items():
            if not _is_key(key):
                raise ValueError(f"dict key {key!r:.40} is not a str or a signed 64-bit int")
            items += [key, _encode_node(value, depth + 1, tensors)]
        return items
    if type(node) in (list, tuple):
        kind = LIST if type(node) is list else TUPLE
        return [kind, *(_encode_node(item, depth + 1, tensors) for item in node)]
    raise ValueError(f"a snapshot cannot hold a {type(node).__name__}")


def _tensor_bytes(tensor: torch.Tensor) -> tuple[str, list[int], torch.Tensor]:
    """(dtype name, shape, flat little-endian uint8 tensor on the CPU) of a tensor."""
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None or tensor.layout != torch.strided:
        raise ValueError(f"a snapshot cannot hold a {tensor.dtype} ({tensor.layout}) tensor")
    try:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    except RuntimeError as e:  # a meta tensor, or anything else that has no bytes
        raise ValueError(f"tensor has no readable bytes: {e}") from e
    return name, list(tensor.shape), _swap_to_little_endian(flat, tensor.dtype.itemsize)


def encode_state(state: dict) -> bytes:
    """The snapshot bytes of ``state`` (module docstring); ValueError if it cannot be one."""
    if not isinstance(state, dict):
        raise ValueError(f"a snapshot state is a dict, not a {type(state).__name__}")
    tensors: list[torch.Tensor] = []
    tree = _encode_node(state, 1, tensors)
    table, raws, cursor = [], [], 0
    for tensor in tensors:
        name, shape, raw = _tensor_bytes(tensor)
        nbytes = _tensor_size(name, shape, ValueError)
        table.append([name, shape, cursor, nbytes])
        raws.append(raw)
        cursor = _align(cursor + nbytes)
    try:
        header = cbor2.dumps({"tree": tree, "tensors": table}, canonical=True)
    except (cbor2.CBOREncodeError, ValueError, TypeError) as e:  # e.g. a str with lone surrogates
        raise ValueError(f"state cannot be encoded: {e}") from e
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"snapshot header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    data_start = _align(_PREFIX + len(header))
    total = data_start + cursor + DIGEST_BYTES
    if total > MAX_SNAPSHOT_BYTES:
        raise ValueError(f"snapshot of {total} bytes exceeds {MAX_SNAPSHOT_BYTES}")
    out = bytearray(total)
    with memoryview(out) as view:
        view[:_PREFIX] = SNAPSHOT_MAGIC + len(header).to_bytes(LENGTH_BYTES, "little")
        view[_PREFIX:_PREFIX + len(header)] = header
        for (_, _, offset, nbytes), raw in zip(table, raws):
            if nbytes:
                view[data_start + offset:data_start + offset + nbytes] = raw.numpy()
        view[-DIGEST_BYTES:] = hashlib.sha256(view[:-DIGEST_BYTES]).digest()
    return bytes(out)


def digest(data: bytes) -> bytes:
    """The trailing sha256 of a snapshot: its integrity id (not verified here: ``decode_state`` does)."""
    if len(data) < _MIN_BYTES or bytes(data[:len(SNAPSHOT_MAGIC)]) != SNAPSHOT_MAGIC:
        raise ValueError("not a snapshot")
    return bytes(data[-DIGEST_BYTES:])


# --- decoding ---------------------------------------------------------------------------------


def _reject_tag(*args: Any) -> NoReturn:
    raise ValueError("CBOR tags are not allowed in a snapshot header")


class _NoTags(Mapping):
    """A semantic-decoder table that maps every tag to a rejection, overriding cbor2's own (as wire.py)."""

    def __getitem__(self, tag: int) -> Any:
        return _reject_tag

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


_NO_TAGS = _NoTags()


def _loads(header: bytes) -> Any:
    try:
        raw = cbor2.loads(
            header, semantic_decoders=_NO_TAGS, tag_hook=_reject_tag, max_depth=_CBOR_DEPTH,
            allow_indefinite=False, allow_duplicate_keys=False, strict_hashable_types=True,
        )
        canonical = cbor2.dumps(raw, canonical=True)
    # The boundary to cbor2: whatever it raises on these bytes means they are not a header.
    except (cbor2.CBORError, ValueError, TypeError, LookupError, ArithmeticError, RecursionError,
            MemoryError) as e:
        raise RemoteProtocolError(f"snapshot header is not valid CBOR: {e}") from e
    if canonical != header:  # one encoding per state: also rejects trailing bytes
        raise RemoteProtocolError("snapshot header is not in canonical CBOR encoding")
    return raw


def _frame(view: memoryview, max_bytes: int) -> tuple[bytes, int]:
    """Check magic, size and digest; return (header bytes, offset of the tensor data)."""
    n = len(view)
    if n > min(max_bytes, MAX_SNAPSHOT_BYTES):
        raise RemoteProtocolError(f"snapshot of {n} bytes exceeds {min(max_bytes, MAX_SNAPSHOT_BYTES)}")
    if n < _MIN_BYTES or view[:len(SNAPSHOT_MAGIC)] != SNAPSHOT_MAGIC:
        raise RemoteProtocolError("not a snapshot (magic or size)")
    if hashlib.sha256(view[:-DIGEST_BYTES]).digest() != view[-DIGEST_BYTES:]:
        raise RemoteProtocolError("snapshot digest does not match its contents")
    length = int.from_bytes(view[len(SNAPSHOT_MAGIC):_PREFIX], "little")
    if length > MAX_HEADER_BYTES or _align(_PREFIX + length) > n - DIGEST_BYTES:
        raise RemoteProtocolError(f"snapshot header length {length} is out of bounds")
    data_start = _align(_PREFIX + length)
    _check_zero(view, _PREFIX + length, data_start)
    return bytes(view[_PREFIX:_PREFIX + length]), data_start


def _check_zero(view: memoryview, start: int, end: int) -> None:
    if any(view[start:end]):
        raise RemoteProtocolError("snapshot padding is not zero")


def _table(raw: Any, view: memoryview, data_start: int) -> list[tuple[str, list[int], int, int]]:
    """The checked tensor table: the tightest layout, exactly filling the data section."""
    if type(raw) is not dict or raw.keys() != {"tree", "tensors"}:
        raise RemoteProtocolError("snapshot header is not a map with exactly the keys tree, tensors")
    table = raw["tensors"]
    if type(table) is not list or len(table) > MAX_TENSORS:
        raise RemoteProtocolError(f"snapshot tensor table is not a list of <= {MAX_TENSORS} entries")
    entries, cursor, data_len = [], 0, len(view) - DIGEST_BYTES - data_start
    for entry in table:
        if type(entry) is not list or len(entry) != 4:
            raise RemoteProtocolError("a tensor entry is [dtype, shape, offset, nbytes]")
        dtype, shape, offset, nbytes = entry
        size = _tensor_size(dtype, shape, RemoteProtocolError)
        if type(offset) is not int or offset != cursor or type(nbytes) is not int or nbytes != size:
            raise RemoteProtocolError(f"tensor entry {len(entries)}: offset or size out of place")
        if _align(offset + nbytes) > data_len:
            raise RemoteProtocolError(f"tensor entry {len(entries)} ends past the data")
        _check_zero(view, data_start + offset + nbytes, data_start + _align(offset + nbytes))
        entries.append((dtype, shape, offset, nbytes))
        cursor = _align(offset + nbytes)
    if cursor != data_len:
        raise RemoteProtocolError(f"tensor data is {data_len} bytes, the table lays out {cursor}")
    return entries


class _Tensors:
    """Builds the table's tensors, each an independent copy, in the order the tree references them."""

    def __init__(self, view: memoryview, data_start: int, entries: list) -> None:
        self.view, self.data_start, self.entries, self.used = view, data_start, entries, 0

    def take(self, index: Any) -> torch.Tensor:
        if type(index) is not int or index != self.used or index >= len(self.entries):
            raise RemoteProtocolError(f"tensor reference {index!r:.40} is not the next of the table")
        self.used += 1
        dtype, shape, offset, nbytes = self.entries[index]
        start = self.data_start + offset
        try:  # the boundary to torch: the sizes are checked, so this is a second guard
            raw = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:
                memoryview(raw.numpy())[:] = self.view[start:start + nbytes]
            raw = _swap_to_little_endian(raw, DTYPES[dtype].itemsize)
            if dtype == "bool" and nbytes and int(raw.max()) > 1:
                raise RemoteProtocolError("a bool tensor holds a byte other than 0 or 1")
            return raw.view(DTYPES[dtype]).reshape(shape)
        except (RuntimeError, ValueError, TypeError, MemoryError) as e:
            raise RemoteProtocolError(f"tensor {index} cannot be built: {e}") from e


def _decode_node(node: Any, depth: int, tensors: _Tensors) -> Any:
    if node is None or type(node) in _SCALARS:
        return node
    if type(node) is int:
        if not INT_MIN <= node <= INT_MAX:
            raise RemoteProtocolError(f"int {node} is outside signed 64-bit")
        return node
    if type(node) is not list or not node or type(node[0]) is not int:
        raise RemoteProtocolError("a snapshot node is a scalar or a [kind, ...] array")
    kind = node[0]
    if kind == TENSOR and len(node) == 2:
        return tensors.take(node[1])
    if depth > MAX_DEPTH:
        raise RemoteProtocolError(f"snapshot state nested deeper than {MAX_DEPTH} containers")
    if kind in (LIST, TUPLE):
        items = [_decode_node(item, depth + 1, tensors) for item in node[1:]]
        return items if kind == LIST else tuple(items)
    if kind != DICT or len(node) % 2 != 1:
        raise RemoteProtocolError(f"snapshot node of unknown kind {kind} or length {len(node)}")
    out = {}
    for i in range(1, len(node), 2):
        key = node[i]
        if not _is_key(key):
            raise RemoteProtocolError(f"dict key {key!r:.40} is not a str or a signed 64-bit int")
        if key in out:
            raise RemoteProtocolError(f"duplicate dict key {key!r:.40}")
        out[key] = _decode_node(node[i + 1], depth + 1, tensors)
    return out


def decode_state(data: bytes, *, max_bytes: int = MAX_SNAPSHOT_BYTES) -> dict:
    """The state a snapshot holds, with its own copies of the tensors; RemoteProtocolError otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"snapshot data must be bytes, not {type(data).__name__}")
    try:
        view = memoryview(data).cast("B")
    except TypeError as e:
        raise ValueError(f"snapshot data must be a contiguous byte buffer: {e}") from e
    with view:
        header, data_start = _frame(view, max_bytes)
        raw = _loads(header)
        tensors = _Tensors(view, data_start, _table(raw, view, data_start))
        state = _decode_node(raw["tree"], 1, tensors)
        if tensors.used != len(tensors.entries):
            raise RemoteProtocolError(f"{len(tensors.entries) - tensors.used} tensors are never referenced")
        if type(state) is not dict:
            raise RemoteProtocolError("a snapshot's state is a dict")
        return state


# --- on disk ----------------------------------------------------------------------------------

_NAME = re.compile(r"snapshot-(\d{8,})-r(\d+)-s(\d+)\.p2ps")
_TEMP_PREFIX, _TEMP_SUFFIX = ".snapshot-", ".tmp"


class SnapshotStore:
    """The newest ``keep`` snapshots in a directory, each written atomically (module docstring).

    One store (one process) writes a directory; its methods may be called from several threads.
    Names sort by a sequence number, never by mtime: ``snapshot-{seq:08d}-r{round}-s{step}.p2ps``.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = KEEP) -> None:
        if type(keep) is not int or keep < 1:
            raise ValueError(f"keep must be a positive int, not {keep!r}")
        self.directory, self.keep = pathlib.Path(directory), keep
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def paths(self) -> list[pathlib.Path]:
        """The complete snapshots, oldest first."""
        found = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                match = _NAME.fullmatch(entry.name)
                if match and entry.is_file(follow_symlinks=False):
                    found.append((int(match.group(1)), entry.name))
        return [self.directory / name for _, name in sorted(found)]

    def save(self, data: bytes, *, round: int, step: int) -> pathlib.Path:
        """Write a snapshot as the newest, durably and atomically; prune to ``keep``; return its path."""
        if type(round) is not int or type(step) is not int or round < 0 or step < 0:
            raise ValueError(f"round and step must be non-negative ints, not {round!r}, {step!r}")
        if bytes(data[:len(SNAPSHOT_MAGIC)]) != SNAPSHOT_MAGIC:
            raise ValueError("data is not a snapshot (encode_state makes one)")
        with self._lock:
            self._remove_temps()
            existing = self.paths()
            seq = int(_NAME.fullmatch(existing[-1].name).group(1)) + 1 if existing else 1
            final = self.directory / f"snapshot-{seq:08d}-r{round}-s{step}.p2ps"
            self._write(data, final)
            for old in self.paths()[:-self.keep]:
                old.unlink(missing_ok=True)
        return final

    def _write(self, data: bytes, final: pathlib.Path) -> None:
        write_atomic(final, data, prefix=_TEMP_PREFIX, suffix=_TEMP_SUFFIX)
        dir_fd = os.open(self.directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(dir_fd)  # the rename itself survives a power cut
        finally:
            os.close(dir_fd)

    def _remove_temps(self) -> None:
        """Remove what an interrupted save left behind (never loaded: it may be incomplete)."""
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.startswith(_TEMP_PREFIX) and entry.name.endswith(_TEMP_SUFFIX):
                    pathlib.Path(entry.path).unlink(missing_ok=True)

    def latest(self) -> tuple[pathlib.Path, dict] | None:
        """The newest snapshot that decodes, with its state; corrupt ones are skipped with a warning."""
        with self._lock:
            self._remove_temps()
            candidates = self.paths()
        for path in reversed(candidates):
            try:
                if path.stat().st_size > MAX_SNAPSHOT_BYTES:
                    raise RemoteProtocolError(f"file exceeds {MAX_SNAPSHOT_BYTES} bytes")
                return path, decode_state(path.read_bytes())
            except (OSError, RemoteProtocolError) as e:
                log.warning("skipping snapshot %s: %s", path.name, e)
        return None
