"""`prepare_json_schema`: a json_schema spec made ready for an engine, with its guard plan.

The one path both backends take for the `json_schema` kind: parse; exact rewrites
(`schema_check.exactly_rewritten`: `schema_allof`, `schema_siblings`, `schema_branches`,
`schema_required`); narrowing rewrites
(`schema_rewrite`); then `schema_check.schema_problems` lists what the engine would drop. What
the semantic guard can check becomes a `schema_guard.GuardPlan`; the rest is refused in strict
mode (a `GrammarError` naming each keyword by JSON pointer, for a 400) or, non-strict, listed
in `unenforced`. Nothing is dropped silently.

It compiles nothing; the backend compiles `schema` and hands the plan to its matchers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from arborlm.constrained.base import ANY_JSON
from arborlm.constrained.schema_check import (
    Problem,
    exactly_rewritten,
    format_problems,
    parse_schema,
    schema_problems,
)
from arborlm.constrained.schema_guard import GuardPlan
from arborlm.constrained.schema_rewrite import rewrite_schema
from arborlm.constrained.schema_walk import iter_schema_nodes
from arborlm.errors import GrammarError


@dataclass(frozen=True)
class PreparedSchema:
    schema: Any  # what the engine compiles
    guard: GuardPlan | None  # None when the grammar enforces everything
    unenforced: tuple[str, ...]  # non-strict only: "pointer/keyword (reason)" each


def prepare_json_schema(spec: str, backend: str, strict: bool = True) -> PreparedSchema:
    schema = exactly_rewritten(parse_schema("{}" if spec == ANY_JSON else spec))
    schema = rewrite_schema(schema, backend)
    problems = schema_problems(schema, backend)
    refused = [p for p in problems if not p.guardable]
    if refused and strict:
        raise GrammarError(f"json_schema uses keywords that neither the {backend} grammar "
                           f"backend nor its semantic guard can enforce: "
                           f"{format_problems(refused)} (not strict: generate anyway and "
                           "report them)", param="json_schema")
    guarded = [p for p in problems if p.guardable]
    plan = GuardPlan(schema, guarded) if guarded else None
    return PreparedSchema(_engine_schema(schema, guarded), plan, tuple(str(p) for p in refused))


def _engine_schema(schema: Any, guarded: list[Problem]) -> Any:
    """What the engine compiles: `schema`, less the formats the guard checks instead (an
    engine may refuse a format it does not know rather than drop it)."""
    formats = {p.node.get("format") for p in guarded if p.keyword == "format"}
    if not formats:
        return schema
    engine = copy.deepcopy(schema)
    for node in iter_schema_nodes(engine):
        if node.get("format") in formats:
            del node["format"]
    return engine
