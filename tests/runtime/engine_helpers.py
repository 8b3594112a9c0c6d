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


class DirectScheduler:
    """A scheduler driven step by step from the test thread (no engine thread); each decode
    step is one `step()` unless `num_continuous_decode_steps` says otherwise."""

    def __init__(self, path: str, **options):
        from arborlm.runtime.config import EngineArgs
        from arborlm.runtime.scheduler.scheduler import Scheduler
        from arborlm.runtime.tokenizer_utils import load_tokenizer

        options.setdefault("num_continuous_decode_steps", 1)
        self.config = EngineArgs(model_path=path, dtype="float32", **options).resolve()
        self.tokenizer = load_tokenizer(self.config.tokenizer_path)
        self.scheduler = Scheduler(self.config, self.tokenizer)
        self.builders: dict = {}

    def submit(self, prompts, params, **kw) -> list[str]:
        from arborlm.runtime.generate_request import GenerateRequest, validate_single
        from arborlm.runtime.request import Req
        from arborlm.runtime.response import ResponseBuilder

        rids = []
        for s in GenerateRequest(text=prompts, sampling_params=params, **kw).normalize():
            ids = self.tokenizer.encode(s.text)
            validate_single(s, ids, context_length=self.config.model.context_length,
                            max_total_tokens=self.scheduler.max_total_tokens,
                            vocab_size=self.config.model.vocab_size)
            self.builders[s.rid] = ResponseBuilder(s, self.tokenizer, ids)
            self.scheduler.add_request(Req(s.rid, ids, s.sampling_params, seed=0,
                                           extra_key=s.extra_key))
            rids.append(s.rid)
        return rids

    def step(self) -> list:
        outs = self.scheduler.step()
        for out in outs:
            if out.rid in self.builders:
                self.builders[out.rid].add(out)
        return outs

    def run(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if all(b.finished for b in self.builders.values()):
                return
            self.step()
        raise AssertionError("requests did not finish")

    def output_ids(self, rids: list[str]) -> list[list[int]]:
        return [self.builders[r].result()["output_ids"] for r in rids]
