"""Writing test GGUF files the way llama.cpp's converter does, from the repo's tiny HF models.

`write_gguf(hf_dir, out, qtype)` writes the model's config as `<arch>.*` metadata, its
byte-level BPE tokenizer as `tokenizer.ggml.*`, and its tensors under llama.cpp names, with the
converter's row permutation of `attn_q` / `attn_k` for the llama architecture. 2-D weights are
stored in `qtype`: quantized with `gguf.quants.quantize` where the package can, else (K-quants)
as random blocks of small scales, so the file's weights differ from the HF model's and tests
compare against a reference decode of the file. Norms and biases stay F32, as llama.cpp keeps
them. Not a converter for real checkpoints.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from arborlm.runtime.models.loader import iter_checkpoint
from tests.runtime.gguf_reference import random_blocks

T = GGMLQuantizationType
_QUANTIZABLE = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1}
_HF_TO_GGUF = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def gguf_name(hf_name: str) -> str:
    module, _, leaf = hf_name.rpartition(".")
    if module in _HF_TO_GGUF:
        return f"{_HF_TO_GGUF[module]}.{leaf}"
    _, _, layer, rest = module.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{_HF_TO_GGUF[rest]}.{leaf}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute` (n_head already the kv count for k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def _store(w: np.ndarray, qtype: T, rng: np.random.Generator) -> tuple[np.ndarray, T]:
    if w.ndim == 1 or qtype == T.F32:
        return w.astype(np.float32), T.F32
    if qtype in _QUANTIZABLE:
        return quantize(w.astype(np.float32), qtype), qtype
    block = GGML_QUANT_SIZES[qtype][0]
    blocks = random_blocks(qtype, w.size // block, rng,
                           scales=np.array([0.002, 0.004, -0.003], np.float16))
    return blocks.reshape(w.shape[0], -1), qtype


def write_gguf(hf_dir: str | Path, out: str | Path, qtype: T = T.F32,
               rope_freqs: np.ndarray | None = None, seed: int = 0,
               zero_typed: dict[str, T] | None = None, metadata: dict | None = None) -> Path:
    """Write `out`; `zero_typed` stores the named tensors as all-zero bytes of another type
    (any GGML type: for refusal tests), `metadata` adds raw key-values."""
    hf_dir, out = Path(hf_dir), Path(out)
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["model_type"]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = GGUFWriter(str(out), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    writer.add_vocab_size(cfg["vocab_size"])
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    else:
        writer.add_rope_dimension_count(head_dim)
    _add_tokenizer(writer, hf_dir)
    for key, value in (metadata or {}).items():
        writer.add_uint32(key, value) if isinstance(value, int) else writer.add_string(key, value)
    rng = np.random.default_rng(seed)
    for name, tensor in iter_checkpoint(hf_dir):
        w = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            w = llama_cpp_permute(w, heads)
        elif arch == "llama" and ".k_proj." in name:
            w = llama_cpp_permute(w, kv_heads)
        data, stored = _store(w, qtype, rng)
        if zero_typed and gguf_name(name) in zero_typed:
            stored = zero_typed[gguf_name(name)]
            block, size = GGML_QUANT_SIZES[stored]
            data = np.zeros((w.shape[0], w.shape[-1] // block * size), np.uint8)
        writer.add_tensor(gguf_name(name), data, raw_dtype=None if stored == T.F32 else stored)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """The `rope_freqs` tensor convert_hf_to_gguf.py writes for a llama3-scaled model."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_tokenizer(writer: GGUFWriter, hf_dir: Path) -> None:
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    for added in spec["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {a["content"] for a in spec["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    for key, text in (("bos", "<s>"), ("eos", "</s>"), ("unk", "<unk>"), ("pad", "<pad>")):
        getattr(writer, f"add_{key}_token_id")(vocab[text])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    template = tok_cfg.get("chat_template")
    if template is None and (hf_dir / "chat_template.jinja").is_file():
        template = (hf_dir / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)
