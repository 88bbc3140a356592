"""Our stage weights under transformers' ``LlamaForCausalLM`` names, and its config for a spec.

Our modules are named as HF's, so the map is a renaming: the ``model.`` prefix, and the layer
index, which is local to a stage (0..stage_size-1) in ours and global in HF's (the stage's
first layer + local). One explicit dict with ``{}`` templates for the layer index, as litgpt's
converters do. ``hf_state_dict`` joins the stages of a whole model into one HF state dict that
``LlamaForCausalLM(LlamaConfig(**llama_config(spec))).load_state_dict(..., strict=True)``
accepts (a test holds our logits to transformers').

Importable without torch: it only renames keys.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from p2pswarm.errors import LocalProtocolError
from p2pswarm.model.catalog import ModelSpec

HF_NAMES = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "layers.{}.input_layernorm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.self_attn.q_proj.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.self_attn.k_proj.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.self_attn.v_proj.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.self_attn.o_proj.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.post_attention_layernorm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "layers.{}.mlp.gate_proj.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.mlp.up_proj.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.mlp.down_proj.weight": "model.layers.{}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
HF_ROPE_TYPE = "default"  # plain rotary positions, no scaling: what p2pswarm.model.transformer computes


class _Stage(Protocol):
    """What ``hf_state_dict`` needs of a stage (a ``transformer.StageModule``)."""

    start: int
    end: int
    is_first: bool
    is_last: bool

    def state_dict(self) -> Mapping[str, Any]: ...


def hf_name(our_name: str, stage_start: int) -> str:
    """HF's name of one of our weights, in a stage whose first layer is ``stage_start``."""
    head, dot, rest = our_name.partition(".")
    if head == "layers" and dot:
        local, _, tail = rest.partition(".")
        if local.isdigit() and f"layers.{{}}.{tail}" in HF_NAMES:
            return HF_NAMES[f"layers.{{}}.{tail}"].format(stage_start + int(local))
    elif our_name in HF_NAMES:
        return HF_NAMES[our_name]
    raise LocalProtocolError(f"{our_name!r} is not a weight of p2pswarm's Llama layout")


def hf_state_dict(stages: Sequence[_Stage]) -> dict[str, Any]:
    """The weights of a whole model, stages 0..S-1 in order, under HF's names (tensors not copied)."""
    if not stages or not stages[0].is_first or not stages[-1].is_last:
        raise LocalProtocolError("an HF state dict needs every stage, from the first to the last")
    for before, after in itertools.pairwise(stages):
        if after.start != before.end:
            raise LocalProtocolError(f"stages do not chain: layers {before.start}:{before.end} then "
                                     f"{after.start}:{after.end}")
    return {hf_name(name, stage.start): tensor for stage in stages for name, tensor in stage.state_dict().items()}


def llama_config(spec: ModelSpec) -> dict[str, Any]:
    """Keyword arguments of transformers' ``LlamaConfig`` for the model ``spec`` describes."""
    return {
        "vocab_size": spec.vocab, "hidden_size": spec.width, "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.n_layers, "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim, "hidden_act": "silu",
        "max_position_embeddings": spec.context, "rms_norm_eps": spec.norm_eps,
        "rope_parameters": {"rope_type": HF_ROPE_TYPE, "rope_theta": spec.rope_theta},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    }
