"""Keyword checks, `allOf` folding, `oneOf` disjointness, schema rewrites, JSON whitespace."""

from __future__ import annotations

import json
import re

import pytest

from arborlm.constrained import create_grammar_backend
from arborlm.constrained.base import GrammarBackend
from arborlm.constrained.schema_allof import merge_all_of
from arborlm.constrained.schema_check import check_schema_supported
from arborlm.constrained.schema_oneof import oneof_branches_disjoint
from arborlm.constrained.schema_rewrite import FORMAT_PATTERNS, ascii_digits, optional_groups
from arborlm.errors import GrammarError
from tests.constrained.conftest import EOS, VOCAB
from tests.constrained.driver import force_text, generate

INT = {"type": "integer"}
STR = {"type": "string"}


@pytest.mark.parametrize("schema, backend, pointer", [
    ({"type": "array", "items": INT, "uniqueItems": True}, "xgrammar", "#/uniqueItems"),
    ({"properties": {"a": {"not": INT}}}, "xgrammar", "#/properties/a/not"),
    ({"if": {"required": ["a"]}, "then": {"required": ["b"]}}, "xgrammar", "#/if"),
    ({"type": "number", "multipleOf": 0.5}, "xgrammar", "#/multipleOf"),
    ({"type": "object", "properties": {"a": INT}, "required": ["a", "b"]}, "xgrammar",
     "#/required (names properties it does not define: b)"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "xgrammar", "#/maxLength"),
    ({"type": "string", "format": "idn-email"}, "xgrammar", "#/format"),
    ({"type": "string", "format": "uuid", "pattern": "^a"}, "xgrammar",
     "#/pattern (dropped beside format 'uuid')"),
    ({"$defs": {"x": {"type": "array", "contains": INT}}, "$ref": "#/$defs/x"}, "xgrammar",
     "#/$defs/x/contains"),
    ({"oneOf": [INT, {"type": "number"}]}, "xgrammar", "#/oneOf"),
    ({"type": "integer", "minimum": 1}, "outlines", "#/minimum"),
    ({"type": "object", "additionalProperties": INT}, "outlines", "#/additionalProperties"),
    ({"type": "string", "pattern": "^.+$"}, "outlines", "#/pattern"),
    ({"allOf": [INT, STR]}, "xgrammar", "#/allOf"),
    ({"$ref": "https://example.com/schema.json"}, "xgrammar", "#/$ref (only local"),
])
def test_dropped_keywords_are_reported(schema: dict, backend: str, pointer: str) -> None:
    with pytest.raises(GrammarError) as info:
        check_schema_supported(merge_all_of(schema), backend)
    assert pointer in str(info.value)
    assert f"the {backend} grammar backend cannot enforce" in str(info.value)


@pytest.mark.parametrize("schema", [
    {"type": "integer", "minimum": 0, "exclusiveMaximum": 9, "multipleOf": 3},
    {"type": "array", "items": INT, "uniqueItems": False, "maxItems": 5},
    {"type": "array", "items": INT, "maxItems": 1, "uniqueItems": True},
    {"type": "object", "properties": {"a": INT}, "additionalProperties": False,
     "dependencies": {"z": ["a"]}},  # "z" can never appear
    {"title": "t", "description": "d", "x-vendor": 1, "type": "string", "format": "color"},
    {"$defs": {"unused": {"not": INT}}, "type": "string"},  # unreachable definition
    {"type": "string", "required": ["x"]},  # required on a non-object is moot
    {"if": INT},  # if without then/else has no effect
])
def test_harmless_keywords_pass(schema: dict) -> None:
    check_schema_supported(schema, "xgrammar")


def test_allof_folds_exactly() -> None:
    schema = {"$defs": {"base": {"type": "object", "properties": {"id": INT},
                                 "required": ["id"]}},
              "allOf": [{"$ref": "#/$defs/base"},
                        {"properties": {"name": STR, "id": {"minimum": 1}},
                         "required": ["name"]}]}
    merged = merge_all_of(schema)
    assert "allOf" not in merged
    assert merged["required"] == ["id", "name"]
    assert merged["properties"]["id"] == {"type": "integer", "minimum": 1}
    bounds = merge_all_of({"allOf": [{"type": "number", "maximum": 5},
                                     {"type": "integer", "maximum": 3, "minimum": 0}]})
    assert bounds == {"type": "integer", "maximum": 3, "minimum": 0}


@pytest.mark.parametrize("schema", [
    {"allOf": [{"pattern": "^a"}, {"pattern": "b$"}]},  # two patterns
    {"allOf": [{"type": "object", "properties": {"a": INT}, "additionalProperties": False},
               {"properties": {"b": INT}}]},  # a closed branch meets a new name
    {"allOf": [INT, STR]},  # no common type
])
def test_allof_is_kept_when_a_merge_would_not_be_exact(schema: dict) -> None:
    assert "allOf" in merge_all_of(schema)


def test_oneof_disjointness() -> None:
    kind = {"type": "object", "required": ["kind"]}
    circle = {**kind, "properties": {"kind": {"const": "circle"}}}
    square = {**kind, "properties": {"kind": {"const": "square"}}}
    assert oneof_branches_disjoint([circle, square], {})
    assert oneof_branches_disjoint([STR, INT, {"type": "null"}], {})
    assert oneof_branches_disjoint([{"enum": [1, 2]}, {"enum": [3]}], {})
    closed = [{"type": "object", "properties": {p: STR}, "required": [p]} for p in "ab"]
    assert oneof_branches_disjoint(closed, {})
    assert not oneof_branches_disjoint([INT, {"type": "number"}], {})
    assert not oneof_branches_disjoint([{"enum": [1.0]}, {"const": 1}], {})
    assert not oneof_branches_disjoint([STR, {"pattern": "^a"}], {})
    refs = {"$defs": {"c": circle, "s": square}}
    assert oneof_branches_disjoint([{"$ref": "#/$defs/c"}, {"$ref": "#/$defs/s"}], refs)


def test_format_patterns_admit_only_real_dates_and_times() -> None:
    date, stamp = FORMAT_PATTERNS["date"], FORMAT_PATTERNS["date-time"]
    assert re.fullmatch(date, "2024-04-30") and not re.fullmatch(date, "2024-04-31")
    assert not re.fullmatch(date, "2024-02-29") and re.fullmatch(date, "2024-02-28")
    assert re.fullmatch(stamp, "2024-12-31T23:59:59.5+05:30")
    assert not re.fullmatch(stamp, "2024-12-31T24:00:00Z")
    assert ascii_digits(r"^\d+[\d-]\\d$") == r"^[0-9]+[0-9-]\\d$"


def test_outlines_patterns_use_ascii_digits(backends: dict[str, GrammarBackend]) -> None:
    """Regression: outlines-core's \\d matched any Unicode digit ("３༣69-12-06")."""
    outlines = backends["outlines"]
    compiled = outlines.compile("json_schema", json.dumps({"type": "string",
                                                           "pattern": r"^\d{3}$"}))
    assert force_text(compiled.matcher(), outlines.vocab, '"123"') is not None
    assert force_text(compiled.matcher(), outlines.vocab, '"１23"') is None


def test_xgrammar_length_bounded_strings_are_valid_json(xgrammar: GrammarBackend) -> None:
    """Regression: xgrammar let raw control characters into minLength/maxLength strings."""
    compiled = xgrammar.compile("json_schema", json.dumps({"type": "string", "maxLength": 4}))
    assert force_text(compiled.matcher(), xgrammar.vocab, '"a\x0c"') is None
    assert force_text(compiled.matcher(), xgrammar.vocab, '"abcd"') is not None
    assert force_text(compiled.matcher(), xgrammar.vocab, '"abcde') is None


def test_xgrammar_excludes_surrogates(xgrammar: GrammarBackend) -> None:
    """Regression: xgrammar admitted ED A0..BF (UTF-16 surrogates), which is not UTF-8."""
    compiled = xgrammar.compile("json_schema", json.dumps({"type": "string"}))
    ids = [t for t, piece in enumerate(xgrammar.vocab.decoded) if piece == b"\xed"]
    tails = [t for t, piece in enumerate(xgrammar.vocab.decoded) if piece[:1] == b"\xa9"]
    matcher = compiled.matcher()
    assert force_text(matcher, xgrammar.vocab, '"') is not None
    assert ids and tails and matcher.accept_token(ids[0])
    assert not matcher.accept_token(tails[0])


@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_json_whitespace_is_bounded_by_default(tokenizer, name: str) -> None:
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "array", "items": INT}},
                         "required": ["a"]})
    tight = create_grammar_backend(name, tokenizer, VOCAB, [EOS])
    loose = create_grammar_backend(name, tokenizer, VOCAB, [EOS], any_whitespace=True)
    padded = '{\n    "a" :\t[ 1,\n 2 ]\n}'  # outlines allows no space before a comma
    assert force_text(tight.compile("json_schema", schema).matcher(), tight.vocab, padded) is None
    assert force_text(loose.compile("json_schema", schema).matcher(), loose.vocab,
                      padded) is not None
    runaway = '{"a": [1' + " " * 40
    assert force_text(loose.compile("json_schema", schema).matcher(), loose.vocab,
                      runaway) is None
    result = generate(tight.compile("json_schema", schema).matcher(), tight.vocab, seed=1)
    text = result.text(tight.vocab)
    if result.terminated:
        json.loads(text)
    assert "\n" not in text and "\t" not in text  # raw, i.e. outside strings


def test_xgrammar_optional_groups_keep_their_first_character(xgrammar: GrammarBackend) -> None:
    """Regression: xgrammar built `^1(-[a-z]+)?$` so that "1x" matched; `(...)?` is now
    written `(...|)`."""
    assert optional_groups(r"^1(-[a-z]+)?$") == r"^1(-[a-z]+|)$"
    assert optional_groups(r"^a\)?[)?](b)??$") == r"^a\)?[)?](b)??$"
    compiled = xgrammar.compile("json_schema", json.dumps(
        {"type": "string", "pattern": r"^[0-9]\.[0-9](-[0-9A-Za-z]+)?$"}))
    for text, valid in (("1.2", True), ("1.2-rc1", True), ("1.2rc1", False)):
        assert (force_text(compiled.matcher(), xgrammar.vocab, json.dumps(text))
                is not None) == valid, text


def test_enum_values_that_fail_the_other_keywords_are_dropped(xgrammar: GrammarBackend) -> None:
    """Regression: both engines generate every enum value whatever the rest says."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "enum": [1, "1", 2.0]},
                                               "s": {"enum": ["a", "bb"], "maxLength": 1}}}
    compiled = xgrammar.compile("json_schema", json.dumps(schema))
    assert force_text(compiled.matcher(), xgrammar.vocab, '{"n": "1"}') is None
    assert force_text(compiled.matcher(), xgrammar.vocab, '{"n": 1}') is not None
    assert force_text(compiled.matcher(), xgrammar.vocab, '{"s": "bb"}') is None
    with pytest.raises(GrammarError, match="no value satisfies"):
        check_schema_supported({"type": "object", "enum": ["a"]})


def test_closed_defaults_do_not_make_schemas_unsatisfiable(xgrammar: GrammarBackend) -> None:
    """An array with `minItems` and no `items`, an object with `minProperties` and nothing to
    fill it: ArborLM's closed default would leave no value, so they stay open."""
    arrays = xgrammar.compile("json_schema", json.dumps({"type": "array", "minItems": 2}))
    assert force_text(arrays.matcher(), xgrammar.vocab, '[1, "a"]') is not None
    objects = xgrammar.compile("json_schema", json.dumps({"type": "object",
                                                          "minProperties": 1}))
    assert force_text(objects.matcher(), xgrammar.vocab, '{"k": 1}') is not None


def test_length_bounds_join_a_one_class_pattern(xgrammar: GrammarBackend) -> None:
    """minLength/maxLength beside a pattern that repeats one class become the repetition's
    bounds, which the grammar enforces (no guard needed)."""
    schema = {"type": "string", "pattern": "^[a-z_]+$", "minLength": 2, "maxLength": 4}
    compiled = xgrammar.compile("json_schema", json.dumps(schema))
    assert compiled.guard is None
    for text, valid in (("a", False), ("ab", True), ("abcd", True), ("abcde", False)):
        assert (force_text(compiled.matcher(), xgrammar.vocab, json.dumps(text))
                is not None) == valid, text


def test_unique_items_over_a_finite_set_bound_the_array(xgrammar: GrammarBackend) -> None:
    """uniqueItems over enum items implies maxItems = the number of distinct values; the grammar
    then closes the array instead of walking into a dead end the guard can only refuse."""
    schema = {"type": "array", "items": {"enum": ["a", "b", 1, 1.0]}, "uniqueItems": True}
    compiled = xgrammar.compile("json_schema", json.dumps(schema))
    assert force_text(compiled.matcher(), xgrammar.vocab, '["a", 1, "b"]') is not None
    assert force_text(compiled.matcher(), xgrammar.vocab, '["a", 1, "b",') is None
