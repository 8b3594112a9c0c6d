"""End-to-end greedy equality with `attention_backend="triton"` (Triton's CPU interpreter).

The foundation issue's greedy test, run through the Triton kernels on a tiny model: the engine's
outputs equal transformers' token for token, alone and in a mixed batch with chunked prefill
and page size > 1.
"""

from __future__ import annotations

import os

import pytest

from arborlm import Engine
from tests.runtime.engine_helpers import PROMPTS, hf_greedy, hf_tokenizer

pytestmark = pytest.mark.triton_interpret

GREEDY8 = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.mark.skipif(os.environ.get("ARBORLM_TEST_DEVICE", "cpu") != "cpu",
                    reason="interpreter run; gpu_check.py covers the GPU")
@pytest.mark.parametrize("options", [{}, {"page_size": 4, "chunked_prefill_size": 8}])
def test_triton_greedy_matches_transformers(make_tiny_model, options):
    path = str(make_tiny_model("llama"))
    engine = Engine(path, dtype="float32", attention_backend="triton", **options)
    prompts = PROMPTS[:3]
    outs = engine.generate(prompts, GREEDY8)
    tok = hf_tokenizer(path)
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy(path, tok.encode(prompt), 8), prompt
    engine.check_integrity()
    engine.shutdown()
