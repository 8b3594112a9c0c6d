"""Rewrite a checked JSON schema into an equivalent (or narrower) one an engine gets right.

Each rewrite mends a measured engine defect by narrowing, never loosening, so whatever the
engine then generates still validates against the schema the user sent:

- `format: date | time | date-time` becomes an ASCII pattern that admits only real calendar
  dates (February stops at 28) and RFC 3339 times with an offset. Both engines' own format
  grammars accept February 31st, and outlines-core's use `\\d`, which in its regex dialect
  matches any Unicode digit ("３༣69-12-06").
- outlines-core: `\\d` in a `pattern` becomes `[0-9]` (JSON Schema patterns are ECMA-262, where
  `\\d` is ASCII).

Grammar-level defects of xgrammar are mended in `xgrammar_backend`. Rewrites happen in
place on the fresh object `schema_check.checked_schema` returns. This module does not decide
what is supported; `schema_check` does, before it.
"""

from __future__ import annotations

from typing import Any

from arborlm.constrained.schema_walk import iter_schema_nodes

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
