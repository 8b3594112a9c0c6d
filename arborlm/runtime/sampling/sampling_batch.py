"""`SamplingBatch`: the per-step sampling parameters of a batch, as tensors.

Built once per forward step from the requests whose next token is sampled. Rows that need a
feature (penalties, bias, min-token masks) are gathered so that a batch without them pays
nothing for them, and an all-greedy batch builds no draw tensors at all. This module only
describes the batch; `sampler.py` acts on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arborlm.runtime.request import Req


@dataclass
class SamplingBatch:
    # The draw's parameters; None when every row is greedy (argmax needs none of them).
    temperatures: torch.Tensor | None  # [B] float32 (1.0 for greedy rows; unused there)
    top_ps: torch.Tensor | None  # [B] float32
    top_ks: torch.Tensor | None  # [B] int64, vocab size where "all"
    min_ps: torch.Tensor | None  # [B] float32
    greedy: torch.Tensor | None  # [B] bool
    all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    seeds: list[int]  # per row: seed of this step's noise (request seed, output position)
    # Penalties, present only when some row uses them.
    penalty_rows: torch.Tensor | None  # [P] int64 rows with any penalty
    frequency: torch.Tensor | None  # [P] float32
    presence: torch.Tensor | None  # [P] float32
    repetition: torch.Tensor | None  # [P] float32
    output_counts: torch.Tensor | None  # [P, V] float32 occurrences in the output so far
    seen_prompt: torch.Tensor | None  # [P, V] bool tokens of prompt + output (repetition)
    # Additive logit bias, [B, V] float32 or None.
    logit_bias: torch.Tensor | None
    # Tokens banned this step (min_new_tokens not reached): (rows, token ids) or None.
    banned: tuple[torch.Tensor, torch.Tensor] | None
    # Rows whose logprobs are returned.
    want_logprobs: bool

    @classmethod
    def build(cls, reqs: list[Req], vocab_size: int, eos_ids: tuple[int, ...],
              device: str = "cpu") -> SamplingBatch:
        params = [r.sampling_params for r in reqs]
        greedy = [p.is_greedy for p in params]
        penalty_rows = [i for i, p in enumerate(params)
                        if p.frequency_penalty or p.presence_penalty
                        or p.repetition_penalty != 1.0]
        draw = {} if all(greedy) else _draw_params(reqs, greedy, vocab_size, device)
        return cls(
            temperatures=draw.get("temperatures"), top_ps=draw.get("top_ps"),
            top_ks=draw.get("top_ks"), min_ps=draw.get("min_ps"), greedy=draw.get("greedy"),
            all_greedy=not draw,
            need_top_p=draw.get("need_top_p", False), need_top_k=draw.get("need_top_k", False),
            need_min_p=draw.get("need_min_p", False), seeds=draw.get("seeds", []),
            **_penalties(reqs, penalty_rows, vocab_size, device),
            logit_bias=_logit_bias(params, vocab_size, device),
            banned=_banned(reqs, eos_ids, vocab_size, device),
            want_logprobs=any(r.return_logprob for r in reqs),
        )


def _draw_params(reqs: list[Req], greedy: list[bool], vocab_size: int, device: str) -> dict:
    """The tensors and flags of a batch that draws some of its tokens."""
    params = [r.sampling_params for r in reqs]
    top_ks = [vocab_size if (p.top_k < 0 or p.top_k > vocab_size) else p.top_k for p in params]
    f = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)  # noqa: E731
    return dict(
        temperatures=f([1.0 if g else p.temperature for g, p in zip(greedy, params)]),
        top_ps=f([p.top_p for p in params]),
        top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
        min_ps=f([p.min_p for p in params]),
        greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
        need_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)),
        need_top_k=any(k < vocab_size and not g for k, g in zip(top_ks, greedy)),
        need_min_p=any(p.min_p > 0 and not g for p, g in zip(params, greedy)),
        seeds=[_step_seed(r) for r in reqs],
    )


def _step_seed(req: Req) -> int:
    # Noise for output position k of a request depends only on (request seed, k): the same seed
    # gives the same tokens whatever else is in the batch.
    return (req.seed * 1_000_003 + req.total_len * 7919) % (2**63 - 1)


def _penalties(reqs: list[Req], rows: list[int], vocab: int, device: str) -> dict:
    if not rows:
        return dict(penalty_rows=None, frequency=None, presence=None, repetition=None,
                    output_counts=None, seen_prompt=None)
    sub = [reqs[i] for i in rows]
    counts = torch.zeros((len(sub), vocab), dtype=torch.float32, device=device)
    seen = torch.zeros((len(sub), vocab), dtype=torch.bool, device=device)
    for j, r in enumerate(sub):
        if r.output_ids:
            out = torch.tensor(r.output_ids, dtype=torch.int64, device=device)
            counts[j].index_add_(0, out, torch.ones(len(out), device=device))
        if r.sampling_params.repetition_penalty != 1.0:
            seen[j, torch.tensor(r.fill_ids, dtype=torch.int64, device=device)] = True
    f = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)
    return dict(
        penalty_rows=torch.tensor(rows, dtype=torch.int64, device=device),
        frequency=f([r.sampling_params.frequency_penalty for r in sub]),
        presence=f([r.sampling_params.presence_penalty for r in sub]),
        repetition=f([r.sampling_params.repetition_penalty for r in sub]),
        output_counts=counts,
        seen_prompt=seen,
    )


def _logit_bias(params: list, vocab: int, device: str) -> torch.Tensor | None:
    if not any(p.logit_bias for p in params):
        return None
    bias = torch.zeros((len(params), vocab), dtype=torch.float32, device=device)
    for i, p in enumerate(params):
        for tok, b in p.logit_bias.items():
            if 0 <= tok < vocab:
                bias[i, tok] = b
    return bias


def _banned(reqs: list[Req], eos_ids: tuple[int, ...], vocab: int,
            device: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows, toks = [], []
    for i, r in enumerate(reqs):
        p = r.sampling_params
        if len(r.output_ids) < p.min_new_tokens:
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            for t in ids:
                if 0 <= t < vocab:
                    rows.append(i)
                    toks.append(t)
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(toks, dtype=torch.int64, device=device))
