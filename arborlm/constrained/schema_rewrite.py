"""Rewrite a checked JSON schema into an equivalent (or narrower) one an engine gets right.

Each rewrite mends a measured engine defect by narrowing, never loosening, so whatever the
engine then generates still validates against the schema the user sent:

- `format: date | time | date-time` becomes an ASCII pattern that admits only real calendar
  dates (February stops at 28) and RFC 3339 times with an offset. Both engines' own format
  grammars accept February 31st, and outlines-core's use `\\d`, which in its regex dialect
  matches any Unicode digit ("３༣69-12-06").
- outlines-core: `\\d` in a `pattern` becomes `[0-9]` (JSON Schema patterns are ECMA-262, where
  `\\d` is ASCII).
- `enum` beside other keywords: the values that fail them (another `type`, too long, below
  `minimum`, ...) are dropped from `enum` (both engines generate every listed value whatever
  the rest of the node says). A `const` or an `enum` left with no value is kept
  (`schema_check` reports it).
- Closed by default, but not where that leaves no value: an array whose `minItems` exceeds its
  `prefixItems` and that has no `items` gets `items: {}`, an object whose `minProperties`
  exceeds its `properties` and that has neither `additionalProperties` nor
  `patternProperties` gets `additionalProperties: {}` (what JSON Schema means by leaving them
  out).
- `minLength` / `maxLength` beside a `pattern` that repeats one character class
  (`^[a-z0-9_-]+$`): the bounds become the repetition's (`^[a-z0-9_-]{3,64}$`), which the
  engines enforce (beside a `pattern` they drop length bounds); `minLength: 0` is dropped.
- `uniqueItems` over a finite set of item values (`items` an `enum`, a `const` or booleans):
  `maxItems` becomes at most the number of distinct values, exactly what uniqueness implies,
  so the grammar closes the array before the semantic guard would meet a dead end.
- xgrammar: an optional group `(...)?` in a `pattern` becomes the equal `(...|)`. xgrammar
  0.2.9 builds `^1(-[a-z]+)?$` so that it also matches "1x" (the group's first character
  goes missing when the optional group ends the pattern).

Grammar-level defects of xgrammar are mended in `xgrammar_backend`. Rewrites happen in
place on the fresh object `schema_check.checked_schema` returns. This module does not decide
what is supported; `schema_check` does, before it.
"""

from __future__ import annotations

import re
from typing import Any

from arborlm.constrained.schema_oneof import canonical_text
from arborlm.constrained.schema_walk import CONSTRAINTS, iter_schema_nodes

_DAY = ("(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
        "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_DATE = f"[0-9]{{4}}-{_DAY}"
_TIME = ("(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,6})?"
         "(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
}


def rewrite_schema(schema: Any, backend: str) -> Any:
    """Apply the rewrites above for `backend` to every subschema; returns `schema`."""
    for node in iter_schema_nodes(schema):
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt in FORMAT_PATTERNS and "pattern" not in node:
            node.pop("format")
            node["pattern"] = FORMAT_PATTERNS[fmt]
        if backend == "outlines" and isinstance(node.get("pattern"), str):
            node["pattern"] = ascii_digits(node["pattern"])
        _open_if_unsatisfiable(node)
        _bound_pattern(node)
        _bound_unique_items(node)
        if isinstance(node.get("enum"), list):
            kept = [v for v in node["enum"] if enum_value_fits(v, node)]
            if kept:
                node["enum"] = kept
        if backend == "xgrammar" and isinstance(node.get("pattern"), str):
            node["pattern"] = optional_groups(node["pattern"])
    return schema


def ascii_digits(pattern: str) -> str:
    """Replace `\\d` by `[0-9]` (or `0-9` inside a character class)."""
    out: list[str] = []
    escaped = in_class = False
    for ch in pattern:
        if escaped:
            escaped = False
            if ch == "d":
                out[-1] = "0-9" if in_class else "[0-9]"
                continue
        elif ch == "\\":
            escaped = True
        elif ch == "[" and not in_class:
            in_class = True
        elif ch == "]" and in_class:
            in_class = False
        out.append(ch)
    return "".join(out)


def optional_groups(pattern: str) -> str:
    """Rewrite each greedy optional group `(...)?` as `(...|)` (the same language)."""
    out: list[str] = []
    escaped = in_class = False
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == ")" and pattern[i + 1:i + 2] == "?" and pattern[i + 2:i + 3] not in ("?", "+"):
            out.append("|)")
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def has_type(value: Any, declared: Any) -> bool:
    """Whether a JSON value is of the JSON Schema `type` (a name or a list of names)."""
    names = [declared] if isinstance(declared, str) else declared
    if not isinstance(names, list):
        return True
    return any(_is(value, name) for name in names)


def _is(value: Any, name: Any) -> bool:
    if name == "integer":
        return isinstance(value, int | float) and not isinstance(value, bool) and \
            float(value).is_integer()
    if name == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    kinds = {"string": str, "boolean": bool, "array": list, "object": dict}
    if name == "null":
        return value is None
    return name in kinds and isinstance(value, kinds[name]) or name not in (*kinds, "null")


def _open_if_unsatisfiable(node: dict[str, Any]) -> None:
    prefix = node.get("prefixItems")
    least = node.get("minItems")
    if isinstance(least, int) and "items" not in node and least > (
            len(prefix) if isinstance(prefix, list) else 0):
        node["items"] = {}
    properties = node.get("properties")
    least = node.get("minProperties")
    if isinstance(least, int) and "additionalProperties" not in node and \
            "patternProperties" not in node and least > (
                len(properties) if isinstance(properties, dict) else 0):
        node["additionalProperties"] = {}


def enum_value_fits(value: Any, node: dict[str, Any]) -> bool:
    """Whether an `enum` / `const` value of `node` satisfies the node's other keywords (True
    when that cannot be told here: references, combinators, a keyword jsonschema rejects)."""
    if "type" in node and not has_type(value, node["type"]):
        return False
    rest = {k: v for k, v in node.items() if k in CONSTRAINTS and k not in ("enum", "const")}
    if not rest or any(k in rest for k in ("$ref", "anyOf", "oneOf", "allOf", "not", "if")):
        return True
    from jsonschema import Draft202012Validator

    try:
        return Draft202012Validator(rest).is_valid(value)
    except Exception:  # noqa: BLE001 - e.g. draft-4 boolean exclusiveMinimum: cannot tell
        return True


_ONE_CLASS = re.compile(r"^\^?((?:\[(?:[^\]\\\[]|\\.)+\])|\\[wdsWDS]|\.)([+*])\$?$")


def _bound_pattern(node: dict[str, Any]) -> None:
    if node.get("minLength") == 0:
        del node["minLength"]
    pattern = node.get("pattern")
    low, high = node.get("minLength"), node.get("maxLength")
    if not isinstance(pattern, str) or (low is None and high is None):
        return
    if not all(b is None or isinstance(b, int) and not isinstance(b, bool) for b in (low, high)):
        return
    match = _ONE_CLASS.match(pattern)
    if match is None:
        return
    atom, repeat = match.groups()
    least = max(low or 0, 1 if repeat == "+" else 0)
    if high is not None and high < least:
        return
    node["pattern"] = f"^{atom}{{{least},{'' if high is None else high}}}$"
    node.pop("minLength", None)
    node.pop("maxLength", None)


def _bound_unique_items(node: dict[str, Any]) -> None:
    items = node.get("items")
    if node.get("uniqueItems") is not True or not isinstance(items, dict) or \
            "prefixItems" in node:
        return
    if isinstance(items.get("enum"), list):
        values = items["enum"]
    elif "const" in items:
        values = [items["const"]]
    elif items.get("type") == "boolean":
        values = [True, False]
    else:
        return
    distinct = {canonical_text(v) for v in values}
    bound = node.get("maxItems")
    if not isinstance(bound, int) or len(distinct) < bound:
        node["maxItems"] = len(distinct)

