"""Hot snapshots: the whole state of a replica as one self-checking safetensors file, on disk and on the wire.

A replica that restarts, or a new one joining a stage, must start from the stage's current weights,
optimizer state and DiLoCo state, not from step 0. ``encode_state`` turns that nested state (dicts,
lists, tuples, tensors, scalars) into one byte string; ``decode_state`` turns a byte string, from
our own disk or from a peer, back into the state or into a ``RemoteProtocolError`` (nothing else
escapes, and nothing is allocated before the declared sizes are checked against the data).
``SnapshotStore`` keeps the newest few on disk, written atomically, so that a crash at any instant
leaves a loadable snapshot. No pickle: a snapshot is data, never code.

A snapshot is a standard safetensors file (``docs/protocols.md``; ``safetensors.safe_open`` lists
its tensors)::

    u64 LE header length | header: JSON, padded with spaces to a multiple of 8 | tensor data

The header is ``{"__metadata__": {"format": FORMAT, "sha256": hex, "tree": tree}, name: {"dtype",
"shape", "data_offsets"}, ...}``, compact JSON in exactly that order, the tensors sorted by item size
(largest first, so each is aligned) then name, their data packed in that order. ``tree`` is the
state as canonical JSON, its tensors referenced by name, a name being the tensor's path in the
state, e.g. ``engine/module/layers.0.mlp.up_proj.weight`` (``snapshot_tree.py``). ``sha256`` is
the sha256 of the whole file with its own 64 hex digits read as ``0``: the snapshot's digest, at a
fixed offset, checked before anything is parsed. Exactly one encoding per state: the decoder
re-encodes the header it parsed and requires the same bytes.

We write and read the layout ourselves, one pass and one copy of the tensor data each way: the
``safetensors`` library writes ``__metadata__`` keys in a random order (not canonical), reads only
``bytes`` and hands back read-only tensors, and its two extra copies made encoding about 2x slower.
The tests hold every file we write, and every file we accept, to the library's reader.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import pathlib
import re
import sys
import threading
from typing import Any

import torch

from p2pswarm.diloco.snapshot_tree import (  # noqa: F401 - the tree's limits are the snapshot's (tests import them here)
    INT_MAX,
    INT_MIN,
    MAX_DEPTH,
    MAX_TENSORS,
    RESERVED_NAME,
    decode_tree,
    dumps,
    encode_tree,
    loads,
)
from p2pswarm.errors import RemoteProtocolError
from p2pswarm.files import write_atomic
from p2pswarm.run import plan

FORMAT = "p2pswarm-snapshot/2"  # the metadata's format id: a new layout gets a new id
OLD_MAGIC = b"P2PSNAP1"  # the first format's magic: refused with a message that says so
LENGTH_BYTES = 8  # u64 header length (safetensors): fixed width, never the limit
DIGEST_HEX = 64  # sha256, as lowercase hex in the metadata
ALIGN = 8  # the header is padded so the data starts 8-aligned (as safetensors writes it)
MAX_SNAPSHOT_BYTES = plan.MAX_SNAPSHOT_BYTES  # the largest catalog stage's snapshot (model/plan.py), ~18 GiB
MAX_HEADER_BYTES = 16 * 1024 * 1024  # ~1.3x MAX_TENSORS tensors' JSON (~200 B each, name twice); bounds the JSON work
MAX_TENSOR_DIMS = 16  # model tensors have <= 4 dims; bounds the shape arithmetic
KEEP = 5  # snapshots kept on disk: enough to step back past a few bad ones, bounded disk use
SNAPSHOT_PERIOD = 120.0  # seconds between snapshots: a crash costs at most ~2 minutes of training
DTYPES = {  # the tensor dtypes a snapshot holds, by their torch name
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
SAFETENSORS_DTYPES = {  # their names in a safetensors header
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}
HEADER_START = ('{"__metadata__":{"format":"' + FORMAT + '","sha256":"').encode()  # every snapshot's
TREE_START = b'","tree":'  # what follows the digest

_DIGEST_AT = LENGTH_BYTES + len(HEADER_START)  # the digest's hex digits: at a fixed offset
_MIN_BYTES = _DIGEST_AT + DIGEST_HEX + len(TREE_START)
_ZERO_DIGEST = "0" * DIGEST_HEX
_HEX = re.compile(r"[0-9a-f]{64}")
_FROM_SAFETENSORS = {code: name for name, code in SAFETENSORS_DTYPES.items()}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ITEMSIZE = {name: dtype.itemsize for name, dtype in DTYPES.items()}
_INFO_KEYS = ["dtype", "shape", "data_offsets"]  # a tensor's entry in the header, in this order

log = logging.getLogger(__name__)


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


def _swap_to_little_endian(raw: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Byte-swap a flat uint8 tensor of ``itemsize`` elements on big-endian hosts (an involution)."""
    if sys.byteorder == "little" or itemsize == 1:
        return raw
    return raw.reshape(-1, itemsize).flip(-1).reshape(-1).contiguous()


def _header_bytes(digest_hex: str, tree_json: str, table: list[tuple[str, str, list[int], int, int]]) -> bytes:
    """The canonical header for a (name, dtype, shape, begin, end) table in data order; ValueError if
    it cannot be UTF-8 (a str with lone surrogates)."""
    header: dict[str, dict[str, Any]] = {"__metadata__": {"format": FORMAT, "sha256": digest_hex, "tree": tree_json}}
    for name, dtype, shape, begin, end in table:
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [begin, end]}
    return _padded(dumps(header).encode("utf-8"))


def _padded(header: bytes) -> bytes:
    return header + b" " * (-(LENGTH_BYTES + len(header)) % ALIGN)


# --- encoding ---------------------------------------------------------------------------------


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
    tree_json, named = encode_tree(state)
    raws = {}
    for name, tensor in named:
        dtype, shape, raw = _tensor_bytes(tensor)
        raws[name] = (dtype, shape, raw, _tensor_size(dtype, shape, ValueError))
    table, parts, cursor = [], [], 0
    for name in sorted(raws, key=lambda n: (-_ITEMSIZE[raws[n][0]], n)):  # data order (_table)
        dtype, shape, raw, nbytes = raws[name]
        table.append((name, dtype, shape, cursor, cursor + nbytes))
        if nbytes:
            parts.append(memoryview(raw.numpy()))
        cursor += nbytes
    try:
        zeroed = _header_bytes(_ZERO_DIGEST, tree_json, table)
    except ValueError as e:  # e.g. a str with lone surrogates
        raise ValueError(f"state cannot be encoded: {e}") from e
    if len(zeroed) > MAX_HEADER_BYTES:
        raise ValueError(f"snapshot header of {len(zeroed)} bytes exceeds {MAX_HEADER_BYTES}")
    prefix = len(zeroed).to_bytes(LENGTH_BYTES, "little") + zeroed
    if len(prefix) + cursor > MAX_SNAPSHOT_BYTES:
        raise ValueError(f"snapshot of {len(prefix) + cursor} bytes exceeds {MAX_SNAPSHOT_BYTES}")
    hasher = hashlib.sha256(prefix)
    for part in parts:
        hasher.update(part)
    at = _DIGEST_AT
    prefix = prefix[:at] + hasher.hexdigest().encode("ascii") + prefix[at + DIGEST_HEX:]
    return b"".join([prefix, *parts])  # the one copy of the tensor data


def digest(data: bytes) -> bytes:
    """The sha256 a snapshot records: its integrity id (not verified here: ``decode_state`` does)."""
    view = bytes(data[:_MIN_BYTES])
    if len(view) < _MIN_BYTES or view[LENGTH_BYTES:_DIGEST_AT] != HEADER_START \
            or not _HEX.fullmatch(view[_DIGEST_AT:_DIGEST_AT + DIGEST_HEX].decode("latin-1")):
        raise ValueError("not a snapshot")
    return bytes.fromhex(view[_DIGEST_AT:_DIGEST_AT + DIGEST_HEX].decode("ascii"))


# --- decoding ---------------------------------------------------------------------------------


def _frame(view: memoryview, max_bytes: int) -> tuple[bytes, int]:
    """Check size, format, header length and digest; return (header bytes, offset of the tensor data)."""
    n = len(view)
    if n > min(max_bytes, MAX_SNAPSHOT_BYTES):
        raise RemoteProtocolError(f"snapshot of {n} bytes exceeds {min(max_bytes, MAX_SNAPSHOT_BYTES)}")
    if view[:len(OLD_MAGIC)] == OLD_MAGIC:
        raise RemoteProtocolError(f"an older snapshot format (P2PSNAP1): this version reads only {FORMAT}")
    if n < _MIN_BYTES or view[LENGTH_BYTES:_DIGEST_AT] != HEADER_START:
        raise RemoteProtocolError(f"not a snapshot (a safetensors file of format {FORMAT})")
    length = int.from_bytes(view[:LENGTH_BYTES], "little")
    if length > MAX_HEADER_BYTES or LENGTH_BYTES + length > n or LENGTH_BYTES + length < _MIN_BYTES:
        raise RemoteProtocolError(f"snapshot header length {length} is out of bounds")
    hasher = hashlib.sha256(view[:_DIGEST_AT])
    hasher.update(_ZERO_DIGEST.encode("ascii"))
    hasher.update(view[_DIGEST_AT + DIGEST_HEX:])
    if hasher.hexdigest().encode("ascii") != view[_DIGEST_AT:_DIGEST_AT + DIGEST_HEX]:
        raise RemoteProtocolError("snapshot digest does not match its contents")
    return bytes(view[LENGTH_BYTES:LENGTH_BYTES + length]), LENGTH_BYTES + length


def _metadata(header: Any) -> tuple[str, str]:
    """(digest hex, tree JSON) of a parsed header."""
    if type(header) is not dict or next(iter(header), None) != RESERVED_NAME or type(header[RESERVED_NAME]) is not dict:
        raise RemoteProtocolError("snapshot header is not a map with __metadata__")
    metadata = header[RESERVED_NAME]
    if list(metadata) != ["format", "sha256", "tree"] or not all(type(v) is str for v in metadata.values()):
        raise RemoteProtocolError("snapshot metadata is not exactly the str keys format, sha256, tree")
    if metadata["format"] != FORMAT or not _HEX.fullmatch(metadata["sha256"]):
        raise RemoteProtocolError("snapshot metadata: unknown format or malformed sha256")
    return metadata["sha256"], metadata["tree"]


def _table(header: dict, data_len: int) -> dict[str, tuple[str, list[int], int, int]]:
    """The checked tensor table, name -> (dtype, shape, begin, end): listed, and packed, in data order
    (by item size, largest first, then by name), each taking exactly its shape's bytes."""
    if len(header) - 1 > MAX_TENSORS:
        raise RemoteProtocolError(f"snapshot holds more than {MAX_TENSORS} tensors")
    entries: dict[str, tuple[str, list[int], int, int]] = {}
    cursor, previous = 0, None
    for name, info in itertools.islice(header.items(), 1, None):  # after the metadata (``_metadata``)
        if type(info) is not dict or list(info) != _INFO_KEYS:
            raise RemoteProtocolError(f"tensor {name!r:.60}: not exactly dtype, shape, data_offsets")
        dtype = _FROM_SAFETENSORS.get(info["dtype"]) if type(info["dtype"]) is str else None
        offsets = info["data_offsets"]
        if type(offsets) is not list or len(offsets) != 2 or not all(type(o) is int for o in offsets):
            raise RemoteProtocolError(f"tensor {name!r:.60}: data_offsets is not [begin, end]")
        size = _tensor_size(dtype, info["shape"], RemoteProtocolError)
        assert dtype is not None  # _tensor_size refused it otherwise
        order = (-_ITEMSIZE[dtype], name)
        if offsets[0] != cursor or offsets[1] - offsets[0] != size or (previous is not None and order <= previous):
            raise RemoteProtocolError(f"tensor {name!r:.60}: out of place in the data or the header, or not its size")
        entries[name] = (dtype, info["shape"], offsets[0], offsets[1])
        cursor, previous = offsets[1], order
    if cursor != data_len:
        raise RemoteProtocolError(f"tensor data is {data_len} bytes, the table lays out {cursor}")
    return entries


class _Tensors:
    """Builds the table's tensors, each an independent copy, as the tree references them by name."""

    def __init__(self, view: memoryview, data_start: int, entries: dict[str, tuple[str, list[int], int, int]]) -> None:
        self.used: set[str]
        self.view, self.data_start, self.entries, self.used = view, data_start, entries, set()

    def take(self, name: str) -> torch.Tensor:
        if name not in self.entries or name in self.used:
            raise RemoteProtocolError(f"tensor {name!r:.60} is not in the table or referenced twice")
        self.used.add(name)
        dtype, shape, begin, end = self.entries[name]
        try:  # the boundary to torch: the sizes are checked, so this is a second guard
            if end > begin:  # a bytearray of its own: one copy, writable, wrapped as is
                own = bytearray(self.view[self.data_start + begin:self.data_start + end])
                raw = torch.frombuffer(own, dtype=torch.uint8)
            else:
                raw = torch.empty(0, dtype=torch.uint8)
            raw = _swap_to_little_endian(raw, _ITEMSIZE[dtype])
            if dtype == "bool" and end > begin and int(raw.max()) > 1:
                raise RemoteProtocolError("a bool tensor holds a byte other than 0 or 1")
            return raw.view(DTYPES[dtype]).reshape(shape)
        except (RuntimeError, ValueError, TypeError, MemoryError) as e:
            raise RemoteProtocolError(f"tensor {name!r:.60} cannot be built: {e}") from e


def decode_state(data: bytes, *, max_bytes: int = MAX_SNAPSHOT_BYTES) -> dict:
    """The state a snapshot holds, with its own copies of the tensors; RemoteProtocolError otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"snapshot data must be bytes, not {type(data).__name__}")
    try:
        view = memoryview(data).cast("B")
    except TypeError as e:
        raise ValueError(f"snapshot data must be a contiguous byte buffer: {e}") from e
    with view:
        header_bytes, data_start = _frame(view, max_bytes)
        return _parse(view, header_bytes, data_start)


def _parse(view: memoryview, header_bytes: bytes, data_start: int) -> dict:
    """The state in a snapshot whose size, format, header length and digest are checked."""
    header = loads(header_bytes, "header")
    _, tree_json = _metadata(header)
    entries = _table(header, len(view) - data_start)
    try:
        canonical = _padded(dumps(header).encode("utf-8")) == header_bytes  # all in order: as written
    except ValueError as e:  # a name or str that is not UTF-8 (a lone surrogate)
        raise RemoteProtocolError(f"snapshot header cannot be re-encoded: {e}") from e
    if not canonical:
        raise RemoteProtocolError("snapshot header is not in its canonical form")
    tensors = _Tensors(view, data_start, entries)
    state = decode_tree(tree_json, tensors.take)
    if len(tensors.used) != len(entries):
        raise RemoteProtocolError(f"{len(entries) - len(tensors.used)} tensors are never referenced")
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
        if bytes(data[LENGTH_BYTES:_DIGEST_AT]) != HEADER_START:
            raise ValueError("data is not a snapshot (encode_state makes one)")
        with self._lock:
            self._remove_temps()
            existing = self.paths()
            last = _NAME.fullmatch(existing[-1].name) if existing else None  # paths() match _NAME
            seq = int(last.group(1)) + 1 if last else 1
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
                log.warning("skipping snapshot %s: %s (an older one, or a replica's, is loaded instead)", path.name, e)
        return None
