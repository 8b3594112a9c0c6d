"""The engine's named request limits and the value checks every edge shares.

`SamplingParams.validate`, `GenerateRequest.normalize` and the HTTP models call these helpers,
so that one concept (an integer in range, a finite float, valid Unicode, a compilable
`stop_regex`) is checked in one place and its error names the field and the limit. The limits
bound what one request may cost the scheduler (memory and time per step), far above what real
clients send; `docs/serving.md` lists them. This module does not know about HTTP or tokens.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from arborlm.errors import InvalidRequestError

# Integer fields are at most 64 bits wide (they cross the process boundary as msgspec ints).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Counts (tokens, top_k, token ids, priorities) fit a signed 32-bit integer.
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# `sampling_seed` / `seed`: any signed 64-bit integer (as vLLM and torch take it). With `n > 1`,
# sequence j gets seed + j, wrapped into the same range.
SEED_MIN, SEED_MAX = INT64_MIN, INT64_MAX
# Stop conditions: OpenAI allows 4 stop sequences; real clients send a few of < 100 characters.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_REGEXES = 8
MAX_STOP_REGEX_CHARS = 1024
# All stop strings and stop_regex patterns of one request together.
MAX_STOP_TOTAL_CHARS = 8192
MAX_STOP_TOKEN_IDS = 256
# A stop_regex match may span at most this many characters (the scanned window, see
# `arborlm.runtime.stop_matcher.StopRegexScanner`).
STOP_REGEX_WINDOW_CHARS = 1024
# RE2's memory budget per compiled stop_regex (program + DFA cache); a pattern that needs more
# to compile is refused, one that needs more while matching falls back to RE2's NFA (linear).
STOP_REGEX_MAX_MEM = 1 << 20
# Sampling values: a temperature above this is a uniform draw anyway; a bias this large already
# bans or forces a token.
MAX_TEMPERATURE = 100.0
MAX_ABS_LOGIT_BIAS = 1e9
# Token ids whose logprobs are returned at every position (as many as `top_logprobs_num`).
MAX_TOKEN_IDS_LOGPROB = 64
# Request ids and cache namespaces (`rid`, `extra_key`), which travel with every step's report.
MAX_ID_CHARS = 512


def check_int(value: Any, name: str, lo: int, hi: int, allowed: str | None = None) -> int:
    """`value` as an integer in [lo, hi] (bool is not an integer here)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be an integer, got {_short(value)}", name)
    if not lo <= value <= hi:
        raise InvalidRequestError(
            f"{name} must be {allowed or f'in [{lo}, {hi}]'}, got {_short(value)}", name)
    return value


def check_float(value: Any, name: str, lo: float, hi: float, *, lo_open: bool = False,
                allowed: str | None = None) -> float:
    """`value` as a finite number in [lo, hi] (or (lo, hi] with `lo_open`); NaN and the
    infinities are out of every range."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a number, got {_short(value)}", name)
    ok = math.isfinite(value) and (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        bounds = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise InvalidRequestError(
            f"{name} must be {allowed or 'in ' + bounds}, got {_short(value)}", name)
    return float(value)


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a boolean, got {_short(value)}", name)
    return value


def unicode_error(text: str) -> str | None:
    """Why `text` is not valid Unicode (a lone surrogate, which UTF-8 cannot encode), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"must be valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at "
                f"character {e.start}")
    return None


def check_text(value: Any, name: str, max_chars: int | None = None) -> str:
    """`value` as a string of valid Unicode, at most `max_chars` characters long."""
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be a string, got {_short(value)}", name)
    if max_chars is not None and len(value) > max_chars:
        raise InvalidRequestError(
            f"{name} must be at most {max_chars} characters, got {len(value)}", name)
    why = unicode_error(value)
    if why is not None:
        raise InvalidRequestError(f"{name} {why}", name)
    return value


def tree_error(value: Any, path: str = "") -> tuple[str, str] | None:
    """(path, reason) of the first string (key or value) that is not valid Unicode or number
    that is not finite in a JSON-like tree, or None. Iterative: deep trees cannot overflow."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            why = unicode_error(item)
            if why is not None:
                return where, why
        elif isinstance(item, float) and not math.isfinite(item):
            return where, f"must be a finite number, got {item!r}"
        elif isinstance(item, dict):
            for key, sub in item.items():
                if isinstance(key, str) and unicode_error(key) is not None:
                    return where, f"has a key that {unicode_error(key)}"
                stack.append((f"{where}.{key}" if where else str(key), sub))
        elif isinstance(item, list | tuple):
            stack.extend((f"{where}[{i}]", sub) for i, sub in enumerate(item))
    return None


def check_tree(value: Any, name: str) -> Any:
    """Raise `InvalidRequestError` naming the first bad string or number inside `value`."""
    found = tree_error(value, name)
    if found is not None:
        raise InvalidRequestError(f"{found[0]} {found[1]}", name)
    return value


@functools.lru_cache(maxsize=256)
def compile_stop_regex(pattern: str) -> Any:
    """The RE2 program of a `stop_regex` pattern (cached; RE2 matches in linear time).

    Raises `InvalidRequestError` naming `stop_regex` for a pattern RE2 cannot compile: bad
    syntax, constructs that need backtracking (backreferences, lookaround), or a program larger
    than `STOP_REGEX_MAX_MEM`."""
    import re2

    options = re2.Options()
    options.log_errors = False
    options.max_mem = STOP_REGEX_MAX_MEM
    try:
        return re2.compile(pattern, options)
    except re2.error as e:
        reason = e.args[0].decode(errors="replace") if e.args and isinstance(
            e.args[0], bytes) else str(e)
        raise InvalidRequestError(
            f"stop_regex {_short(pattern)} is not a pattern RE2 can run in linear time: "
            f"{reason} (RE2 syntax; no backreferences or lookaround)", "stop_regex") from e


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
