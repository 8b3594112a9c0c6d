"""The xgrammar backend (the default): every grammar kind, exact masks, native rollback.

JSON schemas compile in xgrammar's strict mode: an object without `additionalProperties` is
closed (only its listed properties may appear) and an array without `items` beyond its
`prefixItems` ends there. That is ArborLM's documented default for both backends: output stays
valid for the schema, and a model cannot pad an object with keys nobody asked for. A schema that
wants extra keys says so with `additionalProperties` (true or a schema), which xgrammar honours.
Whitespace: fixed separators `", "` and `": "` by default; with `any_whitespace` any JSON
whitespace, at most `ANY_WHITESPACE_MAX_RUN` characters per gap. Patterns are matched whole
(as if anchored). `schema_prepare` rewrites the schema first and decides what xgrammar would
drop: the semantic guard (`schema_guard`, wrapped around each matcher) checks that, or it is
refused (strict) or listed in `unenforced`.

Every grammar (JSON, regex, EBNF) is built as an xgrammar `Grammar`, printed, narrowed by
`narrow_char_classes` (no UTF-16 surrogates; no raw control characters in JSON strings) and
compiled from that text. Choices compile as an EBNF alternation of string literals (exact for
any characters). This module does not cache or time out compiles; `GrammarCompiler` does.
"""

from __future__ import annotations

import json
import os
import re

import torch
import xgrammar as xgr

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
from arborlm.constrained.schema_guard import GuardPlan
from arborlm.constrained.schema_prepare import prepare_json_schema
from arborlm.constrained.vocab import TokenVocab
from arborlm.errors import GrammarError

_LOG_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: ")
_STRING_OR_CLASS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')
_ANY_CHAR = "[\\0-\\U0010ffff]"
_SURROGATES = "\\ud800-\\udfff"
_JSON_EXCLUDED = "\\0-\\x1f" + _SURROGATES


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, vocab: TokenVocab, *, any_whitespace: bool = False,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S):
        super().__init__(vocab, any_whitespace=any_whitespace,
                         compile_timeout_s=compile_timeout_s)
        self.tokenizer_info = xgr.TokenizerInfo(
            list(vocab.decoded), xgr.VocabType.RAW, vocab_size=vocab.vocab_size,
            stop_token_ids=list(vocab.stop_token_ids), add_prefix_space=vocab.add_prefix_space)
        # ArborLM's own GrammarCompiler caches (bounded, with errors); xgrammar's would duplicate.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info,
                                             max_threads=min(4, os.cpu_count() or 1),
                                             cache_enabled=False)

    def _compile_json_schema(self, spec: str, strict: bool) -> CompiledGrammar:
        prepared = prepare_json_schema(spec, self.name, strict)
        text = json.dumps(prepared.schema)
        ws = {"any_whitespace": True, "max_whitespace_cnt": ANY_WHITESPACE_MAX_RUN} \
            if self.any_whitespace else {"any_whitespace": False}
        compiled = self._wrap("json_schema", spec, lambda: self._compile_narrowed(
            xgr.Grammar.from_json_schema(text, strict_mode=True, **ws), _JSON_EXCLUDED))
        compiled.guard, compiled.unenforced = prepared.guard, prepared.unenforced
        return compiled

    def _compile_regex(self, spec: str) -> CompiledGrammar:
        return self._wrap("regex", spec,
                          lambda: self._compile_narrowed(xgr.Grammar.from_regex(spec)))

    def _compile_ebnf(self, spec: str) -> CompiledGrammar:
        return self._wrap("ebnf", spec,
                          lambda: self._compile_narrowed(xgr.Grammar.from_ebnf(spec)))

    def _compile_choices(self, spec: str) -> CompiledGrammar:
        literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in parse_choices(spec))
        return self._wrap("choices", spec,
                          lambda: self._compiler.compile_grammar(f"root ::= {literals}"))

    def _compile_structural_tag(self, spec: str) -> CompiledGrammar:
        return self._wrap("structural_tag", spec,
                          lambda: self._compiler.compile_structural_tag(spec))

    def _compile_narrowed(self, grammar: xgr.Grammar,
                          excluded: str = _SURROGATES) -> xgr.CompiledGrammar:
        return self._compiler.compile_grammar(xgr.Grammar.from_ebnf(
            narrow_char_classes(str(grammar), excluded)))

    def _wrap(self, kind: str, spec: str, build) -> XGrammarCompiled:
        try:
            compiled = build()
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError/its own types
            raise GrammarError(f"invalid {kind}: {_clean_message(e)}", param=kind) from e
        return XGrammarCompiled(kind, spec, compiled, self.vocab)


class XGrammarCompiled(CompiledGrammar):
    def __init__(self, kind: str, spec: str, compiled: xgr.CompiledGrammar, vocab: TokenVocab):
        self.kind = kind
        self.spec = spec
        self._compiled = compiled
        self._vocab = vocab
        self.guard: GuardPlan | None = None  # a JSON schema's semantic guard

    def matcher(self) -> GrammarMatcher:
        return guarded(XGrammarMatcher(xgr.GrammarMatcher(self._compiled),
                                       self._vocab.vocab_size, self._vocab.stop_token_ids),
                       self.guard, self._vocab)


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int,
                 stop_token_ids: tuple[int, ...]):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._last_mask = LastMask()

    def accept_token(self, token_id: int) -> bool:
        accepted = bool(self._matcher.accept_token(int(token_id)))
        if accepted:
            self._last_mask.changed()
        return accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._last_mask.copy_into(bitmask, row):
            return
        if self._matcher.is_terminated():
            bitmask[row].zero_()
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)
        self._last_mask.keep(bitmask, row)

    def rollback(self, n: int) -> None:
        if n:
            self._matcher.rollback(n)
            self._last_mask.changed()

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def is_completed(self) -> bool:
        return bool(self._matcher.is_completed())

    def find_jump_forward_string(self) -> str:
        if self._matcher.is_terminated():
            return ""
        return self._matcher.find_jump_forward_string()

    def copy(self) -> XGrammarMatcher:
        return XGrammarMatcher(self._matcher.fork(), self.vocab_size, self.stop_token_ids)

    def reset(self) -> None:
        self._matcher.reset()
        self._last_mask.changed()


def narrow_char_classes(ebnf: str, excluded: str = _SURROGATES) -> str:
    """Add the ranges `excluded` to every "any character but ..." class of a printed grammar.

    Mends two xgrammar 0.2.9 defects by narrowing. It matches characters as UTF-8 code points
    but admits UTF-16 surrogates (U+D800-U+DFFF), so output could hold bytes such as ED A9 90,
    which are not UTF-8 and decode to replacement characters; and the string rule it builds for
    `minLength`/`maxLength` is `[^"\\\\\\r\\n]`, letting raw control characters into JSON
    strings (JSON grammars therefore also exclude U+0000-U+001F). Negated classes and the
    any-character class `[\\0-\\U0010ffff]` are narrowed; string literals and `Regex("...")`
    bodies are left alone.
    """
    def fix(match: re.Match[str]) -> str:
        token = match.group(0)
        if token.startswith("[^"):
            return token[:-1] + excluded + "]"
        return f"[^{excluded}]" if token == _ANY_CHAR else token

    return _STRING_OR_CLASS.sub(fix, ebnf)


def _clean_message(error: Exception) -> str:
    """xgrammar's C++ errors start with a timestamp and a source path; keep the message."""
    lines = [_LOG_PREFIX.sub("", line).strip() for line in str(error).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(error).__name__
