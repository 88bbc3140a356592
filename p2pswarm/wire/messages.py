"""The generic messages every protocol may use: a named tensor, ping and pong, an error reply.

A ``TensorFrame``'s dtype and shape are checked against its payload's size here, before any
tensor is made; turning tensors into frames and back is ``swarm/codec.py``'s. Pure: no torch.

Besides the plain dtypes (``DTYPE_SIZES``), a tensor may travel quantized (``QUANTIZED_BITS``,
``swarm/quant.py``): each vector along its last dim as a float32 scale (``SCALE_BYTES``) and that
many 8- or 4-bit integers (two 4-bit ones a byte, low nibble first, a vector's last byte padded).
"""

from __future__ import annotations

from p2pswarm.errors import RemoteProtocolError
from p2pswarm.wire.schema import DTYPE_SIZES, MAX_PAYLOAD_BYTES, MAX_TENSOR_DIMS, Message, message

# --- tensors --------------------------------------------------------------------------

QUANTIZED_BITS = {"q8": 8, "q4": 4}  # quantized encodings: bits per element, a float32 scale per vector
SCALE_BYTES = 4  # a float32 scale per vector of the last dim


def quantized_row_bytes(bits: int, width: int) -> int:
    """Bytes of one quantized vector of ``width`` elements: its scale and its packed integers."""
    return SCALE_BYTES + (width * bits + 7) // 8


def check_tensor(dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
    """RemoteProtocolError unless ``nbytes`` is exactly a ``dtype`` tensor of ``shape``.

    The shape's non-zero dims times the item size must stay within MAX_PAYLOAD_BYTES even when
    another dim is 0: torch computes strides from them, and an empty (0, 2**32, 2**32) overflows.
    """
    bits = QUANTIZED_BITS.get(dtype) if type(dtype) is str else None
    itemsize = DTYPE_SIZES.get(dtype, 1 if bits else None) if type(dtype) is str else None
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
    if bits and size:
        size = extent // shape[-1] * quantized_row_bytes(bits, shape[-1]) if shape else nbytes + 1
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
