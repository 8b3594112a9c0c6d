"""Turn property dependencies and `if`/`then`/`else` into `anyOf` branches a grammar can build.

Neither engine enforces `dependentRequired` / `dependentSchemas` (draft 2019-09+),
`dependencies` (drafts 4 to 7) or `if`/`then`/`else`. Each is a disjunction a grammar can
express, so `branch_conditionals` rewrites an object node N in place into an `anyOf` of full
copies of N:

- a dependency "when `a` is present, `b` and `c` must be": one branch where `a` is absent (not
  in `properties`; plus `not: {required: [a]}` unless N's objects are closed anyway) and one
  where `a`, `b` and `c` are all required (and, for a schema dependency, its schema merged in
  with `schema_allof.merge_schemas`). Up to three dependencies (eight branches), branches
  that contradict N's own `required` left out;
- `if: I, then: T, else: E`: the branches N ∧ I ∧ T (merged into one schema with
  `schema_allof.merge_schemas`) and N ∧ E with `not: I`, which is exact because I either holds
  or not. A `not` left in a branch is checked by the semantic guard when that object closes.

A node is left as written when it already combines schemas (`anyOf`, `oneOf`, `allOf`, `$ref`,
`not`), when a merge is not exact, or when a `$ref` points inside it (it would dangle);
`schema_check` then reports the keyword and the guard checks it. Definitions and `$schema`
stay on the node. This module rewrites in place and decides nothing about support.
"""

from __future__ import annotations

import json
import re
from typing import Any

from arborlm.constrained.schema_allof import merge_schemas
from arborlm.constrained.schema_walk import dangles, schema_nodes

MAX_DEPENDENCIES = 3
_COMBINED = ("anyOf", "oneOf", "allOf", "$ref", "not")
_KEPT = frozenset({"$schema", "$id", "id", "$defs", "definitions", "$comment", "title",
                   "description"})
_DEPENDENCY_KEYS = ("dependentRequired", "dependencies", "dependentSchemas")
_REF = re.compile(r'"\$ref": "(#[^"]*)"')


def branch_conditionals(schema: Any) -> Any:
    """Rewrite every eligible node of `schema` (see the module docstring); returns `schema`."""
    if not isinstance(schema, dict):
        return schema
    refs = set(_REF.findall(json.dumps(schema)))
    for pointer, node in list(schema_nodes(schema, "#")):
        if any(k in node for k in _COMBINED) or any(dangles(r, pointer) for r in refs):
            continue
        if "if" in node and ("then" in node or "else" in node):
            _rewrite_if(node, schema)
        elif _dependencies(node):
            _rewrite_dependencies(node, schema)
    return schema


def _dependencies(node: dict[str, Any]) -> dict[str, tuple[list[str], list[Any]]] | None:
    """name -> (the names it requires, the schemas it brings in) for the dependencies of
    `node`, or None when there are none or one cannot be branched (`false`, not an object)."""
    found: dict[str, tuple[list[str], list[Any]]] = {}
    for key in ("dependentRequired", "dependencies", "dependentSchemas"):
        value = node.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            return None
        for name, dependency in value.items():
            needed, schemas = found.get(name, ([], []))
            if isinstance(dependency, list) and key != "dependentSchemas" and all(
                    isinstance(n, str) for n in dependency):
                needed = list(dict.fromkeys(needed + dependency))
            elif isinstance(dependency, dict) and key != "dependentRequired":
                schemas = schemas + ([dependency] if dependency else [])
            elif dependency is not True:
                return None
            found[name] = (needed, schemas)
    return found or None


def _rewrite_dependencies(node: dict[str, Any], root: Any) -> None:
    dependencies = _dependencies(node) or {}
    required = set(node.get("required") or ())
    closed = node.get("additionalProperties", True) is False and "patternProperties" not in node
    live = {name: dependency for name, dependency in dependencies.items()
            if (dependency[1] or not set(dependency[0]) <= required) and (
                not closed or name in (node.get("properties") or {}))}
    if not live or len(live) > MAX_DEPENDENCIES:
        return
    base = {k: v for k, v in node.items() if k not in _KEPT and k not in _DEPENDENCY_KEYS}
    branches: list[tuple[dict[str, Any], list[str]]] = [(base, [])]
    for name, (needed, schemas) in live.items():
        grown = []
        for branch, absent in branches:
            if name not in (branch.get("required") or ()):
                properties = {k: v for k, v in (branch.get("properties") or {}).items()
                              if k != name}
                grown.append(({**branch, "properties": properties}, absent + [name]))
            if not set(needed) & set(absent):
                merged: dict[str, Any] | None = {**branch, "required": list(dict.fromkeys(
                    list(branch.get("required") or ()) + [name] + needed))}
                if schemas:
                    merged = merge_schemas([merged, *schemas], root)
                    if merged is None:
                        return  # not exact as one schema: left to the guard
                grown.append((merged, absent))
        branches = grown
    if not branches:
        return
    out = []
    for branch, absent in branches:
        if absent and not closed:
            branch = {**branch, "not": {"anyOf": [{"required": [n]} for n in absent]}}
        out.append(branch)
    _replace(node, out)


def _rewrite_if(node: dict[str, Any], root: Any) -> None:
    condition = node["if"]
    base = {k: v for k, v in node.items() if k not in _KEPT and k not in ("if", "then", "else")}
    then = merge_schemas([base, condition, node.get("then", True)], root)
    otherwise = merge_schemas([base, node.get("else", True)], root)
    if then is None or otherwise is None or "not" in otherwise:
        return
    _replace(node, [then, {**otherwise, "not": condition}])


def _replace(node: dict[str, Any], branches: list[dict[str, Any]]) -> None:
    kept = {k: v for k, v in node.items() if k in _KEPT}
    node.clear()
    node.update(kept)
    node["anyOf"] = branches

