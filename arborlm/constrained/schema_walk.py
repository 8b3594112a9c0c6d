"""Walk a JSON schema: its subschemas, with or without JSON pointers, and combinator siblings.

Shared by the checker (`schema_check`), the rewrites and the guard, so that all of them agree on
where a subschema can sit (`properties`, `items`, `anyOf`, `dependencies`, definitions, local
`$ref` targets, ...). It reads schemas only; it neither checks nor rewrites them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from arborlm.constrained.schema_oneof import lookup_ref

# Keys that constrain nothing: never reported, and kept in place by rewrites.
NOT_CONSTRAINTS = frozenset({
    "$schema", "$id", "id", "$defs", "definitions", "$comment", "$anchor", "title",
    "description", "examples", "default", "readOnly", "writeOnly", "deprecated",
})
COMBINATORS = ("$ref", "anyOf", "oneOf", "allOf")
SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_VALUES = ("additionalProperties", "not", "if", "then", "else", "contains",
                 "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")



# Every JSON Schema keyword that constrains a value (annotations and definitions excluded).
CONSTRAINTS = frozenset({
    "type", "enum", "const", "properties", "required", "items", "prefixItems", "minItems",
    "maxItems", "minLength", "maxLength", "pattern", "format", "additionalProperties",
    "patternProperties", "propertyNames", "minProperties", "maxProperties", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems", "contains",
    "minContains", "maxContains", "dependentRequired", "dependentSchemas", "dependencies",
    "additionalItems", "unevaluatedItems", "unevaluatedProperties", "not", "if", "then", "else",
    "anyOf", "oneOf", "allOf", "$ref", "$dynamicRef", "$recursiveRef",
})


def iter_schema_nodes(schema: Any) -> Iterator[dict[str, Any]]:
    """Every subschema object in `schema` (definitions and local `$ref` targets included),
    each once."""
    stack, seen = [schema], set()
    while stack:
        node = stack.pop()
        if isinstance(node, dict) and id(node) not in seen:
            seen.add(id(node))
            yield node
            stack.extend(child for _, child in subschemas(node))
            for key in ("$defs", "definitions"):
                if isinstance(node.get(key), dict):
                    stack.extend(node[key].values())
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                stack.append(lookup_ref(schema, ref))


def dropped_siblings(node: dict[str, Any]) -> tuple[str | None, list[str]]:
    """xgrammar builds a node holding `$ref`, `anyOf`, `oneOf` or `allOf` from one of them
    alone: (that keyword, the constraint keys it drops), or (None, []) for other nodes."""
    present = [key for key in COMBINATORS if key in node]
    if not present:
        return None, []
    kept = present[0]
    dropped = [key for key in node if key != kept and key not in NOT_CONSTRAINTS
               and key in CONSTRAINTS]
    return kept, dropped


def subschemas(node: dict[str, Any]):
    """(relative pointer, subschema) for every place a subschema can sit."""
    for key in SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, child in node[key].items():
                yield f"{key}/{escape(name)}", child
    for key in SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, child in enumerate(node[key]):
                yield f"{key}/{i}", child
    for key in SCHEMA_VALUES:
        if key in node:
            yield key, node[key]
    items = node.get("items")
    if isinstance(items, list):
        for i, child in enumerate(items):
            yield f"items/{i}", child
    elif items is not None:
        yield "items", items
    if isinstance(node.get("dependencies"), dict):
        for name, child in node["dependencies"].items():
            yield f"dependencies/{escape(name)}", child


def schema_nodes(node: Any, pointer: str = "#", depth: int = 0) -> Iterator[tuple[str, Any]]:
    """(pointer, node) of every subschema object, definitions included, each place once
    (a node reached at two places comes twice; `$ref` targets only where they are defined)."""
    if not isinstance(node, dict) or depth > 64:
        return
    yield pointer, node
    for key, child in subschemas(node):
        yield from schema_nodes(child, f"{pointer}/{key}", depth + 1)
    for key in ("$defs", "definitions"):
        if isinstance(node.get(key), dict):
            for name, child in node[key].items():
                yield from schema_nodes(child, f"{pointer}/{key}/{escape(name)}", depth + 1)


def dangles(ref: str, pointer: str) -> bool:
    """Whether `ref` points inside the node at `pointer` elsewhere than its definitions, so
    that rewriting the node in place would leave `ref` pointing at nothing."""
    if not ref.startswith(pointer + "/"):
        return False
    return ref[len(pointer) + 1:].split("/")[0] not in ("$defs", "definitions")


def escape(name: str) -> str:
    """A key as a JSON-pointer segment."""
    return str(name).replace("~", "~0").replace("/", "~1")
