"""Fold `allOf` into its parent schema where the merge is exact, before compiling.

Neither grammar engine enforces `allOf` (xgrammar keeps one branch, outlines-core concatenates
the branches' regexes), yet real schemas use it everywhere to extend a base object:
`{"allOf": [{"$ref": "#/$defs/base"}, {"properties": {...}, "required": [...]}]}`. A conjunction
of schemas equals one schema holding all their keywords whenever no keyword appears twice with
different meanings, so `merge_all_of` rewrites such nodes and leaves the rest alone:

- `properties` are united (a name in both becomes the merge of its two subschemas), `required`
  lists are united, `type`s intersected, lower bounds take the larger and upper bounds the
  smaller, equal values are kept and annotations taken from the first;
- a branch that closes objects (`additionalProperties`, `patternProperties`) may not meet new
  property names from another branch, since the merged schema would admit them;
- anything else (two different `pattern`s, a `$ref` beside `allOf`, a non-local reference, a
  self-referential branch) keeps that `allOf` as written, and `schema_check` reports it.

Local `$ref`s resolve against the original root, whose `$defs` the result keeps. This module
only rewrites; it compiles nothing.
"""

from __future__ import annotations

import json
from typing import Any

from arborlm.constrained.schema_oneof import lookup_ref

_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_ANNOTATIONS = frozenset({"title", "description", "examples", "default", "$comment", "$id",
                          "id", "$schema", "readOnly", "writeOnly", "deprecated"})
_MAX_DEPTH = 16


class _Conflict(Exception):
    """Two schemas cannot be merged exactly."""


def merge_all_of(schema: Any) -> Any:
    """A copy of `schema` with every exactly-mergeable `allOf` folded into its parent."""
    if "/allOf/" in json.dumps(schema):  # a $ref into an allOf branch would dangle
        return schema
    return _rewrite(schema, schema, 0)


def _rewrite(node: Any, root: Any, depth: int) -> Any:
    if isinstance(node, list):
        return [_rewrite(item, root, depth) for item in node]
    if not isinstance(node, dict) or depth > _MAX_DEPTH:
        return node
    out = {key: (value if key in ("enum", "const", "required") or key in _ANNOTATIONS
                 else _rewrite_value(key, value, root, depth)) for key, value in node.items()}
    if isinstance(out.get("allOf"), list) and "$ref" not in out:
        try:
            return _fold(out, root, depth)
        except _Conflict:
            return out
    return out


def _rewrite_value(key: str, value: Any, root: Any, depth: int) -> Any:
    if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(value, dict):
            return {name: _rewrite(child, root, depth + 1) for name, child in value.items()}
    return _rewrite(value, root, depth + 1)


def _fold(node: dict[str, Any], root: Any, depth: int) -> dict[str, Any]:
    merged = {key: value for key, value in node.items() if key != "allOf"}
    for branch in node["allOf"]:
        merged = _merge(merged, _inline(branch, root, depth), root, depth)
    return merged


def _inline(branch: Any, root: Any, depth: int) -> dict[str, Any]:
    """A branch as a plain dict: local `$ref` replaced by its (rewritten) target."""
    if branch is True:
        return {}
    if not isinstance(branch, dict):
        raise _Conflict
    ref = branch.get("$ref")
    if ref is None:
        return branch
    target = lookup_ref(root, ref) if isinstance(ref, str) and ref.startswith("#") else None
    if not isinstance(target, dict) or depth > _MAX_DEPTH:
        raise _Conflict
    rest = {key: value for key, value in branch.items() if key != "$ref"}
    target = _rewrite(target, root, depth + 1)
    if isinstance(target.get("allOf"), list) or "$ref" in target:
        raise _Conflict
    return _merge(rest, target, root, depth + 1)


def _merge(a: dict[str, Any], b: dict[str, Any], root: Any, depth: int) -> dict[str, Any]:
    _check_closed(a, b)
    _check_closed(b, a)
    out = dict(a)
    for key, value in b.items():
        if key not in out or out[key] == value or key in _ANNOTATIONS:
            out.setdefault(key, value)
        elif key == "properties" and isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = _merge_properties(out[key], value, root, depth)
        elif key == "required" and isinstance(value, list) and isinstance(out[key], list):
            out[key] = list(dict.fromkeys(out[key] + value))
        elif key == "type":
            out[key] = _intersect_types(out[key], value)
        elif key in _LOWER and _numbers(out[key], value):
            out[key] = max(out[key], value)
        elif key in _UPPER and _numbers(out[key], value):
            out[key] = min(out[key], value)
        else:
            raise _Conflict
    return out


def _merge_properties(a: dict[str, Any], b: dict[str, Any], root: Any,
                      depth: int) -> dict[str, Any]:
    out = dict(a)
    for name, schema in b.items():
        if name not in out or out[name] == schema:
            out[name] = schema
        else:
            out[name] = _fold({"allOf": [out[name], schema]}, root, depth + 1)
    return out


def _check_closed(closing: dict[str, Any], other: dict[str, Any]) -> None:
    """A schema that limits property names must already list every name `other` adds."""
    if "additionalProperties" not in closing and "patternProperties" not in closing:
        return
    listed = set(closing.get("properties") or {})
    if set(other.get("properties") or {}) - listed or (
            "patternProperties" in other and
            other["patternProperties"] != closing.get("patternProperties")):
        raise _Conflict


def _intersect_types(a: Any, b: Any) -> Any:
    set_a = {a} if isinstance(a, str) else set(a)
    set_b = {b} if isinstance(b, str) else set(b)
    both = set_a & set_b
    if "integer" in set_a and "number" in set_b or "number" in set_a and "integer" in set_b:
        both.add("integer")
    if not both:
        raise _Conflict
    ordered = [t for t in (a if isinstance(a, list) else [a]) if t in both] or sorted(both)
    return ordered[0] if len(ordered) == 1 else ordered


def _numbers(a: Any, b: Any) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in (a, b))


def merge_schemas(schemas: list[Any], root: Any) -> dict[str, Any] | None:
    """One schema equal to the conjunction of `schemas` (local `$ref`s resolved against
    `root`), or None when they cannot be merged exactly."""
    try:
        return _fold({"allOf": list(schemas)}, root, 0)
    except _Conflict:
        return None
