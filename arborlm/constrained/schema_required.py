"""Define the `required` properties that `properties` leaves out, so the grammar can write them.

JSON Schema lets `required` name a property that `properties` does not define: it is then
governed by `patternProperties` or `additionalProperties` (any JSON value when absent). Both
engines only generate listed properties (objects are closed by default), so such a name could
never appear and no output could be valid. `define_required` adds each such name to
`properties` with the schema that already governs it: the one `patternProperties` schema whose
pattern matches the name, else `additionalProperties` (true or absent: `{}`, any value). The
rewrite is exact: a listed property is exempt from `additionalProperties` but gets the same
schema, and matching `patternProperties` still apply to it. Names that two patterns match, or
that `additionalProperties: false` forbids, are left alone (and `schema_check` reports them).

This module rewrites in place on a fresh schema object; it decides nothing about support.
"""

from __future__ import annotations

import re
from typing import Any

from arborlm.constrained.schema_walk import iter_schema_nodes

_COMBINED = ("allOf", "$ref", "oneOf", "anyOf")


def define_required(schema: Any) -> Any:
    """Add the undefined `required` names of every object subschema; returns `schema`."""
    for node in list(iter_schema_nodes(schema)):
        required, properties = node.get("required"), node.get("properties", {})
        if not isinstance(required, list) or not isinstance(properties, dict) or \
                not _may_be_object(node) or any(key in node for key in _COMBINED):
            continue
        added = {}
        for name in required:
            if isinstance(name, str) and name not in properties:
                governing = _governing_schema(node, name)
                if governing is not None:
                    added[name] = governing
        if added:
            node["properties"] = {**properties, **added}
    return schema


def _governing_schema(node: dict[str, Any], name: str) -> Any:
    """The schema a property `name` that `properties` does not list must match, or None when
    it is forbidden or not one schema."""
    patterns = node.get("patternProperties") or {}
    if not isinstance(patterns, dict):
        return None
    matching = []
    for pattern, sub in patterns.items():
        try:
            if re.search(pattern, name):
                matching.append(sub)
        except re.error:
            return None
    if matching:
        return matching[0] if len(matching) == 1 else None
    additional = node.get("additionalProperties", True)
    if additional is True:
        return {}
    return additional if isinstance(additional, dict) else None


def _may_be_object(node: dict[str, Any]) -> bool:
    declared = node.get("type", "object")
    return declared == "object" or isinstance(declared, list) and "object" in declared
