"""The sampler: logits of a batch -> next token ids (+ log-probabilities).

Order of operations (each row independent of the others):
  1. penalties (repetition over prompt+output, HF-style; frequency / presence over output,
     OpenAI-style), 2. logit bias, 3. min_new_tokens bans of EOS / stop ids, 4. the grammar mask
     (applied by the caller before `sample`, so the logprobs reflect the constraint),
  5. logprobs = log_softmax of these processed logits (before temperature and truncation),
  6. greedy rows: argmax; other rows: temperature, top-k, top-p, min-p, then a draw.

The draw uses the exponential-race form of categorical sampling (argmax of p / E, E ~ Exp(1))
with noise from a generator seeded by (request seed, output position), so a request with a
`sampling_seed` gets the same tokens whatever batch it runs in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arborlm.runtime.layers.registry import ops_for
from arborlm.runtime.sampling.sampling_batch import SamplingBatch


@dataclass
class SampleOutput:
    next_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B, V] float32 log-softmax of the processed logits


def process_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Apply penalties, bias and bans in place to `logits` [B, V] float32; returns it."""
    if sb.penalty_rows is not None:
        rows = sb.penalty_rows
        sub = logits[rows]  # [P, V]
        rep = sb.repetition[:, None]
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(sb.seen_prompt, penalized, sub)
        sub = sub - sb.frequency[:, None] * sb.output_counts
        sub = sub - sb.presence[:, None] * (sb.output_counts > 0).float()
        logits[rows] = sub
    if sb.logit_bias is not None:
        logits += sb.logit_bias
    if sb.banned is not None:
        logits[sb.banned[0], sb.banned[1]] = float("-inf")
    return logits


def sample(logits: torch.Tensor, sb: SamplingBatch) -> SampleOutput:
    """`logits` [B, V] float32, already processed (see `process_logits`) and masked."""
    logprobs = torch.log_softmax(logits, dim=-1) if sb.want_logprobs else None
    greedy_ids = argmax(logits)
    if sb.all_greedy:
        return SampleOutput(greedy_ids, logprobs)
    probs = torch.softmax(logits / sb.temperatures[:, None], dim=-1)
    probs = _truncate(probs, sb)
    noise = torch.stack([_exponential(seed, probs.shape[1]) for seed in sb.seeds])  # [B, V]
    noise = noise.to(probs.device)
    sampled = argmax(probs / noise)
    return SampleOutput(torch.where(sb.greedy, greedy_ids, sampled), logprobs)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax `[B]` of x `[B, V]` (the first where the maximum repeats), with the
    operator table of x's device and dtype (a vectorized kernel where the platform has one)."""
    return ops_for(x.device, x.dtype).argmax(x)


def _truncate(probs: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Zero out tokens outside top-k / top-p / min-p, per row."""
    if sb.need_min_p:
        top = probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < sb.min_ps[:, None] * top, torch.zeros_like(probs), probs)
    if not (sb.need_top_k or sb.need_top_p):
        return probs
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=probs.device)[None, :]
    drop = rank >= sb.top_ks[:, None]
    if sb.need_top_p:
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above this token
        drop |= before > sb.top_ps[:, None] * sorted_p.sum(dim=-1, keepdim=True)
    drop[:, 0] = False  # always keep the most likely token
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)


def _exponential(seed: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.empty(n).exponential_(generator=gen).clamp_min_(1e-20)
