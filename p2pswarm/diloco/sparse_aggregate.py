"""A robust mean of sparse contributions: each chunk clipped to the members' median scale (issue 27).

A trimmed mean drops, per coordinate, the lowest and highest values: with sparse contributions (the
top 1.56 % of each chunk, ``sparse.py``) a coordinate that one member of four sent is that member's
value among three zeros, and the trim throws it away, so an honest round learns nothing. SparseLoCo
averages plainly (absent entries count as 0), and then one liar can move the model anywhere.

``chunk_clipped_mean`` keeps the plain mean and bounds each member's pull instead: per chunk of
``chunk`` coordinates (the codec's), each contribution is clipped to the median over members of
their largest magnitude in that chunk, then all are averaged. With three or more members and fewer
than half of them lying, the median is at most the largest honest scale, so however large a liar's
values, no coordinate of the result exceeds the largest magnitude an honest member sent in its chunk,
and the liar's share of it is 1/n. A round of one or two members cannot tell a liar from an honest
member (``aggregation.judged``): it averages plainly. Pure torch, deterministic, computed in blocks
of ``BLOCK_CHUNKS`` chunks so that n contributions of a big shard never need n more copies at once.
"""

from __future__ import annotations

import torch

from p2pswarm.diloco.sparse import SPARSE_CHUNK

MIN_CLIPPED = 3  # members needed before any is clipped: with two, neither can be called the liar
BLOCK_CHUNKS = 64  # chunks combined at once: 64 x 4,096 coordinates x n members of temporaries


def chunk_clipped_mean(contributions: list[torch.Tensor], chunk: int = SPARSE_CHUNK) -> torch.Tensor:
    """The mean of equal-length 1-D float32 ``contributions`` (finite), each clipped per chunk to the
    median of the members' largest magnitude there (module docstring); a new float32 tensor.
    ValueError on an empty list, tensors of other shapes or dtypes, or a chunk below 1."""
    if not contributions:
        raise ValueError("no contributions to combine")
    numel = contributions[0].numel()
    if any(c.dim() != 1 or c.dtype != torch.float32 or c.numel() != numel for c in contributions):
        raise ValueError("contributions must be 1-D float32 tensors of one length")
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    out = torch.empty(numel, dtype=torch.float32)
    block = chunk * BLOCK_CHUNKS
    for start in range(0, numel, block):
        end = min(numel, start + block)
        stacked = torch.stack([c[start:end] for c in contributions]).to(torch.float64)
        if len(contributions) >= MIN_CLIPPED:
            stacked = _clipped(stacked, chunk)
        out[start:end] = stacked.mean(dim=0).to(torch.float32)
    return out


def _clipped(stacked: torch.Tensor, chunk: int) -> torch.Tensor:
    """Members x coordinates, each member's chunk clipped to the members' median largest magnitude."""
    members, width = stacked.shape
    padded = torch.nn.functional.pad(stacked, (0, -width % chunk)).view(members, -1, chunk)
    scale = padded.abs().amax(dim=2)  # members x chunks
    bound = scale.median(dim=0).values  # the lower median for an even count: an honest one below n/2 liars
    clipped = torch.maximum(torch.minimum(padded, bound[None, :, None]), -bound[None, :, None])
    return clipped.reshape(members, -1)[:, :width]
