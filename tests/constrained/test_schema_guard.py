"""The semantic guard: a real xgrammar matcher over a real tokenizer, driven token by token.

Each test spells a text with tokens the grammar allows (`force_text`) and asks `check_token`
before the token that would close (or, for maxLength, extend) the offending value.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from arborlm.constrained.base import GrammarBackend, GrammarMatcher
from arborlm.constrained.guarded_matcher import GuardedMatcher
from arborlm.constrained.json_tracker import Close, Grow, JsonTracker
from arborlm.errors import GrammarError
from tests.constrained.conftest import EOS
from tests.constrained.driver import closing_bias, generate

INT = {"type": "integer"}
STR = {"type": "string"}


def _matcher(backend: GrammarBackend, schema: Any, strict: bool = True) -> GrammarMatcher:
    return backend.compile("json_schema", json.dumps(schema), strict=strict).matcher()


def _tokens(backend: GrammarBackend, text: str) -> list[int]:
    """Greedy longest-match token ids that spell `text` (no grammar involved)."""
    data, ids = text.encode(), []
    by_text = backend.vocab.text_token_ids()
    while data:
        piece = max((p for p in by_text if data.startswith(p)), key=len)
        ids.append(by_text[piece][0])
        data = data[len(piece):]
    return ids


def _walk(matcher: GrammarMatcher, backend: GrammarBackend, text: str) -> str | None:
    """Accept the tokens of `text` one by one; the first guard reason (token not accepted)."""
    for token in _tokens(backend, text):
        reason = matcher.check_token(token)
        if reason is not None:
            return reason
        assert matcher.accept_token(token), (text, backend.vocab.decoded[token])
    return matcher.check_token(EOS)


def test_unguarded_schemas_get_the_plain_matcher(xgrammar: GrammarBackend) -> None:
    matcher = _matcher(xgrammar, {"type": "array", "items": INT})
    assert not isinstance(matcher, GuardedMatcher)
    assert matcher.check_token(5) is None


def test_duplicate_item_is_rejected_at_its_closing_token(xgrammar: GrammarBackend) -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": STR,
                                                        "uniqueItems": True}}}
    matcher = _matcher(xgrammar, schema)
    assert isinstance(matcher, GuardedMatcher)
    assert _walk(matcher, xgrammar, '{"tags": ["ab", "cd", "ef"]}') is None
    matcher = _matcher(xgrammar, schema)
    ids = _tokens(xgrammar, '{"tags": ["ab", "cd", "ab')
    for token in ids:
        assert matcher.check_token(token) is None and matcher.accept_token(token)
    closing = _tokens(xgrammar, '"')[0]
    reason = matcher.check_token(closing)
    assert reason == "value at /tags violates uniqueItems (schema #/properties/tags/uniqueItems)"
    assert matcher.check_token(closing) == reason  # checking changed nothing
    other = _tokens(xgrammar, "x")[0]
    assert matcher.check_token(other) is None and matcher.accept_token(other)
    assert _walk(matcher, xgrammar, '"]}') is None


def test_numbers_equal_as_json_schema_says(xgrammar: GrammarBackend) -> None:
    schema = {"type": "array", "items": {"type": "number"}, "uniqueItems": True}
    assert _walk(_matcher(xgrammar, schema), xgrammar, "[1, 1.5, 2]") is None
    assert "uniqueItems" in _walk(_matcher(xgrammar, schema), xgrammar, "[1, 2, 1.0]")


def test_max_length_is_a_prefix_check(xgrammar: GrammarBackend) -> None:
    schema = {"type": "string", "pattern": "^[a-z][a-z]*$", "maxLength": 3}
    matcher = _matcher(xgrammar, schema)
    for token in _tokens(xgrammar, '"abc'):
        assert matcher.check_token(token) is None and matcher.accept_token(token)
    assert matcher.check_token(_tokens(xgrammar, "d")[0]) == \
        "value at / violates maxLength (schema #/maxLength)"
    assert _walk(matcher, xgrammar, '"') is None


def test_min_length_at_the_closing_quote(xgrammar: GrammarBackend) -> None:
    code = {"type": "string", "pattern": "^[a-z][a-z]*$", "minLength": 3}
    schema = {"type": "object", "properties": {"code": code}, "required": ["code"]}
    reason = _walk(_matcher(xgrammar, schema), xgrammar, '{"code": "ab"}')
    assert reason == "value at /code violates minLength (schema #/properties/code/minLength)"
    assert _walk(_matcher(xgrammar, schema), xgrammar, '{"code": "abc"}') is None


def test_not(xgrammar: GrammarBackend) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string",
                                                        "not": {"const": "admin"}}}}
    reason = _walk(_matcher(xgrammar, schema), xgrammar, '{"name": "admin"}')
    assert reason == "value at /name violates not (schema #/properties/name/not)"
    assert _walk(_matcher(xgrammar, schema), xgrammar, '{"name": "adm"}') is None


def test_overlapping_oneof_needs_exactly_one_branch(xgrammar: GrammarBackend) -> None:
    schema = {"type": "object", "properties": {"n": {"oneOf": [INT, {"type": "number"}]}}}
    assert "violates oneOf" in _walk(_matcher(xgrammar, schema), xgrammar, '{"n": 3}')
    assert _walk(_matcher(xgrammar, schema), xgrammar, '{"n": 3.5}') is None


def test_root_number_is_checked_at_the_stop_token(xgrammar: GrammarBackend) -> None:
    schema = {"type": "number", "multipleOf": 0.5}
    matcher = _matcher(xgrammar, schema)
    for token in _tokens(xgrammar, "1.25"):
        assert matcher.check_token(token) is None and matcher.accept_token(token)
    assert matcher.check_token(EOS) == "value at / violates multipleOf (schema #/multipleOf)"
    assert _walk(_matcher(xgrammar, schema), xgrammar, "1.5") is None


def test_values_under_ambiguous_branches_are_checked_when_the_parent_closes(
        xgrammar: GrammarBackend) -> None:
    schema = {"anyOf": [{"type": "object", "properties": {"a": {"type": "string",
                                                                  "not": {"const": "x"}}},
                         "required": ["a"]},
                        {"type": "object", "properties": {"b": INT}, "required": ["b"]}]}
    matcher = _matcher(xgrammar, schema)
    ids = _tokens(xgrammar, '{"a": "x"')
    for token in ids:  # the string closes under an anyOf branch not known yet: no verdict
        assert matcher.check_token(token) is None and matcher.accept_token(token)
    assert matcher.check_token(_tokens(xgrammar, "}")[0]) == \
        "value at /a violates not (schema #/anyOf/0/properties/a/not)"


def test_rollback_copy_and_reset_restore_guard_state(xgrammar: GrammarBackend) -> None:
    schema = {"type": "array", "items": INT, "uniqueItems": True}
    matcher = _matcher(xgrammar, schema)
    comma, one, two = (_tokens(xgrammar, s)[0] for s in (",", "1", "2"))
    prefix = _tokens(xgrammar, "[1, ") + [one]
    for token in prefix:
        assert matcher.accept_token(token)
    twin = matcher.copy()
    assert matcher.check_token(comma) == "value at / violates uniqueItems (schema #/uniqueItems)"
    matcher.rollback(1)  # now "[1, ": the second item is gone
    assert matcher.accept_token(two) and matcher.check_token(comma) is None
    matcher.rollback(1)
    assert matcher.accept_token(one) and matcher.check_token(comma) is not None
    assert twin.check_token(comma) is not None
    twin.rollback(len(prefix))
    assert _walk(twin, xgrammar, "[3, 4]") is None
    matcher.reset()
    assert _walk(matcher, xgrammar, "[2, 1]") is None
    assert matcher.accept_token(EOS) and matcher.is_terminated()
    matcher.rollback(1)
    assert not matcher.is_terminated()


def test_jump_forward_stops_before_a_rejected_token(xgrammar: GrammarBackend) -> None:
    schema = {"type": "array", "items": {"type": "string", "pattern": "^same$"},
              "uniqueItems": True}
    matcher = _matcher(xgrammar, schema, strict=False)
    walked = _tokens(xgrammar, '["same", "same')
    for token in walked:
        assert matcher.accept_token(token)
    quote = _tokens(xgrammar, '"')[0]
    assert matcher.check_token(quote) is not None
    calls: list[int] = []
    original = matcher.check_token

    def spy(token_id: int) -> str | None:
        calls.append(token_id)
        return original(token_id)

    matcher.check_token = spy  # type: ignore[method-assign]
    forced = matcher.find_jump_forward_tokens()
    assert quote not in forced and all(original(t) is None for t in forced[:1])
    assert len(forced) < len(calls) or not forced  # the walk asked the guard, and stopped


def test_strict_refuses_only_what_nobody_enforces(xgrammar: GrammarBackend) -> None:
    remote = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}
    with pytest.raises(GrammarError) as info:
        xgrammar.compile("json_schema", json.dumps(remote))
    assert "#/properties/a/$ref" in str(info.value)
    compiled = xgrammar.compile("json_schema", json.dumps(remote), strict=False)
    assert compiled.unenforced == ("#/properties/a/$ref (only local references (#/...) are "
                                   "resolved)",)
    guarded = xgrammar.compile("json_schema", json.dumps({"type": "array", "uniqueItems": True}))
    assert guarded.unenforced == ()


def test_generated_outputs_validate(xgrammar: GrammarBackend) -> None:
    """Sampled outputs, the guard's rejected tokens banned and sampled again as the decode loop
    does: every finished output validates (a dead end, where every token is banned, aborts)."""
    schemas = [
        {"type": "array", "items": {"enum": [1, 2, 3, 4]}, "uniqueItems": True, "minItems": 2},
        {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-c]*$",
                                                "maxLength": 4, "minLength": 1}},
         "required": ["s"]},
        {"type": "object", "properties": {"k": {"not": {"type": "string"}}}, "required": ["k"]},
    ]
    bias = closing_bias(xgrammar.vocab)
    for schema in schemas:
        finished = 0
        for seed in range(6):
            result = generate(_matcher(xgrammar, schema), xgrammar.vocab, seed, 200, bias)
            if result.terminated:
                jsonschema.validate(json.loads(result.text(xgrammar.vocab)), schema)
                finished += 1
        assert finished >= 3, schema


def test_tracker_reports_paths_and_lengths() -> None:
    sites: list[Any] = []

    def resolve(site: Any, segment: str | int) -> Any:
        sites.append(segment)
        return segment

    tracker = JsonTracker("root", resolve)
    events = tracker.feed(b'{"a": [1, "h\\u00e9\\ud83d\\ude00')
    assert [type(e) for e in events] == [Close, Grow]
    assert events[0].path == ("a", 0) and events[1].path == ("a", 1) and events[1].length == 3
    state = tracker.snapshot()
    closes = tracker.feed(b'"], "b": 2.5}')
    assert [c.path for c in closes] == [("a", 1), ("a",), ("b",), ()]
    tracker.restore(state)
    assert [c.path for c in tracker.feed(b'"]}')] == [("a", 1), ("a",), ()]
    root = JsonTracker("root", resolve)
    assert root.feed(b"12") == [] and [c.end for c in root.finish()] == [2]


def test_both_backends_guard_alike(backend: GrammarBackend) -> None:
    """outlines-core drops more keywords (bounds among them); its matcher gets the same guard."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5},
                                               "t": {"type": "array", "items": INT,
                                                     "uniqueItems": True}},
              "required": ["n", "t"]}
    assert _walk(_matcher(backend, schema), backend, '{"n": 7, "t": [1, 2]}') is None
    reason = _walk(_matcher(backend, schema), backend, '{"n": 7, "t": [1, 1]}')
    assert reason == "value at /t violates uniqueItems (schema #/properties/t/uniqueItems)"
    if backend.name == "outlines":
        reason = _walk(_matcher(backend, schema), backend, '{"n": 3, "t": []}')
        assert reason == "value at /n violates minimum (schema #/properties/n/minimum)"


def _fill_and_accept(matcher: GrammarMatcher, backend: GrammarBackend, text: str) -> None:
    """Accept the tokens of `text` as the decode loop does: the mask filled before each."""
    from arborlm.constrained.bitmask import allocate_token_bitmask

    mask = allocate_token_bitmask(1, matcher.vocab_size)
    for token in _tokens(backend, text):
        matcher.fill_bitmask(mask, 0)
        assert matcher.check_token(token) is None, text
        assert matcher.accept_token(token), (text, backend.vocab.decoded[token])


def _allowed(matcher: GrammarMatcher, token: int) -> bool:
    from arborlm.constrained.bitmask import allocate_token_bitmask

    mask = allocate_token_bitmask(1, matcher.vocab_size)
    matcher.fill_bitmask(mask, 0)
    return bool((int(mask[0, token >> 5]) >> (token & 31)) & 1)


def test_rollback_to_a_value_start_and_its_ban(xgrammar: GrammarBackend) -> None:
    """What the decode loop's rollback uses: the rejected value's first position, the choices,
    a ban cleared from the mask at its position only, bans dropped by a rollback before them,
    and the position from which text is held back (the checked array, not the name)."""
    schema = {"type": "object", "properties": {
        "name": STR, "nums": {"type": "array", "items": INT, "uniqueItems": True}},
        "required": ["name", "nums"]}
    matcher = _matcher(xgrammar, schema)
    prefix = '{"name": "ab", "nums": ['
    _fill_and_accept(matcher, xgrammar, '{"name": "ab"')
    assert matcher.held_from() is None  # nothing checked is open: the name streams
    _fill_and_accept(matcher, xgrammar, prefix[len('{"name": "ab"'):] + "7, ")
    starts = [state[0] for state in matcher._history]  # text offset of each token
    array_at = max(i for i, start in enumerate(starts) if start <= len(prefix) - 1)  # its [
    assert matcher.held_from() == array_at
    item = len(matcher._history)
    _fill_and_accept(matcher, xgrammar, "7")
    comma = _tokens(xgrammar, ",")[0]
    reason = matcher.check_token(comma)
    assert reason is not None and "uniqueItems" in reason
    assert matcher.rejected_value_start() == item
    assert matcher.choice_after(item) == item  # a digit: there was a choice
    assert matcher.choice_before(item) is not None and matcher.choice_before(item) < item
    seven = _tokens(xgrammar, "7")[0]
    matcher.ban_at(item, seven)
    matcher.rollback(len(matcher._history) - item)
    assert not _allowed(matcher, seven) and _allowed(matcher, _tokens(xgrammar, "8")[0])
    assert matcher.bans_at(item) == 1 and not matcher.exhausted
    before = bytes(matcher._tracker.text[matcher._history[item - 1][0]:]).decode()
    matcher.rollback(1)  # before the ban's position: the ban is gone
    assert matcher.bans_at(item) == 0
    _fill_and_accept(matcher, xgrammar, before + "7")
    assert matcher.check_token(comma) is not None  # no ban now: the duplicate comes back


def test_a_root_value_with_a_dropped_keyword_is_held_from_the_start(
        xgrammar: GrammarBackend) -> None:
    matcher = _matcher(xgrammar, {"type": "integer", "not": {"const": 12}})
    _fill_and_accept(matcher, xgrammar, "1")
    assert matcher.held_from() == 0
    _fill_and_accept(matcher, xgrammar, "2")
    assert "not" in matcher.check_token(EOS) and matcher.rejected_value_start() == 0
