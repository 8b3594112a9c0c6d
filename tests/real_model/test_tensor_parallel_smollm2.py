"""Tensor parallelism on the real default model (SmolLM2-135M-Instruct, GGUF) in float32: its
9 attention heads and 3 KV heads split over 3 ranks (it does not split over 2: refused by name),
and greedy tokens equal one rank's with logprobs within 1e-4."""

from __future__ import annotations

import pytest

from arborlm import Engine
from arborlm.errors import ModelLoadError

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


def _generate(path, **options) -> list[dict]:
    engine = Engine(str(path), dtype="float32", max_total_tokens=2048, **options)
    try:
        return engine.generate(PROMPTS, GREEDY, return_logprob=True)
    finally:
        engine.shutdown()


@pytest.mark.slow  # three ranks, each dequantizing the whole GGUF file, on a shared CPU
def test_tp3_greedy_equals_tp1(smollm2_gguf):
    ref, got = _generate(smollm2_gguf), _generate(smollm2_gguf, tp_size=3)
    for a, b in zip(ref, got, strict=True):
        assert b["output_ids"] == a["output_ids"]
        la = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
        lb = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) < 1e-4


def test_tp2_is_refused_naming_the_heads(smollm2_gguf):
    with pytest.raises(ModelLoadError, match="tp_size 2 does not divide 9 attention heads"):
        Engine(str(smollm2_gguf), dtype="float32", tp_size=2)


def test_tp3_packed_gguf_greedy_equals_tp1(smollm2_gguf):
    """`--quantization gguf`: each of 3 ranks computes from its blocks of the file's Q4_1
    linears (o_proj 192 and down_proj 512 input values a rank: whole 32-value blocks). The
    tolerance is `test_tensor_parallel_quant.py`'s, for the same reason."""
    from tests.runtime.test_tensor_parallel_quant import LOGPROB_TOL

    ref = _generate(smollm2_gguf, quantization="gguf")
    got = _generate(smollm2_gguf, quantization="gguf", tp_size=3)
    for a, b in zip(ref, got, strict=True):
        assert b["output_ids"] == a["output_ids"]
        la = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
        lb = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) < LOGPROB_TOL
