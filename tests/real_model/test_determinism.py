"""Deterministic inference on the real default model, in the default dtype: each prompt alone
against batched (very different lengths), chunked prefill, page size 16, radix cache off / cold
/ warm, one decode step per call and a multi-process engine, greedy tokens and their logprobs
bit for bit (`tests/runtime/engine_helpers.exactness_matrix`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from arborlm.runtime.platforms.cpu import capabilities
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from tests.runtime.engine_helpers import exactness_matrix

_SYSTEM = ("<|im_start|>system\nYou are a helpful assistant. Answer briefly and precisely, "
           "and say so when you do not know.<|im_end|>\n")
PROMPTS = [
    "The capital of France is",
    _SYSTEM + "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog. " * 16,  # ~160 tokens
    _SYSTEM + "<|im_start|>user\nName three rivers.<|im_end|>\n<|im_start|>assistant\n",
    "Hello",
]


def test_exactness_matrix_on_the_default_model(smollm2_gguf: Path) -> None:
    # The default dtype (bfloat16 where the CPU has it), deterministic whatever the default.
    dtype = torch.bfloat16 if capabilities.has_native_bf16() else torch.float32
    if not cpu_kernels.available(dtype):
        pytest.skip(f"deterministic inference rests on ArborLM's AVX-512 kernels for {dtype}, "
                    f"which this CPU lacks (the engine refuses it here, naming why: "
                    f"tests/runtime/test_deterministic.py)")
    report = exactness_matrix(str(smollm2_gguf), PROMPTS, new_tokens=16, vocab=49152,
                              enable_deterministic_inference=True)
    assert report == {name: [] for name in report}, report
