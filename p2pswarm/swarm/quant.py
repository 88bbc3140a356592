"""Quantized stage boundaries: activations and their gradients in 8 or 4 bits a number.

A run may send what crosses a stage boundary quantized (``[wire]`` in its run file,
``run.spec``): every vector along the last dim (one token's hidden state, or its gradient) as a
float32 scale, its largest magnitude over ``qmax``, and each element as the nearest integer
multiple of that scale in [-qmax, qmax] (``qmax`` 127 for ``q8``, 7 for ``q4``). This is SWARM's
8-bit baseline, per token rather than per tensor, so that one outlier token costs no precision to
the others. An element is off by at most half its vector's scale (rounding to nearest): largest
magnitude / 254 for ``q8``, / 14 for ``q4``, plus the float32 rounding of the product.

Error feedback (carrying what a message lost into the next one) helps where the same quantity is
sent again, as DiLoCo's outer gradients are (``diloco.contribution``); a boundary tensor belongs to
one micro-batch and is never sent again, so there is none here.

Layout (``wire.QUANTIZED_BITS``, checked by ``wire.check_tensor`` before decoding): the vectors in
row-major order, each as its scale (a little-endian float32) followed by its integers: one int8 each
for ``q8``; for ``q4`` two a byte, value + 8 in a nibble, low nibble first, the last byte padded
with a zero nibble. A vector's bytes are contiguous, so a reader may slice a frame by positions.
Decoding is total: bytes of the right length decode, except scales that are negative, not finite, or so
large that a multiple of them would overflow float32 (``RemoteProtocolError``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from p2pswarm import wire
from p2pswarm.errors import LocalProtocolError, RemoteProtocolError

_SCALES = np.dtype("<f4")  # little-endian on every host
_LARGEST = float(np.finfo(np.float32).max)  # a scale times qmax must stay finite


def qmax(bits: int) -> int:
    """The largest integer magnitude an element takes: 127 (8 bits), 7 (4 bits)."""
    return (1 << (bits - 1)) - 1


def encode(tensor: torch.Tensor, encoding: str) -> bytes:
    """``tensor`` (any float dtype, at least one dim) as the payload of a ``encoding`` frame."""
    bits = wire.QUANTIZED_BITS[encoding]
    if tensor.dim() == 0:
        raise LocalProtocolError("a quantized tensor needs at least one dim")
    width = tensor.shape[-1]
    rows = tensor.detach().to("cpu", torch.float32).reshape(-1, width)
    if rows.numel() and not bool(torch.isfinite(rows).all()):
        raise LocalProtocolError("cannot quantize a tensor holding inf or NaN")
    scales = rows.abs().amax(dim=1) / qmax(bits) if width else torch.zeros(rows.shape[0])
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    ints = torch.round(rows / safe[:, None]).clamp_(-qmax(bits), qmax(bits)).to(torch.int8).numpy()
    if bits == 4:
        nibbles = (ints + 8).astype(np.uint8)
        if width % 2:
            nibbles = np.concatenate([nibbles, np.zeros((nibbles.shape[0], 1), np.uint8)], axis=1)
        ints = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    packed = np.empty((rows.shape[0], wire.quantized_row_bytes(bits, width)), np.uint8)
    packed[:, :wire.SCALE_BYTES] = scales.numpy().astype(_SCALES).reshape(-1, 1).view(np.uint8)
    packed[:, wire.SCALE_BYTES:] = np.ascontiguousarray(ints).view(np.uint8)
    return packed.tobytes()


def decode(encoding: str, shape: tuple[int, ...], payload: bytes) -> torch.Tensor:
    """The float32 tensor of ``shape`` a ``encoding`` payload carries (it owns its memory);
    RemoteProtocolError if the payload does not match the header or a scale is not a scale."""
    wire.check_tensor(encoding, shape, len(payload))
    bits = wire.QUANTIZED_BITS[encoding]
    if not payload:
        return torch.zeros(shape, dtype=torch.float32)
    width = shape[-1]
    vectors = math.prod(shape[:-1])
    packed = np.frombuffer(payload, dtype=np.uint8).reshape(vectors, wire.quantized_row_bytes(bits, width))
    scales = np.ascontiguousarray(packed[:, :wire.SCALE_BYTES]).view(_SCALES).reshape(-1)
    if not bool(np.isfinite(scales).all()) or bool((scales < 0).any()):
        raise RemoteProtocolError(f"{encoding} frame: a scale that is negative or not finite")
    if scales.size and float(scales.max()) * qmax(bits) > _LARGEST:  # no encoder makes one: its product overflows
        raise RemoteProtocolError(f"{encoding} frame: a scale past the largest float32 / {qmax(bits)}")
    data = packed[:, wire.SCALE_BYTES:]
    if bits == 8:
        ints = np.ascontiguousarray(data).view(np.int8)
    else:
        ints = np.empty((vectors, data.shape[1] * 2), np.int8)
        ints[:, 0::2] = (data & 0x0F).astype(np.int8) - 8
        ints[:, 1::2] = (data >> 4).astype(np.int8) - 8
        ints = ints[:, :width]
    values = ints.astype(np.float32) * scales[:, None].astype(np.float32)
    return torch.from_numpy(values).reshape(shape)


def max_error(tensor: torch.Tensor, encoding: str) -> torch.Tensor:
    """Per vector of ``tensor``, the most an element may be off after a round trip: half a scale."""
    width = tensor.shape[-1]
    return tensor.detach().to(torch.float32).reshape(-1, width).abs().amax(dim=1) / qmax(
        wire.QUANTIZED_BITS[encoding]) / 2
