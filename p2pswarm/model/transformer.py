"""The stage-sliceable transformer: one peer builds and trains only the stage it serves.

A Llama-style decoder (the math and parameter names of transformers' ``LlamaForCausalLM``),
cut along its layers into the stages of ``ModelSpec.stage_range``:

- stage 0 = token embedding (``embed_tokens``) + its layers; it takes token ids (int64,
  ``[batch, seq]``);
- a middle stage = its layers; it takes and returns hidden states ``[batch, seq, width]``;
- the last stage = its layers + final RMSNorm (``norm``) + LM head (``lm_head``, untied: the
  embedding lives on another peer); it returns logits ``[batch, seq, vocab]`` and has
  ``loss(logits, targets)``;
- a single-stage model has both ends.

Each layer: ``x + self_attn(input_layernorm(x))`` then ``x + mlp(post_attention_layernorm(x))``.
RMSNorm computes in float32 (epsilon ``spec.norm_eps``; a written-out backward, fewer kernels
than autograd's on a CPU); attention rotates q and k by rotary
position embeddings (HF's default rope: rotate_half, ``inv_freq = 1 / theta^(2i / head_dim)``,
cos/sin computed in float32 for positions 0..seq-1 on every forward, never stored), runs
``scaled_dot_product_attention(is_causal=True)``, with ``spec.kv_heads`` key/value heads
shared by groups of query heads (GQA) when fewer than ``spec.heads``; the MLP is SwiGLU,
``down_proj(silu(gate_proj(x)) * up_proj(x))``. No biases, no dropout: the swarm's replicas
must compute the same function from the same weights. A stage's ``state_dict`` holds only
weights, named as in HF with layers indexed within the stage (``p2pswarm.model.hf_names``
maps them to the global names).

Initial weights are a pure function of (model family, seed, part), where a part is
``"embed"``, ``"block/<global layer index>"`` or ``"head"``: each part draws its weights from
its own ``torch.Generator`` seeded by sha256 of those. So every replica of a stage starts
identical without a transfer, a stage's weights are a pure function of (model, seed, stage),
and, because the parts do not depend on the stage split, chaining stages 0..S-1 built
separately computes exactly the same function as the same model built as one stage
(``dataclasses.replace(spec, stage_size=spec.n_layers)``). Matrices (embedding and head
included) start N(0, 0.02), the residual writes (o_proj, down_proj) N(0, 0.02 / sqrt(2 x
layers)), the norms at 1.

**Cached decode** (generation, ``swarm/inference.py``): ``forward(x, cache=KVCache())`` runs
the new positions ``cache.length .. cache.length + n - 1`` of one sequence (batch 1) against the
keys and values the cache holds (causal within the new positions, full over the cached ones),
appends theirs to it, and, at the last stage, returns the logits of the last position only
(``[1, vocab]``). Prefix then one token at a time equals the full forward (tests/test_kv_cache.py).
It works under ``functional_call`` (the cache is a keyword argument); the training forward
(no cache) takes the same path as before.

This module imports torch; only ``p2pswarm/model/`` and the compute engine import it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from p2pswarm.errors import ConfigError
from p2pswarm.model import subspace
from p2pswarm.model.catalog import ModelSpec
from p2pswarm.model.seeding import INIT_STD, initial_embedding, part_generator


class _RMSNormFunction(torch.autograd.Function):
    """HF's RMSNorm, ``weight * (x / rms(x)).to(dtype)`` computed in float32, with a written-out backward.

    The same numbers as autograd through those ops, in about half the kernels: tiny-lm's 17 norms
    cost about as much as its attention on a CPU otherwise. Saves the float32 x / rms(x) and
    1 / rms(x) for backward.
    """

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        inv_rms = torch.rsqrt(h.square().mean(-1, keepdim=True).add_(eps))
        normed = h * inv_rms
        return weight * normed.to(x.dtype), normed, inv_rms

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, weight, _ = inputs
        _, normed, inv_rms = output
        ctx.save_for_backward(weight, normed, inv_rms)
        ctx.mark_non_differentiable(normed, inv_rms)
        ctx.x_dtype = inputs[0].dtype

    @staticmethod
    def backward(ctx, grad: torch.Tensor, *_unused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        weight, normed, inv_rms = ctx.saved_tensors
        grad = grad.to(normed.dtype)
        grad_weight = (grad * normed).sum(dim=tuple(range(grad.dim() - 1))).to(weight.dtype)
        grad_normed = grad * weight.to(normed.dtype)
        dot = (grad_normed * normed).mean(-1, keepdim=True)
        grad_x = torch.addcmul(grad_normed, normed, dot, value=-1.0).mul_(inv_rms)
        return grad_x.to(ctx.x_dtype), grad_weight, None


class RMSNorm(nn.Module):
    """Llama's RMSNorm: x / rms(x) in float32, cast back, times a learned weight (no bias)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)[0]  # the other two are for backward


def rotary(spec: ModelSpec, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [seq, head_dim] of HF's default rope for positions 0..seq-1, in float32.

    HF rotates by ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``; we
    compute the same as ``x * cos + roll(x, half) * signed_sin``, where signed_sin is sin with its
    first half negated (one kernel fewer per rotation, bit-identical).
    """
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    freqs = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
    sin = freqs.sin()
    return torch.cat((freqs, freqs), dim=-1).cos(), torch.cat((-sin, sin), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [batch, heads, seq, head_dim] (HF's apply_rotary_pos_emb)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


@dataclass
class KVCache:
    """One sequence's keys and values at one stage: per layer (k, v), each [1, kv_heads, length, head_dim]."""

    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    length: int = 0  # positions held: the next forward's first position

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)


def kv_bytes(spec: ModelSpec, stage: int, tokens: int, itemsize: int) -> int:
    """The KV cache of ``tokens`` positions at ``stage``: 2 (k and v) x layers x tokens x kv_width x itemsize."""
    start, end = spec.stage_range(stage)
    return 2 * (end - start) * tokens * spec.kv_width * itemsize


def _cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, gqa: bool) -> torch.Tensor:
    """q [1, heads, n, d] at positions past..past+n-1 over k, v [1, kv_heads, past+n, d]."""
    n = q.shape[2]
    if n == 1:  # one new position sees every key: no mask
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    if past == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    keys = torch.arange(past + n, device=q.device)
    mask = keys[None, :] <= (past + torch.arange(n, device=q.device))[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class Attention(nn.Module):
    """Causal self-attention with rotary positions and grouped key/value heads (HF's names)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        self.q_proj = nn.Linear(spec.width, spec.width, bias=False)
        self.k_proj = nn.Linear(spec.width, spec.kv_width, bias=False)
        self.v_proj = nn.Linear(spec.width, spec.kv_width, bias=False)
        self.o_proj = nn.Linear(spec.width, spec.width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, tuple | None]:
        """Output, and with ``past`` (a cached decode: the cached k, v) the k, v extended by x's."""
        batch, seq, width = x.shape
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        gqa = self.kv_heads != self.heads
        if past is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            return self.o_proj(out.transpose(1, 2).reshape(batch, seq, width)), None
        held = past[0].shape[2]
        if held:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        out = _cached_attention(q, k, v, held, gqa)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, width)), (k, v)


class MLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.width, spec.ffn, bias=False)
        self.up_proj = nn.Linear(spec.width, spec.ffn, bias=False)
        self.down_proj = nn.Linear(spec.ffn, spec.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm Llama layer: attention, then the SwiGLU MLP, each a residual write."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.width, spec.norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.width, spec.norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None,
                basis: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple | None]:
        """With ``basis`` (a subspace-constrained model) each residual write is projected onto its span."""
        attended, kv = self.self_attn(self.input_layernorm(x), cos, sin, past)
        x = x + (attended if basis is None else subspace.project(attended, basis))
        written = self.mlp(self.post_attention_layernorm(x))
        return x + (written if basis is None else subspace.project(written, basis)), kv

    def reset_parameters(self, generator: torch.Generator, n_layers: int) -> None:
        """N(0, 0.02) matrices, residual writes scaled down by depth, norms at 1."""
        with torch.no_grad():
            self.input_layernorm.weight.fill_(1.0)
            self.post_attention_layernorm.weight.fill_(1.0)
            residual_std = INIT_STD / math.sqrt(2 * n_layers)  # two residual writes per layer
            attn, mlp = self.self_attn, self.mlp
            for linear, std in ((attn.q_proj, INIT_STD), (attn.k_proj, INIT_STD), (attn.v_proj, INIT_STD),
                                (attn.o_proj, residual_std), (mlp.gate_proj, INIT_STD), (mlp.up_proj, INIT_STD),
                                (mlp.down_proj, residual_std)):
                linear.weight.normal_(0.0, std, generator=generator)


class StageModule(nn.Module):
    """The layers of one stage of ``spec``, with the embedding on stage 0 and the head on the last."""

    def __init__(self, spec: ModelSpec, stage: int, sub: subspace.Subspace | None = None) -> None:
        super().__init__()
        if not 0 <= stage < spec.n_stages:
            raise ConfigError(f"model {spec.name} has stages 0..{spec.last_stage}, not {stage}")
        self.spec = spec
        self.stage = stage
        self.start, self.end = spec.stage_range(stage)
        self.is_first = stage == 0
        self.is_last = stage == spec.last_stage
        self.embed_tokens = nn.Embedding(spec.vocab, spec.width) if self.is_first else None
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(self.start, self.end))
        self.norm = RMSNorm(spec.width, spec.norm_eps) if self.is_last else None
        self.lm_head = nn.Linear(spec.width, spec.vocab, bias=False) if self.is_last else None
        # a subspace-constrained model's fixed parts (model.subspace): buffers, never weights nor state
        self.register_buffer("sub_basis", None if sub is None else sub.basis.clone(), persistent=False)
        self.register_buffer("sub_fixed", None if sub is None else sub.fixed.clone(), persistent=False)

    def reset_parameters(self, seed: int) -> None:
        """Set every weight from (model name, seed, part): see the module docstring."""
        name = self.spec.family  # the same weights however the model is cut into stages
        with torch.no_grad():
            if self.is_first:
                assert self.embed_tokens is not None  # the first stage has it
                self.embed_tokens.weight.copy_(initial_embedding(name, seed, self.spec.vocab, self.spec.width))
            for layer, block in zip(range(self.start, self.end), self.layers):
                assert isinstance(block, DecoderLayer)  # what __init__ put there
                block.reset_parameters(part_generator(name, seed, f"block/{layer}"), self.spec.n_layers)
            if self.is_last:
                assert self.norm is not None and self.lm_head is not None  # the last stage has them
                self.norm.weight.fill_(1.0)
                self.lm_head.weight.normal_(0.0, INIT_STD, generator=part_generator(name, seed, "head"))

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T] (stage 0) or hidden states [B, T, width] → hidden states, or logits (last stage).

        With ``cache``: a cached decode of one sequence (module docstring); the cache is extended.
        A subspace-constrained model (``model.subspace``) takes and returns its coordinates [B, T, rank]
        instead of hidden states, and a stage after the first needs the micro-batch's token ``ids``."""
        if cache is not None:
            return self._decode(x, cache)
        width = self.spec.width if self.sub_basis is None else self.sub_basis.shape[1]
        if self.is_first:
            ids, x = x, self._embed(x)
        elif x.dim() != 3 or x.shape[-1] != width or not x.is_floating_point():
            raise ValueError(f"stage {self.stage} takes hidden states [batch, seq, {width}], "
                             f"not {x.dtype} {tuple(x.shape)}")
        elif self.sub_basis is not None:
            if ids is None or ids.shape != x.shape[:2]:
                raise ValueError(f"stage {self.stage} of a subspace model needs the token ids of its input")
            x = subspace.from_coords(x, ids, self.sub_basis, self.sub_fixed)
        cos, sin = rotary(self.spec, x.shape[1], x.device)
        for layer in self.layers:
            x = layer(x, cos, sin, basis=self.sub_basis)[0]
        if self.is_last:
            assert self.norm is not None and self.lm_head is not None  # the last stage has them
            return self.lm_head(self.norm(x))
        if self.sub_basis is not None:
            x = subspace.to_coords(x, ids, self.sub_basis, self.sub_fixed)
        return x

    def _decode(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        past, n = cache.length, x.shape[1]
        if x.shape[0] != 1 or not 0 < past + n <= self.spec.context:
            raise ValueError(f"a cached decode takes one sequence within the context of {self.spec.context}, "
                             f"not {tuple(x.shape)} after {past} positions")
        x = self._embed(x) if self.is_first else x
        cos, sin = rotary(self.spec, past + n, x.device)
        cos, sin = cos[past:], sin[past:]
        layers = []
        for i, layer in enumerate(self.layers):
            held = cache.layers[i] if cache.layers else self._empty_kv(x)
            x, kv = layer(x, cos, sin, held, self.sub_basis)
            layers.append(kv)
        cache.layers, cache.length = layers, past + n
        if self.is_last:
            assert self.norm is not None and self.lm_head is not None  # the last stage has them
            return self.lm_head(self.norm(x[:, -1]))
        return x

    def _empty_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        empty = x.new_empty(1, self.spec.kv_heads, 0, self.spec.head_dim)
        return empty, empty

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.dtype != torch.int64:
            raise ValueError(f"stage 0 takes int64 token ids [batch, seq], not {ids.dtype} {tuple(ids.shape)}")
        seq = ids.shape[1]
        if not 0 < seq <= self.spec.context:
            raise ValueError(f"sequence length {seq} is outside 1..{self.spec.context} of {self.spec.name}")
        assert self.embed_tokens is not None  # only the first stage embeds
        if self.sub_basis is not None:
            return subspace.embed(self.embed_tokens.weight, ids, self.sub_basis, self.sub_fixed)
        return self.embed_tokens(ids)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (nats per token) of the last stage's logits [B, T, vocab] against targets [B, T].

        Computed in float32 whatever the logits' dtype (as transformers does for Llama).
        """
        if not self.is_last:
            raise ValueError(f"stage {self.stage} of {self.spec.name} is not the last stage; it has no loss")
        return F.cross_entropy(logits.reshape(-1, self.spec.vocab).float(), targets.reshape(-1))

    def fixed_parts(self) -> subspace.Subspace | None:
        """A subspace-constrained model's fixed basis and embedding (on the host), or None."""
        if self.sub_basis is None or self.sub_fixed is None:
            return None
        return subspace.Subspace(self.sub_basis.cpu(), self.sub_fixed.cpu())

    def param_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_stage(spec: ModelSpec, stage: int, seed: int, rank: int = 0) -> StageModule:
    """Stage ``stage`` of ``spec`` with its initial weights, a pure function of (spec.name, seed, stage);
    ``rank`` > 0: constrained to a subspace of that many directions (``model.subspace``)."""
    module = StageModule(spec, stage, subspace.build(spec, seed, rank) if rank else None)
    module.reset_parameters(seed)
    return module


def build_model(spec: ModelSpec, seed: int, rank: int = 0) -> list[StageModule]:
    """Every stage of ``spec``, in order: for tests, benchmarks and single-machine training."""
    return [build_stage(spec, stage, seed, rank) for stage in range(spec.n_stages)]


def run_stages(stages: Sequence[StageModule], ids: torch.Tensor) -> torch.Tensor:
    """Token ids through stages 0..S-1 in turn: the logits of the whole model."""
    x = ids
    for module in stages:
        x = module(x, ids=ids)  # a subspace model's later stages rebuild their input from the ids
    return x
