"""Initial weights as a pure function of (model family, seed, part): one ``torch.Generator`` per part.

Every replica of a stage starts identical without a transfer (``model.transformer``), and every peer
computes a subspace model's fixed parts alike (``model.subspace``). This module imports torch.
"""

from __future__ import annotations

import hashlib

import torch

INIT_STD = 0.02  # GPT-2's and Llama's init scale: keeps the initial logits near uniform (loss ~ ln vocab)
SEED_BYTES = 8  # bytes of the sha256 digest that seed a generator (torch takes a 64-bit seed)


def part_seed(model_name: str, seed: int, part: str) -> int:
    """A stable 63-bit seed for one part of a model: identical on every machine and Python run."""
    digest = hashlib.sha256(f"p2pswarm-init\x00{model_name}\x00{seed}\x00{part}".encode()).digest()
    return int.from_bytes(digest[:SEED_BYTES], "big") >> 1  # keep it non-negative for manual_seed


def part_generator(model_name: str, seed: int, part: str) -> torch.Generator:
    """The generator that draws one part's initial weights."""
    return torch.Generator(device="cpu").manual_seed(part_seed(model_name, seed, part))


def initial_embedding(family: str, seed: int, vocab: int, width: int) -> torch.Tensor:
    """Stage 0's initial token embedding [vocab, width], N(0, INIT_STD): the one draw of it, which a
    subspace model's every stage also holds as its fixed embedding (``model.subspace``)."""
    return torch.empty(vocab, width).normal_(0.0, INIT_STD, generator=part_generator(family, seed, "embed"))
