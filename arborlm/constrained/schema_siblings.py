"""Move the keywords beside `$ref`, `anyOf` and `oneOf` into the schema they apply with.

xgrammar builds a node that holds `$ref`, `anyOf` or `oneOf` from that keyword alone: every
sibling constraint (`type`, `properties`, `required`, ...) is dropped without a word, so
`{"type": "object", "required": ["id"], "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}`
could produce `7`. `distribute_siblings` rewrites such nodes in place where it is exact:

- siblings S beside `anyOf: [B1, B2]` -> `anyOf: [S ∧ B1, S ∧ B2]`, and likewise for `oneOf`
  (exactly one of S ∧ Bi holds exactly when S and exactly one Bi hold), each conjunction
  merged into one schema by `schema_allof.merge_schemas`;
- siblings S beside a local `$ref` -> S merged with the referenced schema.

A node is left as written when a merge is not exact, when it holds more than one of these
keywords, or when a `$ref` points inside it; `schema_check` then reports the siblings and the
semantic guard checks them. Annotations and definitions stay on the node. This module rewrites
in place and decides nothing about support.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from arborlm.constrained.schema_allof import merge_schemas
from arborlm.constrained.schema_walk import (
    NOT_CONSTRAINTS,
    dangles,
    dropped_siblings,
    schema_nodes,
)

_REF = re.compile(r'"\$ref": "(#[^"]*)"')
_MAX_PASSES = 4


def distribute_siblings(schema: Any) -> Any:
    """Rewrite every eligible node of `schema` (see the module docstring); returns `schema`."""
    if not isinstance(schema, dict):
        return schema
    for _ in range(_MAX_PASSES):  # a merged branch may itself hold a combinator and siblings
        if not _pass(schema):
            break
    return schema


def _pass(schema: dict[str, Any]) -> bool:
    changed = False
    refs = set(_REF.findall(json.dumps(schema)))
    for pointer, node in list(schema_nodes(schema, "#")):
        if any(dangles(r, pointer) for r in refs):
            continue
        combinator, siblings = dropped_siblings(node)
        if combinator is None or combinator == "allOf" or not siblings or any(
                k in node for k in ("$ref", "anyOf", "oneOf", "allOf") if k != combinator):
            continue
        rest = {k: node[k] for k in siblings}
        if combinator == "$ref":
            ref = node["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#") or ref == "#" or \
                    pointer.startswith(ref + "/"):
                continue  # not local, or a reference to an enclosing schema (recursion)
            merged = merge_schemas([rest, {"$ref": node["$ref"]}], schema)
            if merged is None or "$ref" in merged:
                continue
            _replace(node, merged)
            changed = True
        elif isinstance(node[combinator], list):
            branches = [merge_schemas([rest, branch], schema) for branch in node[combinator]]
            if any(b is None for b in branches):
                continue
            _replace(node, {combinator: branches})
            changed = True
    return changed


def _replace(node: dict[str, Any], content: dict[str, Any]) -> None:
    kept = {k: v for k, v in node.items() if k in NOT_CONSTRAINTS}
    node.clear()
    node.update(kept)
    # A copy: the merged content may share subschemas with the rest of the tree.
    node.update(copy.deepcopy({k: v for k, v in content.items() if k not in kept}))

