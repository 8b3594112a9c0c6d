"""A GGUF file's metadata as the Hugging Face `config.json` dict the runtime already reads.

`hf_config_from_gguf(file)` maps llama.cpp's `<arch>.*` keys (block count, embedding length,
heads, feed-forward length, RMS epsilon, rope base and scaling, context length) onto Hugging Face
names, and settles what llama.cpp leaves to the tensors: tied embeddings (no `output.weight`),
attention and MLP biases (bias tensors present), Llama 3.1 rope scaling (the `rope_freqs`
tensor of per-frequency divisors, kept as `rope_freq_factors`). Architectures: `llama` (Llama
2/3, Mistral-style, SmolLM2, ...), `qwen2`, `qwen3`; any other raises `ModelLoadError` naming it.

Not here: tensor data (`tensors.py`), the tokenizer (`tokenizer.py`), the runtime's own checks
of the dict (`ModelConfig.from_path`).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from arborlm.errors import ModelLoadError
from arborlm.runtime.models.gguf.files import metadata_value, open_gguf, require_value

# GGUF `general.architecture` -> (Hugging Face architectures entry, model_type).
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# `<arch>.<key>` -> Hugging Face config key, for keys every supported architecture writes.
_REQUIRED_KEYS = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
}
_ROPE_SCALING_TYPES = {"linear": "linear"}  # llama.cpp name -> rotary.py's; "none" = unscaled

# llama.cpp's end-of-generation ids besides EOS (Llama 3's <|eot_id|>, <|eom_id|>).
_EXTRA_EOS_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def gguf_architecture(reader: Any, file: str | os.PathLike) -> str:
    """`general.architecture`, checked against the supported ones."""
    arch = str(require_value(reader, "general.architecture", file))
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{file}: GGUF architecture {arch!r} is not supported; supported: "
                             f"{', '.join(sorted(GGUF_ARCHITECTURES))}")
    return arch


def hf_config_from_gguf(file: str | os.PathLike) -> dict[str, Any]:
    """The Hugging Face config dict equivalent to the metadata of GGUF `file`."""
    reader = open_gguf(file)
    arch = gguf_architecture(reader, file)
    hf_arch, model_type = GGUF_ARCHITECTURES[arch]
    hf: dict[str, Any] = {"architectures": [hf_arch], "model_type": model_type}
    for key, hf_key in _REQUIRED_KEYS.items():
        hf[hf_key] = int(require_value(reader, f"{arch}.{key}", file))

    def value(key: str, default: Any = None) -> Any:
        return metadata_value(reader, f"{arch}.{key}", default)

    heads = hf["num_attention_heads"]
    hf["num_key_value_heads"] = int(value("attention.head_count_kv", heads))
    hf["head_dim"] = int(value("attention.key_length", 0) or value("rope.dimension_count", 0)
                         or hf["hidden_size"] // heads)
    hf["rms_norm_eps"] = float(value("attention.layer_norm_rms_epsilon", 1e-6))
    hf["max_position_embeddings"] = int(value("context_length", 4096))
    tensor_names = {t.name for t in reader.tensors}
    hf["vocab_size"] = _vocab_size(reader, arch, tensor_names, file)
    hf["tie_word_embeddings"] = "output.weight" not in tensor_names
    hf["attention_bias"] = arch == "llama" and "blk.0.attn_q.bias" in tensor_names
    hf["mlp_bias"] = "blk.0.ffn_gate.bias" in tensor_names
    hf.update(_rope_settings(reader, arch, hf, file))
    hf.update(_special_ids(reader))
    return hf


def _vocab_size(reader: Any, arch: str, tensor_names: set[str],
                file: str | os.PathLike) -> int:
    size = metadata_value(reader, f"{arch}.vocab_size")
    if size is not None:
        return int(size)
    if "token_embd.weight" not in tensor_names:
        raise ModelLoadError(f"{file}: no token_embd.weight tensor")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return int(embd.shape[1])  # GGUF order: [hidden, vocab]


def _rope_settings(reader: Any, arch: str, hf: dict[str, Any],
                   file: str | os.PathLike) -> dict[str, Any]:
    theta = float(metadata_value(reader, f"{arch}.rope.freq_base", 10000.0))
    out: dict[str, Any] = {"rope_theta": theta}
    kind = metadata_value(reader, f"{arch}.rope.scaling.type", "none")
    factor = float(metadata_value(reader, f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if kind not in ("none", "") and factor != 1.0:
        if kind not in _ROPE_SCALING_TYPES:
            raise ModelLoadError(f"{file}: rope scaling {kind!r} is not supported (supported: "
                                 f"{', '.join(_ROPE_SCALING_TYPES)}, none)")
        out["rope_scaling"] = {"rope_type": _ROPE_SCALING_TYPES[kind], "factor": factor}
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        if "rope_scaling" in out:
            raise ModelLoadError(f"{file}: both rope scaling {kind!r} and rope_freqs factors")
        factors = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
        if factors.size != hf["head_dim"] // 2:
            raise ModelLoadError(f"{file}: rope_freqs has {factors.size} factors, expected "
                                 f"{hf['head_dim'] // 2}")
        out["rope_freq_factors"] = [float(f) for f in factors]
    return out


def _special_ids(reader: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    bos = metadata_value(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        out["bos_token_id"] = int(bos)
    eos = [metadata_value(reader, key) for key in ("tokenizer.ggml.eos_token_id",
                                                   *_EXTRA_EOS_KEYS)]
    eos_ids = list(dict.fromkeys(int(i) for i in eos if i is not None))
    if eos_ids:
        out["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    return out
