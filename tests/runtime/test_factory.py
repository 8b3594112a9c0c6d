"""Tests for the built-in model generator: default model, tiny test models, tokenizers, caching."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from arborlm.runtime.models import factory
from arborlm.runtime.models.factory import build_model, build_tokenizer, cache_root

REPO_ROOT = Path(__file__).resolve().parents[2]
MULTIBYTE_TEXT = "café naïve 你好世界 🚀 κόσμε"


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _logits(path: Path, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(path))
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]  # [T, vocab]


def test_default_model_is_a_loadable_llama(default_model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(str(default_model_dir))
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers) == (512, 8)
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 4)
    assert config.intermediate_size == 1408 and config.max_position_embeddings == 4096
    assert config.tie_word_embeddings
    raw = json.loads((default_model_dir / "config.json").read_text())
    assert raw["torch_dtype"] == "float32" and raw["rope_theta"] == 10000.0

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    assert len(tok) >= 32000 and config.vocab_size == len(tok)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3

    model = LlamaForCausalLM.from_pretrained(str(default_model_dir))
    ids = tok("The cache server reads a token.").input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits  # [1, T, vocab]
    assert logits.shape == (1, len(ids), config.vocab_size)
    assert torch.isfinite(logits).all()


def test_default_tokenizer_is_a_real_byte_level_bpe(default_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    ids = tok("hello world").input_ids
    assert ids[0] == tok.bos_token_id and tok.eos_token_id not in ids
    assert len(tok("the", add_special_tokens=False).input_ids) == 1  # a merged word
    encoded = tok(MULTIBYTE_TEXT, add_special_tokens=False).input_ids
    assert tok.decode(encoded) == MULTIBYTE_TEXT
    multibyte = [t for t in range(len(tok)) if not tok.decode([t]).isascii()
                 and "\ufffd" not in tok.decode([t])]
    assert len(multibyte) > 50  # whole multi-byte characters merged into tokens


def test_chat_template_renders_all_roles(default_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Add one."}]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "2"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nAdd one.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        "<|im_end|>\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    with_tools = tok.apply_chat_template(messages[:2], tools=tools, tokenize=False)
    assert with_tools.startswith("<s><|im_start|>system\nBe brief.\n\nYou can call these tools")
    assert with_tools.count("<|im_start|>system") == 1 and '"name": "add"' in with_tools
    ids = tok.apply_chat_template(messages[:2], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == tok.bos_token_id and ids[1] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tok.bos_token_id) == 1


def test_tokenizer_training_is_deterministic(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    files = []
    for run in ("a", "b"):
        monkeypatch.setenv("ARBORLM_CACHE_DIR", str(tmp_path / run))
        tok = build_tokenizer(1000, out_dir=tmp_path / f"out-{run}")
        assert len(tok) == 1000
        files.append((tmp_path / f"out-{run}" / "tokenizer.json").read_bytes())
    assert files[0] == files[1]
    with pytest.raises(ValueError):
        build_tokenizer(100)


def test_build_model_is_deterministic(tmp_path: Path) -> None:
    kwargs = dict(vocab_size=512, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    first = _tensors(build_model(tmp_path / "a", "qwen2", seed=3, **kwargs))
    second = _tensors(build_model(tmp_path / "b", "qwen2", seed=3, **kwargs))
    other = _tensors(build_model(tmp_path / "c", "qwen2", seed=4, **kwargs))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json").read_bytes()


def test_tiny_arch_loads_and_runs(tiny_model_path: Path) -> None:
    config = AutoConfig.from_pretrained(str(tiny_model_path))
    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    assert config.vocab_size == len(tok) == 512
    assert config.eos_token_id == tok.eos_token_id and config.pad_token_id == tok.pad_token_id
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path))
    assert type(model).__name__ == config.architectures[0]
    ids = tok("def cache(x): return x + 1").input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]  # [T, vocab]
    assert logits.shape == (len(ids), 512) and torch.isfinite(logits).all()
    top2 = logits[-1].topk(2).values
    assert top2[0] - top2[1] > 1e-3  # init_std 0.2 makes greedy choices decisive

    tensors = _tensors(tiny_model_path)
    norm = tensors["model.layers.0.input_layernorm.weight"]
    assert not torch.allclose(norm, torch.ones_like(norm))  # a dropped norm would show
    raw = json.loads((tiny_model_path / "config.json").read_text())
    arch = raw["model_type"]
    has_bias = "model.layers.0.self_attn.q_proj.bias" in tensors
    assert has_bias == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in tensors) == (arch == "qwen3")
    if raw["rope_scaling"] is not None:
        assert arch == "llama" and raw["rope_scaling"]["rope_type"] == "llama3"
        assert raw["rope_theta"] == 500000.0
    if arch == "mistral":
        assert raw["sliding_window"] is None


def test_all_archs_are_generated(make_tiny_model) -> None:
    kinds = {}
    for arch in ("llama", "llama3", "mistral", "qwen2", "qwen3"):
        raw = json.loads((make_tiny_model(arch) / "config.json").read_text())
        kinds[arch] = (raw["architectures"][0], (raw["rope_scaling"] or {}).get("rope_type"))
    assert kinds == {
        "llama": ("LlamaForCausalLM", None), "llama3": ("LlamaForCausalLM", "llama3"),
        "mistral": ("MistralForCausalLM", None), "qwen2": ("Qwen2ForCausalLM", None),
        "qwen3": ("Qwen3ForCausalLM", None)}


def test_sharded_checkpoint_matches_single_file(make_tiny_model) -> None:
    sharded = make_tiny_model("llama", num_shards=3, seed=5)
    single = make_tiny_model("llama", seed=5)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) == 3 and sorted(set(index["weight_map"].values())) == files
    assert not (sharded / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(_tensors(single))
    ids = [1, 40, 41, 42, 43]
    assert torch.equal(_logits(sharded, ids), _logits(single, ids))


def test_tied_and_untied_embeddings(make_tiny_model) -> None:
    tied = _tensors(make_tiny_model("qwen3", tie_word_embeddings=True))
    untied = _tensors(make_tiny_model("qwen3"))
    assert "lm_head.weight" not in tied
    assert not torch.equal(untied["lm_head.weight"], untied["model.embed_tokens.weight"])
    raw = json.loads((make_tiny_model("qwen3", tie_word_embeddings=True) / "config.json")
                     .read_text())
    assert raw["tie_word_embeddings"] is True


def test_bfloat16_checkpoint(make_tiny_model) -> None:
    path = make_tiny_model("mistral", dtype="bfloat16")
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in _tensors(path).values()} == {torch.bfloat16}


def test_tiny_model_is_reused(make_tiny_model) -> None:
    first = make_tiny_model("llama")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_model("llama") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert make_tiny_model("llama", seed=1) != first


def test_concurrent_builds_yield_one_directory(tmp_path: Path) -> None:
    tok_dir = cache_root() / "tokenizers" / f"bpe-512-{factory.FACTORY_VERSION}"
    build_tokenizer(512)
    shutil.copytree(tok_dir, tmp_path / "tokenizers" / tok_dir.name)  # skip retraining
    env = {**os.environ, "ARBORLM_CACHE_DIR": str(tmp_path)}
    code = ("from arborlm.runtime.models.factory import tiny_model; "
            "print(tiny_model('qwen2', seed=11))")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    paths = {out.strip().splitlines()[-1] for out, _ in results}
    assert len(paths) == 1
    entries = [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")]
    assert entries == [Path(paths.pop()).name]  # no temporary directories left behind
    assert (tmp_path / "models" / entries[0] / factory.COMPLETE_MARKER).is_file()
    assert _logits(tmp_path / "models" / entries[0], [1, 2, 3]).shape == (3, 512)
