"""Engine configuration: a few frozen dataclasses, each field documented once.

`EngineArgs` holds what the user sets (names follow SGLang's server arguments); `resolve()`
turns "auto" values into concrete ones and returns a frozen `EngineConfig`. The field docs
double as CLI help (see `arborlm.server`). `ModelConfig` is what the runtime needs to know about
a checkpoint, read from its `config.json` (or a GGUF file's metadata).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from arborlm.constrained.base import GRAMMAR_BACKENDS
from arborlm.errors import InvalidRequestError, ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _doc(text: str, **kw: Any) -> Any:
    return field(metadata={"help": text}, **kw)


@dataclass(frozen=True)
class EngineArgs:
    """User-facing options. `None` / "auto" values are resolved by `resolve()`."""

    model_path: str | None = _doc(
        "A Hugging Face model directory or a .gguf file; default: SmolLM2-135M-Instruct (Q4_1 "
        "GGUF, fetched once into the cache). random-llama-40m names the built-in random-weight "
        "model (gibberish, no network).",
        default=None)
    tokenizer_path: str | None = _doc("Tokenizer directory; default: the model's (a GGUF file's "
                                      "own tokenizer).", default=None)
    dtype: str = _doc("Weight and activation dtype: auto (bfloat16 on a CPU with native "
                      "bfloat16 arithmetic, AVX512-BF16 or AMX; else the checkpoint's), float32, "
                      "bfloat16, float16.", default="auto")
    device: str = _doc("Device: cpu or cuda.", default="cpu")
    max_total_tokens: int | None = _doc(
        "KV cache capacity in tokens; default: from mem_fraction of available memory.",
        default=None)
    mem_fraction: float = _doc("Fraction of free memory the KV pool may take when "
                               "max_total_tokens is not given.", default=0.25)
    max_running_requests: int = _doc("Most requests decoding at once.", default=256)
    max_prefill_tokens: int = _doc("Most new prompt tokens admitted in one prefill step.",
                                   default=8192)
    chunked_prefill_size: int = _doc("Prompts longer than this are prefilled in chunks of this "
                                     "many tokens; -1 disables chunking.", default=2048)
    context_length: int | None = _doc("Longest prompt + output; default: the model's.",
                                      default=None)
    page_size: int = _doc("KV slots per page.", default=1)
    schedule_policy: str = _doc("Waiting-queue order: fcfs, lpm, dfs-weight.", default="fcfs")
    disable_radix_cache: bool = _doc("Turn off prefix reuse.", default=False)
    attention_backend: str = _doc("Attention backend: auto, torch_native, triton, flashinfer.",
                                  default="auto")
    disable_cuda_graph: bool = _doc(
        "Run every decode step eagerly instead of replaying captured CUDA graphs (graphs are "
        "used only on CUDA with the triton or flashinfer backend).", default=False)
    cuda_graph_max_bs: int = _doc(
        "Largest decode batch captured in a CUDA graph; a batch is padded up to the next "
        "captured size (1, 2, 4, 8, then multiples of 8) and larger ones run eagerly.",
        default=32)
    enable_torch_compile: bool = _doc(
        "CPU: compile the decode step with torch.compile (Inductor C++ kernels) when the engine "
        "starts (~10-30 s; cached on disk); decode batches up to torch_compile_max_bs then run "
        "compiled, with fewer and fused kernels.", default=False)
    torch_compile_max_bs: int = _doc(
        "Largest decode batch that runs compiled (enable_torch_compile); larger ones, and "
        "batches whose requests share a cached prefix (cascade attention), run eagerly (or "
        "through the fused decode step, which serves Llama-family models).",
        default=32)
    disable_fused_decode: bool = _doc(
        "CPU: run decode steps through the model's modules (eagerly, or compiled with "
        "enable_torch_compile) instead of ArborLM's fused C++ step, which otherwise serves "
        "Llama, Llama 3, Mistral and Qwen2 models on AVX-512 CPUs.", default=False)
    num_continuous_decode_steps: int | None = _doc(
        "CPU fused decode: run this many decode steps of an all-greedy batch in one C++ call "
        "(no scheduling between them; tokens then stream in groups, and a request arriving "
        "meanwhile waits for the group). Default: as many as fit in ~50 ms of decoding, up to "
        "8, while no request waits; 1 turns it off.", default=None)
    enable_deterministic_inference: bool | None = _doc(
        "Batch-invariant computation: a request's logits depend only on its own tokens, never on "
        "what runs beside it, chunk boundaries, the page size or prefix-cache hits (one kernel "
        "per op for every batch size; no cascade attention). Default: on in bfloat16 where "
        "ArborLM's CPU kernels run (x86 AVX-512 with AVX512-BF16), off in float32 (where it "
        "costs more) and elsewhere; --no-enable-deterministic-inference turns it off. See "
        "docs/determinism.md.",
        default=None)
    random_seed: int = _doc("Seed for requests without a sampling_seed.", default=0)
    grammar_backend: str = _doc("Grammar engine for json_schema / regex / ebnf / choices: "
                                "xgrammar or outlines (a request may pick its own).",
                                default="xgrammar")
    grammar_any_whitespace: bool = _doc(
        "Let constrained JSON use any whitespace between elements (each gap still at most 24 "
        "characters, so output cannot run away); default: fixed separators.", default=False)
    grammar_compile_timeout: float = _doc(
        "Seconds a grammar may take to compile before its request fails with a 400.",
        default=30.0)
    disable_jump_forward: bool = _doc(
        "Decode tokens a grammar forces one step each instead of appending them at once.",
        default=False)
    debug_integrity: bool = _doc("Check KV-pool and cache invariants whenever the engine idles.",
                                 default=False)

    def resolve(self) -> EngineConfig:
        from arborlm.runtime.models.builtin import resolve_model_path

        model_path = resolve_model_path(self.model_path)
        dtype = self.dtype
        if dtype == "auto" and self.device == "cpu" and cpu_has_native_bf16():
            dtype = "bfloat16"
        model = ModelConfig.from_path(model_path, dtype, self.context_length)
        backend = self.attention_backend
        if backend == "auto":
            backend = _auto_attention_backend(self.device)
        if backend not in ("torch_native", "triton", "flashinfer"):
            raise InvalidRequestError(f"unknown attention_backend {backend!r}",
                                      "attention_backend")
        if self.schedule_policy not in ("fcfs", "lpm", "dfs-weight"):
            raise InvalidRequestError(
                f"schedule_policy must be fcfs, lpm or dfs-weight, got {self.schedule_policy!r}",
                "schedule_policy")
        if self.page_size < 1:
            raise InvalidRequestError("page_size must be >= 1", "page_size")
        if self.cuda_graph_max_bs < 1:
            raise InvalidRequestError("cuda_graph_max_bs must be >= 1", "cuda_graph_max_bs")
        if self.num_continuous_decode_steps is not None and self.num_continuous_decode_steps < 1:
            raise InvalidRequestError("num_continuous_decode_steps must be >= 1",
                                      "num_continuous_decode_steps")
        if self.torch_compile_max_bs < 1:
            raise InvalidRequestError("torch_compile_max_bs must be >= 1", "torch_compile_max_bs")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise InvalidRequestError(f"grammar_backend must be one of "
                                      f"{', '.join(GRAMMAR_BACKENDS)}, got "
                                      f"{self.grammar_backend!r}", "grammar_backend")
        if not self.grammar_compile_timeout > 0:
            raise InvalidRequestError("grammar_compile_timeout must be > 0 seconds",
                                      "grammar_compile_timeout")
        chunk = self.chunked_prefill_size
        if chunk is not None and chunk != -1 and chunk < self.page_size:
            raise InvalidRequestError("chunked_prefill_size must be -1 or >= page_size",
                                      "chunked_prefill_size")
        return EngineConfig(args=self, model=model, attention_backend=backend,
                            tokenizer_path=self.tokenizer_path or model_path,
                            deterministic=self._deterministic(model, backend))

    def _deterministic(self, model: ModelConfig, backend: str) -> bool:
        """Whether deterministic inference is wanted: `enable_deterministic_inference`, its
        default decided here. Asked for where it cannot hold, it is an error naming why."""
        wanted = self.enable_deterministic_inference
        if wanted is False:
            return False
        reasons = []
        if self.device != "cpu":
            reasons.append(f"it runs on CPU only (device {self.device})")
        elif not _kernel_instructions(model.dtype):
            reasons.append(f"this CPU lacks the instructions of ArborLM's {model.dtype} kernels "
                           f"(AVX-512, and AVX512-BF16 for bfloat16)")
        if backend != "torch_native":
            reasons.append(f"it needs the torch_native attention backend, not {backend}")
        if self.enable_torch_compile:
            reasons.append("enable_torch_compile sums in the compiler's own orders")
        if reasons and wanted:
            raise InvalidRequestError("enable_deterministic_inference cannot hold: "
                                      + "; ".join(reasons), "enable_deterministic_inference")
        if wanted is None and model.dtype == torch.float32:
            return False  # its measured cost in float32 is above 10% (docs/determinism.md)
        return not reasons


def _cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags as Linux lists them (empty where there is no such file)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes in bfloat16 natively (x86 AVX512-BF16 or AMX-BF16), which makes
    bfloat16 matmuls about twice as fast as float32 and halves the weight and KV traffic."""
    return bool(_cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16"})


def _kernel_instructions(dtype: torch.dtype) -> bool:
    """Whether the CPU has what ArborLM's CPU kernels need for `dtype` (AVX-512, and its BF16
    dot product for bfloat16), read without importing them (the API process does not)."""
    flags = _cpu_flags()
    needed = {torch.float32: {"avx512f"}, torch.bfloat16: {"avx512f", "avx512_bf16"}}
    return dtype in needed and needed[dtype] <= flags


def _auto_attention_backend(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        try:
            import flashinfer  # noqa: F401

            return "flashinfer"
        except ImportError:
            return "triton"
    return "torch_native"


@dataclass(frozen=True)
class EngineConfig:
    """Resolved configuration: no "auto" left."""

    args: EngineArgs
    model: ModelConfig
    attention_backend: str
    tokenizer_path: str
    deterministic: bool = False  # enable_deterministic_inference, resolved (see `EngineArgs`)


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
    if dtype == "auto":
        name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        if name not in DTYPES:
            name = "float32"
        return DTYPES[name]
    if dtype not in DTYPES:
        raise InvalidRequestError(f"dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}",
                                  "dtype")
    return DTYPES[dtype]
