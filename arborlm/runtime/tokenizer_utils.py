"""Loading a tokenizer and turning prompts into token ids (no model code)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from arborlm.errors import ModelLoadError


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise ModelLoadError(f"tokenizer directory not found: {path}")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from e


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a prompt, with the tokenizer's special tokens (BOS) as the model expects."""
    return list(tokenizer.encode(text))
