"""`Req`: one live request, owned by the scheduler and hashed by identity.

Lengths are named consistently and always ordered `cached_len <= computed_len <= total_len`:

- `cached_len`   — leading tokens whose KV came from the prefix cache at admission (locked there);
- `computed_len` — leading tokens whose KV is in the pool for this request;
- `total_len`    — `len(fill_ids)`, prompt plus output so far.

While decoding, `total_len == computed_len + 1`: the newest output token's KV is computed by
the next forward step. A retracted request goes back to the waiting queue with its output kept;
when readmitted it prefills `fill_ids` again (mostly from the cache) and carries on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from arborlm.runtime.sampling_params import SamplingParams


@dataclass
class FinishReason:
    """Why a request ended, in the native API's shape."""

    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None

    def to_json(self) -> dict[str, Any]:
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message, "status_code": self.status_code}

    @classmethod
    def abort(cls, message: str, status_code: int = 400) -> FinishReason:
        return cls("abort", message=message, status_code=status_code)


class Req:
    __slots__ = (
        "rid", "origin_input_ids", "sampling_params", "output_ids", "req_pool_idx",
        "cached_len", "computed_len", "prefix_slots", "last_node", "extra_key",
        "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
        "input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs",
        "output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs",
        "finished_reason", "cached_tokens", "arrival_time", "seed", "priority",
        "is_chunked", "retractions", "wait_steps", "grammar", "stream", "emitted_ids",
        "stop_checker", "first_token_time", "jump_forward_steps", "input_logprobs_done",
        "input_logprobs_sent", "spec", "rewind_to",
    )

    def __init__(self, rid: str, input_ids: list[int], sampling_params: SamplingParams, *,
                 return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0, token_ids_logprob: list[int] | None = None,
                 extra_key: str | None = None, seed: int = 0, priority: int = 0,
                 stream: bool = False):
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.sampling_params = sampling_params
        self.output_ids: list[int] = []
        self.req_pool_idx: int | None = None
        self.cached_len = 0
        self.computed_len = 0
        self.prefix_slots = torch.empty(0, dtype=torch.int64)
        self.last_node: Any = None
        self.extra_key = extra_key
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.token_ids_logprob = token_ids_logprob
        # Logprob lists hold (logprob, token_id) pairs; top/ids lists hold lists of pairs.
        self.input_token_logprobs: list[tuple[float | None, int]] = []
        self.input_top_logprobs: list[list[tuple[float, int]] | None] = []
        self.input_token_ids_logprobs: list[list[tuple[float, int]] | None] = []
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.output_token_ids_logprobs: list[list[tuple[float, int]]] = []
        self.finished_reason: FinishReason | None = None
        self.cached_tokens = 0
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.seed = seed
        self.priority = priority
        self.is_chunked = False
        self.retractions = 0
        self.wait_steps = 0
        self.grammar: Any = None
        self.stream = stream
        self.emitted_ids = 0
        self.stop_checker: Any = None
        self.jump_forward_steps = 0
        self.input_logprobs_done = False  # input logprobs computed (never recomputed)
        self.input_logprobs_sent = False
        self.spec: Any = None  # speculative decoding's state (`speculative.speculator`)
        self.rewind_to: int | None = None  # the output length a guard rollback asked for

    # --- lengths -------------------------------------------------------------------------

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def total_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def may_run_ahead(self) -> bool:
        """Whether this request's next decode steps may run ahead in one call, their tokens
        plain argmaxes (continuous decode steps, `scheduler/decode.py`): it samples greedily,
        nothing changes its logits (penalties, bias, a grammar, bans before `min_new_tokens`),
        it wants no logprobs, and its newest token is its only one without KV."""
        p = self.sampling_params
        return (p.is_greedy and self.grammar is None and not self.return_logprob
                and not p.frequency_penalty and not p.presence_penalty
                and p.repetition_penalty == 1.0 and not p.logit_bias
                and len(self.output_ids) >= p.min_new_tokens
                and self.total_len == self.computed_len + 1)

    def check_lengths(self) -> None:
        assert 0 <= self.cached_len <= self.computed_len <= self.total_len, (
            self.cached_len, self.computed_len, self.total_len)

    def drop_output(self, n: int) -> None:
        """Forget the newest `n` output tokens (none of them reported yet): their ids, logprob
        entries, grammar state and stop-string state. KV is the caller's (`KVSlots.rewind`)."""
        keep = len(self.output_ids) - n
        assert 0 < n and keep >= self.emitted_ids, (n, len(self.output_ids), self.emitted_ids)
        del self.output_ids[keep:]
        for entries in (self.output_token_logprobs, self.output_top_logprobs,
                        self.output_token_ids_logprobs):
            del entries[keep:]
        if self.grammar is not None:
            self.grammar.rollback(n)
        if self.stop_checker is not None:
            self.stop_checker.restart(self.output_ids)

    def reset_for_retract(self) -> None:
        """Back to the waiting queue: KV is released by the caller; outputs are kept."""
        self.req_pool_idx = None
        self.cached_len = 0
        self.computed_len = 0
        self.prefix_slots = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.is_chunked = False
        self.retractions += 1

    def __repr__(self) -> str:
        return (f"Req(rid={self.rid!r}, cached={self.cached_len}, computed={self.computed_len}, "
                f"total={self.total_len}, finished={self.finished_reason})")
