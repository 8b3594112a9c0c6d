"""The exact rewrites: every enumerated instance validates against the rewritten schema exactly
when it validates against the original (JSON Schema semantics, objects open as written)."""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

import pytest
from jsonschema import Draft7Validator, Draft202012Validator

from arborlm.constrained.schema_branches import branch_conditionals
from arborlm.constrained.schema_prepare import prepare_json_schema
from arborlm.constrained.schema_required import define_required
from arborlm.constrained.schema_siblings import distribute_siblings
from arborlm.constrained.schema_walk import dropped_siblings
from tests.constrained.driver import force_text

INT = {"type": "integer"}
STR = {"type": "string"}
VALUES = [1, "s", None]


def _objects(names: str) -> list[dict[str, Any]]:
    """Every object over subsets of `names` with each value from `VALUES`, plus non-objects."""
    out: list[Any] = [[], "x", 3]
    for k in range(len(names) + 1):
        for subset in itertools.combinations(names, k):
            for values in itertools.product(VALUES, repeat=k):
                out.append(dict(zip(subset, values)))
    return out


def _assert_exact(original: dict[str, Any], rewritten: dict[str, Any], names: str,
                  cls: Any = Draft202012Validator) -> None:
    before, after = cls(original), cls(rewritten)
    for instance in _objects(names):
        assert before.is_valid(instance) == after.is_valid(instance), (instance, rewritten)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": INT}, "required": ["a", "b"]},
    {"type": "object", "properties": {"a": INT}, "required": ["b"],
     "additionalProperties": STR},
    {"type": "object", "required": ["b", "c"], "patternProperties": {"^b": INT},
     "additionalProperties": {"type": ["string", "null"]}},
    {"type": ["object", "null"], "required": ["c"]},
])
def test_required_names_become_properties_exactly(schema: dict[str, Any]) -> None:
    rewritten = define_required(copy.deepcopy(schema))
    assert set(schema["required"]) <= set(rewritten["properties"])
    _assert_exact(schema, rewritten, "abc")


def test_forbidden_required_names_are_left_alone() -> None:
    schema = {"type": "object", "properties": {"a": INT}, "required": ["b"],
              "additionalProperties": False}
    assert define_required(copy.deepcopy(schema)) == schema


@pytest.mark.parametrize("schema, cls", [
    ({"type": "object", "properties": {"a": INT, "b": STR, "c": INT},
      "dependentRequired": {"a": ["b"]}}, Draft202012Validator),
    ({"type": "object", "properties": {"a": INT, "b": STR, "c": INT},
      "additionalProperties": False, "dependencies": {"a": ["b", "c"], "c": ["b"]}},
     Draft7Validator),
    ({"type": "object", "properties": {"a": INT}, "required": ["a"],
      "dependencies": {"a": ["b"], "b": ["c"]}}, Draft7Validator),
    ({"type": "object", "properties": {"a": INT, "b": STR},
      "dependentSchemas": {"a": {"properties": {"b": {"const": "s"}}, "required": ["b"]}},
      "dependentRequired": {"b": ["c"]}}, Draft202012Validator),
    ({"type": "object", "properties": {"a": INT, "b": STR}, "additionalProperties": False,
      "dependencies": {"a": {"maxProperties": 1}}}, Draft7Validator),
    ({"type": "object", "properties": {"a": INT, "b": STR},
      "if": {"properties": {"a": {"const": 1}}, "required": ["a"]},
      "then": {"required": ["b"]}, "else": {"properties": {"b": {"const": "s"}}}},
     Draft7Validator),
    ({"type": "object", "if": {"properties": {"a": {"type": "string"}}},
      "then": {"properties": {"b": {"type": "null"}}}}, Draft7Validator),
])
def test_conditionals_become_branches_exactly(schema: dict[str, Any], cls: Any) -> None:
    rewritten = branch_conditionals(copy.deepcopy(schema))
    assert "anyOf" in rewritten
    assert not {"dependencies", "dependentRequired", "dependentSchemas", "if"} & set(rewritten)
    _assert_exact(schema, rewritten, "abc", cls)
    prepared = define_required(copy.deepcopy(rewritten))
    _assert_exact(schema, prepared, "abc", cls)


def test_conditionals_that_cannot_branch_exactly_stay() -> None:
    many = {"type": "object", "dependentRequired": {n: ["z"] for n in "abcd"}}
    assert branch_conditionals(copy.deepcopy(many)) == many
    combined = {"anyOf": [INT, STR], "if": INT, "then": {"minimum": 1}}
    assert branch_conditionals(copy.deepcopy(combined)) == combined
    pointed = {"type": "object", "properties": {"a": INT, "b": {"$ref": "#/properties/a"}},
               "dependentRequired": {"a": ["b"]}}
    assert branch_conditionals(copy.deepcopy(pointed)) == pointed


def test_definitions_stay_reachable() -> None:
    schema = {"$defs": {"s": STR}, "type": "object", "properties": {"a": INT,
                                                                      "b": {"$ref": "#/$defs/s"}},
              "dependentRequired": {"a": ["b"]}}
    rewritten = branch_conditionals(copy.deepcopy(schema))
    assert "anyOf" in rewritten and rewritten["$defs"] == {"s": STR}
    _assert_exact(schema, rewritten, "ab")


def test_prepared_schema_needs_no_guard_for_closed_dependencies() -> None:
    schema = {"type": "object", "properties": {"a": INT, "b": STR},
              "additionalProperties": False, "dependentRequired": {"a": ["b"]}}
    prepared = prepare_json_schema(json.dumps(schema), "xgrammar")
    assert prepared.guard is None and prepared.unenforced == ()
    _assert_exact(schema, prepared.schema, "ab")


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": INT, "b": STR}, "required": ["a"],
     "anyOf": [{"required": ["b"]}, {"properties": {"c": {"type": "null"}}, "required": ["c"]}]},
    {"type": "object", "properties": {"a": INT}, "oneOf": [{"required": ["a"]},
                                                          {"required": ["b"]}]},
    {"$defs": {"base": {"type": "object", "properties": {"a": INT}}},
     "$ref": "#/$defs/base", "required": ["a"], "properties": {"b": STR}},
])
def test_siblings_of_combinators_move_into_them_exactly(schema: dict[str, Any]) -> None:
    rewritten = distribute_siblings(copy.deepcopy(schema))
    assert dropped_siblings(rewritten)[1] == []
    _assert_exact(schema, rewritten, "abc")


def test_siblings_are_reported_when_they_cannot_move() -> None:
    schema = {"type": "object", "anyOf": [{"type": "string"}, {"required": ["a"]}]}
    prepared = prepare_json_schema(json.dumps(schema), "xgrammar")  # no common type: kept
    assert prepared.guard is not None
    assert "#/type (dropped beside anyOf)" in [str(p) for p in prepared.guard.problems]


def test_xgrammar_keeps_what_sat_beside_anyof(xgrammar) -> None:
    """Regression: xgrammar built `{"type": "object", ..., "anyOf": [...]}` from anyOf alone,
    so a number or an object without the required "id" was a finished output."""
    schema = {"type": "object", "properties": {"id": INT, "a": STR, "b": STR},
              "required": ["id"], "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}
    compiled = xgrammar.compile("json_schema", json.dumps(schema))
    assert force_text(compiled.matcher(), xgrammar.vocab, "7") is None
    assert force_text(compiled.matcher(), xgrammar.vocab, '{"a": "x"}') is None
    assert force_text(compiled.matcher(), xgrammar.vocab, '{"id": 1, "a": "x"}') is not None
