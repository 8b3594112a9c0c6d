"""Hypothesis strategies that build request bodies from the server's pydantic models.

`request_bodies(Model)` draws dicts with the model's required fields and up to four of its
optional ones (two in nested objects), whose values are mostly of the declared type — small
and extreme numbers (integers past 64 bits, NaN, infinities), strings with lone surrogates,
huge strings and pathological regexes, valid literals, nested models drawn the same way — and
sometimes arbitrary JSON of the wrong type (`encode_body` writes what JSON libraries refuse).
Most bodies pass validation, so the fuzzing reaches the engine's range checks and the generation
path as well as the 400s.
"""

from __future__ import annotations

import json
import math
import types
import typing
from typing import Any

from hypothesis import strategies as st
from pydantic import BaseModel

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5),
                         st.floats(allow_nan=False, allow_infinity=False, width=32),
                         st.text(max_size=6))
JSON = st.recursive(JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=6)
INTS = st.integers(0, 3).flatmap(lambda k: st.sampled_from(
    [-(2**31), 2**31, 10**12, 2**63, -(2**63) - 1, 2**70]) if k == 0 else st.integers(-3, 24))
# NaN and the infinities reach the server as the `NaN` / `Infinity` literals Python's JSON
# writes (send bodies with `encode_body`).
FLOATS = st.integers(0, 3).flatmap(lambda k: st.sampled_from(
    [0.0, 1.0, 1e9, -1e9, 1e308, math.nan, math.inf, -math.inf]) if k == 0
    else st.floats(-3, 3, allow_nan=False))
# Huge strings, lone surrogates (JSON `\ud800` escapes) and pathological regexes.
PATHOLOGICAL = st.sampled_from([
    "x" * 100_000, "ab\ud800cd", "\udfff", "([", "(a+)+b", r"(\w+)\1", "(?=a)", "a{1000}{1000}",
])
_PLAIN = st.text(st.characters(codec="utf-8"), max_size=24)
# one_of picks its branches about evenly, so weigh by hand: 1 in 8 each is hostile
TEXT = st.integers(0, 7).flatmap(lambda k: PATHOLOGICAL if k == 0 else _PLAIN.map(
    lambda t: t + "\ud800") if k == 1 else _PLAIN)


def value_strategy(annotation: Any, depth: int = 0) -> st.SearchStrategy:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return value_strategy(args[0], depth)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[value_strategy(a, depth) for a in args])
    if annotation is type(None):
        return st.none()
    if origin is typing.Literal:
        return st.sampled_from(args)  # the field's JSON junk covers invalid values
    if origin is list:
        items = st.lists(value_strategy(args[0], depth + 1), min_size=1, max_size=3)
        return st.integers(0, 5).flatmap(lambda k: st.just([]) if k == 0 else items)
    if origin is dict:
        return st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 600).map(str)),
                               value_strategy(args[1], depth + 1), max_size=3)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return request_bodies(annotation, depth + 1) if depth < 3 else st.just({})
    simple = {bool: st.booleans(), int: INTS, float: FLOATS, str: TEXT}
    return simple.get(annotation, JSON)


def _field(info: Any, depth: int) -> st.SearchStrategy:
    typed = value_strategy(info.annotation, depth)
    # one_of picks its branches about evenly however often one is repeated, so weigh by hand
    return st.integers(0, 7).flatmap(lambda k: JSON if k == 0 else typed)


def request_bodies(model: type[BaseModel], depth: int = 0) -> st.SearchStrategy[dict]:
    fields = {info.alias or name: info for name, info in model.model_fields.items()}
    required = sorted(k for k, info in fields.items() if info.is_required())
    optional = sorted(k for k, info in fields.items() if not info.is_required())

    @st.composite
    def body(draw: st.DrawFn) -> dict:
        out = {k: draw(_field(fields[k], depth)) for k in required}
        most = 4 if depth == 0 else 2
        chosen = draw(st.sets(st.sampled_from(optional), max_size=most)) if optional else set()
        for key in sorted(chosen):
            out[key] = draw(_field(fields[key], depth))
        return out

    return body()


def encode_body(body: Any) -> bytes:
    """JSON as Python writes it: NaN / Infinity literals, lone surrogates as `\\ud800`."""
    return json.dumps(body).encode()
