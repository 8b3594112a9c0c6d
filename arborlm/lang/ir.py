"""The program's intermediate representation: the expressions a program appends to its state.

`s += "text"`, `s += gen(...)`, `s += user(...)` each submit one expression to the state's
worker, which executes them in order (see `interpreter.py`). Expressions concatenate with `+`
(`"Q: " + gen("a")` is one `ExprList`). `GenParams` holds a `gen`'s sampling options with `None`
for "not set", so program-level defaults (`run(temperature=...)`) fill only what a call left
open. This module builds values; it does no I/O and knows no backend.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

# Regexes that constrain a typed `gen` (the same shapes SGLang uses).
REGEX_INT = r"[-+]?[0-9]+"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""
DTYPE_REGEX = {"int": REGEX_INT, "float": REGEX_FLOAT, "bool": REGEX_BOOL, "str": REGEX_STR}

# Program-level sampling defaults of `run` / `run_batch` (SGLang's values).
PROGRAM_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False,
}

_SAMPLING_KEYS = ("max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "stop_regex",
                  "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                  "presence_penalty", "ignore_eos", "regex", "json_schema")
_LOGPROB_KEYS = ("return_logprob", "logprob_start_len", "top_logprobs_num",
                 "return_text_in_logprobs")


def normalize_dtype(dtype: Any) -> str | None:
    """`int` / "int" -> "int" (likewise float, str, bool); None stays None."""
    if dtype is None:
        return None
    name = dtype.__name__ if isinstance(dtype, type) else str(dtype)
    if name not in DTYPE_REGEX:
        raise ValueError(f"dtype must be int, float, str or bool, got {dtype!r}")
    return name


def schema_to_str(schema: Any) -> str | None:
    """A JSON schema given as a string, a dict, or a pydantic model class -> a JSON string."""
    if schema is None or isinstance(schema, str):
        return schema
    if isinstance(schema, dict):
        return json.dumps(schema)
    if hasattr(schema, "model_json_schema"):
        return json.dumps(schema.model_json_schema())
    raise TypeError(f"json_schema must be a string, a dict or a pydantic model, got {schema!r}")


@dataclass
class GenParams:
    """Sampling and logprob options of one `gen`; `None` means "use the program's default"."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: str | None = None
    regex: str | None = None
    json_schema: str | None = None

    @classmethod
    def program_defaults(cls, **overrides: Any) -> GenParams:
        """The defaults of a program run: SGLang's values, updated by non-None overrides."""
        values = {**PROGRAM_DEFAULTS, **{k: v for k, v in overrides.items() if v is not None}}
        return cls(**values)

    def merged_over(self, defaults: GenParams) -> GenParams:
        """These params with every unset field taken from `defaults`."""
        values = {}
        for f in dataclasses.fields(self):
            mine = getattr(self, f.name)
            values[f.name] = mine if mine is not None else getattr(defaults, f.name)
        return GenParams(**values)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def constraint_regex(self) -> str | None:
        """The regex to decode under: the explicit one, else the dtype's (none for a schema)."""
        if self.regex is not None or self.json_schema is not None:
            return self.regex
        return DTYPE_REGEX.get(self.dtype) if self.dtype else None

    def sampling_params(self) -> dict[str, Any]:
        """The native API's `sampling_params` object (unset fields left out)."""
        out = {k: getattr(self, k) for k in _SAMPLING_KEYS if getattr(self, k) is not None}
        regex = self.constraint_regex()
        if regex is not None:
            out["regex"] = regex
        return out

    def logprob_options(self) -> dict[str, Any]:
        """The native API's top-level logprob fields (unset fields left out)."""
        return {k: getattr(self, k) for k in _LOGPROB_KEYS if getattr(self, k) is not None}


class Expr:
    """Base of everything a program can append to its state."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList([self, as_expr(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([as_expr(other), self])


def as_expr(value: Any) -> Expr:
    """Expressions stay; anything else becomes constant text (its `str()`, taken when the
    expression executes)."""
    return value if isinstance(value, Expr) else ConstantText(value)


@dataclass(eq=False)
class ConstantText(Expr):
    value: Any  # appended as str(value)


@dataclass(eq=False)
class ExprList(Expr):
    items: list[Expr] = field(default_factory=list)

    def __post_init__(self) -> None:
        flat: list[Expr] = []
        for item in self.items:
            flat.extend(item.items if isinstance(item, ExprList) else [item])
        self.items = flat


@dataclass(eq=False)
class Gen(Expr):
    """Generate text into variable `name` (None: append only)."""

    name: str | None
    params: GenParams


@dataclass(eq=False)
class Select(Expr):
    """Pick one of `choices` by scoring them with the model (see `choices.py`)."""

    name: str | None
    choices: list[str]
    temperature: float
    choices_method: Any


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(eq=False)
class VarScopeBegin(Expr):
    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    name: str


@dataclass(eq=False)
class WarmPrefix(Expr):
    """Internal: prefill the state's text once so forked branches share it in the cache."""


@dataclass(eq=False)
class ConcatAndAppend(Expr):
    """Internal: append the text each of `states` added since the fork (join mode
    "concate_and_append")."""

    states: list[Any]


def variable_names(expr: Expr) -> list[str]:
    """Names of the variables an expression will set (gen, select, var scopes)."""
    if isinstance(expr, (Gen, Select)):
        return [expr.name] if expr.name is not None else []
    if isinstance(expr, VarScopeBegin):
        return [expr.name]
    if isinstance(expr, ExprList):
        return [n for item in expr.items for n in variable_names(item)]
    return []
