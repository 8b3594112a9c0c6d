"""Decide whether the branches of a `oneOf` can never both match a generated value.

Both grammar engines compile `oneOf` as `anyOf`: the output matches at least one branch, but
`oneOf` demands exactly one. The two agree when no value the grammar can produce matches two
branches, which this module proves for the common cases (a conservative check: False means
"could not prove it", and the caller reports the keyword). Two branches are disjoint when:

- their types cannot meet (`integer` sits inside `number`), or their `const`/`enum` values differ;
- both are objects with a property that both require and whose subschemas are disjoint (a
  discriminator such as `"kind": {"const": "circle"}`);
- each requires a property the other cannot produce. This relies on generated objects being
  closed (only listed properties), which both backends guarantee unless a branch opens itself
  with `additionalProperties` or `patternProperties`.

`$ref` to a local definition is followed; extra keywords beside it only narrow a branch, which
keeps a proof of disjointness valid.
"""

from __future__ import annotations

import json
from itertools import combinations
from typing import Any

_MAX_DEPTH = 8


def oneof_branches_disjoint(branches: list[Any], root: Any) -> bool:
    """True if no two of `branches` can match the same generated value."""
    resolved = [_resolve(b, root) for b in branches]
    return all(_disjoint(a, b, root, 0) for a, b in combinations(resolved, 2))


def _resolve(schema: Any, root: Any) -> Any:
    """Follow local `$ref`s; an unresolvable reference becomes True (matches anything)."""
    for _ in range(_MAX_DEPTH):
        if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
            return schema
        schema = lookup_ref(root, schema["$ref"])
    return True


def lookup_ref(root: Any, ref: str) -> Any:
    """The subschema a local `$ref` ("#/$defs/x") points at in `root`; True if unresolvable."""
    if not ref.startswith("#"):
        return True
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return True
    return node


def _disjoint(a: Any, b: Any, root: Any, depth: int) -> bool:
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict) or depth > _MAX_DEPTH:
        return False
    types_a, types_b = _types(a), _types(b)
    if types_a is not None and types_b is not None and not types_a & types_b:
        return True
    values_a, values_b = _values(a), _values(b)
    if values_a is not None and values_b is not None and not values_a & values_b:
        return True
    return _objects_disjoint(a, b, root, depth)


def _objects_disjoint(a: dict[str, Any], b: dict[str, Any], root: Any, depth: int) -> bool:
    props_a, props_b = a.get("properties") or {}, b.get("properties") or {}
    req_a, req_b = set(a.get("required") or ()), set(b.get("required") or ())
    for name in req_a & req_b & props_a.keys() & props_b.keys():
        if _disjoint(_resolve(props_a[name], root), _resolve(props_b[name], root), root,
                     depth + 1):
            return True
    return (_is_closed(b) and bool(req_a - props_b.keys())
            and _is_closed(a) and bool(req_b - props_a.keys()))


def _is_closed(schema: dict[str, Any]) -> bool:
    """Generated objects of `schema` hold only its listed properties."""
    return schema.get("additionalProperties", False) is False and "patternProperties" not in schema


def _types(schema: dict[str, Any]) -> set[str] | None:
    declared = schema.get("type")
    if isinstance(declared, str):
        names = {declared}
    elif isinstance(declared, list):
        names = set(declared)
    elif _values(schema) is not None:
        return {t for value in _raw_values(schema) for t in _type_of(value)}
    else:
        return None
    if "number" in names:
        names.add("integer")
    return names


def _type_of(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


def _raw_values(schema: dict[str, Any]) -> list[Any]:
    if "const" in schema:
        return [schema["const"]]
    return list(schema["enum"])


def _values(schema: dict[str, Any]) -> set[str] | None:
    """Canonical texts of the only values `schema` allows, or None if not an enum/const."""
    if "const" not in schema and not isinstance(schema.get("enum"), list):
        return None
    return {canonical_text(v) for v in _raw_values(schema)}


def canonical_text(value: Any) -> str:
    """Equal texts exactly for values JSON Schema calls equal (1 == 1.0; true != 1)."""
    return json.dumps(_normalized(value), sort_keys=True)


def _normalized(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_normalized(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalized(v) for k, v in value.items()}
    return value
