"""Engine configuration: a few frozen dataclasses, each field documented once.

`EngineArgs` holds what the user sets (names follow SGLang's server arguments); `resolve()`
turns "auto" values into concrete ones and returns a frozen `EngineConfig`. The field docs
(`option`) double as CLI help (see `arborlm.server`).

Two modules hold the rest, and this one re-exports their names, so importers need only
`arborlm.runtime.config`: `options` declares the options with a fixed set of values once, as
`StrEnum`s, with `choices` / `check_choice` (the CLI's `choices=`, the server's options and
`resolve()`'s checks all read them); `model_config` has `ModelConfig`, what the runtime needs
to know about a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from arborlm.errors import InvalidRequestError
from arborlm.runtime.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from arborlm.runtime.options import (
    DTYPES,
    MAX_DRAFT_TOKENS,
    MAX_NGRAM_WINDOW,
    AttentionBackend,
    DType,
    EngineMode,
    GrammarBackendName,
    Quantization,
    SchedulePolicy,
    SpeculativeAlgorithm,
    check_choice,
    choices,
    option,
)
from arborlm.runtime.platforms.cpu.capabilities import has_native_bf16, kernel_instructions

__all__ = ["DTYPES", "MAX_DRAFT_TOKENS", "MAX_NGRAM_WINDOW", "SUPPORTED_ARCHITECTURES",
           "AttentionBackend", "DType", "EngineArgs", "EngineConfig", "EngineMode",
           "GrammarBackendName", "ModelConfig", "Quantization", "SchedulePolicy",
           "SpeculativeAlgorithm", "check_choice", "choices", "option"]


@dataclass(frozen=True)
class EngineArgs:
    """User-facing options. `None` / "auto" values are resolved by `resolve()`."""

    model_path: str | None = option(
        "A Hugging Face model directory or a .gguf file; default: SmolLM2-135M-Instruct (Q4_1 "
        "GGUF, fetched once into the cache). random-llama-40m names the built-in random-weight "
        "model (gibberish, no network).",
        default=None)
    tokenizer_path: str | None = option("Tokenizer directory; default: the model's (a GGUF file's "
                                        "own tokenizer).", default=None)
    dtype: str = option("Weight and activation dtype; auto: bfloat16 on a CPU with native "
                        "bfloat16 arithmetic (AVX512-BF16 or AMX), else the checkpoint's.",
                        default=DType.AUTO.value)
    device: str = option("Device: cpu or cuda.", default="cpu")
    quantization: str | None = option(
        "CPU: keep the linear weights and the embedding packed in GGUF blocks and compute from "
        "them. q8_0, q4_0, q4_1, q5_0, q5_1, q4_k (llama.cpp's Q4_K_M mix of Q4_K and Q6_K) or "
        "q6_k quantize a float checkpoint at load (embedding and head: Q6_K, or Q8_0); gguf "
        "keeps a GGUF file's quantized tensors as the file has them. Decode steps run through the "
        "fused C++ step on the packed blocks (not torch.compile: --enable-torch-compile does "
        "not apply to them). Default: none (every weight in dtype).",
        default=None)
    max_total_tokens: int | None = option(
        "KV cache capacity in tokens; default: from mem_fraction of available memory.",
        default=None)
    mem_fraction: float = option("Fraction of free memory the KV pool may take when "
                                 "max_total_tokens is not given.", default=0.25)
    max_running_requests: int = option("Most requests decoding at once.", default=256)
    max_prefill_tokens: int = option("Most new prompt tokens admitted in one prefill step.",
                                     default=8192)
    chunked_prefill_size: int = option("Prompts longer than this are prefilled in chunks of this "
                                       "many tokens; -1 disables chunking.", default=2048)
    context_length: int | None = option("Longest prompt + output; default: the model's.",
                                        default=None)
    page_size: int = option("KV slots per page.", default=1)
    schedule_policy: str = option("Waiting-queue order: arrival (fcfs), longest cached prefix "
                                  "first (lpm), or the radix tree depth first, heavier subtrees "
                                  "first (dfs-weight).",
                                  default=SchedulePolicy.FCFS.value)
    disable_radix_cache: bool = option("Turn off prefix reuse.", default=False)
    attention_backend: str = option(
        "Attention backend; auto: flashinfer on CUDA where it is installed, "
        "else triton there, torch_native on CPU.", default=AttentionBackend.AUTO.value)
    disable_cuda_graph: bool = option(
        "Run every decode step eagerly instead of replaying captured CUDA graphs (graphs are "
        "used only on CUDA with the triton or flashinfer backend).", default=False)
    cuda_graph_max_bs: int = option(
        "Largest decode batch captured in a CUDA graph; a batch is padded up to the next "
        "captured size (1, 2, 4, 8, then multiples of 8) and larger ones run eagerly.",
        default=32)
    enable_torch_compile: bool = option(
        "CPU: compile the decode step with torch.compile (Inductor C++ kernels) when the engine "
        "starts (a slower start-up; cached on disk); decode batches up to "
        "torch_compile_max_bs then run compiled, with fewer and fused kernels.", default=False)
    torch_compile_max_bs: int = option(
        "Largest decode batch that runs compiled (enable_torch_compile); larger ones, and "
        "batches whose requests share a cached prefix (cascade attention), run eagerly (or "
        "through the fused decode step, which serves Llama-family models).",
        default=32)
    disable_fused_decode: bool = option(
        "CPU: run decode steps through the model's modules (eagerly, or compiled with "
        "enable_torch_compile) instead of ArborLM's fused C++ step, which otherwise serves "
        "Llama, Llama 3, Mistral and Qwen2 models on AVX-512 CPUs.", default=False)
    num_continuous_decode_steps: int | None = option(
        "CPU fused decode: run this many decode steps of an all-greedy batch in one C++ call "
        "(no scheduling between them; tokens then stream in groups, and a request arriving "
        "meanwhile waits for the group). Default: as many as fit in ~50 ms of decoding, up to "
        "8, while no request waits; 1 turns it off.", default=None)
    enable_deterministic_inference: bool | None = option(
        "Batch-invariant computation: a request's logits depend only on its own tokens, never on "
        "what runs beside it, chunk boundaries, the page size or prefix-cache hits (one kernel "
        "per op for every batch size; no cascade attention). Default: on in bfloat16 where "
        "ArborLM's CPU kernels run (x86 AVX-512 with AVX512-BF16), off in float32 and with "
        "--quantization (where it costs more) and elsewhere; "
        "--no-enable-deterministic-inference turns it off. See docs/determinism.md.",
        default=None)
    random_seed: int = option("Seed for requests without a sampling_seed.", default=0)
    grammar_backend: str = option("Grammar engine for json_schema / regex / ebnf / choices (a "
                                  "request may pick its own).",
                                  default=GrammarBackendName.XGRAMMAR.value)
    grammar_any_whitespace: bool = option(
        "Let constrained JSON use any whitespace between elements (each gap still at most 24 "
        "characters, so output cannot run away); default: fixed separators.", default=False)
    grammar_compile_timeout: float = option(
        "Seconds a grammar may take to compile before its request fails with a 400.",
        default=30.0)
    disable_jump_forward: bool = option(
        "Decode tokens a grammar forces one step each instead of appending them at once.",
        default=False)
    speculative_algorithm: str | None = option(
        "Speculative decoding: NGRAM drafts tokens from n-gram matches in each request's own "
        "prompt and output (prompt lookup); STANDALONE drafts them greedily with a smaller "
        "model of the same tokenizer (speculative_draft_model_path). Drafts are verified in "
        "one forward; outputs equal plain decoding's. A request's grammar cuts its drafts "
        "where it rejects them and extends them by the tokens it forces. Needs page_size 1. "
        "Default: off.", default=None)
    speculative_num_draft_tokens: int = option(
        "Most draft tokens per request per verify step (each request's draft length adapts "
        "to its acceptance below this).", default=8)
    speculative_draft_model_path: str | None = option(
        "STANDALONE: the draft model (a Hugging Face directory, a .gguf file or a built-in "
        "name), with the target's vocabulary. Its KV pool holds as many tokens as the "
        "target's, and both share the memory budget.", default=None)
    speculative_num_steps: int = option(
        "STANDALONE: most tokens the draft model drafts per request per verify step (one "
        "draft forward each; the draft length adapts to acceptance below this).", default=4)
    speculative_ngram_min_match_window_size: int = option(
        "NGRAM: the shortest suffix of a request's tokens that must recur to draft from it.",
        default=1)
    speculative_ngram_max_match_window_size: int = option(
        "NGRAM: the longest suffix matched (longer matches are tried first).", default=12)
    debug_integrity: bool = option("Check KV-pool and cache invariants whenever the engine idles.",
                                   default=False)
    tp_size: int = option(
        "Tensor-parallel ranks: each holds a 1/tp_size share of the attention heads, MLP and "
        "vocabulary, in a process of its own (gloo on CPU, NCCL on CUDA, one GPU per rank); "
        "rank 0 schedules and broadcasts each batch. Decode steps then run eagerly.", default=1)
    nnodes: int = option("Machines the tensor-parallel ranks span (tp_size / nnodes ranks each).",
                         default=1)
    node_rank: int = option(
        "This machine's index among nnodes: 0 runs the scheduler and the server, the others "
        "only their ranks, which wait for node 0's batches.", default=0)
    dist_init_addr: str | None = option(
        "host:port where the ranks meet (node 0 listens there); needed with nnodes > 1, "
        "default for one node: a free loopback port.", default=None)
    dist_timeout: float = option(
        "Seconds a rank waits for the others (to join, or in a collective) before the engine "
        "fails.", default=300.0)

    def resolve(self) -> EngineConfig:
        from arborlm.runtime.models.builtin import resolve_model_path

        model_path = resolve_model_path(self.model_path)
        dtype = self.dtype
        if dtype == DType.AUTO and self.device == "cpu" and has_native_bf16():
            dtype = DType.BFLOAT16.value
        model = ModelConfig.from_path(model_path, dtype, self.context_length)
        backend = check_choice(AttentionBackend, self.attention_backend, "attention_backend")
        if backend == AttentionBackend.AUTO:
            backend = _auto_attention_backend(self.device)
        check_choice(SchedulePolicy, self.schedule_policy, "schedule_policy")
        if self.page_size < 1:
            raise InvalidRequestError("page_size must be >= 1", "page_size")
        if self.cuda_graph_max_bs < 1:
            raise InvalidRequestError("cuda_graph_max_bs must be >= 1", "cuda_graph_max_bs")
        if self.num_continuous_decode_steps is not None and self.num_continuous_decode_steps < 1:
            raise InvalidRequestError("num_continuous_decode_steps must be >= 1",
                                      "num_continuous_decode_steps")
        if self.torch_compile_max_bs < 1:
            raise InvalidRequestError("torch_compile_max_bs must be >= 1", "torch_compile_max_bs")
        check_choice(GrammarBackendName, self.grammar_backend, "grammar_backend")
        if not self.grammar_compile_timeout > 0:
            raise InvalidRequestError("grammar_compile_timeout must be > 0 seconds",
                                      "grammar_compile_timeout")
        self.check_parallel()
        draft_model = self._check_speculative(model)
        self.check_quantization(model)
        chunk = self.chunked_prefill_size
        if chunk is not None and chunk != -1 and chunk < self.page_size:
            raise InvalidRequestError("chunked_prefill_size must be -1 or >= page_size",
                                      "chunked_prefill_size")
        return EngineConfig(args=self, model=model, attention_backend=backend,
                            tokenizer_path=self.tokenizer_path or model_path,
                            deterministic=self._deterministic(model, backend),
                            draft_model=draft_model)

    def check_parallel(self) -> None:
        """`InvalidRequestError` for tensor-parallel and multi-node options that cannot hold."""
        if self.tp_size < 1:
            raise InvalidRequestError("tp_size must be >= 1", "tp_size")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise InvalidRequestError(f"nnodes must be >= 1 and divide tp_size "
                                      f"({self.tp_size}), got {self.nnodes}", "nnodes")
        if not 0 <= self.node_rank < self.nnodes:
            raise InvalidRequestError(f"node_rank must be in [0, {self.nnodes}), got "
                                      f"{self.node_rank}", "node_rank")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise InvalidRequestError("nnodes > 1 needs dist_init_addr (host:port of node 0)",
                                      "dist_init_addr")
        if not self.dist_timeout > 0:
            raise InvalidRequestError("dist_timeout must be > 0 seconds", "dist_timeout")

    def _check_speculative(self, model: ModelConfig) -> ModelConfig | None:
        """`InvalidRequestError` for speculative options that cannot hold; the draft model's
        configuration with STANDALONE."""
        if self.speculative_algorithm is None:
            if self.speculative_draft_model_path is not None:
                raise InvalidRequestError("speculative_draft_model_path needs "
                                          "speculative_algorithm STANDALONE",
                                          "speculative_draft_model_path")
            return None
        check_choice(SpeculativeAlgorithm, self.speculative_algorithm, "speculative_algorithm")
        if self.page_size != 1:
            raise InvalidRequestError("speculative decoding needs page_size 1", "page_size")
        if not 1 <= self.speculative_num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise InvalidRequestError(
                f"speculative_num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}]",
                "speculative_num_draft_tokens")
        lo = self.speculative_ngram_min_match_window_size
        hi = self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi <= MAX_NGRAM_WINDOW:
            raise InvalidRequestError(
                "speculative_ngram_min_match_window_size and "
                "speculative_ngram_max_match_window_size must satisfy 1 <= min <= max <= "
                f"{MAX_NGRAM_WINDOW}", "speculative_ngram_max_match_window_size")
        if self.speculative_algorithm != SpeculativeAlgorithm.STANDALONE:
            if self.speculative_draft_model_path is not None:
                raise InvalidRequestError("speculative_draft_model_path needs "
                                          "speculative_algorithm STANDALONE",
                                          "speculative_draft_model_path")
            return None
        return self._draft_model(model)

    def _draft_model(self, model: ModelConfig) -> ModelConfig:
        """STANDALONE's draft model configuration, refused where its vocabulary or length
        cannot serve `model`'s requests (the tokenizers themselves are compared when the
        draft model loads: `speculative.draft_model`)."""
        from arborlm.runtime.models.builtin import resolve_model_path

        if not 1 <= self.speculative_num_steps <= MAX_DRAFT_TOKENS:
            raise InvalidRequestError(
                f"speculative_num_steps must be in [1, {MAX_DRAFT_TOKENS}]",
                "speculative_num_steps")
        if self.speculative_draft_model_path is None:
            raise InvalidRequestError("speculative_algorithm STANDALONE needs "
                                      "speculative_draft_model_path",
                                      "speculative_draft_model_path")
        if self.tp_size != 1:
            raise InvalidRequestError("speculative_algorithm STANDALONE runs with tp_size 1",
                                      "tp_size")
        path = resolve_model_path(self.speculative_draft_model_path)
        draft = ModelConfig.from_path(path, self.dtype, model.context_length)
        if draft.vocab_size != model.vocab_size:
            raise InvalidRequestError(
                f"the draft model's vocabulary ({draft.vocab_size} tokens, "
                f"{self.speculative_draft_model_path}) differs from the target model's "
                f"({model.vocab_size} tokens): a draft model must share the target's tokenizer",
                "speculative_draft_model_path")
        return draft.replace(dtype=model.dtype)

    def check_quantization(self, model: ModelConfig) -> None:
        """`InvalidRequestError` naming `quantization` where it cannot apply to this engine."""
        if self.quantization is None:
            return
        from arborlm.runtime.models.gguf.files import find_gguf_file

        value = check_choice(Quantization, self.quantization, "quantization")
        is_gguf = find_gguf_file(Path(model.path)) is not None
        reasons = []
        if self.device != "cpu":
            reasons.append(f"its packed kernels run on CPU only (device {self.device})")
        if model.dtype not in (torch.float32, torch.bfloat16):
            reasons.append(f"its kernels take float32 or bfloat16 activations, not {model.dtype}")
        if value == Quantization.GGUF and not is_gguf:
            reasons.append(f"gguf keeps a GGUF file's packed tensors and {model.path} is not one")
        if value != Quantization.GGUF and is_gguf:
            reasons.append(f"{model.path} is a GGUF file: --quantization gguf keeps its own "
                           f"quantization (requantizing it would compound the rounding)")
        if self.device == "cpu" and not reasons:
            from arborlm.runtime.platforms.cpu import kernels as cpu_kernels

            if not cpu_kernels.quant_linear_available():  # builds them: nothing else may have
                reasons.append(cpu_kernels.OPERATORS_MISSING)
        if reasons:
            raise InvalidRequestError(f"quantization {value} cannot apply: " + "; ".join(reasons),
                                      "quantization")

    def _deterministic(self, model: ModelConfig, backend: str) -> bool:
        """Whether deterministic inference is wanted: `enable_deterministic_inference`, its
        default decided here. Asked for where it cannot hold, it is an error naming why."""
        wanted = self.enable_deterministic_inference
        if wanted is False:
            return False
        reasons = []
        if self.device != "cpu":
            reasons.append(f"it runs on CPU only (device {self.device})")
        elif not kernel_instructions(model.dtype):
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
        if wanted is None and self.quantization is not None:
            return False  # pinning one packed path costs one-row decode ~3x (docs/determinism.md)
        return not reasons


def _auto_attention_backend(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        try:
            import flashinfer  # noqa: F401

            return AttentionBackend.FLASHINFER.value
        except ImportError:
            return AttentionBackend.TRITON.value
    return AttentionBackend.TORCH_NATIVE.value


@dataclass(frozen=True)
class EngineConfig:
    """Resolved configuration: no "auto" left."""

    args: EngineArgs
    model: ModelConfig
    attention_backend: str
    tokenizer_path: str
    deterministic: bool = False  # enable_deterministic_inference, resolved (see `EngineArgs`)
    draft_model: ModelConfig | None = None  # speculative_algorithm STANDALONE's draft model
