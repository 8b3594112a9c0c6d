"""The public primitives of the frontend language, named and shaped like SGLang's.

    @function
    def qa(s, question):
        s += system("You are terse.")
        s += user(question)
        s += assistant(gen("answer", max_tokens=64))

    state = qa.run(question="...")
    state["answer"]

`gen` generates into a variable (optionally typed: `dtype=int` decodes under an integer regex
and stores an `int`; `regex` / `json_schema` / `choices` constrain decoding in the runtime);
`select` scores a fixed set of choices with the model; `system` / `user` / `assistant` wrap a
message in the chat template's role markers (or, without an argument, are the empty message).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from arborlm.lang.choices import ChoicesSamplingMethod, token_length_normalized
from arborlm.lang.ir import (
    Expr,
    ExprList,
    Gen,
    GenParams,
    RoleBegin,
    RoleEnd,
    Select,
    as_expr,
    normalize_dtype,
    schema_to_str,
)
from arborlm.lang.program import (
    ProgramFunction,
    get_default_backend,
    resolve_backend,
    set_default_backend,
)

__all__ = [
    "assistant", "assistant_begin", "assistant_end", "flush_cache", "function", "gen",
    "gen_int", "gen_string", "get_default_backend", "get_server_info", "select",
    "set_default_backend", "system", "system_begin", "system_end", "user", "user_begin",
    "user_end",
]


def function(func: Callable[..., Any] | None = None) -> Any:
    """Decorator making a program: `@function` or `@function()`."""
    if func is not None:
        return ProgramFunction(func)
    return ProgramFunction


_REGEX_SPECIALS = set("\\.^$*+?{}[]|()")


def choices_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices`: regex operators escaped, nothing else (so
    grammar engines with a plain regex dialect read it too)."""
    escaped = ["".join("\\" + ch if ch in _REGEX_SPECIALS else ch for ch in c) for c in choices]
    return "(" + "|".join(escaped) + ")"


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None, temperature: float | None = None,
        top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
        frequency_penalty: float | None = None, presence_penalty: float | None = None,
        ignore_eos: bool | None = None, return_logprob: bool | None = None,
        logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None, dtype: Any = None,
        choices: list[str] | None = None, regex: str | None = None,
        json_schema: Any = None) -> Gen:
    """Generate into variable `name`. Unset options take the program's defaults.

    `choices` constrains decoding to exactly one of the strings (as a regex, so it works on
    any runtime with regex support); to score choices instead, use `select`.
    """
    constraints = [k for k, v in (("choices", choices), ("regex", regex),
                                  ("json_schema", json_schema)) if v is not None]
    if len(constraints) > 1:
        raise ValueError(f"gen takes at most one of choices / regex / json_schema, "
                         f"got {', '.join(constraints)}")
    if regex is not None:
        re.compile(regex)
    if choices is not None:
        if not choices:
            raise ValueError("gen choices must not be empty")
        regex = choices_regex(list(choices))
    params = GenParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, stop=stop,
        stop_token_ids=stop_token_ids, stop_regex=stop_regex, temperature=temperature,
        top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
        logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, dtype=normalize_dtype(dtype),
        regex=regex, json_schema=schema_to_str(json_schema))
    return Gen(name, params)


def gen_int(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Gen:
    """`gen` of an integer: decoded under an integer regex, stored as an `int`."""
    return gen(name, max_tokens, dtype=int, **kwargs)


def gen_string(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Gen:
    """`gen` of a double-quoted string: stored without the quotes."""
    return gen(name, max_tokens, dtype=str, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> Select:
    """Append the choice the model scores best (see `arborlm.lang.choices`) and store it."""
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    if any(not isinstance(c, str) or c == "" for c in choices):
        raise ValueError("select choices must be non-empty strings")
    if temperature > 1e-6:
        raise ValueError("select scores its choices deterministically; temperature must be 0")
    return Select(name, list(choices), temperature, choices_method)


def _role(role: str, expr: Any) -> ExprList:
    inner: list[Expr] = [] if expr is None else [as_expr(expr)]
    return ExprList([RoleBegin(role), *inner, RoleEnd(role)])


def system(expr: Any = None) -> ExprList:
    return _role("system", expr)


def user(expr: Any = None) -> ExprList:
    return _role("user", expr)


def assistant(expr: Any = None) -> ExprList:
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


def flush_cache(backend: Any = None) -> bool:
    """Empty the backend's prefix cache (False while it has requests in flight)."""
    return resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any]:
    return resolve_backend(backend).get_server_info()
