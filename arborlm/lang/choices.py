"""How `select` picks a choice from the logprobs of each choice's tokens.

A backend scores every choice in one batched prefill and hands the method, per choice, the
logprob entries `[logprob, token_id, text]` of the choice's own tokens given the prompt
(`input_token_logprobs`) and, when the method asks for them, given no prompt
(`unconditional_token_logprobs`). An entry's logprob is `None` where nothing predicts the
token (the first position of a sequence); every method here skips or zeroes such entries.

- `token_length_normalized`: the highest mean logprob per token.
- `greedy_token_selection`: compare token by token, keep the choices with the best logprob at
  each position until one is left (shorter choices are padded with their own mean). Logprobs
  within `GREEDY_TIE_TOLERANCE` of the best count as tied: choices sharing a first token get
  that token's logprob from different rows of a batch, which may differ in the last bits.
- `unconditional_likelihood_normalized`: the highest mean of (logprob given the prompt -
  logprob without it), which discounts choices that are likely whatever the prompt says.

The call signature matches SGLang's, so custom methods written for it work here.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any

LogprobEntry = list  # [logprob | None, token_id, text | None]
GREEDY_TIE_TOLERANCE = 1e-4


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] | None = None


def entry_logprobs(entries: list[LogprobEntry]) -> list[float]:
    """The logprobs of `entries`, with the unpredicted (None) ones left out."""
    return [float(e[0]) for e in entries if e[0] is not None]


def mean_logprob(entries: list[LogprobEntry]) -> float:
    """Mean logprob per predicted token; -inf when no token has a logprob."""
    values = entry_logprobs(entries)
    return sum(values) / len(values) if values else -math.inf


def _argmax(values: list[float]) -> int:
    """First index of the largest value (ties go to the earlier choice)."""
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


class ChoicesSamplingMethod(abc.ABC):
    """Base class: `__call__` returns the chosen string and what it was decided from."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    @abc.abstractmethod
    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: list[list[LogprobEntry]],
                 output_token_logprobs: list[list[LogprobEntry]],
                 unconditional_token_logprobs: list[list[LogprobEntry]] | None = None,
                 ) -> ChoicesDecision:
        """Pick one of `choices`; the lists run parallel to `choices`."""


class TokenLengthNormalized(ChoicesSamplingMethod):
    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        best = _argmax(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
        })


class GreedyTokenSelection(ChoicesSamplingMethod):
    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        rows = self.logprob_matrix(input_token_logprobs)
        remaining = list(range(len(choices)))
        width = max((len(r) for r in rows), default=0)
        for j in range(width):
            top = max(rows[i][j] for i in remaining)
            remaining = [i for i in remaining if rows[i][j] >= top - GREEDY_TIE_TOLERANCE]
            if len(remaining) == 1:
                break
        return ChoicesDecision(choices[remaining[0]], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            "greedy_logprob_matrix": rows,
        })

    @staticmethod
    def logprob_matrix(input_token_logprobs: list[list[LogprobEntry]]) -> list[list[float]]:
        """One row per choice, padded to the longest with the row's own mean logprob."""
        rows = [entry_logprobs(entries) for entries in input_token_logprobs]
        width = max((len(r) for r in rows), default=0)
        padded = []
        for r in rows:
            fill = sum(r) / len(r) if r else -math.inf
            padded.append(r + [fill] * (width - len(r)))
        return padded


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs")
        scores = [self.normalized_difference(cond, uncond) for cond, uncond
                  in zip(input_token_logprobs, unconditional_token_logprobs)]
        best = _argmax(scores)
        return ChoicesDecision(choices[best], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            "unconditional_token_logprobs": unconditional_token_logprobs,
            "normalized_unconditional_prompt_logprobs": scores,
        })

    @staticmethod
    def normalized_difference(cond: list[LogprobEntry], uncond: list[LogprobEntry]) -> float:
        """Mean over the choice's tokens of (conditional - unconditional) logprob.

        Position by position; an unpredicted (None) logprob counts as 0 on either side, as
        the first token of an unconditional sequence has none.
        """
        if not cond:
            return -math.inf
        diffs = []
        for i, c in enumerate(cond):
            u = uncond[i][0] if i < len(uncond) else None
            diffs.append((c[0] or 0.0) - (u or 0.0))
        return sum(diffs) / len(diffs)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
