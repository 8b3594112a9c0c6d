"""`Speculator`: draft tokens for a decode step and verify them in one target forward.

Drafts come from a drafter chosen at start-up: NGRAM's (`ngram.NgramDrafter`: the request's
own prompt and output, else the server-wide cache of finished requests' n-grams) or
STANDALONE's (`draft_model.DraftModel`: a smaller model drafting greedily from its own KV
cache). Both propose point masses, so verification is the same for either.

A decode step of the running requests (`DecodeScheduler.schedule`) becomes, when some of them
have drafts, a verify step: an extend of each request's newest token followed by its draft
(`ScheduledBatch.draft_ids`), with logits at every new position (run as a decode step of one
row per token: `ScheduledBatch._verify_rows`). Verification then samples
position after position through the ordinary path (`ResultProcessor.sample_next`: penalties,
bias, bans, the grammar mask and guard, the seeded sampler, logprobs, stop checks,
jump-forward), and a request keeps going while the token it sampled equals its next draft
token. So what a request appends is exactly what plain decoding appends, for greedy and for
sampling alike: a draft (n-gram, or a draft model's greedy one) is a point mass q, and
sampling t ~ p then accepting when t is the draft is rejection sampling with acceptance
probability p(draft), whose rejected branch is p without the draft, renormalized. The seeded
sampler draws by (seed, output position), so even the tokens of a seeded request are those of
plain decoding. The last position sampled gives the bonus token; the KV slots of the rejected
drafts go back to the pool (`DecodeScheduler.after_verify`).

Grammar-aware drafting: a request with a grammar has its draft cut before the first token the
grammar (or its semantic guard) rejects, and extended by the tokens the grammar forces after
it and by the tokenizer's spelling of the string it forces after those (`grammar_draft.fit_draft`,
on the request's own matcher, rolled back after the walk), so the target never verifies a
token the mask would forbid, and a JSON key with its quotes and separators (forced as a
string, not as tokens) is one verify step where plain decoding spends a step per token. Forced
tokens alone are drafted only with jump-forward off (on, it has appended them already); the
spelled string is drafted with or without a draft before it. When jump-forward appends a forced
run after a sampled token during verification, the draft positions equal to it keep their KV
and verification goes on after them (`spec_grammar_pruned_tokens`, `spec_grammar_forced_tokens`
and `spec_grammar_spelled_tokens` count the tokens cut and added).

Adaptive: each request's draft length follows its acceptance (grows by one after a fully
accepted draft, shrinks to what was accepted plus one otherwise), and a request whose drafts
keep failing stops drafting for a number of steps that doubles with each failure, so a
workload with nothing to copy runs as plain decoding.

It drafts only for requests whose newest token is their only one without KV and only with
page size 1 (`EngineArgs.resolve` rejects other page sizes with speculation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from arborlm.runtime.config import EngineConfig, SpeculativeAlgorithm
from arborlm.runtime.forward_batch import ForwardMode
from arborlm.runtime.request import Req
from arborlm.runtime.scheduler.batch import ScheduledBatch
from arborlm.runtime.scheduler.in_batch_prefix import common_prefix_len
from arborlm.runtime.scheduler.kv_slots import KVSlots
from arborlm.runtime.scheduler.results import ResultProcessor, per_request
from arborlm.runtime.speculative.grammar_draft import fit_draft
from arborlm.runtime.speculative.ngram import NgramDrafter

# After this many failed drafts in a row a request pauses drafting for 2**(failures - 1) decode
# steps, at most MAX_BACKOFF_STEPS.
FAILURES_BEFORE_BACKOFF = 2
MAX_BACKOFF_STEPS = 64
# A verify step costs more than a plain decode step of the same requests (more rows): a step
# verifies only when its drafts hold at least this many tokens per request of the batch
# (always, for a lone request with a draft).
MIN_DRAFT_TOKENS_PER_REQUEST = 1


class Drafter(Protocol):
    """Where drafts come from (`NgramDrafter`, `DraftModel`)."""

    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        """Up to `ks[i]` draft tokens to follow `reqs[i]`'s tokens (none where ks[i] is 0)."""

    def release(self, req: Req) -> None:
        """`req` finished: drop what the drafter holds for it."""

    def reset(self) -> None:
        """Forget what finished requests left behind (with the prefix cache)."""

    def check_integrity(self) -> None:
        """Idle-time invariants of what the drafter holds."""


@dataclass
class SpecState:
    """One request's speculation: its draft length, back-off and counts (`verify_ct`: verifies
    of its drafts; `accepted`: draft tokens accepted in them)."""

    draft_len: int
    failures: int = 0  # drafts in a row with nothing accepted
    pause: int = 0  # decode steps left without drafting
    stats: dict[str, int] = field(default_factory=lambda: {"verify_ct": 0, "accepted": 0})


def create_speculator(config: EngineConfig, kv: KVSlots, results: ResultProcessor,
                      stats: dict[str, int], tokenizer: Any) -> Speculator | NoSpeculation:
    """The speculator `speculative_algorithm` names (checked by `EngineArgs.resolve`), its
    draft model's KV pool (STANDALONE) as large as the target's (`kv`)."""
    args = config.args
    if args.speculative_algorithm is None:
        return NoSpeculation()
    drafter: Drafter
    if args.speculative_algorithm == SpeculativeAlgorithm.STANDALONE:
        from arborlm.runtime.speculative.draft_model import DraftModel

        drafter = DraftModel(config, kv.allocator.total_size, tokenizer)
        max_draft = args.speculative_num_steps
    else:
        max_draft = args.speculative_num_draft_tokens
        drafter = NgramDrafter(args.speculative_ngram_min_match_window_size,
                               args.speculative_ngram_max_match_window_size, max_draft)
    return Speculator(config, drafter, max_draft, kv, results, stats,
                      encode=_encoder(tokenizer))


def _encoder(tokenizer: Any) -> Callable[[str], list[int]] | None:
    """Text -> token ids without special tokens, for spelling a grammar's forced string; None
    without a tokenizer (`skip_tokenizer_init`)."""
    if tokenizer is None or not hasattr(tokenizer, "encode"):
        return None
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


class NoSpeculation:
    """Speculation off: no decode step becomes a verify step."""

    def draft(self, batch: ScheduledBatch) -> None:
        return None

    def holds_back_run_ahead(self, batch: ScheduledBatch) -> bool:
        return False

    def release(self, req: Req) -> None:
        pass

    def reset(self) -> None:
        pass

    def info(self) -> dict[str, float]:
        return {}

    def check_integrity(self) -> None:
        pass


class Speculator:
    """Drafts from `drafter`, at most `max_draft` tokens per request and step, verified in
    one target forward. `stats`: the engine's counters (drafts, draft tokens, accepted draft
    tokens, verify steps), updated in place. `encode`: the tokenizer, to spell the strings
    grammars force (None: those are not drafted)."""

    def __init__(self, config: EngineConfig, drafter: Drafter, max_draft: int, kv: KVSlots,
                 results: ResultProcessor, stats: dict[str, int], *,
                 encode: Callable[[str], list[int]] | None = None):
        self.drafter = drafter
        self.encode = encode
        self.num_draft_tokens = max_draft
        self.context_length = config.model.context_length
        self.kv = kv
        self.results = results
        self.stats = stats
        for key in ("spec_verifies", "spec_drafts", "spec_draft_tokens",
                    "spec_accepted_tokens", "spec_grammar_pruned_tokens",
                    "spec_grammar_forced_tokens", "spec_grammar_spelled_tokens"):
            stats.setdefault(key, 0)

    def info(self) -> dict[str, float]:
        """The average acceptance length: tokens a request appends per verify of a draft
        (its accepted draft tokens plus the bonus token)."""
        n = self.stats["spec_verifies"]
        return {"avg_spec_accept_length": (self.stats["spec_accepted_tokens"] + n) / n
                if n else 0.0}

    # --- drafting -----------------------------------------------------------------------------

    def _state(self, req: Req) -> SpecState:
        if req.spec is None:
            req.spec = SpecState(self.num_draft_tokens)
        return req.spec

    def _room(self, req: Req) -> int | None:
        """How many draft tokens `req` may take this step: None when it drafts nothing (it
        has tokens without KV besides its newest, it finished, or it pauses)."""
        if req.total_len != req.computed_len + 1 or req.finished:
            return None
        state = self._state(req)
        if state.pause:
            state.pause -= 1
            return None
        return min(req.sampling_params.max_new_tokens - len(req.output_ids) - 1,
                   self.context_length - req.total_len - 1)

    def _drafts(self, reqs: list[Req]) -> list[list[int]]:
        rooms = [self._room(r) for r in reqs]
        ks = [0 if room is None else max(0, min(r.spec.draft_len, room))
              for r, room in zip(reqs, rooms)]
        drafts = self.drafter.propose(reqs, ks) if any(ks) else [[] for _ in reqs]
        return [d if r.grammar is None or room is None
                else self._fit_to_grammar(r, d, min(self.num_draft_tokens, room))
                for r, d, room in zip(reqs, drafts, rooms)]

    def _fit_to_grammar(self, req: Req, draft: list[int], limit: int) -> list[int]:
        """`draft` pruned by `req`'s grammar and extended by its forced tokens and the spelling
        of its forced string, at most `limit` in all (`fit_draft`). Forced tokens alone only
        when jump-forward is off: on, it has already appended them after the newest token."""
        hook = self.results.grammar_hook
        fitted = None
        with per_request(req, "grammar draft"):
            fitted = fit_draft(req.grammar, draft, len(req.output_ids), limit,
                               forced_alone=hook is None or not hook.jump_forward_enabled,
                               encode=self.encode)
        if fitted is None:
            return []  # the matcher failed: the request is finished with the error
        self.stats["spec_grammar_pruned_tokens"] += fitted.pruned
        self.stats["spec_grammar_forced_tokens"] += fitted.forced
        self.stats["spec_grammar_spelled_tokens"] += fitted.spelled
        return fitted.tokens

    def reset(self) -> None:
        """Forget what finished requests left in the drafter (with the prefix cache:
        `flush_cache`)."""
        self.drafter.reset()

    def release(self, req: Req) -> None:
        """A request finished (the n-gram drafter learns its tokens; the draft model frees its
        KV)."""
        self.drafter.release(req)

    def check_integrity(self) -> None:
        self.drafter.check_integrity()

    def draft(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """`batch` (a decode step, its slots taken) as a verify step: an extend of each
        request's newest token and its draft, the drafts' KV slots taken and written to the
        requests' rows. None when the drafts are too few for the batch
        (`MIN_DRAFT_TOKENS_PER_REQUEST`) or the pool lacks their slots (the step then runs as
        it is)."""
        if batch.mode is not ForwardMode.DECODE or self.kv.page_size != 1:
            return None
        drafts = self._drafts(batch.reqs)
        extra = sum(map(len, drafts))
        if extra < MIN_DRAFT_TOKENS_PER_REQUEST * batch.size:
            return None
        self.kv.make_room(extra)
        if self.kv.allocator.available_size() < extra:
            return None
        slots = self.kv.allocator.alloc_slots(extra)
        own = batch.out_cache_loc.view(-1)
        out, taken = [], 0
        for i, (req, d) in enumerate(zip(batch.reqs, drafts)):
            mine = slots[taken:taken + len(d)]
            taken += len(d)
            self.kv.req_pool.write(req.req_pool_idx, batch.prefix_lens[i] + 1, mine)
            out.extend([own[i:i + 1], mine])
        self.stats["spec_drafts"] += sum(1 for d in drafts if d)
        self.stats["spec_draft_tokens"] += extra
        return ScheduledBatch(
            mode=ForwardMode.EXTEND, decoding=True, reqs=batch.reqs,
            prefix_lens=batch.prefix_lens, extend_lens=[1 + len(d) for d in drafts],
            sample=[True] * batch.size, input_logprob_positions=[range(0)] * batch.size,
            out_cache_loc=torch.cat(out), draft_ids=drafts)

    def holds_back_run_ahead(self, batch: ScheduledBatch) -> bool:
        """Whether `batch` should decode one step rather than a run of continuous steps
        (`DecodeScheduler.steps_ahead`): some request's last draft was accepted in part, so
        it is likely copying and will draft again at the next step, which a run would skip."""
        return any(r.spec is not None and r.spec.stats["verify_ct"] and not r.spec.failures
                   for r in batch.reqs)

    # --- verification -------------------------------------------------------------------------

    def verify(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[int]:
        """Sample the verify step's positions in order (`logits` [sum(extend_lens), V], each
        request's rows consecutive) while each request's samples match its draft; returns
        per request how many of its new positions hold accepted KV (1 + accepted drafts)."""
        reqs, drafts = batch.reqs, batch.draft_ids
        # A request with no draft that only fed one of its forced tokens (more follow), or
        # that was aborted, is not sampled (as in `ResultProcessor.process`).
        computed = list(batch.extend_lens)
        live = [i for i, r in enumerate(reqs) if not r.finished
                and batch.prefix_lens[i] + batch.extend_lens[i] >= r.total_len]
        row = [0] * len(reqs)  # per request: its next row to sample, past its newest token
        while live:
            before = [len(reqs[i].output_ids) for i in live]
            rows = torch.tensor([batch.rows[i][2] + row[i] for i in live], dtype=torch.int64)
            self.results.sample_next([reqs[i] for i in live], logits[rows])
            todo, live = live, []
            for i, n in zip(todo, before):
                # What the row appended: the sampled token, then the tokens jump-forward
                # appended after it (a grammar's forced run). Those equal to the draft from
                # this row on have their KV here; the newest token never counts.
                req, new = reqs[i], reqs[i].output_ids[n:]
                same = common_prefix_len(new, drafts[i][row[i]:])
                computed[i] = row[i] + 1 + max(0, min(same, len(new) - 1))
                if not req.finished and new and same == len(new):
                    row[i] += len(new)
                    live.append(i)
        for i, req in enumerate(reqs):
            if drafts[i]:
                self._adapt(req, len(drafts[i]), computed[i] - 1)
        return computed

    def _adapt(self, req: Req, drafted: int, accepted: int) -> None:
        state = self._state(req)
        state.stats["verify_ct"] += 1
        state.stats["accepted"] += accepted
        self.stats["spec_verifies"] += 1
        self.stats["spec_accepted_tokens"] += accepted
        if accepted == drafted:
            state.draft_len = min(self.num_draft_tokens, state.draft_len + 1)
        else:
            state.draft_len = max(1, accepted + 1)
        state.failures = 0 if accepted else state.failures + 1
        if state.failures >= FAILURES_BEFORE_BACKOFF:
            state.pause = min(MAX_BACKOFF_STEPS, 2 ** (state.failures - FAILURES_BEFORE_BACKOFF))
