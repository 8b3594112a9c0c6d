"""`GrammarManager`: grammar-constrained decoding as the scheduler drives it.

The scheduler owns one and calls it at fixed points of a request's life; a request without a
grammar costs it one emptiness check per step. For a request with a grammar (`sampling_params.
grammar` is (kind, spec)):

1. `submit(req)` on arrival sends the compile to `GrammarCompiler`'s thread pool (cached by
   (backend, kind, spec, strict)). A JSON schema compiles strict unless the request's
   `json_schema_strict` is false: strict refuses what cannot be guaranteed (a 400 naming the
   JSON pointer), non-strict accepts it and lists it in `CompiledGrammar.unenforced`. The
   request stays in the waiting queue and admission skips it while `is_pending(req)`, so the
   requests behind it go ahead; nothing blocks on a compile.
2. `poll()` at the start of each step gives each request whose compile has finished its own
   matcher (`req.grammar`), and returns those whose compile failed (invalid or unsupported
   spec, time limit), each marked finished with an abort, status 400 and the compiler's message,
   for the scheduler to finish alone. When nothing can run but compiles are pending, `wait()`
   sleeps on them for a few milliseconds instead of spinning.
3. Sampling (this object is `ResultProcessor.grammar_hook`): `apply_mask(reqs, logits)` fills one
   packed int32 bitmask for the batch, only the rows with a grammar, and sets the logits of
   disallowed tokens to -inf before sampling, so the logprobs reflect the constraint (other rows
   are untouched). `accept(req, token)` advances the matcher; `is_terminated(req)` means the
   request finishes with `stop`. A matcher that raises (making or filling a mask here; accepting,
   terminating or jump-forward in `results.py`) fails its own request (abort, 500), not the step.
4. The semantic guard (what a mask cannot express: `not`, `uniqueItems`, overlapping `oneOf`,
   string lengths, ...): `check(req, token)` asks the matcher whether accepting a sampled or
   forced token would close a JSON value that violates its subschema (`GrammarMatcher.
   check_token`, state unchanged) and returns the reason. A value that closed wrong is rolled
   back (`rewind_to_value`): the request goes back to the first position inside the value
   where the mask left a choice, the token taken there is banned at that position (the matcher
   clears it from the mask while the request stands there), and the scheduler drops the tokens
   after it with their KV once the step is done (`req.rewind_to`, `KVSlots.rewind`); a
   different value must then come. A string that only grew too long (or a value whose every
   token was forced) has its token banned for this step instead and the row sampled again.
   When a position's bans leave nothing, the request goes back to the last earlier choice
   (`back_off`). `ban` counts every ban: at most `MAX_GUARD_BANS_PER_STEP` at one position and
   `MAX_GUARD_BANS_PER_REQUEST` in all; a request's rollbacks may drop at most
   `GUARD_ROLLBACK_BUDGET` x its `max_new_tokens` tokens in all (each dropped token was computed
   and is generated again, so one request never costs unbounded compute); past them, or with no
   earlier choice left that was not yet reported to the client, `dead_end` finishes that request
   alone with `abort` (status 400) and a message naming the reason.
5. Jump-forward: `jump_forward(req, limit)` lists the tokens the grammar forces next. The result
   processor appends them (logprob 0.0: each is the only token the mask leaves) without masking
   or sampling them, and the scheduler computes their KV: in one extend step when the batch
   holds enough forced tokens (always for a lone request), else one per decode step. Every
   forced token is the only legal one, so outputs are those of decoding token by token, greedy
   or sampled.
6. `release(req)` on finish or abort drops the matcher, or cancels the pending compile.
   Retraction keeps the matcher: the output tokens are kept, and it has accepted exactly them.

Parallel samples (`n > 1`) are separate requests: they share the compiled grammar and each gets
a fresh matcher. This module neither compiles (see `arborlm.constrained`) nor decides about
length, stop tokens or stop strings (`results.py`).
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from arborlm.constrained.base import MAX_JUMP_FORWARD_TOKENS
from arborlm.constrained.bitmask import allocate_token_bitmask, apply_token_bitmask_
from arborlm.constrained.compile_cache import GrammarCompiler
from arborlm.runtime.config import EngineArgs
from arborlm.runtime.request import FinishReason, Req
from arborlm.runtime.sampling_params import SamplingParams
from arborlm.runtime.scheduler.results import fail_request, per_request

# The semantic guard's retries: tokens it may ban at one output position (each ban resamples the
# request's row without the banned tokens), and in a whole request. Past either, or when the
# grammar mask minus the bans allows nothing, the request ends with `abort` and this status.
MAX_GUARD_BANS_PER_STEP = 16
MAX_GUARD_BANS_PER_REQUEST = 64
# Tokens a request's rollbacks may drop in all, in multiples of its `max_new_tokens`: a request
# then computes at most (1 + this) x max_new_tokens output tokens.
GUARD_ROLLBACK_BUDGET = 4
GUARD_DEAD_END_STATUS = 400


class GrammarManager:
    def __init__(self, args: EngineArgs, tokenizer: Any, vocab_size: int,
                 stop_token_ids: tuple[int, ...]):
        self.compiler = GrammarCompiler.for_tokenizer(
            tokenizer, vocab_size, list(stop_token_ids), args.grammar_backend,
            any_whitespace=args.grammar_any_whitespace,
            compile_timeout_s=args.grammar_compile_timeout)
        self.vocab_size = vocab_size
        # May be switched between steps (benchmarks compare both ways on one engine).
        self.jump_forward_enabled = not args.disable_jump_forward
        self._pending: dict[Req, Future] = {}
        self._active = 0  # requests holding a matcher
        self._bans: dict[Req, int] = {}  # guard bans so far, per request that had any
        self._dropped: dict[Req, int] = {}  # tokens its rollbacks dropped, per request
        self.guard_bans = 0  # in all, since start
        self.rollbacks = 0  # of them, those that rolled a request back (since start)
        self.dropped_tokens = 0  # output tokens those rollbacks dropped (since start)
        self._bitmask = allocate_token_bitmask(1, vocab_size)  # [rows, W], grown on demand

    # --- compiling ----------------------------------------------------------------------------

    def compile(self, params: SamplingParams) -> Future | None:
        """The compile of `params`' grammar (None without one). Thread-safe: a client may call
        it to reject a bad grammar before queuing; the scheduler then finds it cached. A JSON
        schema with `json_schema_strict` false compiles non-strict."""
        grammar = params.grammar
        if grammar is None:
            return None
        kind, spec = grammar
        if kind == "json_schema" and not params.json_schema_strict:
            return self.compiler.submit(kind, spec, params.grammar_backend, strict=False)
        return self.compiler.submit(kind, spec, params.grammar_backend)

    def submit(self, req: Req) -> None:
        future = self.compile(req.sampling_params)
        if future is not None:
            self._pending[req] = future

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def num_active(self) -> int:
        """Requests that hold a matcher now."""
        return self._active

    def is_pending(self, req: Req) -> bool:
        """True while `req`'s grammar is compiling (admission skips it)."""
        return bool(self._pending) and req in self._pending

    def poll(self) -> list[Req]:
        """Hand out the matchers of finished compiles; return the requests whose compile failed
        (already marked finished: abort, 400, the reason)."""
        if not self._pending:
            return []
        failed = []
        for req, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[req]
            error = future.exception()
            if error is None:
                try:
                    req.grammar = future.result().matcher()
                except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                    fail_request(req, "grammar matcher", e)
                    failed.append(req)
                    continue
                self._active += 1
            else:
                req.finished_reason = FinishReason.abort(str(error), 400)
                failed.append(req)
        return failed

    def wait(self, timeout: float) -> None:
        """Sleep until a pending compile finishes or `timeout` seconds pass."""
        if self._pending:
            wait_futures(list(self._pending.values()), timeout, return_when=FIRST_COMPLETED)

    def release(self, req: Req) -> None:
        """`req` finished or was aborted: drop its matcher or its pending compile."""
        future = self._pending.pop(req, None) if self._pending else None
        if future is not None:
            future.cancel()
        if req.grammar is not None:
            req.grammar = None
            self._active -= 1
        if self._bans:
            self._bans.pop(req, None)
        if self._dropped:
            self._dropped.pop(req, None)

    # --- the decode loop (ResultProcessor.grammar_hook) ----------------------------------------

    def apply_mask(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Mask `logits` [len(reqs), V] in place for the rows whose request has a grammar."""
        if not self._active:
            return
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return
        if self._bitmask.shape[0] < len(reqs):
            self._bitmask = allocate_token_bitmask(len(reqs), self.vocab_size)
        mask = self._bitmask[:len(reqs)]  # [B, W]; rows without a grammar are not read
        filled, stuck = [], []
        for i in rows:
            with per_request(reqs[i], "grammar mask"):
                reqs[i].grammar.fill_bitmask(mask, i)
                filled.append(i)
                if reqs[i].grammar.exhausted:  # its bans left nothing here: go back further
                    self.back_off(reqs[i], "the guard's bans leave no token at output "
                                  f"position {len(reqs[i].output_ids)}",
                                  len(reqs[i].output_ids))
                    stuck.append(i)
        if filled:
            apply_token_bitmask_(logits, mask, filled)
        for i in stuck:  # not sampled for real (finished or rewound): keep its row finite
            logits[i, 0] = 0.0

    def accept(self, req: Req, token: int) -> bool:
        """Advance `req`'s matcher on `token`.

        The mask makes every sampled token acceptable unless bans applied before it left no
        token the grammar allows (stop tokens banned until `min_new_tokens`, or user stop token
        ids that the grammar needs). Then the token is rejected and `req` finishes: with `stop`
        when the grammar is complete (the grammar's end wins over `min_new_tokens`), else with
        a 400 that names the conflict. Returns whether the token was accepted.
        """
        if req.grammar.accept_token(token):
            return True
        if req.grammar.is_completed():
            req.finished_reason = FinishReason("stop", matched=None)
        else:
            req.finished_reason = FinishReason.abort(
                "min_new_tokens bans stop_token_ids that the grammar requires next; no token "
                "is left to generate", 400)
        return False

    # --- the semantic guard ---------------------------------------------------------------------

    @staticmethod
    def check(req: Req, token: int) -> str | None:
        """Why accepting `token` would break `req`'s schema (a value that closes invalid, a string
        too long), or None; the matcher is unchanged."""
        return req.grammar.check_token(token)

    def ban(self, req: Req, bans_this_step: int) -> bool:
        """Count a guard ban of `req`, its `bans_this_step`-th at this position (this one
        included); False, counting nothing, when that is more than `MAX_GUARD_BANS_PER_STEP`
        or `req` already had `MAX_GUARD_BANS_PER_REQUEST`: the request is at a dead end."""
        total = self._bans.get(req, 0)
        if bans_this_step > MAX_GUARD_BANS_PER_STEP or total >= MAX_GUARD_BANS_PER_REQUEST:
            return False
        self._bans[req] = total + 1
        self.guard_bans += 1
        return True

    def rewind_to_value(self, req: Req, reason: str) -> bool:
        """After `check` rejected a token of `req` for `reason`: roll back to the first choice
        inside the value that closed wrong, or finish `req` at a dead end; False (nothing
        done) when that value has no choice before the rejected token (the token is then
        banned at this position, as for a string grown too long)."""
        start = req.grammar.rejected_value_start()
        if start is None or start >= len(req.output_ids):
            return False
        position = req.grammar.choice_after(start)
        if position is None:
            return False
        self._rewind(req, reason, position)
        return True

    def back_off(self, req: Req, reason: str, end: int,
                 what: str = "no earlier choice is left to change") -> None:
        """Nothing is left to take at output position `end` (`what` says why): roll `req`
        back to the last choice before it and ban what it took there, or finish it at a dead
        end."""
        position = req.grammar.choice_before(end)
        if position is None:
            self.dead_end(req, reason, what)
        else:
            self._rewind(req, reason, position)

    def _rewind(self, req: Req, reason: str, position: int) -> None:
        dropped = self._dropped.get(req, 0) + len(req.output_ids) - position
        budget = GUARD_ROLLBACK_BUDGET * req.sampling_params.max_new_tokens
        if position < req.emitted_ids:
            self.dead_end(req, reason, "the value's choices were already sent")
        elif dropped > budget:
            self.dead_end(req, reason, f"rolling back would bring the tokens its rollbacks "
                          f"dropped to {dropped}, past the budget of {budget} "
                          f"({GUARD_ROLLBACK_BUDGET} x max_new_tokens)")
        elif not self.ban(req, req.grammar.bans_at(position) + 1):
            self.dead_end(req, reason, "the guard's retries ran out")
        else:
            req.grammar.ban_at(position, req.output_ids[position])
            req.rewind_to = position
            self.dropped_tokens += dropped - self._dropped.get(req, 0)
            self._dropped[req] = dropped
            self.rollbacks += 1

    def dead_end(self, req: Req, reason: str, what: str) -> None:
        """Finish `req` alone: the guard rejected its token (`reason`) and `what` is left."""
        kind = req.sampling_params.grammar[0]
        bans = self._bans.get(req, 0)
        req.finished_reason = FinishReason.abort(
            f"{kind} guard: {reason}; {what} (after {bans} guard ban{'s' * (bans != 1)} in this "
            "request): generation stopped", GUARD_DEAD_END_STATUS)

    def is_terminated(self, req: Req) -> bool:
        return req.grammar.is_terminated()

    def jump_forward(self, req: Req, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (matcher unchanged); [] when disabled."""
        if not self.jump_forward_enabled or limit <= 0:
            return []
        return req.grammar.find_jump_forward_tokens(min(limit, MAX_JUMP_FORWARD_TOKENS))

    def info(self) -> dict[str, Any]:
        stats = self.compiler.stats
        return {"grammar_compiling": len(self._pending), "grammar_active": self._active,
                "grammar_guard_bans": self.guard_bans,
                "grammar_guard_rollbacks": self.rollbacks,
                "grammar_guard_dropped_tokens": self.dropped_tokens,
                "grammar_cache_hits": stats.hits, "grammar_cache_misses": stats.misses,
                "grammar_errors": stats.errors, "grammar_timeouts": stats.timeouts}
