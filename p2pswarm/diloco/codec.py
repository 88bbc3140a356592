"""The outer codecs behind one call: what a round's Parts and Results carry, dense or sparse.

``compression`` holds the dense codecs (float32, float16, bfloat16 and int8, the default) and
``sparse`` the sparse 2-bit one (issue 27: the top 64 entries of each 4,096-element chunk, 0.73 %
of the float32 bytes). The run file names one (``[diloco] codec``); a round moves every piece with
it. A sparse piece's size also depends on its *width*, the members whose entries it must hold:

- a member's part keeps ``SPARSE_TOP`` entries a chunk (width 1);
- an owner's aggregate of n members' parts has at most n times as many non-zero entries a chunk,
  so it travels at width n (``sparse_top``: at most a whole chunk) and the union of what they sent
  arrives whole: nothing a member sent is cut again by the owner. A Result names its width (its
  ``contributors``), so a receiver knows the size before it decodes.

Dense codecs ignore the width. Like the codecs it calls, ``decode`` is total: a peer's bytes decode
to a finite float32 vector or raise ``RemoteProtocolError``; a width outside [1, MAX_WIDTH] from a
peer is refused the same way. Pure torch: no I/O.
"""

from __future__ import annotations

import torch

from p2pswarm.diloco import compression, sparse
from p2pswarm.diloco.compression import MAX_ELEMENTS
from p2pswarm.diloco.messages import MAX_MEMBERS
from p2pswarm.errors import RemoteProtocolError

SPARSE = "sparse"
CODECS = (*compression.CODECS, SPARSE)  # must equal p2pswarm.diloco.messages.CODECS
MAX_WIDTH = MAX_MEMBERS  # members whose entries one sparse piece holds: a group's largest


def sparse_top(width: int) -> int:
    """Entries a chunk of a sparse piece holding ``width`` members' entries (ValueError outside [1, MAX_WIDTH])."""
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"width must be an int in [1, {MAX_WIDTH}], got {width!r}")
    return min(sparse.SPARSE_CHUNK, sparse.SPARSE_TOP * width)


def encoded_size(codec: str, numel: int, width: int = 1, *, max_elements: int = MAX_ELEMENTS) -> int:
    """The bytes ``encode`` makes of ``numel`` elements; ValueError on an unknown codec or a bad size or width."""
    if codec == SPARSE:
        return sparse.encoded_size(numel, top=sparse_top(width), max_elements=max_elements)
    return compression.encoded_size(codec, numel, max_elements=max_elements)


def encode(vector: torch.Tensor, codec: str, error_out: torch.Tensor | None = None, *, width: int = 1,
           max_elements: int = MAX_ELEMENTS) -> bytes:
    """``vector`` (1-D float32) under ``codec``; ``error_out`` receives what the codec left out, exactly.
    ValueError (a local fault) as ``compression.encode`` and ``sparse.encode``."""
    if codec == SPARSE:
        return sparse.encode(vector, error_out, top=sparse_top(width), max_elements=max_elements)
    return compression.encode(vector, codec, error_out, max_elements=max_elements)


def decode(data: bytes, codec: str, numel: int, out: torch.Tensor | None = None, *, width: int = 1,
           max_elements: int = MAX_ELEMENTS) -> torch.Tensor:
    """A peer's ``data`` as ``numel`` finite float32 elements (in ``out`` if given); RemoteProtocolError otherwise."""
    if codec != SPARSE:
        return compression.decode(data, codec, numel, out, max_elements=max_elements)
    try:
        top = sparse_top(width)
    except ValueError as exc:
        raise RemoteProtocolError(str(exc)) from None
    data = bytes(data) if isinstance(data, memoryview) else data
    return sparse.decode(data, numel, out, top=top, max_elements=max_elements)
