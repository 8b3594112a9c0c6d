"""Shared helpers for engine-level tests: a transformers reference and prompt sets."""

from __future__ import annotations

import functools

import torch

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    "def add(a, b):",
    '{"name": "Ada", "age":',
    "1 2 3 4 5",
    "A",
    "In the beginning the universe was created. This has made a lot of people very angry",
    "Hello",
]


@functools.lru_cache(maxsize=8)
def hf_model(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@functools.lru_cache(maxsize=8)
def hf_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate, never stopping early."""
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def hf_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position, [len(ids), V] float32."""
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
