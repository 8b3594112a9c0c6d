"""`GuardPlan`: check generated JSON against the schema keywords a grammar cannot express.

A grammar engine drops some keywords (`not`, `uniqueItems`, overlapping `oneOf`, `multipleOf`,
length bounds beside a `pattern`, ...; `schema_check.schema_problems` lists them). The plan is
built once per compiled schema from those problems and checks each value as the output is
written, through a `json_tracker.JsonTracker` fed the accepted tokens' bytes:

- at value close: the closed value is validated with `jsonschema` (the schema's own draft, the
  root resolving local `$ref`s, formats checked only where the engine drops them) against every
  schema node that definitely applies at its instance path (`properties`, `items`, ... followed
  from the root, with the in-place `$ref`, `allOf` and one-branch `anyOf`/`oneOf`), and only
  where that node's subtree holds a dropped keyword, so everything else costs nothing. A value
  under an `anyOf`/`oneOf`/`if` whose branch is not known yet has no definite node; it is
  checked when an enclosing value with one closes (the root always has one, so every finished
  output has been validated against the whole schema);
- `uniqueItems` each time an item closes (a duplicate of an earlier item);
- `maxLength` (where dropped) as a prefix check: a token that makes the string too long.

`check(events, text)` returns None or a reason naming the instance and the schema keyword by
JSON pointer. The matcher wrapper (`guarded_matcher`) asks it before a token is accepted; this
module neither masks tokens nor owns any request state.
"""

from __future__ import annotations

import json
import re
from typing import Any

from arborlm.constrained.json_tracker import Close, Grow, JsonTracker, pointer
from arborlm.constrained.schema_check import Problem
from arborlm.constrained.schema_oneof import canonical_text, lookup_ref
from arborlm.constrained.schema_walk import iter_schema_nodes, subschemas

_MAX_DEPTH = 16
MAX_CACHED_SITES = 4096  # per plan


class Site:
    """What applies to the values at one place of the instance: the definite schema nodes
    (pointer, node), the ones to validate at close, and the prefix / item checks."""

    __slots__ = ("schemas", "validate", "max_length", "unique", "prefix_len", "held")

    def __init__(self, schemas: list[tuple[str, Any]], validate: list[tuple[str, Any]],
                 max_length: tuple[int, str] | None, unique: str | None, prefix_len: int,
                 held: bool = False):
        self.schemas = schemas
        self.validate = validate
        # Whether the check at close can reject what the checks of the values inside did not
        # (a dropped keyword here, or below an indefinite branch): the value's text is then
        # held back from the client until it closes.
        self.held = held
        self.max_length = max_length  # (bound, schema pointer of the keyword)
        self.unique = unique  # schema pointer of the uniqueItems keyword
        self.prefix_len = prefix_len


_NOWHERE = Site([], [], None, None, 0)


class GuardPlan:
    """The semantic checks of one compiled schema; immutable apart from its cache of sites, so
    one plan serves every request of that schema (thread-safe under the GIL)."""

    def __init__(self, schema: Any, problems: list[Problem]):
        from jsonschema import FormatChecker
        from jsonschema.validators import validator_for

        self.schema = schema
        self.problems = tuple(problems)
        self._keywords: dict[int, set[str]] = {}
        for problem in problems:
            self._keywords.setdefault(id(problem.node), set()).add(problem.keyword)
        self._needs = _ancestors(schema, set(self._keywords))
        self._held = _held(schema, set(self._keywords), self._needs)
        formats = [p.node.get("format") for p in problems if p.keyword == "format"]
        from jsonschema import Draft202012Validator

        cls = validator_for(schema, default=Draft202012Validator) if isinstance(
            schema, dict) else Draft202012Validator
        checker = FormatChecker(formats=formats) if formats else None
        self._validator = cls(schema, format_checker=checker)
        self._children: dict[tuple[int, str | int], Site] = {}
        self.root = self._site(_expand([("#", schema)], schema))

    def tracker(self) -> JsonTracker:
        return JsonTracker(self.root, self.child)

    def child(self, site: Site, segment: str | int) -> Site:
        """The site of the value at `segment` (a key or an index) inside a value at `site`."""
        if not site.schemas:
            return _NOWHERE
        key = (id(site), segment if isinstance(segment, str) or segment < site.prefix_len
               else -1)
        found = self._children.get(key)
        if found is None:
            found = self._site(_expand(_children(site.schemas, segment), self.schema))
            if len(self._children) < MAX_CACHED_SITES:  # free-form keys must not grow it
                self._children[key] = found
        return found

    def check(self, events: list[Close | Grow], text: bytearray) -> str | None:
        """The first violation the events reveal, or None."""
        found = self.violation(events, text)
        return None if found is None else found[0]

    def violation(self, events: list[Close | Grow], text: bytearray
                  ) -> tuple[str, Close | Grow] | None:
        """The first violation the events reveal and the event that revealed it (a `Close`:
        that value is wrong as a whole; a `Grow`: that string is already too long), or None."""
        for event in events:
            site = event.site
            if isinstance(event, Grow):
                if site.max_length is not None and event.length > site.max_length[0]:
                    return (f"value at {pointer(event.path) or '/'} violates maxLength (schema "
                            f"{site.max_length[1]})"), event
                continue
            parent = event.parent
            if parent is not None and parent[3].unique is not None and parent[0] == 1:
                reason = _duplicate(text, parent, event)
                if reason:
                    return reason, event
            if site.validate:
                reason = self._validate(site, event, text)
                if reason:
                    return reason, event
        return None

    @staticmethod
    def checked_start(tracker: JsonTracker) -> int | None:
        """The start offset of the outermost open value that is checked when it closes (its
        site validates, or it is an item of a `uniqueItems` array), or None: text from there
        on may still be rejected as a whole."""
        for start, site, parent in tracker.open_values():
            if site.held or (parent is not None and parent[0] == 1
                             and parent[3].unique is not None):
                return start
        return None

    def _validate(self, site: Site, event: Close, text: bytearray) -> str | None:
        from jsonschema.exceptions import best_match

        try:
            value = json.loads(text[event.start:event.end])
        except ValueError:
            return None  # not JSON: the grammar's business, not the guard's
        for ptr, node in site.validate:
            try:
                error = best_match(self._validator.evolve(schema=node).iter_errors(value))
            except Exception as e:  # noqa: BLE001 - e.g. 1e999 under multipleOf: not provably
                return (f"value at {pointer(event.path) or '/'} cannot be validated against "
                        f"schema {ptr}: {type(e).__name__}: {e}")
            if error is not None:
                where = pointer(event.path + tuple(error.absolute_path)) or "/"
                keyword_at = "/".join(str(p) for p in error.absolute_schema_path)
                return (f"value at {where} violates {error.validator} (schema "
                        f"{ptr}/{keyword_at})")
        return None

    def _site(self, schemas: list[tuple[str, Any]]) -> Site:
        if not schemas:
            return _NOWHERE
        validate, max_length, unique, prefix_len = [], None, None, 0
        for ptr, node in schemas:
            if not isinstance(node, dict):
                continue
            for key in ("prefixItems", "items"):
                if isinstance(node.get(key), list):
                    prefix_len = max(prefix_len, len(node[key]))
            keywords = self._keywords.get(id(node), ())
            bound = node.get("maxLength")
            if "maxLength" in keywords and isinstance(bound, int) and (
                    max_length is None or bound < max_length[0]):
                max_length = (bound, f"{ptr}/maxLength")
            if "uniqueItems" in keywords and node.get("uniqueItems") is True:
                unique = f"{ptr}/uniqueItems"
        # Validating an outer node covers the nodes its $ref / allOf brought in.
        covered: set[int] = set()
        for ptr, node in schemas:
            if isinstance(node, dict) and id(node) in self._needs and id(node) not in covered:
                validate.append((ptr, node))
                covered |= {id(n) for _, n in _expand([(ptr, node)], self.schema)}
        held = any(id(node) in self._held for _, node in validate)
        return Site(schemas, validate, max_length, unique, prefix_len, held)


def _expand(entries: list[tuple[str, Any]], root: Any) -> list[tuple[str, Any]]:
    """The nodes that apply in place: each entry with what its local `$ref`, `allOf` and
    single-branch `anyOf`/`oneOf` bring in."""
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def go(ptr: str, node: Any, depth: int) -> None:
        if not isinstance(node, dict) or id(node) in seen or depth > _MAX_DEPTH:
            return
        seen.add(id(node))
        out.append((ptr, node))
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            go(ref, lookup_ref(root, ref), depth + 1)
        if isinstance(node.get("allOf"), list):
            for i, branch in enumerate(node["allOf"]):
                go(f"{ptr}/allOf/{i}", branch, depth + 1)
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and len(node[key]) == 1:
                go(f"{ptr}/{key}/0", node[key][0], depth + 1)

    for ptr, node in entries:
        go(ptr, node, 0)
    return out


def _children(schemas: list[tuple[str, Any]], segment: str | int) -> list[tuple[str, Any]]:
    """The subschemas that apply to the member `segment` of a value all of `schemas` apply to."""
    out: list[tuple[str, Any]] = []
    for ptr, node in schemas:
        if not isinstance(node, dict):
            continue
        if isinstance(segment, str):
            out.extend(_member(ptr, node, segment))
            continue
        prefix, items = node.get("prefixItems"), node.get("items")
        if isinstance(prefix, list):
            if segment < len(prefix):
                out.append((f"{ptr}/prefixItems/{segment}", prefix[segment]))
            elif isinstance(items, dict):
                out.append((f"{ptr}/items", items))
        elif isinstance(items, list):
            if segment < len(items):
                out.append((f"{ptr}/items/{segment}", items[segment]))
            elif isinstance(node.get("additionalItems"), dict):
                out.append((f"{ptr}/additionalItems", node["additionalItems"]))
        elif isinstance(items, dict):
            out.append((f"{ptr}/items", items))
    return out


def _member(ptr: str, node: dict[str, Any], name: str) -> list[tuple[str, Any]]:
    out, matched = [], False
    properties = node.get("properties")
    if isinstance(properties, dict) and name in properties:
        out.append((f"{ptr}/properties/{_escape(name)}", properties[name]))
        matched = True
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict):
        for pattern, sub in patterns.items():
            try:
                hit = re.search(pattern, name) is not None
            except re.error:  # cannot tell: left to the enclosing value's check at close
                matched = True
                continue
            if hit:
                out.append((f"{ptr}/patternProperties/{_escape(pattern)}", sub))
                matched = True
    if not matched and isinstance(node.get("additionalProperties"), dict):
        out.append((f"{ptr}/additionalProperties", node["additionalProperties"]))
    return out


def _ancestors(root: Any, flagged: set[int]) -> set[int]:
    """Ids of the nodes whose subtree (subschemas and local `$ref` targets, transitively)
    holds a node in `flagged`, those included."""
    parents: dict[int, list[int]] = {}
    for node in iter_schema_nodes(root):
        children = [child for _, child in subschemas(node)]
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            children.append(lookup_ref(root, ref))
        for child in children:
            if isinstance(child, dict):
                parents.setdefault(id(child), []).append(id(node))
    needs, stack = set(flagged), list(flagged)
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent not in needs:
                needs.add(parent)
                stack.append(parent)
    return needs


# Subschema places that apply to the members of a value (each member's own site checks them).
_MEMBER_KEYS = frozenset(("properties", "prefixItems", "items", "additionalItems",
                          "additionalProperties"))


def _held(root: Any, flagged: set[int], needs: set[int]) -> set[int]:
    """Ids of the nodes whose check at close can fail where the checks of the members did
    not: a node with a dropped keyword, one that applies a node in `needs` through an
    indefinite place (a branch of a several-branch `anyOf`/`oneOf`, `not`, `if`, ...,
    `patternProperties`), or one that brings a held node in place (`$ref`, `allOf`, a
    one-branch `anyOf`/`oneOf`)."""
    edges: list[tuple[int, list[int], list[int]]] = []  # node, in place, indefinite
    for node in iter_schema_nodes(root):
        same, loose = [], []
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            same.append(id(lookup_ref(root, ref)))
        for rel, child in subschemas(node):
            key = rel.split("/", 1)[0]
            if not isinstance(child, dict):
                continue
            if key == "allOf" or (key in ("anyOf", "oneOf") and len(node[key]) == 1):
                same.append(id(child))
            elif key not in _MEMBER_KEYS or (key == "additionalProperties"
                                             and "patternProperties" in node):
                loose.append(id(child))
        edges.append((id(node), same, loose))
    held = set(flagged)
    changed = True
    while changed:
        changed = False
        for node, same, loose in edges:
            if node not in held and (any(c in held for c in same)
                                     or any(c in needs for c in loose)):
                held.add(node)
                changed = True
    return held


def _duplicate(text: bytearray, array: list[Any], item: Close) -> str | None:
    """A reason if the item that just closed equals an earlier item of its array."""
    try:
        items = json.loads(bytes(text[array[1]:item.end]) + b"]")
    except ValueError:
        return None
    last = canonical_text(items[-1])
    if any(canonical_text(other) == last for other in items[:-1]):
        return (f"value at {pointer(array[2]) or '/'} violates uniqueItems (schema "
                f"{array[3].unique})")
    return None



def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")
