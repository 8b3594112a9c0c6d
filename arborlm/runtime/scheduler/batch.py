"""`ScheduledBatch`: the requests of one step and the phase they run in, and its ForwardBatch.

For EXTEND, request i prefills `fill_ids[prefix_lens[i] : prefix_lens[i] + extend_lens[i]]`.
The logits plan lists, per request, which of its new positions need logits: the positions whose
next token's input logprob was asked for (`logprob_start_len`), and the last position when the
next token is sampled. A verify step of speculative decoding (`draft_ids` set) is an EXTEND of
each request's newest token followed by its draft tokens, with logits at every new position
(`arborlm.runtime.speculative`); its ForwardBatch is a DECODE of one row per new token (see
`_verify_rows`). DECODE runs one token per request, `fill_ids[prefix_lens[i]]`, and keeps the
logits of every row.

The batch carries everything the later phases of the step read (its phase, its KV slots, the
logits plan); it is built once, complete, by `prefill.py` or `decode.py`. It neither allocates
KV slots nor changes its requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from arborlm.runtime.forward_batch import ForwardBatch, ForwardMode
from arborlm.runtime.memory_pool import KVPool, ReqToTokenPool
from arborlm.runtime.request import Req


@dataclass(kw_only=True)
class ScheduledBatch:
    mode: ForwardMode
    # A step of the running requests (DECODE, or an EXTEND of the tokens their grammars
    # forced: see `decode.py`), as opposed to a prefill of newly admitted requests.
    decoding: bool
    reqs: list[Req]
    prefix_lens: list[int]
    extend_lens: list[int]
    sample: list[bool]  # per request: sample its next token after this step
    # Per request: absolute positions p whose logits are kept for input logprobs of token p+1.
    input_logprob_positions: list[range]
    # KV slots of the new tokens, request after request (already in their `req_to_token` rows).
    out_cache_loc: torch.Tensor
    # A verify step's draft tokens per request (extend_lens[i] == 1 + len(draft_ids[i])); None
    # for any other step.
    draft_ids: list[list[int]] | None = None
    # The logits plan: rows of the forward's hidden states that need logits, in order.
    logits_rows: list[int] = field(init=False, repr=False)
    # Per request: (its first row in the logits, its n input logprob rows, its sample row | -1).
    rows: list[tuple[int, int, int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.logits_rows, self.rows = [], []
        start = 0
        for i in range(self.size):
            prefix, ext = self.prefix_lens[i], self.extend_lens[i]
            first = len(self.logits_rows)
            lp = self.input_logprob_positions[i]
            self.logits_rows.extend(start + p - prefix for p in lp)
            sample_row = -1
            if self.draft_ids is not None:  # every new position: rows sample_row + j
                sample_row = len(self.logits_rows)
                self.logits_rows.extend(range(start, start + ext))
            elif self.sample[i]:
                sample_row = len(self.logits_rows)
                self.logits_rows.append(start + ext - 1)
            self.rows.append((first, len(lp), sample_row))
            start += ext

    @property
    def size(self) -> int:
        return len(self.reqs)

    def to_forward_batch(self, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool,
                         device: str) -> ForwardBatch:
        if self.draft_ids is not None:
            return self._verify_rows(req_to_token_pool, kv_pool, device)
        rows = torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64)
        seq_lens = [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]
        if self.mode.is_decode:
            ids = [r.fill_ids[p] for r, p in zip(self.reqs, self.prefix_lens)]
            positions = torch.tensor(self.prefix_lens, dtype=torch.int64)
        else:
            ids = []
            for i, (r, p, e) in enumerate(zip(self.reqs, self.prefix_lens, self.extend_lens)):
                draft = self.draft_ids[i] if self.draft_ids is not None else []
                ids.extend(r.fill_ids[p:p + e - len(draft)] + draft)
            positions = torch.cat([torch.arange(p, p + e)
                                   for p, e in zip(self.prefix_lens, self.extend_lens)])
        return ForwardBatch(
            mode=self.mode,
            batch_size=self.size,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=positions.to(device),
            req_pool_indices=rows.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            out_cache_loc=self.out_cache_loc.to(device),
            req_to_token_pool=req_to_token_pool,
            kv_pool=kv_pool,
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=[] if self.mode.is_decode else list(self.prefix_lens),
            extend_seq_lens_cpu=[] if self.mode.is_decode else list(self.extend_lens),
            logits_indices=self._logits_indices(len(ids), device),
        )

    def _verify_rows(self, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool,
                     device: str) -> ForwardBatch:
        """A verify step as a DECODE of one row per new token: request i's token at position
        prefix_lens[i] + j is a row over the request's own `req_to_token` row, attending to the
        positions up to its own. Every layer writes all rows' keys before any row attends
        (`AttentionBackend.forward`, the fused CPU step), so each row sees the drafts before it
        as an extend's causal mask would, and the logits come back one row per token, in the
        order of `logits_rows`. The decode executors take it as one step, which costs far less
        than an eager extend (docs/performance.md)."""
        assert self.draft_ids is not None and not any(map(len, self.input_logprob_positions))
        ids: list[int] = []
        rows: list[int] = []
        positions: list[int] = []
        for r, p, e, draft in zip(self.reqs, self.prefix_lens, self.extend_lens, self.draft_ids):
            ids.extend(r.fill_ids[p:p + e - len(draft)] + draft)
            rows.extend([r.req_pool_idx] * e)
            positions.extend(range(p, p + e))
        assert len(self.logits_rows) == len(ids), "a verify step keeps every row's logits"
        seq_lens = [q + 1 for q in positions]
        return ForwardBatch(
            mode=ForwardMode.DECODE, batch_size=len(ids),
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            out_cache_loc=self.out_cache_loc.to(device),
            req_to_token_pool=req_to_token_pool, kv_pool=kv_pool, seq_lens_cpu=seq_lens)

    def _logits_indices(self, num_tokens: int, device: str) -> torch.Tensor | None:
        """`logits_rows` for the forward; None when it keeps every row in order (decode)."""
        if len(self.logits_rows) == num_tokens and all(self.sample) and not any(
                map(len, self.input_logprob_positions)):
            return None  # one row per token, each sampled: the model skips the row selection
        return torch.tensor(self.logits_rows, dtype=torch.int64, device=device)
