"""The built-in model generator: random-weight Llama-family checkpoints with real tokenizers.

`default_model_path()` returns the default model (a ~40M-parameter Llama with a 32,000-entry
byte-level BPE tokenizer and a chat template), building it under the cache root on first use.
`build_model()` writes a small checkpoint of any supported architecture (Llama 2/3, Mistral,
Qwen2, Qwen3) as a normal Hugging Face directory; `tiny_model()` caches the small ones the tests
use. Cached entries are built in a temporary directory under a file lock and renamed into
place, so concurrent processes see either nothing or a complete directory.

Weights are random (seeded), so the models produce gibberish: they exist to exercise loading,
batching, caching and grammars, not to be good. This module does not load models for serving
(see the model loader) and never touches the network. Cache root: `$ARBORLM_CACHE_DIR`, or
`~/.cache/arborlm`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arborlm.runtime.models.corpus import training_corpus

if TYPE_CHECKING:  # transformers and torch load lazily: reusing a cached model needs neither
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

FACTORY_VERSION = "v1"
COMPLETE_MARKER = ".arborlm-complete"
DEFAULT_MODEL_NAME = f"default-llama-40m-{FACTORY_VERSION}"

UNK, BOS, EOS, PAD, IM_START, IM_END = "<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD, IM_START, IM_END)  # ids 0..5, in this order
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")
_CONFIG_CLASSES = {"llama": "LlamaConfig", "llama3": "LlamaConfig", "mistral": "MistralConfig",
                   "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
_ROPE_THETA = {"llama": 10000.0, "llama3": 500000.0, "mistral": 10000.0, "qwen2": 1000000.0,
               "qwen3": 1000000.0}
LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
DTYPES = ("float32", "bfloat16", "float16")

TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
    "num_heads": 4, "num_kv_heads": 2, "init_std": 0.2,
}

# ChatML turns; the rendered text starts with BOS (like Llama templates), so encode it with
# add_special_tokens=False. `tools` become a system block; assistant `tool_calls` become
# <tool_call>{...}</tool_call> lines; list-of-parts content keeps its text parts.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is iterable -%}"
    "{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- set ns = namespace(skip_first=false) -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{{- render(messages[0].content) + '\\n\\n' -}}{%- set ns.skip_first = true -%}"
    "{%- endif -%}"
    "{{- 'You can call these tools by replying with <tool_call>{\"name\": ..., "
    "\"arguments\": ...}</tool_call>:\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (loop.first and ns.skip_first) -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + render(message.content) -}}"
    "{%- if message.tool_calls is defined and message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{{- '<tool_call>{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' -}}"
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}"
    "{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def cache_root() -> Path:
    """The cache directory: `$ARBORLM_CACHE_DIR` or `~/.cache/arborlm`."""
    env = os.environ.get("ARBORLM_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "arborlm"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def cached_build(final: Path, build: Callable[[Path], None]) -> Path:
    """Return `final`, first running `build(tmp_dir)` and renaming it there if not yet complete.

    Readers take the fast path (the marker exists) without locking; builders serialize on a lock
    file next to `final`, and the rename makes a half-built directory invisible.
    """
    if (final / COMPLETE_MARKER).is_file():
        return final
    with _file_lock(final.parent / f".{final.name}.lock"):
        if (final / COMPLETE_MARKER).is_file():
            return final
        if final.exists():  # not made by this function (it renames only complete builds)
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes 0700; the cache may be shared
            build(tmp)
            (tmp / COMPLETE_MARKER).write_text(FACTORY_VERSION + "\n")
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _train_tokenizer(vocab_size: int, out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    n_lines = min(60000, max(2000, 2 * vocab_size))
    tok.train_from_iterator(training_corpus(n_lines), trainer, length=n_lines)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, bos_id)]),
    ])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        extra_special_tokens=[IM_START, IM_END], add_bos_token=True, add_eos_token=False,
        clean_up_tokenization_spaces=False)
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(out_dir)


def build_tokenizer(vocab_size: int, out_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of `vocab_size` entries (specials included), cached per size.

    Special tokens: <unk>=0, <s>=1 (BOS, prepended when encoding), </s>=2 (EOS), <pad>=3,
    <|im_start|>=4, <|im_end|>=5; a ChatML chat template. Saved to `out_dir` when given.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + specials)")
    from transformers import PreTrainedTokenizerFast

    cached = cache_root() / "tokenizers" / f"bpe-{vocab_size}-{FACTORY_VERSION}"
    cached_build(cached, lambda d: _train_tokenizer(vocab_size, d))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(cached))
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def _make_config(arch: str, *, vocab_size: int, hidden_size: int, intermediate_size: int,
                 num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int | None,
                 max_position_embeddings: int, tie_word_embeddings: bool, dtype: str,
                 rope_scaling: dict | None, special_ids: dict[str, int]) -> PretrainedConfig:
    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}; got {arch!r}")
    if rope_scaling is None and arch == "llama3":
        rope_scaling = dict(LLAMA3_ROPE_SCALING)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings, rope_theta=_ROPE_THETA[arch],
        rope_scaling=rope_scaling, hidden_act="silu", **special_ids)
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch in ("qwen2", "qwen3"):
        kwargs.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    import torch
    import transformers

    config = getattr(transformers, _CONFIG_CLASSES[arch])(**kwargs)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.dtype = getattr(torch, dtype)
    return config


def _init_weights(model: torch.nn.Module, seed: int, init_std: float) -> None:
    """Matrices ~ N(0, init_std); norm weights ~ 1 + 0.1 N(0, 1); biases ~ init_std N(0, 1).

    Norms and biases are deliberately far from their identity values, so a loader that drops
    them produces different logits.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith(".bias"):
                param.copy_(init_std * noise)
            elif param.ndim == 1:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(init_std * noise)


def _reshard(path: Path, num_shards: int) -> None:
    """Split `model.safetensors` into `num_shards` files plus `model.safetensors.index.json`."""
    from safetensors.torch import load_file, save_file

    single = path / "model.safetensors"
    tensors = load_file(str(single))
    names = list(tensors)
    if num_shards > len(names):
        raise ValueError(f"num_shards={num_shards} exceeds the {len(names)} tensors")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    groups: list[list[str]] = [[]]
    done = 0
    for i, name in enumerate(names):
        to_open = num_shards - len(groups)
        if groups[-1] and to_open and (done >= len(groups) * total / num_shards
                                       or len(names) - i <= to_open):
            groups.append([])
        groups[-1].append(name)
        done += tensors[name].numel() * tensors[name].element_size()
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in group}, str(path / fname),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, fname))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    single.unlink()


def _patch_config_json(path: Path, dtype: str, config: PretrainedConfig) -> None:
    """Add the classic `torch_dtype`, `rope_theta` and `rope_scaling` keys next to the newer
    `dtype` / `rope_parameters`, as checkpoints on the Hub have them."""
    file = path / "config.json"
    data = json.loads(file.read_text())
    data["torch_dtype"] = dtype
    rope = dict(getattr(config, "rope_parameters", None) or {})
    data["rope_theta"] = rope.pop("rope_theta", _ROPE_THETA.get(data["model_type"], 10000.0))
    data["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build_model(path: str | Path, arch: str = "llama", *, vocab_size: int = 512,
                hidden_size: int = 64, intermediate_size: int = 128, num_layers: int = 2,
                num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
                max_position_embeddings: int = 2048, tie_word_embeddings: bool = False,
                dtype: str = "float32", seed: int = 0, init_std: float = 0.02,
                num_shards: int = 1, rope_scaling: dict | None = None) -> Path:
    """Write a random-weight checkpoint of `arch` with its tokenizer to `path`; return `path`.

    arch: "llama", "llama3" (Llama 3 rope scaling, rope_theta 5e5), "mistral", "qwen2" (qkv
    bias), "qwen3" (q/k RMSNorm). The same arguments give byte-identical tensors.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    config = _make_config(
        arch, vocab_size=max(vocab_size, len(tokenizer)), hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, dtype=dtype, rope_scaling=rope_scaling,
        special_ids=ids)
    with torch.random.fork_rng(devices=[]):  # seed without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed, init_std)
    model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos_token_id"], pad_token_id=ids["pad_token_id"],
        eos_token_id=[ids["eos_token_id"], tokenizer.convert_tokens_to_ids(IM_END)])
    with _quiet_progress_bars():
        model.save_pretrained(str(out), safe_serialization=True)
    _patch_config_json(out, dtype, config)
    if num_shards > 1:
        _reshard(out, num_shards)
    tokenizer.model_max_length = max_position_embeddings
    tokenizer.save_pretrained(str(out))
    return out


def tiny_model(arch: str = "llama", **overrides: Any) -> Path:
    """A cached small checkpoint for tests: `TINY_DEFAULTS` updated by `overrides`.

    Keyed by (arch, overrides) under `<cache root>/models/`; built once across processes.
    """
    kwargs = {**TINY_DEFAULTS, **overrides}
    key = json.dumps({"arch": arch, **kwargs}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    final = cache_root() / "models" / f"tiny-{arch}-{digest}-{FACTORY_VERSION}"
    return cached_build(final, lambda d: build_model(d, arch, **kwargs))


def _build_default(path: Path) -> None:
    build_model(path, "llama", vocab_size=32000, hidden_size=512, intermediate_size=1408,
                num_layers=8, num_heads=8, num_kv_heads=4, max_position_embeddings=4096,
                tie_word_embeddings=True, dtype="float32", seed=0, init_std=0.02)


def default_model_path() -> Path:
    """The default model's directory (LlamaForCausalLM, 32,000 vocab), built on first use."""
    return cached_build(cache_root() / "models" / DEFAULT_MODEL_NAME, _build_default)


def main() -> None:
    """Ensure the default model exists and print its path."""
    print(default_model_path())


if __name__ == "__main__":
    main()
