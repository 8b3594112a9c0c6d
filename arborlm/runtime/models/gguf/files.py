"""Which paths are GGUF checkpoints, and opening one (`GGUFReader`, memory-mapped, cached).

A model path is GGUF when it is a `.gguf` file, or a directory holding exactly one `.gguf` file
and no safetensors weights (several are refused as ambiguous). Split files (llama.cpp's
`gguf-split` shards, named `*-00001-of-00003.gguf` or carrying `split.count` > 1) are refused:
merge them with `llama-gguf-split --merge` first. `metadata_value` reads one key-value field
as a Python value.

Not here: what the metadata means (`metadata.py`), tensors (`tensors.py`), the tokenizer
(`tokenizer.py`). The `gguf` package is imported only when a file is opened.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arborlm.errors import ModelLoadError

if TYPE_CHECKING:
    from gguf import GGUFReader

GGUF_SUFFIX = ".gguf"
_SPLIT_NAME = re.compile(r"-\d{5}-of-(\d{5})\.gguf$")


def find_gguf_file(path: str | os.PathLike) -> Path | None:
    """The GGUF file `path` names, or None when `path` is not a GGUF checkpoint.

    A directory with safetensors files is a Hugging Face checkpoint even if it also holds
    `.gguf` files. Raises `ModelLoadError` for a directory with several `.gguf` files and for
    split files.
    """
    p = Path(path)
    if p.is_file():
        if p.suffix != GGUF_SUFFIX:
            return None
        _refuse_split_name(p)
        return p
    if not p.is_dir():
        if p.suffix == GGUF_SUFFIX:
            raise ModelLoadError(f"GGUF file not found: {p}")
        return None
    found = sorted(f for f in p.iterdir() if f.suffix == GGUF_SUFFIX and f.is_file())
    if not found or any(p.glob("*.safetensors")):
        return None  # a Hugging Face checkpoint (pass a .gguf file beside one to load that)
    if len(found) > 1:
        if all(_SPLIT_NAME.search(f.name) for f in found):
            _refuse_split_name(found[0])
        raise ModelLoadError(f"{p} holds {len(found)} GGUF files "
                             f"({', '.join(f.name for f in found)}); pass one of them")
    _refuse_split_name(found[0])
    return found[0]


def _refuse_split_name(file: Path) -> None:
    match = _SPLIT_NAME.search(file.name)
    if match and int(match.group(1)) > 1:
        raise ModelLoadError(_split_message(file, int(match.group(1))))


def _split_message(file: Path, count: int) -> str:
    return (f"{file} is one part of a split GGUF ({count} files); split GGUF files are not "
            "supported: merge them into one with `llama-gguf-split --merge` first")


def open_gguf(file: str | os.PathLike) -> GGUFReader:
    """A memory-mapped reader of `file` (cached per file version: parsing the metadata of a
    large vocabulary takes seconds, and config, weights and tokenizer all read it)."""
    p = Path(file).resolve()
    try:
        stat = p.stat()
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file {p}: {e}") from e
    reader = _cached_reader(str(p), stat.st_mtime_ns, stat.st_size)
    count = metadata_value(reader, "split.count", 1)
    if int(count) > 1:
        raise ModelLoadError(_split_message(p, int(count)))
    return reader


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int) -> GGUFReader:
    from gguf import GGUFReader

    try:
        return GGUFReader(path, "r")
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e


def metadata_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """The value of metadata `key` (str, int, float, bool, or a list of them), else `default`."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def require_value(reader: GGUFReader, key: str, file: str | os.PathLike) -> Any:
    """`metadata_value` for a key the file must have; `ModelLoadError` naming it otherwise."""
    value = metadata_value(reader, key)
    if value is None:
        raise ModelLoadError(f"{file}: GGUF metadata key {key!r} is missing")
    return value
