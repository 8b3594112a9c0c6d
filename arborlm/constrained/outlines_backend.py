"""The outlines-core backend: JSON schema, regex and choices through a token-level regex index.

outlines-core turns a JSON schema into one regular expression and the regex into an `Index`
(a DFA over token ids), so it has no EBNF (asked for one, it fails with a `GrammarError`
naming xgrammar) and no structural tags. Its JSON follows the same documented defaults as
xgrammar's: objects are closed, whitespace between elements is `[ ]?` by default (outlines'
own), and `any_whitespace` allows up to `ANY_WHITESPACE_MAX_RUN` JSON whitespace characters.
Its JSON strings have no `\\u` escapes and exclude U+007F-U+009F, a narrowing that keeps output
valid. Its regexes match leftmost-first: in a user regex `(cat|cats)`, "cats" is unreachable
(outputs still match; choices are ordered longest first to avoid this). `$$ANY$$` is any JSON
value nested at most three levels deep (outlines' recursion limit).

outlines-core's `Vocabulary` takes a single EOS id; this module adds every other stop id
itself, allowing them wherever the grammar is complete. Rollback reaches back at most
`MAX_ROLLBACK_TOKENS` tokens (outlines keeps that many states).

Indexes are built in child processes (`index_process`): a regex whose index explodes is
killed at its time limit or its memory cap, and never takes the server's memory.
"""

from __future__ import annotations

import json

import outlines_core
import torch
from outlines_core.json_schema import build_regex_from_schema

from arborlm.constrained.base import (
    ANY_WHITESPACE_MAX_RUN,
    DEFAULT_COMPILE_TIMEOUT_S,
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    LastMask,
    parse_choices,
)
from arborlm.constrained.guarded_matcher import guarded
from arborlm.constrained.index_process import IndexProcesses
from arborlm.constrained.schema_guard import GuardPlan
from arborlm.constrained.schema_prepare import prepare_json_schema
from arborlm.constrained.vocab import TokenVocab
from arborlm.errors import GrammarError

MAX_ROLLBACK_TOKENS = 256
_REGEX_META = frozenset("\\.^$|?*+()[]{}/-\"#&~")


class OutlinesBackend(GrammarBackend):
    name = "outlines"

    def __init__(self, vocab: TokenVocab, *, any_whitespace: bool = False,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 index_memory_bytes: int | None = None):
        super().__init__(vocab, any_whitespace=any_whitespace,
                         compile_timeout_s=compile_timeout_s)
        self.whitespace = f"[ \\t\\n\\r]{{0,{ANY_WHITESPACE_MAX_RUN}}}" if any_whitespace \
            else "[ ]?"
        self._indexes = IndexProcesses(vocab.stop_token_ids[0], vocab.text_token_ids(),
                                       memory_bytes=index_memory_bytes)

    def _compile_json_schema(self, spec: str, strict: bool) -> CompiledGrammar:
        prepared = prepare_json_schema(spec, self.name, strict)
        try:
            regex = build_regex_from_schema(json.dumps(prepared.schema), self.whitespace)
        except Exception as e:  # outlines raises ValueError/TypeError with a readable message
            message = " ".join(str(e).split("\n")[0].split())
            raise GrammarError(f"invalid json_schema for outlines: {message}",
                               param="json_schema") from e
        compiled = self._index("json_schema", spec, regex)
        compiled.guard, compiled.unenforced = prepared.guard, prepared.unenforced
        return compiled

    def _compile_regex(self, spec: str) -> CompiledGrammar:
        return self._index("regex", spec, spec)

    def _compile_ebnf(self, spec: str) -> CompiledGrammar:
        raise GrammarError("the outlines grammar backend does not support ebnf grammars; "
                           "use the xgrammar backend", param="ebnf")

    def _compile_choices(self, spec: str) -> CompiledGrammar:
        # Longest first: outlines-core's regexes match leftmost-first, so in "(alpha|alphabet)"
        # the first alternative wins and "alphabet" could never be generated.
        choices = sorted(parse_choices(spec), key=len, reverse=True)
        regex = "(" + "|".join(escape_regex(c) for c in choices) + ")"
        return self._index("choices", spec, regex)

    def _index(self, kind: str, spec: str, regex: str) -> OutlinesCompiled:
        try:
            index = self._indexes.build(regex, self.compile_timeout_s)
        except GrammarError as e:  # the build's time limit or memory cap
            raise GrammarError(f"{kind}: {e}", param=kind) from e
        except ValueError as e:  # outlines-core's word on an invalid regex
            raise GrammarError(f"invalid {kind}: {e}", param=kind) from e
        return OutlinesCompiled(kind, spec, index, self.vocab)

    def close(self) -> None:
        """Stop the index-building processes."""
        self._indexes.close()


def escape_regex(text: str) -> str:
    """`text` as a regex literal: metacharacters backslashed, control characters as \\xHH."""
    out = []
    for ch in text:
        if ch in _REGEX_META:
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


class OutlinesCompiled(CompiledGrammar):
    def __init__(self, kind: str, spec: str, index: outlines_core.Index, vocab: TokenVocab):
        self.kind = kind
        self.spec = spec
        self._index = index
        self._vocab = vocab
        self.guard: GuardPlan | None = None  # a JSON schema's semantic guard

    def matcher(self) -> GrammarMatcher:
        return guarded(OutlinesMatcher(self._index, self._vocab), self.guard, self._vocab)


class OutlinesMatcher(GrammarMatcher):
    """A `Guide` (the DFA state) plus the accepted tokens, which `copy` replays on a new guide
    (deep-copying a guide copies its whole index: milliseconds with a 32k vocabulary)."""

    def __init__(self, index: outlines_core.Index, vocab: TokenVocab):
        self._index = index
        self._guide = outlines_core.Guide(index, max_rollback=MAX_ROLLBACK_TOKENS)
        self._history: list[int] = []  # accepted tokens, the terminating stop token excluded
        self._vocab = vocab
        self._terminated = False
        self.vocab_size = vocab.vocab_size
        self.stop_token_ids = vocab.stop_token_ids
        self._last_mask = LastMask()

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if token_id in self.stop_token_ids:
            self._terminated = self._guide.is_finished()
            if self._terminated:
                self._last_mask.changed()
            return self._terminated
        if not 0 <= token_id < len(self._vocab.decoded) or not self._vocab.decoded[token_id]:
            return False
        try:
            self._guide.advance(token_id, return_tokens=False)
        except ValueError:
            return False
        self._history.append(token_id)
        self._last_mask.changed()
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu"
        if self._last_mask.copy_into(bitmask, row):
            return
        target = bitmask[row]  # [ceil(V/32)]
        assert target.is_contiguous()
        target.zero_()
        if not self._terminated:
            self._guide.write_mask_into(target.data_ptr(), target.numel(), 4)
            if self._guide.is_finished():
                for token_id in self.stop_token_ids:
                    target[token_id // 32] |= _bit(token_id % 32)
        self._last_mask.keep(bitmask, row)

    def rollback(self, n: int) -> None:
        if n:
            self._last_mask.changed()
        if n and self._terminated:
            self._terminated = False
            n -= 1
        if n:
            self._guide.rollback_state(n)
            del self._history[-n:]

    def is_terminated(self) -> bool:
        return self._terminated

    def is_completed(self) -> bool:
        return self._terminated or self._guide.is_finished()

    def find_jump_forward_string(self) -> str:
        """The text of the forced tokens: outlines' index is token-level, so a forced string
        that tokens could split several ways is not found (xgrammar's is character-level)."""
        text = b"".join(self._vocab.decoded[t] for t in self.find_jump_forward_tokens()
                        if t not in self.stop_token_ids)
        return _complete_utf8_prefix(text)

    def copy(self) -> OutlinesMatcher:
        twin = OutlinesMatcher(self._index, self._vocab)
        for token_id in self._history:
            twin._guide.advance(token_id, return_tokens=False)
        twin._history = list(self._history)
        twin._terminated = self._terminated
        return twin

    def reset(self) -> None:
        self._guide.reset()
        self._history.clear()
        self._terminated = False
        self._last_mask.changed()


def _bit(position: int) -> int:
    """The int32 value with only bit `position` set (bit 31 is the sign bit)."""
    return (1 << position) - (1 << 32 if position == 31 else 0)


def _complete_utf8_prefix(data: bytes) -> str:
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="ignore")

