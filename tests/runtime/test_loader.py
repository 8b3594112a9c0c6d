"""Checkpoint loading: which files are read, what lands in which parameter, and the errors.

Covers single-file and sharded checkpoints, tied and untied embeddings, float32/bfloat16/auto
dtypes, and a clear `ModelLoadError` (naming the path or tensor) for an unknown architecture,
a missing config.json, missing weight files or shards, missing, unexpected or misshapen
tensors, unsupported rope types and sliding windows.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from arborlm.errors import ModelLoadError
from arborlm.runtime.config import ModelConfig
from arborlm.runtime.models.factory import tiny_model
from arborlm.runtime.models.loader import checkpoint_files, iter_checkpoint
from arborlm.runtime.models.registry import get_model_class, load_model


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    file = path / "config.json"
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


def _rewrite_weights(path: Path, edit) -> None:
    """Load model.safetensors, let `edit(tensors)` change the dict, write it back."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return dict(iter_checkpoint(path))


def test_parameters_hold_the_checkpoint_tensors() -> None:
    path = tiny_model("qwen2")
    ckpt = _checkpoint(path)
    model = load_model(ModelConfig.from_path(path, "float32"))
    attn = model.model.layers[1].self_attn
    prefix = "model.layers.1.self_attn"
    qkv = torch.cat([ckpt[f"{prefix}.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, qkv)
    assert torch.equal(attn.qkv_proj.bias, torch.cat([ckpt[f"{prefix}.{p}_proj.bias"]
                                                      for p in "qkv"]))
    mlp = model.model.layers[0].mlp
    gate_up = torch.cat([ckpt["model.layers.0.mlp.gate_proj.weight"],
                         ckpt["model.layers.0.mlp.up_proj.weight"]])
    assert torch.equal(mlp.gate_up_proj.weight, gate_up)
    assert torch.equal(model.model.norm.weight, ckpt["model.norm.weight"])
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())


def test_untied_embeddings_are_separate() -> None:
    path = tiny_model("llama")
    ckpt = _checkpoint(path)
    model = load_model(ModelConfig.from_path(path, "float32"))
    assert torch.equal(model.lm_head.weight, ckpt["lm_head.weight"])
    assert torch.equal(model.model.embed_tokens.weight, ckpt["model.embed_tokens.weight"])
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_tied_embeddings_share_the_embedding_matrix() -> None:
    path = tiny_model("qwen2", tie_word_embeddings=True)
    assert "lm_head.weight" not in _checkpoint(path)
    model = load_model(ModelConfig.from_path(path, "float32"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hidden = torch.randn(3, 64)
    expected = hidden @ model.model.embed_tokens.weight.T
    torch.testing.assert_close(model.compute_logits(hidden), expected)


def test_sharded_checkpoint_loads_like_single_file() -> None:
    single = tiny_model("qwen3")
    sharded = tiny_model("qwen3", num_shards=3)
    files = checkpoint_files(sharded)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    a = load_model(ModelConfig.from_path(single, "float32")).state_dict()
    b = load_model(ModelConfig.from_path(sharded, "float32")).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bfloat16_option_casts_a_float32_checkpoint() -> None:
    path = tiny_model("llama")
    ckpt = _checkpoint(path)
    model = load_model(ModelConfig.from_path(path, "bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary.cos.dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight, ckpt["lm_head.weight"].to(torch.bfloat16))


def test_auto_dtype_is_the_checkpoints() -> None:
    path = tiny_model("mistral", dtype="bfloat16")
    ckpt = _checkpoint(path)
    assert ckpt["model.norm.weight"].dtype == torch.bfloat16
    config = ModelConfig.from_path(path, "auto")
    assert config.dtype == torch.bfloat16
    model = load_model(config)
    assert torch.equal(model.model.embed_tokens.weight, ckpt["model.embed_tokens.weight"])
    upcast = load_model(ModelConfig.from_path(path, "float32"))
    assert upcast.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(upcast.model.embed_tokens.weight,
                       ckpt["model.embed_tokens.weight"].float())


def test_unknown_architecture_is_rejected(tmp_path: Path) -> None:
    path = _copy(tiny_model("llama"), tmp_path)
    _edit_config(path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        ModelConfig.from_path(path)
    with pytest.raises(ModelLoadError, match="no model implementation for architecture 'gpt2'"):
        get_model_class("gpt2")


def test_missing_config_json(tmp_path: Path) -> None:
    path = _copy(tiny_model("llama"), tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        ModelConfig.from_path(path)


def test_missing_weights_name_the_directory(tmp_path: Path) -> None:
    path = _copy(tiny_model("llama"), tmp_path)
    config = ModelConfig.from_path(path, "float32")
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"no safetensors weights in .*model.*pytorch_model"):
        load_model(config)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    path = _copy(tiny_model("qwen3", num_shards=3), tmp_path)
    config = ModelConfig.from_path(path, "float32")
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing: .*model-00002-of-00003.safetensors"):
        load_model(config)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    path = _copy(tiny_model("llama"), tmp_path)
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor.*layers\.1\.self_attn\.k_proj"):
        load_model(ModelConfig.from_path(path, "float32"))


def test_untied_checkpoint_without_lm_head_is_an_error(tmp_path: Path) -> None:
    path = _copy(tiny_model("llama"), tmp_path)
    _rewrite_weights(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        load_model(ModelConfig.from_path(path, "float32"))


def test_misshapen_tensor_is_named(tmp_path: Path) -> None:
    path = _copy(tiny_model("llama"), tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite_weights(path, lambda t: t.update({name: t[name][:100].contiguous()}))
    with pytest.raises(ModelLoadError, match=rf"{path}.*{name}.*\(100, 64\).*\(128, 64\)"):
        load_model(ModelConfig.from_path(path, "float32"))


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    """A Qwen2 checkpoint (q/k/v biases) labelled as Llama must not load silently."""
    path = _copy(tiny_model("qwen2"), tmp_path)
    _edit_config(path, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(ModelLoadError, match=r"unexpected tensor .*_proj\.bias"):
        load_model(ModelConfig.from_path(path, "float32"))


def test_corrupt_weight_file(tmp_path: Path) -> None:
    path = _copy(tiny_model("llama"), tmp_path)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ModelLoadError, match="cannot read weight file .*model.safetensors"):
        load_model(ModelConfig.from_path(path, "float32"))


def test_unsupported_rope_type(tmp_path: Path) -> None:
    path = _copy(tiny_model("llama"), tmp_path)
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    _edit_config(path, rope_scaling=yarn, rope_parameters=yarn)
    with pytest.raises(ModelLoadError, match="rope type 'yarn' is not supported"):
        load_model(ModelConfig.from_path(path, "float32"))


def test_sliding_window_shorter_than_context(tmp_path: Path) -> None:
    path = _copy(tiny_model("mistral"), tmp_path)
    _edit_config(path, sliding_window=64)
    with pytest.raises(ModelLoadError, match="sliding-window attention.*context_length <= 64"):
        load_model(ModelConfig.from_path(path, "float32"))
    model = load_model(ModelConfig.from_path(path, "float32", context_length=64))
    assert model.model.rotary.cos.shape[0] == 64
