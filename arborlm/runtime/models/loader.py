"""Find a Hugging Face checkpoint's safetensors files and stream its tensors.

`checkpoint_files(dir)` picks the weight files: the shards named in
`model.safetensors.index.json` when it exists, else `model.safetensors`, else every
`*.safetensors` in the directory. `iter_checkpoint(dir)` opens them one at a time with
`safetensors.safe_open` and yields `(name, tensor)` pairs, one tensor in memory at a time, so
a model's weights are read once and never held twice.

Not here: mapping names onto parameters (the model's `load_weights` does that), dtype casting,
GGUF files (`models/gguf/`), `.bin` checkpoints (unsupported: a directory with only those raises
`ModelLoadError`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from arborlm.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files holding the weights of `model_dir`, in load order."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelLoadError(f"model directory not found: {root}")
    index = root / INDEX_FILE
    if index.is_file():
        return _files_from_index(index)
    single = root / SINGLE_FILE
    if single.is_file():
        return [single]
    found = sorted(root.glob("*.safetensors"))
    if found:
        return found
    others = sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".gguf"))
    hint = f" (found {', '.join(others)}; only safetensors is supported)" if others else ""
    raise ModelLoadError(f"no safetensors weights in {root}: expected {SINGLE_FILE} or "
                         f"{INDEX_FILE}{hint}")


def _files_from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{index} is not a valid safetensors index: {e!r}") from e
    names = sorted(set(weight_map.values()))
    files = [index.parent / name for name in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"weight shard(s) listed in {index} are missing: "
                             f"{', '.join(missing)}")
    return files


def iter_checkpoint(model_dir: str | os.PathLike,
                    device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(tensor name, tensor)` for every tensor of the checkpoint, file by file."""
    for path in checkpoint_files(model_dir):
        yield from _iter_file(path, device)


def _iter_file(path: Path, device: str) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        handle = safe_open(str(path), framework="pt", device=device)
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"cannot read weight file {path}: {e}") from e
    with handle as f:
        for name in f.keys():
            try:
                tensor = f.get_tensor(name)
            except (SafetensorError, OSError) as e:
                raise ModelLoadError(f"cannot read tensor {name!r} from {path}: {e}") from e
            yield name, tensor
