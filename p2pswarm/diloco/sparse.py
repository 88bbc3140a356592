"""Sparse 2-bit pseudo-gradients: the top entries of each chunk, at two bits each (issue 27).

SparseLoCo (arXiv 2508.15706) sends, of each chunk of a pseudo-gradient, only the entries of largest
magnitude, at 2 bits, and keeps the rest in a local error-feedback buffer that the next round adds
back: 1-3 % of the entries and still no worse than full-precision DiLoCo. This module is our codec
for it, a 1-D float32 vector to bytes and back:

- the vector is cut into chunks of ``SPARSE_CHUNK`` elements (the last may be shorter); of each,
  the ``SPARSE_TOP`` entries of largest magnitude are kept (all of a chunk no longer than that);
- a kept entry is its sign and one bit saying whether its magnitude is in the chunk's upper or
  lower half (split at the midpoint of the kept magnitudes' range); it decodes to the sign times
  the mean magnitude of its half (``low`` or ``high``, two float32 per chunk). So a kept entry is
  off by at most half the range of its chunk's kept magnitudes, and every other entry decodes to 0:
  what the codec left out, exactly, is ``error_out`` (the caller's error feedback keeps it);
- a kept entry's index within its chunk takes ``INDEX_BITS`` (12) bits, two indices in 3 bytes,
  in increasing order. A chunk with fewer non-zero entries than ``top`` (an owner's aggregate of
  n members' entries, kept at n times ``top`` a chunk, is one) ends in padding: the last index
  repeated, code 0, decoding to nothing, so a zero is never sent as a value. (A caller may keep
  another ``top`` a chunk; both sides name it, as they name the element count.)

At the defaults a 4,096-element chunk costs 8 + 96 + 16 = 120 bytes against 16,384 in float32:
0.73 %. Layout, little-endian: every chunk's (low, high), then every kept index, then every kept entry's
2-bit code (four to a byte, the first in the lowest bits). The encoding is canonical: a decoder
refuses indices not strictly increasing or past their chunk (but for the padding at a chunk's end),
scales not finite or not 0 <= low <= high, and padding bits or entries' codes that are not zero.
``decode`` is total: any bytes decode to a finite float32 vector or raise ``RemoteProtocolError``;
the sizes are checked against ``MAX_ELEMENTS`` (or a lower ``max_elements``) before anything is
allocated. Pure torch: no I/O.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from p2pswarm.diloco.compression import MAX_ELEMENTS, checked_input
from p2pswarm.errors import RemoteProtocolError

SPARSE_CHUNK = 4096  # elements per chunk (SparseLoCo's): a 12-bit index within it
SPARSE_TOP = 64  # entries kept per full chunk: 1.56 % of them (SparseLoCo's k)
INDEX_BITS = 12  # bits of one index within a chunk: ceil(log2(SPARSE_CHUNK))
SCALE_BYTES = 8  # per chunk: the float32 magnitudes of its lower and upper half
MAX_SCALE = torch.finfo(torch.float32).max
SIGN_BIT, HIGH_BIT = 1, 2  # a kept entry's 2-bit code: negative, and in the upper half


def kept(numel: int, top: int = SPARSE_TOP) -> int:
    """The number of entries kept of a ``numel``-element vector, ``top`` per chunk."""
    full, rest = divmod(numel, SPARSE_CHUNK)
    return full * top + min(rest, top)


def encoded_size(numel: int, *, top: int = SPARSE_TOP, max_elements: int = MAX_ELEMENTS) -> int:
    """The bytes ``encode`` makes of ``numel`` elements; ValueError outside [0, max_elements] or for a
    ``top`` outside [1, SPARSE_CHUNK]."""
    if isinstance(numel, bool) or not isinstance(numel, int) or not 0 <= numel <= min(max_elements, MAX_ELEMENTS):
        raise ValueError(f"numel must be an int in [0, {max_elements}], got {numel!r}")
    if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= SPARSE_CHUNK:
        raise ValueError(f"top must be an int in [1, {SPARSE_CHUNK}], got {top!r}")
    chunks, entries = math.ceil(numel / SPARSE_CHUNK), kept(numel, top)
    return chunks * SCALE_BYTES + 3 * math.ceil(entries / 2) + math.ceil(entries / 4)


def encode(vector: torch.Tensor, error_out: torch.Tensor | None = None, *, top: int = SPARSE_TOP,
           max_elements: int = MAX_ELEMENTS) -> bytes:
    """The bytes of a 1-D float32 ``vector``, ``top`` entries a chunk; ``error_out`` (float32, same length) receives
    ``vector - decode(result)`` exactly. ValueError on a vector that is not 1-D float32, is too long
    or holds non-finite values (a local fault), or an ``error_out`` that does not fit."""
    flat = checked_input(vector, error_out, max_elements)
    encoded_size(flat.numel(), top=top)  # ValueError if ``top`` is out of range
    scales, positions, codes = [], [], []
    for rows in _chunk_rows(flat):
        index, values, real = _top_entries(rows, min(top, rows.shape[1]))
        low, high, upper = _halves(values.abs(), real)
        scales.append(torch.stack([low, high], dim=1))
        positions.append(index)
        codes.append(((values < 0).to(torch.uint8) * SIGN_BIT + upper.to(torch.uint8) * HIGH_BIT) * real)
    if not scales:
        return b""
    scale = torch.cat(scales).reshape(-1)
    index = torch.cat([p.reshape(-1) for p in positions])
    code = torch.cat([c.reshape(-1) for c in codes])
    if error_out is not None:
        error_out.copy_(flat)
        error_out.sub_(_dense(flat.numel(), top, scale, index, code))
    return _float32_bytes(scale) + _pack_indices(index) + _pack_codes(code)


def decode(data: bytes, numel: int, out: torch.Tensor | None = None, *, top: int = SPARSE_TOP,
           max_elements: int = MAX_ELEMENTS) -> torch.Tensor:
    """A new 1-D float32 tensor of ``numel`` finite elements from a peer's ``data`` (or ``out``,
    written only once the data is known good). Total: RemoteProtocolError for anything else."""
    if isinstance(numel, bool) or not isinstance(numel, int) or not 0 <= numel <= min(max_elements, MAX_ELEMENTS):
        raise RemoteProtocolError(f"element count {numel!r} outside [0, {max_elements}]")
    if not isinstance(data, (bytes, bytearray)):
        raise RemoteProtocolError(f"encoded data must be bytes, got {type(data).__name__}")
    size = encoded_size(numel, top=top)  # (``top`` is ours, not the peer's: a ValueError is a local fault)
    if len(data) != size:
        raise RemoteProtocolError(f"sparse data of {numel} elements is {size} bytes, got {len(data)}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != torch.float32
                            or out.shape != (numel,) or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous float32 vector of {numel} elements")
    if numel == 0:
        return torch.empty(0, dtype=torch.float32) if out is None else out
    chunks, entries = math.ceil(numel / SPARSE_CHUNK), kept(numel, top)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    head, index_bytes = chunks * SCALE_BYTES, 3 * math.ceil(entries / 2)
    scale = torch.from_numpy(np.frombuffer(data, dtype="<f4", count=2 * chunks).astype(np.float32))
    low, high = scale[0::2], scale[1::2]
    if not bool(((low >= 0) & (low <= high) & (high <= MAX_SCALE)).all()):  # also false for NaN
        raise RemoteProtocolError("sparse scales must be finite with 0 <= low <= high")
    index = _unpack_indices(raw[head: head + index_bytes], entries)
    code = _unpack_codes(raw[head + index_bytes:], entries)
    _check_indices(index, code, numel, top)
    dense = _dense(numel, top, scale, index, code)
    return dense if out is None else out.copy_(dense)


# --- helpers ----------------------------------------------------------------------------


def _chunk_rows(flat: torch.Tensor) -> list[torch.Tensor]:
    """2-D views of ``flat``: the full chunks as rows, then the partial last one as one row."""
    full = flat.numel() // SPARSE_CHUNK
    rows = [flat[: full * SPARSE_CHUNK].view(full, SPARSE_CHUNK)] if full else []
    if flat.numel() % SPARSE_CHUNK:
        rows.append(flat[full * SPARSE_CHUNK:].view(1, -1))
    return rows


def _top_entries(rows: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, the ``top`` entries of largest magnitude in canonical order: the non-zero ones by increasing
    index, then padding (entries that are 0: a row with fewer non-zero ones) at the last real index, or at
    0 if there is none. Returns (indices, values, which are real)."""
    index = rows.abs().topk(top, dim=1).indices
    pad = rows.gather(1, index) == 0
    index = index.gather(1, (index + pad * SPARSE_CHUNK).sort(dim=1).indices)  # real ones first, by index
    values = rows.gather(1, index)
    real = values != 0
    last = index.gather(1, (real.sum(dim=1, keepdim=True) - 1).clamp(min=0))
    return torch.where(real, index, torch.where(real.any(dim=1, keepdim=True), last, 0)), values, real


def _halves(magnitude: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of kept magnitudes, of its ``real`` entries: the mean of the lower and of the upper half (split
    at the midpoint of their range), and which entries are in the upper half. A row whose lower half is empty
    has low = high; one with no real entry has both 0."""
    least = torch.where(real, magnitude, torch.inf).min(dim=1).values
    most = torch.where(real, magnitude, 0.0).max(dim=1).values
    least = torch.where(real.any(dim=1), least, 0.0)
    upper = real & (magnitude >= ((least + most) / 2)[:, None])
    n_upper = upper.sum(dim=1)
    high = (magnitude * upper).sum(dim=1) / n_upper.clamp(min=1)
    high = torch.minimum(torch.maximum(high, least), most)  # rounding never leaves the half's range
    lower = real & ~upper
    n_lower = lower.sum(dim=1)
    low = torch.where(n_lower > 0, (magnitude * lower).sum(dim=1) / n_lower.clamp(min=1), high)
    return torch.minimum(low, high), high, upper


def _dense(numel: int, top: int, scale: torch.Tensor, index: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """The decoded vector: each kept entry its sign times its half's magnitude, the rest (padding included) 0."""
    chunk = _chunk_of(numel, top)
    magnitude = torch.where((code & HIGH_BIT) > 0, scale[1::2][chunk], scale[0::2][chunk])
    values = torch.where((code & SIGN_BIT) > 0, -magnitude, magnitude)
    real = ~_padding(index, chunk)
    dense = torch.zeros(numel, dtype=torch.float32)
    dense[(chunk * SPARSE_CHUNK + index)[real]] = values[real]
    return dense


def _padding(index: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """Which entries are padding: those that repeat the index before them in their chunk."""
    pad = torch.zeros_like(index, dtype=torch.bool)
    pad[1:] = (chunk[1:] == chunk[:-1]) & (index[1:] == index[:-1])
    return pad


def _chunk_of(numel: int, top: int) -> torch.Tensor:
    """The chunk of each kept entry, in order."""
    full, rest = divmod(numel, SPARSE_CHUNK)
    counts = torch.tensor([top] * full + ([min(rest, top)] if rest else []), dtype=torch.long)
    return torch.repeat_interleave(torch.arange(len(counts)), counts)


def _check_indices(index: torch.Tensor, code: torch.Tensor, numel: int, top: int) -> None:
    """Every chunk's indices within the chunk and strictly increasing, then only padding (the last index
    repeated, code 0) to the chunk's end (RemoteProtocolError if not)."""
    chunk = _chunk_of(numel, top)
    length = torch.clamp(numel - chunk * SPARSE_CHUNK, max=SPARSE_CHUNK)
    same = chunk[1:] == chunk[:-1]
    pad = _padding(index, chunk)
    if bool((index >= length).any()) or bool((same & (index[1:] < index[:-1])).any()):
        raise RemoteProtocolError("sparse indices must increase within a chunk and lie inside it")
    if bool((pad & (code != 0)).any()) or bool((same & pad[:-1] & ~pad[1:]).any()):
        raise RemoteProtocolError("sparse padding must repeat the last index, with code 0, to the chunk's end")


def _float32_bytes(values: torch.Tensor) -> bytes:
    """Little-endian float32, whatever the host."""
    return values.numpy().astype("<f4").tobytes()


def _pack_indices(index: torch.Tensor) -> bytes:
    """Two 12-bit indices in three bytes (a zero index pads an odd count)."""
    if index.numel() % 2:
        index = torch.cat([index, index.new_zeros(1)])
    a, b = index[0::2], index[1::2]
    packed = torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=1)
    return packed.to(torch.uint8).numpy().tobytes()


def _unpack_indices(raw: torch.Tensor, entries: int) -> torch.Tensor:
    triples = raw.to(torch.long).view(-1, 3)
    a = triples[:, 0] | ((triples[:, 1] & 0xF) << 8)
    b = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
    index = torch.stack([a, b], dim=1).reshape(-1)
    if bool(index[entries:].any()):
        raise RemoteProtocolError("sparse index padding must be zero")
    return index[:entries]


def _pack_codes(code: torch.Tensor) -> bytes:
    """Four 2-bit codes a byte, the first in the lowest bits (zeros pad the last byte)."""
    padded = torch.cat([code, code.new_zeros(-code.numel() % 4)]).to(torch.long).view(-1, 4)
    packed = padded[:, 0] | (padded[:, 1] << 2) | (padded[:, 2] << 4) | (padded[:, 3] << 6)
    return packed.to(torch.uint8).numpy().tobytes()


def _unpack_codes(raw: torch.Tensor, entries: int) -> torch.Tensor:
    byte = raw.to(torch.long)
    code = torch.stack([(byte >> shift) & 3 for shift in (0, 2, 4, 6)], dim=1).reshape(-1)
    if bool(code[entries:].any()):
        raise RemoteProtocolError("sparse code padding must be zero")
    return code[:entries].to(torch.uint8)
