"""`ModelConfig`: what the runtime needs to know about a checkpoint, and where it reads it from.

A model directory's `config.json`, or a GGUF file's metadata; `SUPPORTED_ARCHITECTURES` maps
the Hugging Face architectures the runtime implements to its model families.
`arborlm.runtime.config` re-exports both.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from arborlm.errors import ModelLoadError
from arborlm.runtime.options import DTYPES, DType, check_choice

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    """The parts of a Hugging Face `config.json` the runtime uses."""

    path: str  # the model directory, or the GGUF file
    architecture: str  # "llama" | "qwen2" | "qwen3"
    hf_config: dict[str, Any]
    dtype: torch.dtype
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_path(cls, path: str | os.PathLike, dtype: str = "auto",
                  context_length: int | None = None) -> ModelConfig:
        p, hf = _read_hf_config(Path(path))
        archs = hf.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES),
                    None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or hf.get('model_type')!r} in {p}; supported: "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        head_dim = hf.get("head_dim") or hidden // num_heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        ctx = hf.get("max_position_embeddings", 4096)
        if context_length is not None:
            ctx = context_length
        return cls(
            path=str(p),
            architecture=arch,
            hf_config=hf,
            dtype=_resolve_dtype(dtype, hf),
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            context_length=ctx,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
        )

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _read_hf_config(p: Path) -> tuple[Path, dict[str, Any]]:
    """(the checkpoint's path, its Hugging Face config dict): a directory's `config.json`, or
    the metadata of a GGUF file (`p` itself, or the one `.gguf` in directory `p`)."""
    from arborlm.runtime.models.gguf.files import find_gguf_file

    gguf_file = find_gguf_file(p)
    if gguf_file is not None:
        from arborlm.runtime.models.gguf.metadata import hf_config_from_gguf

        return gguf_file, hf_config_from_gguf(gguf_file)
    if not p.is_dir():
        raise ModelLoadError(f"model directory not found: {p}")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"no config.json in model directory {p}")
    try:
        return p, json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"config.json in {p} is not valid JSON: {e}") from e


def _resolve_dtype(dtype: str, hf: dict[str, Any]) -> torch.dtype:
    if check_choice(DType, dtype, "dtype") == DType.AUTO:
        name = hf.get("torch_dtype") or hf.get("dtype") or DType.FLOAT32
        return DTYPES.get(name, torch.float32)
    return DTYPES[dtype]
