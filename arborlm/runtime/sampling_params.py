"""`SamplingParams`: what the user asked for, validated.

Field names and defaults follow the native API (`docs/api.md`). Validation happens once,
here, at the edge; the scheduler and sampler trust these values. This module does not know about
tokens beyond ids: stop strings are checked by the detokenizing side.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from arborlm.constrained import GRAMMAR_BACKENDS
from arborlm.errors import InvalidRequestError
from arborlm.runtime.request_limits import (
    INT32_MAX,
    MAX_ABS_LOGIT_BIAS,
    MAX_STOP_REGEX_CHARS,
    MAX_STOP_REGEXES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOP_TOTAL_CHARS,
    MAX_TEMPERATURE,
    SEED_MAX,
    SEED_MIN,
    check_bool,
    check_float,
    check_int,
    check_text,
    compile_stop_regex,
)

GREEDY_TEMPERATURE = 1e-6
MAX_N = 64


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    logit_bias: dict[int, float] = field(default_factory=dict)
    sampling_seed: int | None = None
    json_schema: str | None = None
    # Strict (the default): a schema whose every keyword cannot be guaranteed is refused (400
    # naming the JSON pointer). False: accepted; the response lists what is not enforced and
    # whether the output validated (`json_schema_unenforced`, `json_schema_valid`).
    json_schema_strict: bool = True
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    choices: list[str] | None = None
    grammar_backend: str | None = None  # None: the engine's --grammar-backend

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a user dict; unknown keys are an error naming them."""
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter(s): {', '.join(unknown)}", param=unknown[0]
            )
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if isinstance(d.get("stop_regex"), str):
            d["stop_regex"] = [d["stop_regex"]]
        for key in ("stop", "stop_token_ids", "stop_regex"):
            if d.get(key) is None and key in d:
                d[key] = []
        if d.get("logit_bias") is None and "logit_bias" in d:
            d["logit_bias"] = {}
        if "logit_bias" in d:
            try:
                d["logit_bias"] = {int(k): float(v) for k, v in d["logit_bias"].items()}
            except (TypeError, ValueError, AttributeError, OverflowError) as e:
                raise InvalidRequestError(
                    "logit_bias must map token ids to numbers", param="logit_bias"
                ) from e
        params = cls(**d)
        params.validate()
        return params

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, spec) of the constraint, or None."""
        for kind in ("json_schema", "regex", "ebnf", "structural_tag"):
            spec = getattr(self, kind)
            if spec is not None:
                return kind, spec
        if self.choices is not None:
            import json

            return "choices", json.dumps(self.choices)
        return None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `InvalidRequestError` naming the first field out of its allowed range.

        Every number is checked for type, finiteness and range, every string for valid Unicode
        and size (`request_limits`), and every `stop_regex` is compiled with RE2."""

        def bad(name: str, allowed: str) -> InvalidRequestError:
            value = getattr(self, name)
            return InvalidRequestError(f"{name} must be {allowed}, got {value!r}", param=name)

        check_int(self.max_new_tokens, "max_new_tokens", 0, INT32_MAX)
        check_int(self.min_new_tokens, "min_new_tokens", 0, INT32_MAX)
        if self.min_new_tokens > self.max_new_tokens:
            raise bad("min_new_tokens", f"<= max_new_tokens ({self.max_new_tokens})")
        check_float(self.temperature, "temperature", 0, MAX_TEMPERATURE)
        check_float(self.top_p, "top_p", 0, 1, lo_open=True)
        check_int(self.top_k, "top_k", -1, INT32_MAX, "-1 (all) or a positive integer")
        if self.top_k == 0:
            raise bad("top_k", "-1 (all) or a positive integer")
        check_float(self.min_p, "min_p", 0, 1)
        check_float(self.frequency_penalty, "frequency_penalty", -2, 2)
        check_float(self.presence_penalty, "presence_penalty", -2, 2)
        check_float(self.repetition_penalty, "repetition_penalty", 0, 2, lo_open=True)
        check_int(self.n, "n", 1, MAX_N)
        for name in ("no_stop_trim", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "json_schema_strict"):
            check_bool(getattr(self, name), name)
        self._validate_stops()
        if self.sampling_seed is not None:
            check_int(self.sampling_seed, "sampling_seed", SEED_MIN, SEED_MAX,
                      "a signed 64-bit integer")
        if not isinstance(self.logit_bias, dict):
            raise bad("logit_bias", "an object mapping token ids to numbers")
        for tok, value in self.logit_bias.items():
            check_int(tok, "logit_bias", 0, INT32_MAX, "keyed by token ids")
            check_float(value, "logit_bias", -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS,
                        allowed=f"in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}] per token")
        self._validate_grammar()
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if t >= vocab_size:
                    raise bad("stop_token_ids", f"token ids below the vocabulary size {vocab_size}")
            for t in self.logit_bias:
                if not 0 <= t < vocab_size:
                    raise bad("logit_bias", f"keyed by token ids in [0, {vocab_size})")

    def _validate_stops(self) -> None:
        """Stop strings, regexes and token ids: types, Unicode, counts and sizes, RE2 syntax."""
        for name, most, longest in (("stop", MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS),
                                    ("stop_regex", MAX_STOP_REGEXES, MAX_STOP_REGEX_CHARS)):
            values = getattr(self, name)
            if not isinstance(values, list):
                raise InvalidRequestError(f"{name} must be a string or a list of strings", name)
            if len(values) > most:
                raise InvalidRequestError(
                    f"{name} must be at most {most} strings, got {len(values)}", name)
            for value in values:
                check_text(value, name, longest)
                if value == "":
                    raise InvalidRequestError(f"{name} must be non-empty strings", name)
        total = sum(map(len, self.stop)) + sum(map(len, self.stop_regex))
        if total > MAX_STOP_TOTAL_CHARS:
            raise InvalidRequestError(
                f"stop and stop_regex must total at most {MAX_STOP_TOTAL_CHARS} characters, "
                f"got {total}", "stop" if self.stop else "stop_regex")
        for pattern in self.stop_regex:
            compile_stop_regex(pattern)
        ids = self.stop_token_ids
        if not isinstance(ids, list):
            raise InvalidRequestError("stop_token_ids must be a list of token ids",
                                      "stop_token_ids")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                "stop_token_ids")
        for t in ids:
            check_int(t, "stop_token_ids", 0, INT32_MAX, "a list of non-negative token ids")

    def _validate_grammar(self) -> None:
        grammars = [k for k in ("json_schema", "regex", "ebnf", "structural_tag", "choices")
                    if getattr(self, k) is not None]
        if len(grammars) > 1:
            raise InvalidRequestError(
                f"at most one of json_schema / regex / ebnf / structural_tag / choices may be "
                f"set, got {', '.join(grammars)}", param=grammars[1])
        for name in ("json_schema", "regex", "ebnf", "structural_tag"):
            if getattr(self, name) is not None:
                check_text(getattr(self, name), name)
        if self.choices is not None:
            if not isinstance(self.choices, list):  # an empty list is the compiler's error
                raise InvalidRequestError("choices must be a list of strings", "choices")
            for choice in self.choices:
                check_text(choice, "choices")
        if self.grammar_backend is not None and self.grammar_backend not in GRAMMAR_BACKENDS:
            raise InvalidRequestError(
                f"grammar_backend must be one of {', '.join(GRAMMAR_BACKENDS)}, got "
                f"{self.grammar_backend!r}", "grammar_backend")

    def clone(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)
