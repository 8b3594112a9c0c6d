"""`GuardedMatcher`: a grammar matcher plus the semantic guard of its schema.

It wraps any backend's `GrammarMatcher` and adds `check_token`: the bytes of a candidate token
are fed to the request's `json_tracker.JsonTracker` and the `schema_guard.GuardPlan` judges the
values they close (or the string they extend); the tracker is then restored, so checking
changes nothing. `accept_token` advances both the grammar and the tracker and keeps the
tracker's state before each token, so `rollback(n)` restores the guard exactly; `copy` and
`reset` carry or clear it. Jump-forward stops before a forced token the guard rejects (the
decode loop then samples there and asks `check_token`).

It does not mask: the grammar's bitmask is the inner matcher's, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from arborlm.constrained.base import GrammarMatcher
from arborlm.constrained.json_tracker import JsonTracker
from arborlm.constrained.schema_guard import GuardPlan
from arborlm.constrained.vocab import TokenVocab


def guarded(matcher: GrammarMatcher, plan: GuardPlan | None,
            vocab: TokenVocab) -> GrammarMatcher:
    """`matcher` itself without a plan, else wrapped with the plan's guard."""
    return matcher if plan is None else GuardedMatcher(matcher, plan, vocab)


class GuardedMatcher(GrammarMatcher):
    def __init__(self, inner: GrammarMatcher, plan: GuardPlan, vocab: TokenVocab,
                 tracker: JsonTracker | None = None, history: list[Any] | None = None):
        self._inner = inner
        self._plan = plan
        self._vocab = vocab
        self._tracker = tracker if tracker is not None else plan.tracker()
        self._history: list[Any] = history if history is not None else []  # state per token
        self.vocab_size = inner.vocab_size
        self.stop_token_ids = inner.stop_token_ids

    @property
    def inner(self) -> GrammarMatcher:
        return self._inner

    def check_token(self, token_id: int) -> str | None:
        if self._inner.is_terminated():
            return None
        state = self._tracker.snapshot()
        try:
            return self._plan.check(self._advance(token_id), self._tracker.text)
        finally:
            self._tracker.restore(state)

    def accept_token(self, token_id: int) -> bool:
        state = self._tracker.snapshot()
        if not self._inner.accept_token(token_id):
            return False
        self._history.append(state)
        self._advance(token_id)
        return True

    def _advance(self, token_id: int) -> list[Any]:
        if token_id in self.stop_token_ids:
            return self._tracker.finish()
        decoded = self._vocab.decoded
        return self._tracker.feed(decoded[token_id] if 0 <= token_id < len(decoded) else b"")

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._inner.fill_bitmask(bitmask, row)

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        self._inner.rollback(n)
        self._tracker.restore(self._history[-n])
        del self._history[-n:]

    def is_terminated(self) -> bool:
        return self._inner.is_terminated()

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def find_jump_forward_string(self) -> str:
        return self._inner.find_jump_forward_string()

    def copy(self) -> GuardedMatcher:
        return GuardedMatcher(self._inner.copy(), self._plan, self._vocab,
                              self._tracker.clone(), list(self._history))

    def reset(self) -> None:
        self._inner.reset()
        self._tracker = self._plan.tracker()
        self._history.clear()
