"""`SamplingParams`: what the user asked for, validated.

Field names and defaults follow the native API (`shared/docs/API.md`). Validation happens once,
here, at the edge; the scheduler and sampler trust these values. This module does not know about
tokens beyond ids: stop strings are checked by the detokenizing side.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from arborlm.errors import InvalidRequestError

GREEDY_TEMPERATURE = 1e-6
MAX_STOP_STRINGS = 64
MAX_N = 64
# The grammar engines a request may pick (`arborlm.constrained.GRAMMAR_BACKENDS`, repeated here
# so that validating a request does not import the grammar package and torch).
GRAMMAR_BACKENDS = ("xgrammar", "outlines")


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
            except (TypeError, ValueError, AttributeError) as e:
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
        """Raise `InvalidRequestError` naming the first field out of its allowed range."""

        def bad(name: str, allowed: str) -> InvalidRequestError:
            value = getattr(self, name)
            return InvalidRequestError(f"{name} must be {allowed}, got {value!r}", param=name)

        def check_type(name: str, types: tuple[type, ...]) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) and bool not in types:
                raise bad(name, f"of type {'/'.join(t.__name__ for t in types)}")
            if not isinstance(value, types):
                raise bad(name, f"of type {'/'.join(t.__name__ for t in types)}")

        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            check_type(name, (int,))
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            check_type(name, (int, float))
        if self.max_new_tokens < 0:
            raise bad("max_new_tokens", ">= 0")
        if not 0 <= self.min_new_tokens:
            raise bad("min_new_tokens", ">= 0")
        if self.min_new_tokens > self.max_new_tokens:
            raise bad("min_new_tokens", f"<= max_new_tokens ({self.max_new_tokens})")
        if self.temperature < 0:
            raise bad("temperature", ">= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise bad("top_k", "-1 (all) or a positive integer")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2:
            raise bad("repetition_penalty", "in (0, 2]")
        if not 1 <= self.n <= MAX_N:
            raise bad("n", f"in [1, {MAX_N}]")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise bad("stop", "a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise bad("stop", "non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} strings")
        ids = self.stop_token_ids
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
        ):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        if self.sampling_seed is not None and (
            not isinstance(self.sampling_seed, int) or isinstance(self.sampling_seed, bool)
        ):
            raise bad("sampling_seed", "an integer")
        grammars = [k for k in ("json_schema", "regex", "ebnf", "structural_tag", "choices")
                    if getattr(self, k) is not None]
        if len(grammars) > 1:
            raise InvalidRequestError(
                f"at most one of json_schema / regex / ebnf / structural_tag / choices may be "
                f"set, got {', '.join(grammars)}", param=grammars[1])
        if self.grammar_backend is not None and self.grammar_backend not in GRAMMAR_BACKENDS:
            raise bad("grammar_backend", f"one of {', '.join(GRAMMAR_BACKENDS)}")
        if vocab_size is not None:
            for t in ids:
                if t >= vocab_size:
                    raise bad("stop_token_ids", f"token ids below the vocabulary size {vocab_size}")
            for t in self.logit_bias:
                if not 0 <= t < vocab_size:
                    raise bad("logit_bias", f"keyed by token ids in [0, {vocab_size})")

    def clone(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)
