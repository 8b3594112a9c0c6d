"""`GuardedMatcher`: a grammar matcher plus the semantic guard of its schema.

It wraps any backend's `GrammarMatcher` and adds `check_token`: the bytes of a candidate token
are fed to the request's `json_tracker.JsonTracker` and the `schema_guard.GuardPlan` judges the
values they close (or the string they extend); the tracker is then restored, so checking
changes nothing. `accept_token` advances both the grammar and the tracker and keeps the
tracker's state before each token, so `rollback(n)` restores the guard exactly; `copy` and
`reset` carry or clear it. Jump-forward stops before a forced token the guard rejects (the
decode loop then samples there and asks `check_token`).

Rollback to a value's start (the decode loop drives it, `GrammarManager`): after a rejection
`rejected_value_start()` is the output position of the first token of the value that closed
wrong (None when a string merely grew too long); `choice_after(start)` / `choice_before(end)`
find the positions where the mask left more than one token (a forced token is no choice: a
different value needs a different token where there was one); `ban_at(position, token)` bans a
token there, kept until a rollback goes before that position, and cleared from the bitmask
whenever the matcher stands there (`exhausted` then says whether the bans left nothing).
`held_from()` is the output position from which tokens must not be shown yet: the start of the
outermost open value that is checked when it closes.

It does not otherwise mask: the grammar's bitmask is the inner matcher's.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

import torch

from arborlm.constrained.base import (
    MAX_JUMP_FORWARD_TOKENS,
    GrammarMatcher,
    _single_allowed_token,
)
from arborlm.constrained.json_tracker import Close, JsonTracker
from arborlm.constrained.schema_guard import GuardPlan
from arborlm.constrained.vocab import TokenVocab


def guarded(matcher: GrammarMatcher, plan: GuardPlan | None,
            vocab: TokenVocab) -> GrammarMatcher:
    """`matcher` itself without a plan, else wrapped with the plan's guard."""
    return matcher if plan is None else GuardedMatcher(matcher, plan, vocab)


class GuardedMatcher(GrammarMatcher):
    def __init__(self, inner: GrammarMatcher, plan: GuardPlan, vocab: TokenVocab,
                 tracker: JsonTracker | None = None, history: list[Any] | None = None,
                 choices: list[bool] | None = None, bans: dict[int, set[int]] | None = None):
        self._inner = inner
        self._plan = plan
        self._vocab = vocab
        self._tracker = tracker if tracker is not None else plan.tracker()
        self._history: list[Any] = history if history is not None else []  # state per token
        self._choices: list[bool] = choices if choices is not None else []  # per token
        self._bans: dict[int, set[int]] = bans if bans is not None else {}  # position -> ids
        self._choice_here = False  # the last bitmask filled left more than one token
        self._rejected_start: int | None = None
        self.exhausted = False
        self.vocab_size = inner.vocab_size
        self.stop_token_ids = inner.stop_token_ids

    @property
    def inner(self) -> GrammarMatcher:
        return self._inner

    def check_token(self, token_id: int) -> str | None:
        self._rejected_start = None
        if self._inner.is_terminated():
            return None
        state = self._tracker.snapshot()
        try:
            found = self._plan.violation(self._advance(token_id), self._tracker.text)
        finally:
            self._tracker.restore(state)
        if found is None:
            return None
        reason, event = found
        if isinstance(event, Close):
            self._rejected_start = self._position_of(event.start)
        return reason

    def rejected_value_start(self) -> int | None:
        return self._rejected_start

    def held_from(self) -> int | None:
        start = self._plan.checked_start(self._tracker)
        return None if start is None else self._position_of(start)

    def _position_of(self, offset: int) -> int:
        """The position of the token whose bytes hold text offset `offset` (the number of
        accepted tokens when it is past them: the token being checked)."""
        if offset >= len(self._tracker.text):
            return len(self._history)
        return max(0, bisect_right(self._history, offset, key=lambda state: state[0]) - 1)

    def choice_after(self, start: int) -> int | None:
        """The first position at or after `start` whose token was a choice, or None."""
        return next((i for i in range(start, len(self._choices)) if self._choices[i]), None)

    def choice_before(self, end: int) -> int | None:
        """The last position before `end` whose token was a choice, or None."""
        return next((i for i in range(min(end, len(self._choices)) - 1, -1, -1)
                     if self._choices[i]), None)

    def ban_at(self, position: int, token_id: int) -> None:
        self._bans.setdefault(position, set()).add(token_id)

    def bans_at(self, position: int) -> int:
        return len(self._bans.get(position, ()))

    def accept_token(self, token_id: int) -> bool:
        state = self._tracker.snapshot()
        if not self._inner.accept_token(token_id):
            return False
        self._history.append(state)
        self._choices.append(self._choice_here)
        self._choice_here = False  # a token accepted without a mask (forced) is no choice
        self._advance(token_id)
        return True

    def _advance(self, token_id: int) -> list[Any]:
        if token_id in self.stop_token_ids:
            return self._tracker.finish()
        decoded = self._vocab.decoded
        return self._tracker.feed(decoded[token_id] if 0 <= token_id < len(decoded) else b"")

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._inner.fill_bitmask(bitmask, row)
        words = bitmask[row]  # [W] int32
        banned = self._bans.get(len(self._history))
        if banned:
            for tok in banned:
                word = int(words[tok >> 5]) & ~(1 << (tok & 31)) & 0xFFFFFFFF
                words[tok >> 5] = word - (1 << 32) if word >= 1 << 31 else word
        self.exhausted = bool(banned) and not bool(words.any())
        self._choice_here = not self.exhausted and _single_allowed_token(words) is None

    def find_jump_forward_tokens(self, max_tokens: int = MAX_JUMP_FORWARD_TOKENS) -> list[int]:
        exhausted = self.exhausted
        try:
            return super().find_jump_forward_tokens(max_tokens)
        finally:  # the walk filled masks ahead: what comes next is a forced token or a fill
            self._choice_here, self.exhausted = False, exhausted

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        self._inner.rollback(n)
        self._tracker.restore(self._history[-n])
        del self._history[-n:]
        del self._choices[-n:]
        kept = len(self._history)
        for position in [p for p in self._bans if p > kept]:
            del self._bans[position]  # bans made after a prefix that is gone

    def is_terminated(self) -> bool:
        return self._inner.is_terminated()

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def find_jump_forward_string(self) -> str:
        return self._inner.find_jump_forward_string()

    def copy(self) -> GuardedMatcher:
        return GuardedMatcher(self._inner.copy(), self._plan, self._vocab,
                              self._tracker.clone(), list(self._history), list(self._choices),
                              {p: set(b) for p, b in self._bans.items()})

    def reset(self) -> None:
        self._inner.reset()
        self._tracker = self._plan.tracker()
        self._history.clear()
        self._choices.clear()
        self._bans.clear()
