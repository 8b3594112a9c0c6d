"""The real SmolLM2-135M-Instruct Q4_1 GGUF against transformers' own loading of the file:
greedy tokens (float32), the tokenizer rebuilt from the metadata, and the load's peak memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.runtime.engine_helpers import PROMPTS
from tests.runtime.test_gguf_tokenizer import tokenizer_strings

NEW_TOKENS = 32


def test_greedy_tokens_equal_transformers_gguf_loading(smollm2_gguf, hf_smollm2):
    import arborlm

    engine = arborlm.Engine(model_path=str(smollm2_gguf), dtype="float32")
    try:
        outs = engine.generate(PROMPTS, {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                         "ignore_eos": True})
        tokenizer = engine.tokenizer
    finally:
        engine.shutdown()
    ref = hf_smollm2[0]
    assert len(PROMPTS) >= 8
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            gen = ref.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               eos_token_id=None, pad_token_id=0,
                               attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert out["output_ids"] == gen[0, len(ids):].tolist(), prompt


def test_tokenizer_equals_transformers_gguf_loading(smollm2_gguf, hf_smollm2):
    from arborlm.runtime.models.gguf.tokenizer import gguf_tokenizer

    ours = gguf_tokenizer(smollm2_gguf)
    ref = hf_smollm2[1]
    for text in tokenizer_strings():
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == text
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (ref.bos_token, ref.eos_token,
                                                                 ref.pad_token)
    messages = [{"role": "user", "content": "Hi there"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


_MEASURE = """
import json, resource, sys, torch
from arborlm.runtime.config import ModelConfig
from arborlm.runtime.models.registry import load_model
config = ModelConfig.from_path(sys.argv[1], "float32")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model = load_model(config)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
weights = sum(t.numel() * t.element_size() for t in model.state_dict().values()
              if t.device.type != "meta")
weights -= model.lm_head.weight.numel() * 4 if config.tie_word_embeddings else 0
print(json.dumps({"grown": (peak - before) * 1024, "weights": weights}))
"""


def test_load_peak_memory_is_under_one_and_a_half_times_the_weights(smollm2_gguf):
    """Peak RSS growth while loading (the file's pages, one tensor's decode, the model) stays
    under 1.5x the float32 weights: tensors are decoded one at a time, never all twice."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(smollm2_gguf)], capture_output=True,
                          text=True, env=env, check=True)
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["weights"] > 400e6  # 135M float32 parameters, the tied head counted once
    assert figures["grown"] <= 1.5 * figures["weights"], figures
