"""`DraftModel`: a smaller model with the target's tokenizer drafts greedily from its own KV cache.

STANDALONE speculation. The draft model runs in a `ModelRunner` of its own (the same model,
attention and decode-executor code as the target's) with its own request rows and a KV pool of
as many tokens as the target's (`ModelRunner._pool_slots` sizes the target's pool so that both
fit the memory budget). Each request drafting has a `DraftCache`: its row and the tokens whose
KV the draft pool holds, positions 0.. in order.

A draft of k tokens for a batch of requests is one forward of each request's tokens the draft
cache lacks (at least its newest token; its whole prompt the first time, as an extend; a few
tokens as decode rows), whose last logits give the first draft token by argmax, then k - 1
greedy decode steps (one C++ call on CPU where the decode executor runs steps ahead). The cache
then holds the request's tokens and its first k - 1 draft tokens. After verification the
request's tokens are its old ones, the accepted drafts and the bonus token: the next draft keeps
the cache's longest common prefix with them (the accepted drafts' KV), frees the slots past it
and extends from there, so the bonus token (and a fully accepted draft's last token) is fed
then. A guard rollback or a retraction
is handled the same way: whatever no longer matches the request's tokens is dropped.

When the draft pool or its rows run short, the caches of requests not in the step (retracted,
paused) go first, least recently used first; a request that still finds no room drafts nothing
that step. It does not verify, sample with the target's parameters, or touch the target's pool.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from arborlm.errors import InvalidRequestError
from arborlm.runtime.config import EngineConfig
from arborlm.runtime.forward_batch import ForwardBatch, ForwardMode
from arborlm.runtime.model_runner import ModelRunner
from arborlm.runtime.request import Req
from arborlm.runtime.scheduler.in_batch_prefix import common_prefix_len

logger = logging.getLogger(__name__)

# An extend of at most this many tokens per request runs as decode rows, one per token (as a
# verify step does: `ScheduledBatch._verify_rows`); a longer one (a prompt) as an extend.
MAX_ROWS_PER_REQUEST = 16


@dataclass
class DraftCache:
    """One request's KV in the draft pool: `tokens[p]` is at `req_to_token[row, p]`."""

    row: int
    tokens: list[int]
    last_used: int  # the draft step that last used it (for eviction)


def check_same_vocab(tokenizer: Any, draft_tokenizer: Any, path: str) -> None:
    """`InvalidRequestError` naming `speculative_draft_model_path` when the draft model's
    tokenizer maps any token differently from the target's."""
    ours, theirs = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
        raise InvalidRequestError(
            f"the draft model's tokenizer ({path}) differs from the target model's "
            f"({len(theirs)} vs {len(ours)} tokens; e.g. {differ}): a draft model must share "
            "the target's vocabulary", "speculative_draft_model_path")


class DraftModel:
    """Drafts for the requests of a verify step from the draft model named in `config`."""

    def __init__(self, config: EngineConfig, num_slots: int, tokenizer: Any):
        from arborlm.runtime.tokenizer_utils import load_tokenizer

        draft = config.draft_model
        assert draft is not None, "STANDALONE speculation without a resolved draft model"
        if draft.path != config.model.path:
            check_same_vocab(tokenizer, load_tokenizer(draft.path),
                             config.args.speculative_draft_model_path)
        args = dataclasses.replace(
            config.args, model_path=draft.path, tokenizer_path=None, max_total_tokens=num_slots,
            speculative_algorithm=None, speculative_draft_model_path=None,
            enable_deterministic_inference=None)
        self.runner = ModelRunner(EngineConfig(
            args=args, model=draft, attention_backend=config.attention_backend,
            tokenizer_path=config.tokenizer_path))
        self.context_length = draft.context_length
        self.req_pool = self.runner.req_to_token_pool
        self.allocator = self.runner.allocator
        self.caches: dict[Req, DraftCache] = {}
        self._clock = itertools.count()
        logger.info("draft model %s: %d layers, KV pool of %d tokens", draft.path,
                    draft.num_layers, self.allocator.total_size)

    # --- the caches ---------------------------------------------------------------------------

    def release(self, req: Req) -> None:
        """Free `req`'s draft cache (its request finished), if it has one."""
        cache = self.caches.pop(req, None)
        if cache is not None:
            self._truncate(cache, 0)
            self.req_pool.free(cache.row)

    def reset(self) -> None:
        """Nothing outlives its request here: each cache goes with its request (`release`)."""

    def check_integrity(self) -> None:
        """With no request holding a cache, every slot and row of the draft pool is free."""
        assert not self.caches, f"draft caches held while idle: {len(self.caches)}"
        assert self.allocator.available_size() == self.allocator.total_size, "draft KV leaked"
        assert self.req_pool.available_size() == self.req_pool.size, "draft rows leaked"

    def _truncate(self, cache: DraftCache, keep: int) -> None:
        if keep < len(cache.tokens):
            self.allocator.free(self.req_pool.req_to_token[cache.row, keep:len(cache.tokens)])
            del cache.tokens[keep:]

    def _evict_idle(self, busy: set[Req], slots: int) -> None:
        """Free the caches of requests not in `busy`, least recently used first, until `slots`
        slots and a row are free (or no idle cache is left)."""
        idle = sorted((c.last_used, id(r), r) for r, c in self.caches.items() if r not in busy)
        for _, _, req in idle:
            if (self.allocator.available_size() >= slots
                    and self.req_pool.available_size() > 0):
                return
            self.release(req)

    def _reserve(self, req: Req, tokens: list[int], steps: int, reserved: int, busy: set[Req],
                 step: int) -> tuple[DraftCache, int] | None:
        """`req`'s cache, cut to its longest common prefix with `tokens` (at most all but the
        newest token), and the slots it needs for the rest of `tokens` and `steps` decode
        steps, with `reserved` slots already promised to others; None where the draft pool
        cannot hold them."""
        if len(tokens) + steps > self.context_length:
            return None
        cache = self.caches.get(req)
        if cache is not None:
            self._truncate(cache, min(common_prefix_len(cache.tokens, tokens), len(tokens) - 1))
        need = len(tokens) - (len(cache.tokens) if cache else 0) + steps
        if self.allocator.available_size() < reserved + need or (
                cache is None and self.req_pool.available_size() == 0):
            self._evict_idle(busy, reserved + need)
        if self.allocator.available_size() < reserved + need:
            return None
        if cache is None:
            row = self.req_pool.alloc()
            if row is None:
                return None
            cache = self.caches[req] = DraftCache(row, [], step)
        cache.last_used = step
        return cache, need

    # --- drafting -----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        """Up to `ks[i]` greedy draft tokens after `reqs[i]`'s tokens (none where ks[i] is 0 or
        the draft pool is full)."""
        step = next(self._clock)
        busy = set(reqs)
        steps = max(ks) - 1  # decode steps after the extend, for every request drafting
        work: list[tuple[int, DraftCache, list[int]]] = []
        reserved = 0
        for i, (req, k) in enumerate(zip(reqs, ks)):
            if k > 0:
                tokens = req.fill_ids
                got = self._reserve(req, tokens, steps, reserved, busy, step)
                if got is not None:
                    work.append((i, got[0], tokens))
                    reserved += got[1]
        drafts: list[list[int]] = [[] for _ in reqs]
        if not work:
            return drafts
        first = self._extend(work)
        later = self._decode(work, first, steps) if steps else []
        for j, (i, _, _) in enumerate(work):
            drafts[i] = ([first[j]] + [row[j] for row in later])[:ks[i]]
        return drafts

    def _extend(self, work: list[tuple[int, DraftCache, list[int]]]) -> list[int]:
        """Feed each cache the tokens it lacks; the argmax after each request's newest token."""
        ids, positions, out, ends = [], [], [], []
        prefix, ext = [], []
        for _, cache, tokens in work:
            start = len(cache.tokens)
            new = tokens[start:]
            slots = self.allocator.alloc_slots(len(new))
            self.req_pool.write(cache.row, start, slots)
            ids.extend(new)
            positions.extend(range(start, len(tokens)))
            out.append(slots)
            prefix.append(start)
            ext.append(len(new))
            ends.append(len(ids) - 1)
            cache.tokens.extend(new)
        if max(ext) <= MAX_ROWS_PER_REQUEST:  # as decode rows, as a verify step runs
            rows = [cache.row for (_, cache, _), e in zip(work, ext) for _ in range(e)]
            batch = self._batch(ForwardMode.DECODE, rows, ids, positions,
                                [q + 1 for q in positions], torch.cat(out))
            return self.runner.forward(batch)[ends].argmax(-1).tolist()
        batch = self._batch(ForwardMode.EXTEND, [cache.row for _, cache, _ in work], ids,
                            positions, [p + e for p, e in zip(prefix, ext)], torch.cat(out),
                            logits_rows=ends)
        batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu = prefix, ext
        return self.runner.forward(batch).argmax(-1).tolist()

    def _decode(self, work: list[tuple[int, DraftCache, list[int]]], first: list[int],
                steps: int) -> list[list[int]]:
        """`steps` greedy decode steps after the tokens `first`: the tokens [steps][requests]
        each step gives. The caches then hold `first` and all but the last step's tokens."""
        lens = [len(cache.tokens) for _, cache, _ in work]
        slots = self.allocator.alloc_slots(steps * len(work)).view(len(work), steps)
        for (_, cache, _), n, own in zip(work, lens, slots):
            self.req_pool.write(cache.row, n, own)
        slots = slots.t().contiguous()  # [steps, requests]
        rows = [cache.row for _, cache, _ in work]
        batch = self._batch(ForwardMode.DECODE, rows, first, lens, [n + 1 for n in lens],
                            slots[0])
        if steps > 1 and self.runner.can_run_ahead(batch):
            tokens = self.runner.run_ahead(batch, slots).tolist()
        else:
            tokens, feed = [], first
            for s in range(steps):
                batch = self._batch(ForwardMode.DECODE, rows, feed, [n + s for n in lens],
                                    [n + s + 1 for n in lens], slots[s])
                feed = self.runner.forward(batch).argmax(-1).tolist()
                tokens.append(feed)
        fed = [first] + tokens[:-1]  # the tokens whose KV the steps wrote
        for j, (_, cache, _) in enumerate(work):
            cache.tokens.extend(row[j] for row in fed)
        return tokens

    def _batch(self, mode: ForwardMode, rows: list[int], ids: list[int], positions: list[int],
               seq_lens: list[int], out_cache_loc: torch.Tensor,
               logits_rows: list[int] | None = None) -> ForwardBatch:
        device = self.runner.device
        return ForwardBatch(
            mode=mode, batch_size=len(rows),
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            out_cache_loc=out_cache_loc.to(device),
            req_to_token_pool=self.req_pool, kv_pool=self.runner.kv_pool,
            seq_lens_cpu=seq_lens,
            logits_indices=None if logits_rows is None else torch.tensor(
                logits_rows, dtype=torch.int64, device=device))
