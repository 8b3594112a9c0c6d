"""Turning a forward step's logits into request progress.

For each request of the batch: record input logprobs for the prompt positions it asked for,
sample its next token (penalties, bias, bans, grammar mask, then the sampler), record output
logprobs, append the token and decide whether the request is finished (stop token, stop string,
stop regex, length, context limit, grammar end). For a request with a grammar, then append the
tokens the grammar forces next (jump-forward), each checked like a sampled one. Grammar state
is `grammar_hook`'s (the scheduler's `GrammarManager`); this module only calls it.

The semantic guard: a sampled or forced token that the grammar's guard rejects because it closes
a JSON value that violates its subschema rolls the request back to that value's first choice,
banned there (`GrammarManager.rewind_to_value`): the request takes no token this step and the
scheduler drops the value's tokens once the step is done (`req.rewind_to`). A token rejected
otherwise (a string grown too long, a value with no choice before it) is banned for this step
and the request's row is sampled again from the same processed, masked logits minus the banned
tokens, with the same sampling parameters and the same seed and position, so seeded sampling
stays deterministic. When the bans at a position run out, or nothing is left, the request goes
back to an earlier choice (`back_off`), and finishes alone with `abort` when there is none or
its retries are spent. The logprobs of a resampled token (and its top / ids logprobs) are the
log-softmax of that final row: penalties, bias, bans, the grammar mask and the guard's bans
applied (banned tokens -inf, the rest renormalized), before temperature and truncation, like
every constrained token's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from arborlm.runtime.config import EngineConfig
from arborlm.runtime.request import FinishReason, Req
from arborlm.runtime.sampling.sampler import SampleOutput, process_logits, sample
from arborlm.runtime.sampling.sampling_batch import SamplingBatch
from arborlm.runtime.scheduler.batch import ScheduledBatch
from arborlm.runtime.scheduler.outputs import chosen_logprobs, ids_logprobs, top_logprobs
from arborlm.runtime.scheduler.stop_checker import StopChecker

if TYPE_CHECKING:  # grammar_manager.py imports this module
    from arborlm.runtime.scheduler.grammar_manager import GrammarManager

logger = logging.getLogger(__name__)
# The status of a request that failed inside the engine (a bug, not the caller's input).
INTERNAL_ERROR_STATUS = 500


def fail_request(req: Req, stage: str, error: BaseException) -> None:
    """Finish `req` alone with an abort that names the stage that failed (logged with its
    traceback); the scheduler releases it like any finished request."""
    logger.error("request %s failed in %s", req.rid, stage, exc_info=error)
    req.finished_reason = FinishReason.abort(f"{stage} failed: {error!r}", INTERNAL_ERROR_STATUS)


@contextmanager
def per_request(req: Req, stage: str) -> Iterator[None]:
    """Run one request's share of a step's work; an exception fails that request only."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - one request fails, the batch goes on
        fail_request(req, stage, e)


class ResultProcessor:
    """`eos_ids`: every id that ends generation by default (`eos_token_ids`); `grammar_hook`:
    the grammar state of the requests that have a grammar (None: no request has one)."""

    def __init__(self, config: EngineConfig, tokenizer: Any, vocab_size: int, *,
                 eos_ids: tuple[int, ...], grammar_hook: GrammarManager | None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = config.model.context_length
        self.eos_ids = eos_ids
        self.grammar_hook = grammar_hook

    def attach(self, req: Req) -> None:
        """Per-request state: a stop checker when the request has stop strings/regex."""
        p = req.sampling_params
        if p.stop or p.stop_regex:
            req.stop_checker = StopChecker(
                self.tokenizer, req.origin_input_ids, list(p.stop), list(p.stop_regex),
                p.skip_special_tokens, p.spaces_between_special_tokens)
            if req.output_ids:
                req.stop_checker.add(req.output_ids)

    def detach(self, req: Req) -> None:
        req.stop_checker = None

    def process(self, batch: ScheduledBatch, logits: torch.Tensor) -> None:
        """`logits` [N, V] float32 in the row order of `batch.logits_rows`."""
        sample_reqs, sample_rows = [], []
        for i, req in enumerate(batch.reqs):
            first, n_input, sample_row = batch.rows[i]
            if (not batch.mode.is_decode and req.wants_input_logprobs
                    and not req.input_logprobs_done):
                end = batch.prefix_lens[i] + batch.extend_lens[i]
                with per_request(req, "input logprobs"):
                    self._input_logprobs(req, batch.input_logprob_positions[i],
                                         logits[first:first + n_input], batch.prefix_lens[i],
                                         end)
            if sample_row < 0 or req.finished:
                continue
            if batch.prefix_lens[i] + batch.extend_lens[i] < req.total_len:
                continue  # a decode step fed one of its forced tokens; more follow
            sample_reqs.append(req)
            sample_rows.append(sample_row)
        if not sample_reqs:
            return
        if sample_rows == list(range(logits.shape[0])) and not any(
                r.grammar is not None for r in sample_reqs):
            # Every row in order (decode): sample from the forward's logits themselves; they
            # are inference tensors, which sampling changes in place. (Grammar masks are applied
            # outside inference mode, so those batches sample from a copy, as any subset does.)
            with torch.inference_mode():
                self._sample(sample_reqs, logits)
        else:
            self._sample(sample_reqs, logits[torch.tensor(sample_rows, dtype=torch.int64)])

    def sample_next(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Sample each request's next token from its row of `logits` [len(reqs), V], as a
        decode step does (a speculative verify step calls this once per draft position)."""
        self._sample(reqs, logits)

    # --- input logprobs -------------------------------------------------------------------------

    def _input_logprobs(self, req: Req, positions: range, logits: torch.Tensor,
                        prefix: int, end: int) -> None:
        if not req.input_token_logprobs and req.logprob_start_len == 0 and prefix == 0:
            first = req.origin_input_ids[0]
            req.input_token_logprobs.append((None, first))
            req.input_top_logprobs.append(None)
            req.input_token_ids_logprobs.append(None)
        if len(positions):
            lp = torch.log_softmax(logits, dim=-1)  # [n, V]
            ids = torch.tensor([req.origin_input_ids[p + 1] for p in positions],
                               dtype=torch.int64)
            req.input_token_logprobs.extend(zip(chosen_logprobs(lp, ids), ids.tolist()))
            if req.top_logprobs_num:
                req.input_top_logprobs.extend(top_logprobs(lp, req.top_logprobs_num))
            if req.token_ids_logprob:
                req.input_token_ids_logprobs.extend(ids_logprobs(lp, req.token_ids_logprob))
        if end >= req.prompt_len:
            req.input_logprobs_done = True

    # --- sampling -----------------------------------------------------------------------------

    def _sample(self, reqs: list[Req], logits: torch.Tensor) -> None:
        sb, reqs, logits = self._sampling_batch(reqs, logits)
        if not reqs:
            return
        logits = process_logits(logits, sb)
        grammar = self.grammar_hook
        if grammar is not None:
            grammar.apply_mask(reqs, logits)
        out = sample(logits, sb)
        ids = out.next_ids.tolist()
        if grammar is not None and grammar.num_active:
            for i, req in enumerate(reqs):
                if req.grammar is not None and not req.finished:
                    with per_request(req, "grammar guard"):
                        ids[i] = self._guard(req, i, ids[i], logits, sb, out)
        chosen = None
        if out.logprobs is not None:
            chosen = chosen_logprobs(out.logprobs, torch.tensor(ids, dtype=torch.int64,
                                                                device=out.logprobs.device))
        now = time.monotonic()
        for i, (req, tok) in enumerate(zip(reqs, ids)):
            if req.finished:
                continue  # its grammar mask or guard ended it (`GrammarManager`)
            if req.rewind_to is not None:
                continue  # its guard rolled it back: no token this step
            if req.first_token_time is None:
                req.first_token_time = now
            if req.grammar is not None:
                accepted = False
                with per_request(req, "grammar"):
                    accepted = grammar.accept(req, tok)
                if not accepted or req.finished:
                    continue  # bans left nothing the grammar allows, or the grammar failed
            req.output_ids.append(tok)
            if req.return_logprob:
                with per_request(req, "output logprobs"):
                    self._output_logprobs(req, chosen[i], tok, out.logprobs[i:i + 1])
            if not req.finished:
                self._check_finished(req, tok)
            if req.grammar is not None and not req.finished:
                with per_request(req, "grammar jump-forward"):
                    self._jump_forward(req)

    def _guard(self, req: Req, row: int, tok: int, logits: torch.Tensor, sb: SamplingBatch,
               out: SampleOutput) -> int:
        """The token `req` takes at `row`: `tok` if its guard accepts it, else one sampled
        again with every rejected token banned (`logits[row]` set to -inf there, and
        `out.logprobs[row]` recomputed from it). When `req` is rolled back instead, or
        finished at a dead end, the returned token is unused."""
        grammar = self.grammar_hook
        if req.rewind_to is not None:
            return tok  # its mask left nothing: already rolled back (`apply_mask`)
        reason = grammar.check(req, tok)
        if reason is not None and grammar.rewind_to_value(req, reason):
            return tok
        bans = 0
        while reason is not None:
            bans += 1
            if not grammar.ban(req, bans):
                grammar.back_off(req, reason, len(req.output_ids), "the guard's retries ran out")
                return tok
            logits[row, tok] = float("-inf")
            if not bool((logits[row] > float("-inf")).any()):
                grammar.back_off(req, reason, len(req.output_ids),
                                 "the grammar allows no other token")
                return tok
            tok = int(sample(logits[row:row + 1], _row_batch(sb, row)).next_ids[0])
            reason = grammar.check(req, tok)
        if bans and out.logprobs is not None:
            out.logprobs[row] = torch.log_softmax(logits[row], dim=-1)
        return tok

    def _sampling_batch(self, reqs: list[Req], logits: torch.Tensor
                        ) -> tuple[SamplingBatch, list[Req], torch.Tensor]:
        """The batch's sampling tensors. Should building them fail, each request is tried
        alone: those that fail are finished with the error, the others are sampled."""
        try:
            return SamplingBatch.build(reqs, self.vocab_size, self.eos_ids), reqs, logits
        except Exception:  # noqa: BLE001 - find the request(s) at fault below
            pass
        keep = []
        for i, req in enumerate(reqs):
            with per_request(req, "sampling parameters"):
                SamplingBatch.build([req], self.vocab_size, self.eos_ids)
                keep.append(i)
        kept = [reqs[i] for i in keep]
        rows = logits[torch.tensor(keep, dtype=torch.int64)]
        return SamplingBatch.build(kept, self.vocab_size, self.eos_ids), kept, rows

    def take_greedy(self, req: Req, tok: int) -> None:
        """Append `tok`, chosen by a greedy step run ahead (`DecodeScheduler.take_ahead`) for a
        request with no grammar, logprobs or logit changes, and check whether it finished: what
        `_sample` does for such a request."""
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        req.output_ids.append(tok)
        self._check_finished(req, tok)

    def _output_logprobs(self, req: Req, chosen: float, tok: int,
                         logprobs: torch.Tensor) -> None:
        """Logprob entries of the sampled `tok`; `logprobs` [1, V] is its row."""
        req.output_token_logprobs.append((chosen, tok))
        if req.top_logprobs_num:
            req.output_top_logprobs.append(top_logprobs(logprobs, req.top_logprobs_num)[0])
        if req.token_ids_logprob:
            req.output_token_ids_logprobs.append(ids_logprobs(logprobs, req.token_ids_logprob)[0])

    def _jump_forward(self, req: Req) -> None:
        """Append the tokens `req`'s grammar forces next, as if each had been sampled.

        Each is the only token its mask leaves, so any sampler picks it with logprob 0.0 (its
        top logprobs are itself alone; every other id is -inf). Stops where a token would
        finish the request, or where it would be banned (a stop token before
        `min_new_tokens`): decoding then samples at that point as usual. The scheduler computes
        their KV and counts the decode steps that saves. A forced token the semantic guard
        rejects leaves nothing to sample there: the request goes back as for a sampled one.
        """
        p = req.sampling_params
        limit = min(p.max_new_tokens - len(req.output_ids), self.context_length - req.total_len)
        for tok in self.grammar_hook.jump_forward(req, limit):
            if self._banned(req, tok):
                return
            reason = self.grammar_hook.check(req, tok)
            if reason is not None:  # the only token the grammar allows: go back
                if not self.grammar_hook.rewind_to_value(req, reason):
                    self.grammar_hook.back_off(req, reason, len(req.output_ids),
                                               "it is the only token the grammar allows")
                return
            self.grammar_hook.accept(req, tok)
            req.output_ids.append(tok)
            if req.return_logprob:
                self._forced_logprobs(req, tok)
            self._check_finished(req, tok)
            if req.finished:
                return

    def _banned(self, req: Req, tok: int) -> bool:
        """Whether sampling would ban `tok` now (as `SamplingBatch` does before min tokens)."""
        p = req.sampling_params
        if len(req.output_ids) >= p.min_new_tokens:
            return False
        return tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids)

    @staticmethod
    def _forced_logprobs(req: Req, tok: int) -> None:
        req.output_token_logprobs.append((0.0, tok))
        if req.top_logprobs_num:
            req.output_top_logprobs.append([(0.0, tok)])
        if req.token_ids_logprob:
            req.output_token_ids_logprobs.append(
                [(0.0 if t == tok else float("-inf"), t) for t in req.token_ids_logprob])

    def _check_finished(self, req: Req, tok: int) -> None:
        p = req.sampling_params
        n_out = len(req.output_ids)
        if n_out >= p.min_new_tokens and (tok in p.stop_token_ids
                                          or (not p.ignore_eos and tok in self.eos_ids)):
            req.finished_reason = FinishReason("stop", matched=tok)
            return
        if req.stop_checker is not None:
            with per_request(req, "stop check"):
                self._check_stop(req, tok, n_out >= p.min_new_tokens)
            if req.finished:
                return
        if self.grammar_hook is not None and req.grammar is not None:
            with per_request(req, "grammar"):
                if self.grammar_hook.is_terminated(req):
                    req.finished_reason = FinishReason("stop", matched=tok)
            if req.finished:
                return
        if n_out >= p.max_new_tokens:
            req.finished_reason = FinishReason("length", length=p.max_new_tokens)
        elif req.total_len >= self.context_length:
            req.finished_reason = FinishReason("length", length=n_out)

    @staticmethod
    def _check_stop(req: Req, tok: int, check: bool) -> None:
        """Feed `tok` to the stop checker; with `check` (past `min_new_tokens`), finish `req`
        with `stop` when its text reached a stop string or a `stop_regex` match."""
        if not check:
            req.stop_checker.add([tok])
            return
        matched = req.stop_checker.check(tok)
        if matched is not None:
            req.finished_reason = FinishReason("stop", matched=matched)


def _row_batch(sb: SamplingBatch, row: int) -> SamplingBatch:
    """Row `row` of `sb` as a batch of one, for sampling that row again from logits already
    processed (penalties, bias and bans applied): the same temperature, truncation and seed."""
    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[row:row + 1]

    greedy = sb.all_greedy or bool(sb.greedy[row])
    return dataclasses.replace(
        sb, temperatures=take(sb.temperatures), top_ps=take(sb.top_ps), top_ks=take(sb.top_ks),
        min_ps=take(sb.min_ps), greedy=take(sb.greedy), all_greedy=greedy,
        seeds=sb.seeds[row:row + 1], penalty_rows=None, frequency=None, presence=None,
        repetition=None, output_counts=None, seen_prompt=None, logit_bias=None, banned=None,
        want_logprobs=False)


def eos_token_ids(config: EngineConfig, tokenizer: Any) -> tuple[int, ...]:
    """Every id that ends generation by default: config, generation config and tokenizer EOS."""
    ids = set(config.model.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_file = Path(config.model.path) / "generation_config.json"
    if gen_file.is_file():
        gen = json.loads(gen_file.read_text()).get("eos_token_id")
        ids.update(gen if isinstance(gen, list) else [gen] if gen is not None else [])
    return tuple(sorted(ids))
