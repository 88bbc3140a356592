"""Subspace-constrained stage boundaries: a residual stream whose trained part spans ``rank`` fixed directions.

A run may constrain its model (run file ``[wire] subspace = K``) so that what crosses a stage boundary
is ``K`` numbers a token instead of ``width``, exactly, with no approximation at the boundary: the idea
of Pluralis' protocol models (arXiv 2506.01260), written here for our Llama.

The residual stream of a Llama is the token embedding plus every layer's two writes (``o_proj`` and
``down_proj``). Here:

- ``basis`` U is a fixed ``[width, K]`` matrix with orthonormal columns, a pure function of (model
  family, seed, K);
- ``fixed`` T is the model's *initial* token embedding (the same N(0, 0.02) draw as stage 0's
  ``embed_tokens``), a pure function of (model family, seed): every stage can compute it;
- every residual write ``y`` is projected onto U's span (``y U Uᵀ``), and stage 0's embedding of a
  token is ``T[id] + (E[id] - T[id]) U Uᵀ``: what training changes in the embedding lies in the span.

So at every layer boundary the hidden state is ``h = T[ids] + z Uᵀ`` for the coordinates
``z = (h - T[ids]) U`` (``to_coords``), and the next stage rebuilds ``h`` exactly from ``z`` and the
token ids (``from_coords``). The gradient comes back as ``K`` numbers too, exactly: the stage before
changes ``h`` only inside the span, so ``dL/dz = dL/dh U`` is all its parameters' gradients need, and
autograd through ``from_coords`` computes it. A forward therefore carries the micro-batch's token ids
(``swarm/codec.py``: the targets' window one token longer), 1 byte a token for a byte vocabulary.

The constraint is in the forward (projected writes), not in the optimizer: AdamW and DiLoCo move
the stored weights freely, and only their in-span part ever acts. ``effective_weights`` folds the
projections into plain matrices (``U Uᵀ W`` for a write, ``T + (E - T) U Uᵀ`` for the embedding): a
plain ``LlamaForCausalLM`` with those weights computes the same function (``model.hf_export``).
Cached decoding (generation) passes full hidden states between stages; the model is the same.

This module imports torch; only ``p2pswarm/model/`` and the compute engine import it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from p2pswarm.model.catalog import ModelSpec
from p2pswarm.model.seeding import initial_embedding, part_generator

MIN_RANK = 1
WRITES = ("self_attn.o_proj.weight", "mlp.down_proj.weight")  # a layer's residual writes, by parameter name


@dataclass(frozen=True)
class Subspace:
    """The fixed parts of a subspace-constrained model: ``basis`` [width, rank], ``fixed`` [vocab, width]."""

    basis: torch.Tensor
    fixed: torch.Tensor

    @property
    def rank(self) -> int:
        return self.basis.shape[1]


def build(spec: ModelSpec, seed: int, rank: int) -> Subspace:
    """The subspace of ``rank`` directions of (``spec``'s family, ``seed``): identical on every machine."""
    if not MIN_RANK <= rank <= spec.width:
        raise ValueError(f"a subspace of {spec.name} has 1 to {spec.width} directions, not {rank}")
    fixed = initial_embedding(spec.family, seed, spec.vocab, spec.width)
    gaussian = torch.randn(spec.width, rank, generator=part_generator(spec.family, seed, f"subspace/{rank}"),
                           dtype=torch.float64)
    basis, _ = torch.linalg.qr(gaussian)  # orthonormal columns
    return Subspace(basis.to(torch.float32).contiguous(), fixed)


def project(y: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``y`` projected onto the span of ``basis``'s columns (along the last dim)."""
    basis = basis.to(y.dtype)
    return (y @ basis) @ basis.T


def embed(table: torch.Tensor, ids: torch.Tensor, basis: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
    """Stage 0's embedding of ``ids``: the fixed embedding plus the in-span part of what training changed."""
    base = fixed[ids]
    return base + project(table[ids] - base, basis)


def to_coords(h: torch.Tensor, ids: torch.Tensor, basis: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
    """The ``rank`` coordinates [B, T, rank] of hidden states [B, T, width] of the tokens ``ids``."""
    return (h - fixed[ids].to(h.dtype)) @ basis.to(h.dtype)


def from_coords(z: torch.Tensor, ids: torch.Tensor, basis: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
    """The hidden states [B, T, width] whose coordinates are ``z`` [B, T, rank] (``to_coords`` inverted)."""
    return fixed[ids].to(z.dtype) + z @ basis.T.to(z.dtype)


def effective_weights(weights: dict[str, torch.Tensor], sub: Subspace) -> dict[str, torch.Tensor]:
    """A stage's weights (HF names within the stage) with the projections folded in: what a plain Llama
    needs to compute the constrained model's function."""
    out = dict(weights)
    basis = sub.basis.to(torch.float64)
    projector = basis @ basis.T
    for name, weight in weights.items():  # only the writes and the embedding change: the rest as they are
        if name.endswith(WRITES):
            out[name] = (projector @ weight.to(torch.float64)).to(weight.dtype)
        elif name.endswith("embed_tokens.weight"):
            base = sub.fixed.to(torch.float64)
            out[name] = (base + (weight.to(torch.float64) - base) @ projector).to(weight.dtype)
    return out

