"""Pseudo-gradient shards on the wire: fp32, fp16, bf16 and int8 with per-chunk scales.

An outer DiLoCo round moves every replica's pseudo-gradient (start weights minus weights after
the inner steps) across the network, once per round and per replica: at 4 bytes an element it is
the biggest thing the swarm sends. This module turns a 1-D float32 vector into the bytes of one
of four codecs and back:

- ``float32``: exact, 4 bytes an element;
- ``float16``: 2 bytes, relative error at most 2^-11 in fp16's normal range (values are clamped
  to +-65504 first, so a large element saturates instead of becoming inf);
- ``bfloat16``: 2 bytes, fp32's range, relative error at most 2^-8;
- ``int8`` (the default): 1 byte an element plus one float32 scale per ``INT8_CHUNK`` elements.
  Symmetric quantisation per chunk: ``scale = max|x| / 127``, ``q = round(x / scale)`` clamped
  to [-127, 127], so each element is off by at most half its chunk's scale. Layout: all chunk
  scales first, then all values. A decoder refuses a scale that is negative, not finite or above
  ``MAX_INT8_SCALE`` (127 times it would be inf), and the value -128, which no encoder makes.

Everything on the wire is little-endian, whatever the host. ``decode`` is total: a peer's bytes
and header values decode to a finite float32 vector or raise ``RemoteProtocolError``, and the
size is checked against ``MAX_ELEMENTS`` (or a lower ``max_elements``) before anything is
allocated. A stage bigger than that travels as several pieces (``messages.shard_plan``), each
encoded and decoded on its own. ``ErrorFeedback`` keeps
what quantisation lost in one round and adds it to the next round's vector, so over rounds
nothing is lost, only delayed. The module is pure torch: no I/O, no trio, no pickle.
"""

from __future__ import annotations

import math
import sys

import torch

from p2pswarm.errors import RemoteProtocolError

CODECS = ("float32", "float16", "bfloat16", "int8")
DEFAULT_CODEC = "int8"  # 4x fewer bytes than fp32 with no measurable loss in DiLoCo (INTELLECT-1)
INT8_CHUNK = 1024  # elements per int8 scale: 0.4 % overhead, and one outlier coarsens only 1024 values
MAX_ELEMENTS = 64 * 1024 * 1024  # the most elements one encoded vector (a piece) may claim: 256 MiB decoded
INT8_LEVELS = 127  # symmetric int8 range [-127, 127]: -128 would make the grid lopsided
FLOAT16_MAX = 65504.0  # largest finite fp16: larger values saturate here rather than become inf
BFLOAT16_MAX = torch.finfo(torch.bfloat16).max  # largest finite bf16 (fp32 values above round to inf)
MAX_INT8_SCALE = float.fromhex("0x1.0204060000000p+121")  # largest fp32 scale whose 127 multiple is finite
SCALE_BYTES = 4  # one float32 per int8 chunk
BYTES_PER_ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}  # payload bytes per element


def encoded_size(codec: str, numel: int, *, max_elements: int = MAX_ELEMENTS) -> int:
    """The number of bytes ``encode`` produces for ``numel`` elements with ``codec``.

    Raises ValueError on an unknown codec or a ``numel`` outside [0, max_elements].
    """
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}, expected one of {CODECS}")
    if isinstance(numel, bool) or not isinstance(numel, int) or not 0 <= numel <= _limit(max_elements):
        raise ValueError(f"numel must be an int in [0, {max_elements}], got {numel!r}")
    size = numel * BYTES_PER_ELEMENT[codec]
    if codec == "int8":
        size += _chunks(numel) * SCALE_BYTES
    return size


def encode(vector: torch.Tensor, codec: str, error_out: torch.Tensor | None = None, *,
           max_elements: int = MAX_ELEMENTS) -> bytes:
    """The bytes of a 1-D float32 ``vector`` (any layout) under ``codec``.

    ``error_out``, a float32 tensor of the same length, receives what the codec left out:
    ``vector - decode(result)``, exactly (the decoder's arithmetic, without decoding the bytes
    again). Raises ValueError on an unknown codec, a tensor that is not 1-D float32, one longer
    than ``max_elements`` (at most MAX_ELEMENTS), non-finite values (they would not decode: a local
    fault, not a message) or an ``error_out`` that does not fit.
    """
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}, expected one of {CODECS}")
    flat = checked_input(vector, error_out, max_elements)
    out = bytearray(encoded_size(codec, flat.numel()))
    if not out:  # frombuffer rejects an empty buffer
        return b""
    raw = torch.frombuffer(out, dtype=torch.uint8)
    if codec == "int8":
        _encode_int8(flat, raw, error_out)
        return bytes(out)
    if codec == "float32":
        narrow = flat
    elif codec == "float16":
        narrow = flat.clamp(-FLOAT16_MAX, FLOAT16_MAX).to(torch.float16)
    else:
        narrow = flat.clamp(-BFLOAT16_MAX, BFLOAT16_MAX).to(torch.bfloat16)
    _put(raw, narrow)
    if error_out is not None:
        torch.sub(flat, narrow.to(torch.float32), out=error_out)
    return bytes(out)


def checked_input(vector: torch.Tensor, error_out: torch.Tensor | None,
                  max_elements: int = MAX_ELEMENTS) -> torch.Tensor:
    """``vector`` as a contiguous 1-D float32 CPU tensor, ready to encode; ValueError (a local fault) if it is
    not one, is longer than ``max_elements``, holds non-finite values, or ``error_out`` does not fit it."""
    flat = _check_vector(vector, max_elements)
    if error_out is not None and (not isinstance(error_out, torch.Tensor) or error_out.dtype != torch.float32
                                  or error_out.shape != flat.shape or not error_out.is_contiguous()):
        raise ValueError(f"error_out must be a contiguous float32 tensor of shape {tuple(flat.shape)}")
    if not all_finite(flat):
        raise ValueError("cannot encode a vector with non-finite values")
    return flat


def decode(data: bytes, codec: str, numel: int, out: torch.Tensor | None = None, *,
           max_elements: int = MAX_ELEMENTS) -> torch.Tensor:
    """A new, writable 1-D float32 tensor of ``numel`` finite elements from a peer's ``data``,
    or ``out`` (a contiguous float32 vector of ``numel`` elements) holding them.

    Total: any ``data``, ``codec`` and ``numel`` either decode or raise RemoteProtocolError;
    the size is checked against ``max_elements`` (at most MAX_ELEMENTS) before anything is
    allocated, and ``out`` is not written unless the data decodes. ValueError for an ``out``
    that does not fit (a local fault).
    """
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != torch.float32
                            or out.dim() != 1 or not out.is_contiguous()
                            or (isinstance(numel, int) and out.numel() != numel)):
        raise ValueError(f"out must be a contiguous float32 vector of {numel!r} elements")
    if not isinstance(codec, str) or codec not in CODECS:
        raise RemoteProtocolError(f"unknown codec {codec!r}")
    if isinstance(numel, bool) or not isinstance(numel, int) or not 0 <= numel <= _limit(max_elements):
        raise RemoteProtocolError(f"element count {numel!r} outside [0, {max_elements}]")
    if isinstance(data, memoryview) and data.c_contiguous:
        length = data.nbytes
    elif isinstance(data, (bytes, bytearray)):
        length = len(data)
    else:
        raise RemoteProtocolError(f"encoded data must be bytes, got {type(data).__name__}")
    expected = encoded_size(codec, numel, max_elements=max_elements)
    if length != expected:
        raise RemoteProtocolError(f"{codec} of {numel} elements is {expected} bytes, got {length}")
    if numel == 0:
        return torch.empty(0, dtype=torch.float32) if out is None else out
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # a private, writable copy
    if codec == "int8":
        return _decode_int8(raw, numel, out)
    values = _get(raw, {"float32": torch.float32, "float16": torch.float16,
                        "bfloat16": torch.bfloat16}[codec]).to(torch.float32)  # no copy for float32
    if not all_finite(values):
        raise RemoteProtocolError(f"{codec} data holds non-finite values")
    return values if out is None else out.copy_(values)


class ErrorFeedback:
    """Error feedback: what compression lost in one round is added to the next round's vector.

    ``compress`` encodes ``vector + residual`` and keeps ``(vector + residual) - decoded`` as the
    new residual, where ``decoded`` is exactly what every receiver will decode. The sum of what
    was sent over rounds therefore tracks the sum of the vectors to within one residual.
    """

    def __init__(self, numel: int) -> None:
        if isinstance(numel, bool) or not isinstance(numel, int) or not 0 <= numel <= MAX_ELEMENTS:
            raise ValueError(f"numel must be an int in [0, {MAX_ELEMENTS}], got {numel!r}")
        self._residual = torch.zeros(numel, dtype=torch.float32)

    def compress(self, vector: torch.Tensor, codec: str) -> bytes:
        """The bytes of ``vector + residual`` under ``codec``; the residual becomes what was lost."""
        flat = _check_vector(vector)
        if flat.numel() != self._residual.numel():
            raise ValueError(f"vector has {flat.numel()} elements, residual {self._residual.numel()}")
        target = flat + self._residual
        data = encode(target, codec, error_out=target)  # ValueError (residual untouched) if not finite
        self._residual = target
        return data

    def residual_norm(self) -> float:
        """The L2 norm of the residual carried to the next round."""
        return float(torch.linalg.vector_norm(self._residual))

    def state_dict(self) -> dict:
        """The residual, as a copy: ``{"residual": tensor}``."""
        return {"residual": self._residual.clone()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a residual saved by ``state_dict``; ValueError if it does not fit."""
        residual = state.get("residual") if isinstance(state, dict) else None
        if not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32 or residual.dim() != 1:
            raise ValueError("state must hold a 1-D float32 tensor under 'residual'")
        if residual.numel() != self._residual.numel():
            raise ValueError(f"residual has {residual.numel()} elements, expected {self._residual.numel()}")
        if not all_finite(residual):
            raise ValueError("residual holds non-finite values")
        self._residual = residual.detach().to("cpu").clone()


# --- helpers ----------------------------------------------------------------------------


def _chunks(numel: int) -> int:
    """The number of int8 chunks (and scales) for ``numel`` elements."""
    return math.ceil(numel / INT8_CHUNK)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite; a finite sum proves it in one fast pass (NaN and inf
    elements always make the sum non-finite), else an exact check tells overflow from NaN/inf."""
    return math.isfinite(float(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _limit(max_elements: int) -> int:
    """``max_elements`` if it is a valid limit (an int within MAX_ELEMENTS); ValueError otherwise."""
    if isinstance(max_elements, bool) or not isinstance(max_elements, int) or not 0 <= max_elements <= MAX_ELEMENTS:
        raise ValueError(f"max_elements must be an int in [0, {MAX_ELEMENTS}], got {max_elements!r}")
    return max_elements


def _check_vector(vector: torch.Tensor, max_elements: int = MAX_ELEMENTS) -> torch.Tensor:
    """``vector`` as a contiguous 1-D float32 CPU tensor; ValueError if it is not one."""
    if not isinstance(vector, torch.Tensor) or vector.dim() != 1 or vector.dtype != torch.float32:
        raise ValueError("expected a 1-D float32 tensor")
    if vector.numel() > _limit(max_elements):
        raise ValueError(f"vector has {vector.numel()} elements, more than {max_elements}")
    return vector.detach().to("cpu").contiguous()


def _swap(raw: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Byte-swap a flat uint8 tensor of ``itemsize`` elements on big-endian hosts (an involution)."""
    if sys.byteorder == "little" or itemsize == 1:
        return raw
    return raw.reshape(-1, itemsize).flip(-1).reshape(-1)


def _put(raw: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` little-endian into the uint8 tensor ``raw`` (which must fit exactly)."""
    raw.copy_(_swap(values.contiguous().view(torch.uint8), values.element_size()))


def _get(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The little-endian uint8 tensor ``raw`` read as elements of ``dtype`` (no copy when possible)."""
    return _swap(raw, torch.empty(0, dtype=dtype).element_size()).view(dtype)


def _chunk_views(flat: torch.Tensor) -> list[torch.Tensor]:
    """2-D views of ``flat``: the full chunks as rows, then the partial last chunk as one row."""
    full = flat.numel() // INT8_CHUNK
    views = [flat[: full * INT8_CHUNK].view(full, INT8_CHUNK)]
    if flat.numel() % INT8_CHUNK:
        views.append(flat[full * INT8_CHUNK:].view(1, -1))
    return views


def _encode_int8(flat: torch.Tensor, raw: torch.Tensor, error_out: torch.Tensor | None) -> None:
    """Quantise ``flat`` chunk by chunk into ``raw``: the float32 scales, then the int8 values;
    ``error_out`` (if given) gets ``flat`` minus the values the decoder will make of them."""
    head = _chunks(flat.numel()) * SCALE_BYTES
    values = raw[head:].view(torch.int8)
    errors = _chunk_views(error_out) if error_out is not None else None
    scales, start = [], 0
    for index, rows in enumerate(_chunk_views(flat)):  # at most two: the full chunks, then the partial one
        low, high = torch.aminmax(rows, dim=1)
        scale = (torch.maximum(high, -low) / INT8_LEVELS).clamp_(max=MAX_INT8_SCALE)
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero chunk stays 0
        quantised = (rows / divisor[:, None]).round_().clamp_(-INT8_LEVELS, INT8_LEVELS)
        values[start: start + rows.numel()].view(rows.shape).copy_(quantised)
        if errors is not None:  # the decoder's q * scale, in float32 as it computes it
            torch.sub(rows, quantised.mul_(scale[:, None]), out=errors[index])
        scales.append(scale)
        start += rows.numel()
    _put(raw[:head], torch.cat(scales))


def _decode_int8(raw: torch.Tensor, numel: int, out: torch.Tensor | None) -> torch.Tensor:
    """The float32 vector of a length-checked int8 payload (in ``out`` if given; written only
    once the payload is known good); RemoteProtocolError on bad scales or values."""
    head = _chunks(numel) * SCALE_BYTES
    scales = _get(raw[:head], torch.float32)
    if not bool(((scales >= 0) & (scales <= MAX_INT8_SCALE)).all()):  # also false for NaN
        raise RemoteProtocolError(f"int8 scales must lie in [0, {MAX_INT8_SCALE:g}]")
    quantised = raw[head:].view(torch.int8)
    if bool((quantised == -INT8_LEVELS - 1).any()):
        raise RemoteProtocolError(f"int8 value {-INT8_LEVELS - 1} is outside [-127, 127]")
    out = quantised.to(torch.float32) if out is None else out.copy_(quantised)
    row = 0
    for rows in _chunk_views(out):
        rows.mul_(scales[row: row + rows.shape[0], None])
        row += rows.shape[0]
    return out
