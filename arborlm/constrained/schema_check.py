"""Reject JSON-schema keywords a grammar backend would silently drop.

Both engines compile a JSON schema into a grammar, and both skip keywords they cannot express
(`uniqueItems`, `not`, `if`/`then`, ...) without a word, so the output can violate the schema it
was constrained by. `check_schema_supported` walks every subschema first and raises one
`GrammarError` naming each such keyword with its JSON pointer, for a 400 reply.

What counts as dropped was measured against xgrammar 0.2.9 and outlines-core 0.2.14, not read
from their docs. Annotations (`title`, `description`, `examples`, `default`, ...) and unknown
vendor keys (`x-...`, `javaType`) are not constraints and pass. A keyword is also accepted when
it cannot change the output: `uniqueItems: false`, `unevaluatedProperties: false` (objects are
closed anyway, see `xgrammar_backend`), `additionalItems` next to a non-list `items`, `if`
without `then`/`else`, and `oneOf` whose branches provably never both match (both engines build
`oneOf` as `anyOf`, which is exact only then). Custom `format` names are annotations; standard
formats an engine cannot check are reported.

xgrammar also builds a node holding `$ref`, `anyOf`, `oneOf` or `allOf` from that keyword
alone, so the constraints beside it are reported too (`schema_siblings` first moves them in
where that is exact). `checked_schema` applies the exact rewrites before checking.

`schema_problems` returns the same findings as `Problem`s that also say whether the semantic
guard (`schema_guard`) can enforce them when each value closes: everything except references
outside the schema, standard formats `jsonschema` cannot check either, and (outlines) text the
engine would write as invalid JSON.

This module does not compile anything and checks only what the engines would drop; a schema
that is invalid in other ways is left to the engine's own error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from arborlm.constrained.schema_allof import merge_all_of
from arborlm.constrained.schema_branches import branch_conditionals
from arborlm.constrained.schema_oneof import lookup_ref, oneof_branches_disjoint
from arborlm.constrained.schema_required import define_required
from arborlm.constrained.schema_rewrite import enum_value_fits
from arborlm.constrained.schema_siblings import distribute_siblings
from arborlm.constrained.schema_walk import (
    dropped_siblings,
    subschemas,
)
from arborlm.errors import GrammarError

# Validation keywords of drafts 4 to 2020-12 that both engines implement.
_COMMON = frozenset({
    "type", "enum", "const", "properties", "required", "items", "prefixItems", "minItems",
    "maxItems", "minLength", "maxLength", "pattern", "format", "$ref", "$defs", "definitions",
    "anyOf",
})
_SUPPORTED = {
    "xgrammar": _COMMON | {
        "additionalProperties", "patternProperties", "propertyNames", "minProperties",
        "maxProperties", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    },
    "outlines": _COMMON,
}
# Every other JSON Schema validation keyword: reported unless a rule below accepts its value.
_VALIDATION = frozenset({
    "multipleOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "uniqueItems",
    "contains", "minContains", "maxContains", "minProperties", "maxProperties",
    "dependentRequired", "dependentSchemas", "dependencies", "patternProperties",
    "additionalProperties", "propertyNames", "additionalItems", "unevaluatedItems",
    "unevaluatedProperties", "allOf", "oneOf", "not", "if", "then", "else", "$dynamicRef",
    "$recursiveRef",
})
_STANDARD_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname",
    "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template",
    "json-pointer", "relative-json-pointer", "regex",
})
_FORMATS = {
    "xgrammar": _STANDARD_FORMATS - {"idn-email", "idn-hostname", "iri", "iri-reference", "regex"},
    "outlines": frozenset({"date-time", "date", "time", "email", "uri", "uuid"}),
}


@dataclass(frozen=True)
class Problem:
    """A keyword the engine would drop: where (JSON pointer), which, why, and whether the
    semantic guard can check it instead."""

    pointer: str  # of the schema node holding the keyword, "#/..."
    keyword: str
    reason: str
    guardable: bool
    node: Any = field(compare=False, repr=False, hash=False)  # that schema node (a dict)

    def __str__(self) -> str:
        return f"{self.pointer}/{self.keyword} ({self.reason})"


def parse_schema(spec: str) -> dict[str, Any] | bool:
    """Parse a json_schema spec; it must be a JSON object (or true/false)."""
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as e:
        raise GrammarError(f"json_schema is not valid JSON: {e}", param="json_schema") from e
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"json_schema must be a JSON object, got {type(schema).__name__}",
                           param="json_schema")
    return schema


def checked_schema(spec: str, backend: str) -> dict[str, Any] | bool:
    """Parse a json_schema spec, apply the exact rewrites (`allOf` folded, siblings of
    combinators moved in, dependencies and if/then/else as branches, required names defined)
    and check it for `backend`, with no semantic guard (a path without one, such as tool-call
    tags, uses this); the result is a fresh object the caller may rewrite. Raises
    `GrammarError` for invalid JSON or keywords the backend would drop."""
    schema = exactly_rewritten(parse_schema(spec))
    check_schema_supported(schema, backend)
    return schema


def exactly_rewritten(schema: Any) -> Any:
    """`schema` (a fresh parse) after the exact rewrites, in their order: `allOf` folded,
    siblings of combinators moved in, conditionals as branches, required names defined."""
    return define_required(branch_conditionals(distribute_siblings(merge_all_of(schema))))


def supports_format(backend: str, name: Any) -> bool:
    """Whether `backend` checks the string format `name`."""
    return name in _FORMATS[backend]


def check_schema_supported(schema: dict[str, Any] | bool, backend: str = "xgrammar") -> None:
    """Raise `GrammarError` listing every keyword `backend` would drop, with its location."""
    problems = schema_problems(schema, backend)
    if problems:
        raise GrammarError(f"json_schema uses keywords the {backend} grammar backend cannot "
                           f"enforce: {format_problems(problems)}", param="json_schema")


def schema_problems(schema: dict[str, Any] | bool, backend: str = "xgrammar") -> list[Problem]:
    """Every keyword `backend` would drop in the subschemas reachable from the root."""
    problems: list[Problem] = []
    _walk(schema, "#", backend, schema, problems, set())
    return problems


def format_problems(problems: list[Problem], limit: int = 12) -> str:
    shown = [str(p) for p in problems[:limit]]
    return "; ".join(shown) + ("; ..." if len(problems) > limit else "")


def _guardable(key: str, value: Any, reason: str) -> bool:
    """Whether `jsonschema`, run on each closed value, checks what the engine drops."""
    if key == "$ref" or reason.startswith("outlines ") or key == "items":
        return False  # the engine cannot build it (or builds invalid JSON): nothing to guard
    if key == "format":
        return value in _checkable_formats()
    return True


def _checkable_formats() -> frozenset[str]:
    global _CHECKABLE
    if _CHECKABLE is None:
        from jsonschema import FormatChecker

        _CHECKABLE = frozenset(FormatChecker().checkers)
    return _CHECKABLE


_CHECKABLE: frozenset[str] | None = None


def _walk(node: Any, where: str, backend: str, root: Any, problems: list[Problem],
          visited: set[str]) -> None:
    """Check `node` and every subschema reachable from it; definitions are checked when a
    local `$ref` reaches them (once each), so unused definitions cannot fail a schema."""
    if not isinstance(node, dict):
        return
    reported = set()
    for key, value in node.items():
        reason = _unsupported(key, value, node, backend, root)
        if reason:
            reported.add(key)
            problems.append(Problem(where, key, reason, _guardable(key, value, reason), node))
    kept, dropped = dropped_siblings(node)
    for key in dropped:
        if key not in reported:
            problems.append(Problem(where, key, f"dropped beside {kept}", True, node))
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in visited:
        visited.add(ref)
        _walk(lookup_ref(root, ref), ref, backend, root, problems, visited)
    for key, child in subschemas(node):
        _walk(child, f"{where}/{key}", backend, root, problems, visited)


def _unsupported(key: str, value: Any, node: dict[str, Any], backend: str,
                 root: Any) -> str | None:
    """Why `key` would be dropped, or None when it is enforced or cannot matter."""
    if key == "format":
        standard = isinstance(value, str) and value in _STANDARD_FORMATS
        return f"format {value!r} not checked" if standard and value not in _FORMATS[
            backend] else None
    if key in ("enum", "const") and not any(
            enum_value_fits(v, node) for v in (value if key == "enum" and isinstance(
                value, list) else [value])):
        return "no value satisfies the node's other keywords (the engine ignores them here)"
    if key == "pattern" and supports_format(backend, node.get("format")):
        return f"dropped beside format {node['format']!r}"
    if key == "required" and isinstance(value, list):
        return _undefined_required(value, node)
    if key == "$ref" and isinstance(value, str) and not value.startswith("#"):
        return "only local references (#/...) are resolved"
    if key == "items" and isinstance(value, list):
        return "a list of schemas (draft-4 tuple) is not supported; use prefixItems"
    if key in ("minLength", "maxLength") and ("pattern" in node or supports_format(
            backend, node.get("format"))):
        return "not enforced together with pattern or format"
    if key == "pattern" and backend == "outlines" and isinstance(value, str) and \
            _may_match_quote(value):
        return "outlines matches patterns on escaped JSON text; this one may match '\"' or '\\'"
    if key == "properties" and backend == "outlines" and isinstance(value, dict) and any(
            _needs_json_escape(name) for name in value):
        return "outlines writes property names unescaped; names need no quote, backslash or " \
            "control character"
    if key in _SUPPORTED[backend] or key not in _VALIDATION:
        return None
    return _value_rule(key, value, node, backend, root)


def _value_rule(key: str, value: Any, node: dict[str, Any], backend: str,
                root: Any) -> str | None:
    if key == "uniqueItems":
        at_most_one = isinstance(node.get("maxItems"), int) and node["maxItems"] <= 1
        return None if value is False or at_most_one else "not enforced"
    if key in ("unevaluatedProperties", "unevaluatedItems"):
        return None if value is False else "only false is supported"
    if key == "additionalProperties":  # outlines: objects stay closed whatever it says
        return None if value is False else "objects are always closed on this backend"
    if key == "additionalItems":
        return None if not isinstance(node.get("items"), list) else "not enforced"
    if key == "if":
        return None if "then" not in node and "else" not in node else "not enforced"
    if key in ("then", "else"):
        return None if "if" not in node else "not enforced"
    if key == "allOf":  # what merge_all_of could not fold into its parent
        return "branches that cannot be merged into one schema"
    if key == "oneOf" and isinstance(value, list):
        if oneof_branches_disjoint(value, root):
            return None
        return "branches may overlap; only exclusive branches are enforced"
    if key == "multipleOf" and backend == "xgrammar" and node.get("type") == "integer":
        return None
    if key in ("dependencies", "dependentRequired", "dependentSchemas") and isinstance(
            value, dict) and all(_dependency_moot(name, dep, node) for name, dep in value.items()):
        return None
    return "not enforced"


def _dependency_moot(name: str, dependents: Any, node: dict[str, Any]) -> bool:
    """A dependency cannot fire when its trigger property can never be generated (closed object
    that does not list it), or is moot when it only requires names that are required anyway."""
    if name not in (node.get("properties") or {}) and "patternProperties" not in node and \
            node.get("additionalProperties", False) is False:
        return True
    return isinstance(dependents, list) and set(dependents) <= set(node.get("required") or ())


def _undefined_required(required: list[Any], node: dict[str, Any]) -> str | None:
    """Engines drop required names that `properties` does not define; report them (unless
    the node is no object, or combines with other schemas that may define them)."""
    if not _may_be_object(node) or any(k in node for k in ("allOf", "$ref", "oneOf", "anyOf")):
        return None
    defined = node.get("properties") or {}
    missing = [name for name in required if name not in defined]
    if not missing:
        return None
    return f"names properties it does not define: {', '.join(map(str, missing))}"


def _may_match_quote(pattern: str) -> bool:
    """Conservatively: could `pattern` match a double quote or a backslash?"""
    escaped = in_class = False
    for i, ch in enumerate(pattern):
        if escaped:
            escaped = False
            if ch in "WSDpP" or ch in "\\\"":
                return True
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "^":
                return True
        elif ch in ".\"":
            return True
        if in_class and ch == '"':
            return True
    return False


def _needs_json_escape(name: str) -> bool:
    return any(ch in '"\\' or ord(ch) < 0x20 for ch in name)


def _may_be_object(node: dict[str, Any]) -> bool:
    declared = node.get("type", "object")
    return declared == "object" or isinstance(declared, list) and "object" in declared


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")
