"""Regex, EBNF, choices and structural tags: outputs match, bad specs fail with a clear 400."""

from __future__ import annotations

import json
import re

import pytest

from arborlm.constrained.base import GrammarBackend
from arborlm.errors import GrammarError, InvalidRequestError
from tests.constrained.driver import force_text, generate

REGEXES = [
    r"[a-z]{2,5}-[0-9]{3}",
    r"(cat|dog|bird)s?",
    r"\+?[0-9]{1,3}( [0-9]{2,4}){2,3}",
    r"[A-Z][a-z]{1,6} [A-Z]\. [A-Z][a-z]{1,6}",
    r"(true|false|null)",
    r"0x[0-9a-f]{1,8}",
    r"[0-9]{1,4}(\.[0-9]{1,3})?(e[+-]?[0-9]{1,2})?",
    r"(ab|a)(bc|c)d",
]

# A tiny arithmetic language; `_parses` below checks outputs without the grammar engine.
ARITH_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9] | [1-9] [0-9] | "(" expr ")"
"""


def _parses(text: str) -> bool:
    """Recursive-descent recogniser of ARITH_EBNF."""
    pos = 0

    def factor() -> bool:
        nonlocal pos
        if text[pos:pos + 1] == "(":
            pos += 1
            if not expr() or text[pos:pos + 1] != ")":
                return False
            pos += 1
            return True
        match = re.match(r"[1-9][0-9]|[0-9]", text[pos:])
        if not match:
            return False
        pos += match.end()
        return True

    def chain(item, ops: str) -> bool:
        nonlocal pos
        if not item():
            return False
        while text[pos:pos + 1] and text[pos] in ops:
            pos += 1
            if not item():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and pos == len(text)


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_fullmatch(backend: GrammarBackend, pattern: str) -> None:
    compiled = backend.compile("regex", pattern)
    for seed in range(3):
        result = generate(compiled.matcher(), backend.vocab, seed=seed)
        assert result.terminated
        assert re.fullmatch(pattern, result.text(backend.vocab)), result.text(backend.vocab)


def test_ebnf_outputs_parse(xgrammar: GrammarBackend) -> None:
    compiled = xgrammar.compile("ebnf", ARITH_EBNF)
    done = 0
    for seed in range(8):
        result = generate(compiled.matcher(), xgrammar.vocab, seed=seed, budget=200)
        if not result.terminated:
            continue
        text = result.text(xgrammar.vocab)
        assert _parses(text), text
        replay = compiled.matcher()  # a fresh matcher accepts the same tokens to completion
        assert all(replay.accept_token(t) for t in result.token_ids) and replay.is_completed()
        done += 1
    assert done >= 6
    assert not _parses("1+") and not _parses("(1") and _parses("(1+23)*4")


def test_choices_return_one_of_them(backend: GrammarBackend) -> None:
    choices = ["yes", "no", "maybe so", 'say "hi"', "back\\slash", "new\nline", "café ☕",
               "ye"]
    compiled = backend.compile("choices", json.dumps(choices))
    seen = set()
    for seed in range(12):
        result = generate(compiled.matcher(), backend.vocab, seed=seed)
        assert result.terminated
        text = result.text(backend.vocab)
        assert text in choices
        seen.add(text)
    assert len(seen) >= 3


def test_every_choice_is_reachable(backend: GrammarBackend) -> None:
    choices = ["alpha", "alphabet", "x(y)", "1.5", "a|b"]
    compiled = backend.compile("choices", json.dumps(choices))
    for choice in choices:
        matcher = compiled.matcher()
        assert force_text(matcher, backend.vocab, choice) is not None, choice
        assert matcher.is_completed() and matcher.accept_token(2) and matcher.is_terminated()
    assert force_text(compiled.matcher(), backend.vocab, "beta") is None


@pytest.mark.parametrize("kind, spec, fragment", [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
    ("json_schema", json.dumps({"type": "strin"}), "json_schema"),
    ("json_schema", json.dumps({"type": "array", "items": [{"type": "integer"}]}), "items"),
    ("json_schema", json.dumps({"$ref": "https://example.com/a.json"}), "#/$ref"),
    ("json_schema", json.dumps({"type": "string", "format": "iri"}), "#/format"),
    ("regex", "[a-z", "regex"),
    ("regex", "(ab", "regex"),
    ("choices", "[]", "non-empty"),
    ("choices", '["a", 3]', "string"),
    ("choices", "yes", "JSON list"),
    ("ebnf", "root ::= foo", "ebnf"),
    ("ebnf", 'root ::= "a" |', "ebnf"),
    ("ebnf", 'start ::= "a"', "ebnf"),
    ("yaml", "a: b", "unknown grammar kind"),
])
def test_invalid_specs_raise_grammar_error(backend: GrammarBackend, kind: str, spec: str,
                                           fragment: str) -> None:
    if kind == "ebnf" and backend.name == "outlines":
        fragment = "does not support ebnf"
    with pytest.raises(GrammarError) as info:
        backend.compile(kind, spec)
    assert isinstance(info.value, InvalidRequestError)  # the HTTP layer's 400
    assert fragment in str(info.value)
    assert not str(info.value).startswith("[")  # no xgrammar log prefix leaks through


def test_structural_tag_is_xgrammar_only(backends: dict[str, GrammarBackend]) -> None:
    tag = json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<n>", "content": {"type": "json_schema", "json_schema": {
            "type": "integer"}}, "end": "</n>"}})
    compiled = backends["xgrammar"].compile("structural_tag", tag)
    result = generate(compiled.matcher(), backends["xgrammar"].vocab, seed=0)
    assert result.terminated and re.fullmatch(r"<n>-?[0-9]+</n>",
                                              result.text(backends["xgrammar"].vocab))
    with pytest.raises(GrammarError, match="does not support structural_tag"):
        backends["outlines"].compile("structural_tag", tag)
