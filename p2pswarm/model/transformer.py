"""The stage-sliceable transformer: one peer builds and trains only the stage it serves.

A pre-norm decoder-only transformer over bytes (``ModelSpec.vocab`` = 256), cut along its
blocks into the stages of ``ModelSpec.stage_range``:

- stage 0 = token embedding + learned position embedding + its blocks; it takes token ids
  (int64, ``[batch, seq]``);
- a middle stage = its blocks; it takes and returns hidden states ``[batch, seq, width]``;
- the last stage = its blocks + final LayerNorm + LM head; it returns logits
  ``[batch, seq, vocab]`` and has ``loss(logits, targets)``;
- a single-stage model has both ends.

Each block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``; causal self-attention through
``scaled_dot_product_attention(is_causal=True)``, a GELU MLP. No dropout: the swarm's
replicas must compute the same function from the same weights.

Initial weights are a pure function of (model family, seed, part), where a part is
``"embed"``, ``"block/<global layer index>"`` or ``"head"``: each part draws its weights from
its own ``torch.Generator`` seeded by sha256 of those. So every replica of a stage starts
identical without a transfer, a stage's weights are a pure function of (model, seed, stage),
and, because the parts do not depend on the stage split, chaining stages 0..S-1 built
separately computes exactly the same function as the same model built as one stage
(``dataclasses.replace(spec, stage_size=spec.n_layers)``).

This module imports torch; only ``p2pswarm/model/`` and the compute engine import it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from p2pswarm.errors import ConfigError
from p2pswarm.model.catalog import ModelSpec

INIT_STD = 0.02  # GPT-2's weight init scale: keeps the initial logits near uniform (loss ~ ln vocab)
SEED_BYTES = 8  # bytes of the sha256 digest that seed a generator (torch takes a 64-bit seed)


def part_seed(model_name: str, seed: int, part: str) -> int:
    """A stable 63-bit seed for one part of a model: identical on every machine and Python run."""
    digest = hashlib.sha256(f"p2pswarm-init\x00{model_name}\x00{seed}\x00{part}".encode()).digest()
    return int.from_bytes(digest[:SEED_BYTES], "big") >> 1  # keep it non-negative for manual_seed


def _generator(model_name: str, seed: int, part: str) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(part_seed(model_name, seed, part))


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention, then a GELU MLP, each residual."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads = spec.heads
        self.ln1 = nn.LayerNorm(spec.width)
        self.qkv = nn.Linear(spec.width, 3 * spec.width)
        self.out = nn.Linear(spec.width, spec.width)
        self.ln2 = nn.LayerNorm(spec.width)
        self.up = nn.Linear(spec.width, spec.ffn)
        self.down = nn.Linear(spec.ffn, spec.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.down(F.gelu(self.up(self.ln2(x))))

    def reset_parameters(self, generator: torch.Generator, n_layers: int) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, residual projections scaled by depth."""
        with torch.no_grad():
            for norm in (self.ln1, self.ln2):
                norm.weight.fill_(1.0)
                norm.bias.zero_()
            residual_std = INIT_STD / math.sqrt(2 * n_layers)  # two residual writes per block
            for linear, std in ((self.qkv, INIT_STD), (self.out, residual_std),
                                (self.up, INIT_STD), (self.down, residual_std)):
                linear.weight.normal_(0.0, std, generator=generator)
                linear.bias.zero_()


class StageModule(nn.Module):
    """The layers of one stage of ``spec``, with the embeddings on stage 0 and the head on the last."""

    def __init__(self, spec: ModelSpec, stage: int) -> None:
        super().__init__()
        if not 0 <= stage < spec.n_stages:
            raise ConfigError(f"model {spec.name} has stages 0..{spec.last_stage}, not {stage}")
        self.spec = spec
        self.stage = stage
        self.start, self.end = spec.stage_range(stage)
        self.is_first = stage == 0
        self.is_last = stage == spec.last_stage
        self.embed = nn.Embedding(spec.vocab, spec.width) if self.is_first else None
        self.pos = nn.Embedding(spec.context, spec.width) if self.is_first else None
        self.blocks = nn.ModuleList(Block(spec) for _ in range(self.start, self.end))
        self.norm = nn.LayerNorm(spec.width) if self.is_last else None
        self.head = nn.Linear(spec.width, spec.vocab, bias=False) if self.is_last else None

    def reset_parameters(self, seed: int) -> None:
        """Set every weight from (model name, seed, part): see the module docstring."""
        name = self.spec.family  # the same weights however the model is cut into stages
        with torch.no_grad():
            if self.is_first:
                generator = _generator(name, seed, "embed")
                self.embed.weight.normal_(0.0, INIT_STD, generator=generator)
                self.pos.weight.normal_(0.0, INIT_STD, generator=generator)
            for layer, block in zip(range(self.start, self.end), self.blocks):
                block.reset_parameters(_generator(name, seed, f"block/{layer}"), self.spec.n_layers)
            if self.is_last:
                self.norm.weight.fill_(1.0)
                self.norm.bias.zero_()
                self.head.weight.normal_(0.0, INIT_STD, generator=_generator(name, seed, "head"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] (stage 0) or hidden states [B, T, width] → hidden states, or logits (last stage)."""
        if self.is_first:
            x = self._embed(x)
        elif x.dim() != 3 or x.shape[-1] != self.spec.width or not x.is_floating_point():
            raise ValueError(f"stage {self.stage} takes hidden states [batch, seq, {self.spec.width}], "
                             f"not {x.dtype} {tuple(x.shape)}")
        for block in self.blocks:
            x = block(x)
        if self.is_last:
            x = self.head(self.norm(x))
        return x

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.dtype != torch.int64:
            raise ValueError(f"stage 0 takes int64 token ids [batch, seq], not {ids.dtype} {tuple(ids.shape)}")
        seq = ids.shape[1]
        if not 0 < seq <= self.spec.context:
            raise ValueError(f"sequence length {seq} is outside 1..{self.spec.context} of {self.spec.name}")
        positions = torch.arange(seq, device=ids.device)
        return self.embed(ids) + self.pos(positions)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (nats per byte) of the last stage's logits [B, T, vocab] against targets [B, T]."""
        if not self.is_last:
            raise ValueError(f"stage {self.stage} of {self.spec.name} is not the last stage; it has no loss")
        return F.cross_entropy(logits.reshape(-1, self.spec.vocab), targets.reshape(-1))

    def param_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_stage(spec: ModelSpec, stage: int, seed: int) -> StageModule:
    """Stage ``stage`` of ``spec`` with its initial weights, a pure function of (spec.name, seed, stage)."""
    module = StageModule(spec, stage)
    module.reset_parameters(seed)
    return module


def build_model(spec: ModelSpec, seed: int) -> list[StageModule]:
    """Every stage of ``spec``, in order: for tests, benchmarks and single-machine training."""
    return [build_stage(spec, stage, seed) for stage in range(spec.n_stages)]


def run_stages(stages: Sequence[StageModule], ids: torch.Tensor) -> torch.Tensor:
    """Token ids through stages 0..S-1 in turn: the logits of the whole model."""
    x = ids
    for module in stages:
        x = module(x)
    return x
