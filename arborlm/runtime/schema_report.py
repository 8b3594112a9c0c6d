"""Non-strict JSON schemas: what the engine does not enforce, and whether each output validated.

A request whose `json_schema` is sent with `json_schema_strict: false` (OpenAI: `response_format.
json_schema.strict: false`) is accepted even where the engine cannot guarantee every keyword.
`Engine` and the HTTP routes then report, per sequence, in its `meta_info` (the OpenAI routes on
each choice):

- `json_schema_unenforced`: the list of what is not enforced, each a JSON pointer into the schema
  with the keyword and why (`"#/properties/tags/uniqueItems (not enforced)"`); empty when all is;
- `json_schema_valid`: once the sequence finishes, whether its whole output parses as JSON and
  validates against the ORIGINAL schema (`jsonschema`, the schema's own draft, formats checked);
  null when the schema itself cannot be used to validate (a remote `$ref`, ...).

`attach(events, req, default_backend)` wraps a stream of engine events so that each such
sequence's events carry the fields, `annotate_results` does it for finished results
(`choice_fields` picks them for an OpenAI choice). Strict
requests get neither: their outputs are valid by construction, and what cannot be guaranteed
was refused with a 400. This module does not compile or generate anything.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import jsonschema

from arborlm.constrained.schema_prepare import prepare_json_schema
from arborlm.errors import GrammarError, InvalidRequestError
from arborlm.runtime.generate_request import GenerateRequest

UNENFORCED_KEY = "json_schema_unenforced"
VALID_KEY = "json_schema_valid"


@dataclass(frozen=True)
class SchemaReport:
    schema: Any  # the original schema, parsed
    unenforced: tuple[str, ...]

    def annotate(self, meta: dict[str, Any], text: str) -> None:
        """Add the report's fields to one event's `meta_info`; `text` is the event's whole
        output so far (checked only once the sequence has finished)."""
        meta[UNENFORCED_KEY] = list(self.unenforced)
        if meta.get("finish_reason") is not None:
            meta[VALID_KEY] = output_valid(text, self.schema)


def attach(events: AsyncIterator[tuple[int, dict[str, Any]]], req: GenerateRequest,
           default_backend: str) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """`events` annotated for the non-strict schemas of `req` (unchanged when it has none).
    An invalid request is left to the engine runner to refuse."""
    params = req.sampling_params
    rows = params if isinstance(params, list) else [params]
    if not any(isinstance(p, dict) and p.get("json_schema_strict") is False for p in rows):
        return events
    try:
        by_index = reports(req, default_backend)
    except InvalidRequestError:
        return events
    return annotated(events, by_index) if by_index else events


def choice_fields(meta: dict[str, Any]) -> dict[str, Any]:
    """The report's fields in a finished sequence's `meta_info`, for its OpenAI choice (or
    its last stream chunk); nothing before it finishes."""
    if meta.get("finish_reason") is None:
        return {}
    return {k: meta[k] for k in (UNENFORCED_KEY, VALID_KEY) if k in meta}


def reports(req: GenerateRequest, default_backend: str) -> dict[int, SchemaReport]:
    """The report of each sequence (by index after batch and `n` expansion) whose JSON schema
    is not strict. A schema that does not parse gets none: the engine refuses it with a 400."""
    out: dict[int, SchemaReport] = {}
    made: dict[tuple[str, str], SchemaReport | None] = {}
    for index, single in enumerate(req.normalize()):
        sp = single.sampling_params
        if sp.json_schema is None or sp.json_schema_strict:
            continue
        key = (sp.json_schema, sp.grammar_backend or default_backend)
        if key not in made:
            made[key] = _report(*key)
        if made[key] is not None:
            out[index] = made[key]
    return out


def annotate_results(results: list[dict[str, Any]], req: GenerateRequest,
                     default_backend: str) -> list[dict[str, Any]]:
    """Each finished result of `req` (by sequence index) annotated for its non-strict schema, in
    place; returns `results`."""
    params = req.sampling_params
    rows = params if isinstance(params, list) else [params]
    if not any(isinstance(p, dict) and p.get("json_schema_strict") is False for p in rows):
        return results
    for index, report in reports(req, default_backend).items():
        if index < len(results):
            report.annotate(results[index]["meta_info"], results[index]["text"])
    return results


async def annotated(events: AsyncIterator[tuple[int, dict[str, Any]]],
                    by_index: dict[int, SchemaReport]
                    ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """`events` with each reported sequence's `meta_info` annotated (closing `events` on close)."""
    async with aclosing(events):
        async for index, event in events:
            report = by_index.get(index)
            if report is not None:
                report.annotate(event["meta_info"], event["text"])
            yield index, event


def output_valid(text: str, schema: Any) -> bool | None:
    """Whether `text` is one JSON value that `schema` accepts (None: the schema cannot be used)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        cls = jsonschema.validators.validator_for(schema)
        return bool(cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(value))
    except Exception:  # noqa: BLE001 - an unusable schema (bad $ref, ...) proves nothing
        return None


def json_schema_unenforced(spec: str, backend: str) -> tuple[str, ...]:
    """What the engine's non-strict compile of `spec` leaves unenforced on `backend` (the same
    preparation the compile runs): each a JSON pointer with the keyword and the reason. Raises
    `GrammarError` for a spec that does not parse."""
    return prepare_json_schema(spec, backend, strict=False).unenforced


def _report(spec: str, backend: str) -> SchemaReport | None:
    try:
        return SchemaReport(json.loads(spec), json_schema_unenforced(spec, backend))
    except (ValueError, GrammarError):
        return None
