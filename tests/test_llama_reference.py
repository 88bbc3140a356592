"""Our stages are transformers' LlamaForCausalLM: the same weights under HF's names give the same logits."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the reference Llama is transformers' (dev extra)")

from p2pswarm.errors import LocalProtocolError  # noqa: E402
from p2pswarm.model.catalog import ModelSpec  # noqa: E402
from p2pswarm.model.hf_names import HF_NAMES, hf_name, hf_state_dict, llama_config  # noqa: E402
from p2pswarm.model.transformer import build_model, run_stages  # noqa: E402

GQA = ModelSpec("ref-gqa", n_layers=4, stage_size=2, width=64, heads=4, kv_heads=2, ffn=160, context=64)
MHA = ModelSpec("ref-mha", n_layers=4, stage_size=2, width=64, heads=4, ffn=160, context=64, rope_theta=500000.0)
TOLERANCE = 1e-4  # float32 on both sides: only summation order differs


def reference(spec: ModelSpec, stages, attention: str):
    config = transformers.LlamaConfig(**llama_config(spec))
    config._attn_implementation = attention
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(hf_state_dict(stages), strict=True)
    return model


@pytest.mark.parametrize("spec", [GQA, MHA], ids=lambda s: s.name)
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_our_logits_are_transformers_llama_logits(spec, attention):
    stages = build_model(spec, seed=5)
    for stage in stages:  # norms away from 1, so a misplaced norm weight would show
        for name, param in stage.named_parameters():
            if name.endswith("norm.weight"):
                param.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    model = reference(spec, stages, attention)
    ids = torch.randint(0, spec.vocab, (3, spec.context), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = run_stages(stages, ids)
        theirs = model(input_ids=ids).logits
    assert ours.shape == theirs.shape == (3, spec.context, spec.vocab)
    assert (ours - theirs).abs().max().item() <= TOLERANCE


def test_every_weight_has_one_hf_name():
    stages = build_model(GQA, seed=0)
    names = hf_state_dict(stages)
    assert len(names) == sum(len(s.state_dict()) for s in stages) == 2 + 1 + GQA.n_layers * 9
    assert hf_name("layers.1.mlp.down_proj.weight", 2) == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("lm_head.weight", 2) == "lm_head.weight"
    assert all(name.count("{}") <= 1 for name in HF_NAMES)
    for bad in ["layers.x.mlp.up_proj.weight", "layers.0.mlp.up_proj.bias", "pos.weight", "layers"]:
        with pytest.raises(LocalProtocolError):
            hf_name(bad, 0)
    with pytest.raises(LocalProtocolError):
        hf_state_dict(stages[1:])
    with pytest.raises(LocalProtocolError):
        hf_state_dict([stages[0], stages[0], stages[1]])
