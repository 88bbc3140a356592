"""The small JSON and tokenizer files of an exported Hugging Face model directory.

``config.json`` (Llama), ``generation_config.json``, ``tokenizer_config.json`` and, for the
byte-level run, a ``tokenizers`` byte-level BPE with no merges whose ids are the byte values;
``model.hf_export`` writes them beside the weights. Pure: no torch, no transformers (the
``tokenizers`` package only when the byte-level tokenizer is built).
"""

from __future__ import annotations

from p2pswarm.model.catalog import ModelSpec
from p2pswarm.model.hf_names import llama_config

TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # the generic tokenizers-backed class: no custom code


def config_json(spec: ModelSpec) -> dict:
    """config.json: ``LlamaConfig(**llama_config(spec))`` as transformers writes it, fp32."""
    values = llama_config(spec)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **values,
            "rope_theta": spec.rope_theta, "torch_dtype": "float32", "dtype": "float32", "use_cache": True,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def generation_config_json(spec: ModelSpec) -> dict:
    """Greedy up to the context: the model has no end-of-text token (bytes, or the run's BPE as trained)."""
    return {"do_sample": False, "max_length": spec.context}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte value -> the printable character ``tokenizers``' ByteLevel uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(printable, map(chr, printable))), 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(chars.items()))


def byte_tokenizer_json() -> str:
    """A ``tokenizers`` file whose ids are the byte values: byte-level BPE with no merges, no regex split."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab={char: b for b, char in bytes_to_unicode().items()}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer.to_str()


def tokenizer_config_json(spec: ModelSpec) -> dict:
    return {"tokenizer_class": TOKENIZER_CLASS, "model_max_length": spec.context,
            "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False}
