"""Loading a tokenizer and turning prompts into token ids (no model code).

A tokenizer comes from a Hugging Face directory (`AutoTokenizer`) or from a GGUF file's
metadata (`models/gguf/tokenizer.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from arborlm.errors import ModelLoadError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a Hugging Face directory, or the one a GGUF file (or a directory holding
    one GGUF file and no tokenizer files) describes."""
    from transformers import AutoTokenizer

    from arborlm.runtime.models.gguf.files import find_gguf_file

    gguf_file = None if _has_tokenizer_files(Path(path)) else find_gguf_file(path)
    if gguf_file is not None:
        from arborlm.runtime.models.gguf.tokenizer import gguf_tokenizer

        return gguf_tokenizer(gguf_file)
    if not Path(path).is_dir():
        raise ModelLoadError(f"tokenizer directory not found: {path}")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from e


def _has_tokenizer_files(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in _TOKENIZER_FILES)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a prompt, with the tokenizer's special tokens (BOS) as the model expects."""
    return list(tokenizer.encode(text))
