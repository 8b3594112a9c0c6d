"""The grammar-engine interface: `GrammarBackend` -> `CompiledGrammar` -> `GrammarMatcher`.

One `GrammarBackend` per engine (xgrammar, outlines-core) and tokenizer. `compile(kind, spec)`
turns a grammar spec into an immutable `CompiledGrammar` that many requests share; each request
gets its own `GrammarMatcher` from `compiled.matcher()`, which the decode loop drives one token
at a time. Compiling happens off the hot path in `compile_cache.GrammarCompiler`; masks are
applied with `bitmask.apply_token_bitmask_`.

How the engine drives it (the scheduler and sampler code against exactly this):

1. Arrival: `future = compiler.submit(kind, spec, backend)`; the request waits in its grammar
   state and the loop checks `future.done()` each step. `future.exception()` is a
   `GrammarError`: finish that request alone as an abort with status 400 and `str(error)`.
   Otherwise `req.grammar = future.result().matcher()`.
2. Each decode step: one `allocate_token_bitmask(batch, vocab_size)` buffer (reusable);
   `req.grammar.fill_bitmask(mask, i)` for every row i with a grammar;
   `apply_token_bitmask_(logits, mask, rows)` after logit bias and penalties, before
   temperature / top-k / top-p / sampling.
3. After sampling t: `req.grammar.check_token(t)`; a reason (a JSON schema's semantic guard
   found a violation) bans t for this step and samples again, a bounded number of times, then
   aborts with the reason. Then `req.grammar.accept_token(t)` (True by construction of the mask);
   `is_terminated()` then means finish with `stop`, matched = t (also under `ignore_eos`: a
   complete grammar allows nothing but its stop tokens).
4. Jump-forward: `forced = req.grammar.find_jump_forward_tokens()`; accept each, append them
   to the output and compute their KV in the next extend step instead of one decode step each
   (steps saved = len(forced)); outputs are unchanged because each was the only legal token.
5. Retraction keeps the matcher as it is (output tokens are kept); an abort drops it;
   speculative decoding accepts the draft tokens and `rollback`s the rejected ones; `n > 1`
   samples and DSL forks `copy()` the matcher.

This module holds the contracts only; it imports neither engine. The registry of engines
(`GRAMMAR_BACKENDS`, `create_grammar_backend`) is the package's `__init__`.
"""

from __future__ import annotations

import abc
import json
from typing import TYPE_CHECKING, Any

import torch

from arborlm.errors import GrammarError

if TYPE_CHECKING:
    from arborlm.constrained.vocab import TokenVocab

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "choices", "structural_tag")
ANY_JSON = "$$ANY$$"  # json_schema spec meaning "any JSON value"
DEFAULT_COMPILE_TIMEOUT_S = 30.0
MAX_JUMP_FORWARD_TOKENS = 64
# With any_whitespace=True, JSON may hold at most this many whitespace characters between two
# elements (after "{", around ":" and ",", before "]"), so a model cannot emit whitespace
# forever; enough for pretty-printed JSON nested a dozen levels deep.
ANY_WHITESPACE_MAX_RUN = 24


class LastMask:
    """A matcher's last filled mask row and the state it was filled in, so that a second fill
    in the same state is a copy: the decode loop fills each state twice when jump-forward finds
    nothing forced (its probe, then the next step's mask). The matcher calls `changed()` on
    every accepted token, rollback and reset."""

    def __init__(self) -> None:
        self._state = 0
        self._kept_state = -1  # the state `_row` holds the mask of (-1: none)
        self._row: torch.Tensor | None = None  # [W] int32, reused from fill to fill

    def changed(self) -> None:
        self._state += 1

    def copy_into(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the kept row into `bitmask[row]` if it is this state's; whether it was."""
        kept = self._row
        if self._kept_state != self._state or kept is None or kept.shape != bitmask[row].shape:
            return False
        bitmask[row].copy_(kept)
        return True

    def keep(self, bitmask: torch.Tensor, row: int) -> None:
        """`bitmask[row]` was just filled in the current state."""
        if self._row is None or self._row.shape != bitmask[row].shape:
            self._row = torch.empty_like(bitmask[row])
        self._row.copy_(bitmask[row])
        self._kept_state = self._state


class GrammarMatcher(abc.ABC):
    """Per-request state of one grammar: which tokens may come next.

    Lifecycle: accept tokens as they are sampled; `is_terminated()` becomes true once a stop
    token is accepted where the grammar is complete (the request then finishes with `stop`).
    `rollback(n)` undoes the last n accepted tokens (speculative decoding, retraction of
    unverified tokens); `reset()` returns to the start; `copy()` forks an independent matcher
    (parallel samples, `fork` in the DSL). Matchers are not thread-safe; one thread drives one.
    """

    vocab_size: int  # bits per bitmask row that can be set: the model's vocabulary
    stop_token_ids: tuple[int, ...]

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance on `token_id`; return False (state unchanged) if the grammar rejects it."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32, CPU): bit i set = allowed.

        Writes the whole row, including ids past the tokenizer's vocabulary (always 0). After
        termination the row allows nothing. Does not change the matcher's state.
        """

    @abc.abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (a terminating stop token counts as one)."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token has been accepted at a point where the grammar is complete."""

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True when the text so far is a complete sentence of the grammar (a stop may follow)."""

    @abc.abstractmethod
    def find_jump_forward_string(self) -> str:
        """The longest string the grammar forces from here ("" if none), state unchanged.

        Character-level: it need not end on a token boundary, so appending it as the tokenizer
        would encode it can change what a model decoding token by token would produce. Use it to
        propose draft tokens for verification (speculative decoding); the decode loop's exact
        jump-forward uses `find_jump_forward_tokens`.
        """

    @abc.abstractmethod
    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (same history, so rollback works)."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Return to the initial state, forgetting every accepted token."""

    def check_token(self, token_id: int) -> str | None:
        """Whether accepting `token_id` (which the mask allows) would close a JSON value that
        violates its subschema, or make a string too long: a reason naming the instance and
        the schema keyword by JSON pointer, or None. State unchanged. The decode loop asks
        after sampling; on a reason it bans that token for the step and samples again (a
        bounded number of times, then aborts with the reason). Without a semantic guard
        (every grammar but a JSON schema with keywords the grammar cannot express) None.
        """
        return None

    # --- rollback to a value's start (only a semantic guard rejects values) -----------------

    exhausted = False  # the bans at this position left no token (`fill_bitmask` sets it)

    def rejected_value_start(self) -> int | None:
        """After `check_token` gave a reason: the output position of the first token of the
        value that closed wrong, or None (no guard, or a string that merely grew too long)."""
        return None

    def held_from(self) -> int | None:
        """The output position from which tokens may still be rejected as part of an open
        value (they must not be shown yet), or None."""
        return None

    def choice_after(self, start: int) -> int | None:
        """The first position at or after `start` where the mask left more than one token."""
        return None

    def choice_before(self, end: int) -> int | None:
        """The last position before `end` where the mask left more than one token."""
        return None

    def ban_at(self, position: int, token_id: int) -> None:
        """Ban `token_id` at output position `position` until a rollback goes before it."""
        raise NotImplementedError(f"{type(self).__name__} has no semantic guard to ban with")

    def bans_at(self, position: int) -> int:
        return 0

    def find_jump_forward_tokens(self, max_tokens: int = MAX_JUMP_FORWARD_TOKENS) -> list[int]:
        """The tokens the grammar forces from here, one at a time; state unchanged.

        A token is forced when the mask allows exactly that one token; the walk stops at the
        first state that allows two or more (or none), after `max_tokens`, or after a forced stop
        token (which is then the last element), and before a forced token `check_token`
        rejects (the decode loop then samples there and meets the rejection itself). Because
        every returned token is the only one the mask admits, any sampler would pick it:
        appending these tokens without a decode step per token leaves the output identical,
        greedy or not.
        """
        row = torch.zeros(1, (self.vocab_size + 31) // 32, dtype=torch.int32)  # [1, ceil(V/32)]
        forced: list[int] = []
        while len(forced) < max_tokens and not self.is_terminated():
            self.fill_bitmask(row, 0)
            token = _single_allowed_token(row[0])
            if token is None or self.check_token(token) is not None or \
                    not self.accept_token(token):
                break
            forced.append(token)
            if token in self.stop_token_ids:
                break
        self.rollback(len(forced))  # walked on this matcher, then undone: no copy needed
        return forced


class CompiledGrammar(abc.ABC):
    """An immutable compiled grammar, safe to share across requests and threads."""

    kind: str
    spec: str
    # What this grammar does not enforce (non-strict JSON schemas only): "pointer/keyword
    # (reason)" each; empty when everything is enforced by the grammar or its semantic guard.
    unenforced: tuple[str, ...] = ()

    @abc.abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""


class GrammarBackend(abc.ABC):
    """One grammar engine bound to one tokenizer and model vocabulary.

    `compile` is synchronous and thread-safe; it raises `GrammarError` with a message fit for a
    400 reply when the spec is invalid or uses something the engine cannot enforce. It does not
    enforce `compile_timeout_s` itself: `GrammarCompiler` does, around it.
    """

    name: str
    vocab: TokenVocab  # the token bytes this backend masks over
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    any_whitespace: bool
    compile_timeout_s: float

    def __init__(self, vocab: TokenVocab, *, any_whitespace: bool = False,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S):
        self.vocab = vocab
        self.vocab_size = vocab.vocab_size
        self.stop_token_ids = vocab.stop_token_ids
        self.any_whitespace = any_whitespace
        self.compile_timeout_s = compile_timeout_s

    def compile(self, kind: str, spec: str, *, strict: bool = True) -> CompiledGrammar:
        """Compile `spec` of grammar `kind` (one of `GRAMMAR_KINDS`).

        `strict` matters for `json_schema` only. Strict (the default): refuse what neither the
        grammar, an exact rewrite nor the semantic guard can enforce. Not strict: accept it
        and list it in the result's `unenforced`.
        """
        if kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r}; expected one of "
                               f"{', '.join(GRAMMAR_KINDS)}", param=kind)
        if not isinstance(spec, str):
            raise GrammarError(f"{kind} must be a string, got {type(spec).__name__}", param=kind)
        if kind == "json_schema":
            return self._compile_json_schema(spec, strict)
        if kind == "regex":
            return self._compile_regex(spec)
        if kind == "ebnf":
            return self._compile_ebnf(spec)
        if kind == "choices":
            return self._compile_choices(spec)
        return self._compile_structural_tag(spec)

    def close(self) -> None:  # noqa: B027 (an optional hook: most backends hold nothing)
        """Release what the backend holds outside this process: the outlines backend's index
        processes (the xgrammar backend holds nothing there)."""

    @abc.abstractmethod
    def _compile_json_schema(self, spec: str, strict: bool) -> CompiledGrammar: ...

    @abc.abstractmethod
    def _compile_regex(self, spec: str) -> CompiledGrammar: ...

    @abc.abstractmethod
    def _compile_ebnf(self, spec: str) -> CompiledGrammar: ...

    @abc.abstractmethod
    def _compile_choices(self, spec: str) -> CompiledGrammar: ...

    def _compile_structural_tag(self, spec: str) -> CompiledGrammar:
        raise GrammarError(f"the {self.name} grammar backend does not support structural_tag; "
                           "use the xgrammar backend", param="structural_tag")


def parse_choices(spec: str) -> list[str]:
    """The `choices` spec is a JSON list of one or more strings; return it or raise."""
    try:
        choices: Any = json.loads(spec)
    except json.JSONDecodeError as e:
        raise GrammarError(f"choices must be a JSON list of strings: {e}", param="choices") from e
    if not isinstance(choices, list) or not choices:
        raise GrammarError("choices must be a non-empty list of strings", param="choices")
    if not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("every choice must be a non-empty string", param="choices")
    return choices


def _single_allowed_token(row: torch.Tensor) -> int | None:
    """The id of the only set bit in a bitmask row, or None if zero or several are set."""
    nonzero = row.nonzero()  # [k, 1]
    if nonzero.shape[0] != 1:
        return None
    word_index = int(nonzero[0, 0])
    word = int(row[word_index]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return word_index * 32 + word.bit_length() - 1
