"""Shared helpers for engine-level tests: a transformers reference and prompt sets."""

from __future__ import annotations

import functools
from typing import Any

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


# --- the exactness matrix (deterministic inference) ---------------------------------------------

# Configurations a request's logits must not depend on under deterministic inference: the
# engine options of each, under which every prompt is sent at once (requests of very different
# lengths batched together). Consecutive configurations with the same options share one engine,
# so "cache warm" runs on the radix cache that "cache cold" has just filled.
EXACTNESS_CONFIGS = {
    "batched, radix cache off": {"disable_radix_cache": True},
    "batched, cache cold": {},
    "batched, cache warm": {},
    "chunked prefill 16, page size 16": {"chunked_prefill_size": 16, "page_size": 16},
    "chunked prefill 64, one decode step per call": {"chunked_prefill_size": 64,
                                                     "num_continuous_decode_steps": 1},
    "multi-process engine": {"mode": "multiprocess"},
}


def _greedy_with_logprobs(engine, prompts: list[str], new_tokens: int,
                          vocab: int | None) -> list[tuple]:
    spread = [] if vocab is None else list(range(0, vocab, -(-vocab // 64)))  # <= 64 ids
    outs = engine.generate(prompts, {"temperature": 0, "max_new_tokens": new_tokens,
                                     "ignore_eos": True},
                           return_logprob=True, top_logprobs_num=5,
                           token_ids_logprob=spread or None)
    return [(o["output_ids"], o["meta_info"]["output_token_logprobs"],
             list(zip(o["meta_info"]["output_top_logprobs"],
                      o["meta_info"]["output_token_ids_logprobs"] if spread
                      else o["meta_info"]["output_top_logprobs"])))
            for o in outs]


def first_difference(a: tuple, b: tuple) -> str | None:
    """Where two (ids, logprobs, top logprobs) results first differ, or None if identical."""
    for step, (x, y) in enumerate(zip(zip(*a), zip(*b))):
        if x[0] != y[0]:
            return f"output token {step}: token id {x[0]} != {y[0]}"
        if x != y:
            return f"output token {step}: logprobs {x[1:]} != {y[1:]}"
    return None if a == b else "lengths differ"


def exactness_matrix(path: str, prompts: list[str], new_tokens: int = 12,
                     vocab: int | None = None, **options) -> dict[str, list[str]]:
    """Each prompt alone (radix cache off, one request at a time) against every configuration
    of `EXACTNESS_CONFIGS`: {configuration: ["prompt i: where it first differs", ...]}; empty
    lists where every prompt's greedy tokens, their logprobs and the top-5 logprobs at every
    step are bit-identical (logprobs are the logits less one log-sum-exp over all of them).
    With `vocab`, also the logprobs of 64 token ids spread evenly over the vocabulary."""
    from arborlm import Engine

    engine = Engine(path, disable_radix_cache=True, **options)
    try:
        alone = [_greedy_with_logprobs(engine, [p], new_tokens, vocab)[0] for p in prompts]
    finally:
        engine.shutdown()
    report: dict[str, list[str]] = {}
    engines: dict[str, Any] = {}
    try:
        for name, extra in EXACTNESS_CONFIGS.items():
            key = repr(sorted(extra.items()))
            if key not in engines:
                for e in engines.values():
                    e.shutdown()
                engines = {key: Engine(path, **options, **extra)}
            got = _greedy_with_logprobs(engines[key], prompts, new_tokens, vocab)
            report[name] = [f"prompt {i}: {d}" for i, (a, b) in enumerate(zip(alone, got))
                            if (d := first_difference(a, b)) is not None]
    finally:
        for e in engines.values():
            e.shutdown()
    return report
