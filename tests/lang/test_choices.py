"""The three `select` scoring methods on hand-made logprobs, including null entries."""

from __future__ import annotations

import math

import pytest

from arborlm.lang.choices import (
    GreedyTokenSelection,
    UnconditionalLikelihoodNormalized,
    entry_logprobs,
    greedy_token_selection,
    mean_logprob,
    token_length_normalized,
    unconditional_likelihood_normalized,
)


def entries(*logprobs: float | None) -> list[list]:
    return [[lp, 100 + i, f"t{i}"] for i, lp in enumerate(logprobs)]


def decide(method, choices, cond, uncond=None):
    return method(choices=choices, normalized_prompt_logprobs=[mean_logprob(c) for c in cond],
                  input_token_logprobs=cond, output_token_logprobs=[[] for _ in choices],
                  unconditional_token_logprobs=uncond)


def test_mean_skips_null_logprobs():
    assert mean_logprob(entries(None, -1.0, -3.0)) == pytest.approx(-2.0)
    assert mean_logprob(entries(None)) == -math.inf
    assert entry_logprobs(entries(None, -0.5)) == [-0.5]


def test_token_length_normalized_prefers_best_mean_not_best_sum():
    # "long" has the lower sum (-3.0) but the better mean (-1.0 vs -1.5).
    cond = [entries(-1.5), entries(-1.0, -1.0, -1.0)]
    d = decide(token_length_normalized, ["short", "long"], cond)
    assert d.decision == "long"
    assert d.meta_info["normalized_prompt_logprobs"] == pytest.approx([-1.5, -1.0])


def test_token_length_normalized_ignores_leading_null():
    cond = [entries(None, -2.0), entries(None, -1.0)]
    assert decide(token_length_normalized, ["a", "b"], cond).decision == "b"


def test_greedy_token_selection_decides_on_first_differing_token():
    # Same first token logprob; the second token decides, although "b" has the better mean.
    cond = [entries(-0.5, -1.0, -9.0), entries(-0.5, -2.0, -0.1)]
    d = decide(greedy_token_selection, ["a", "b"], cond)
    assert d.decision == "a"
    assert mean_logprob(cond[1]) > mean_logprob(cond[0])


def test_greedy_token_selection_pads_short_choices_with_their_mean():
    rows = GreedyTokenSelection.logprob_matrix([entries(-1.0, -3.0), entries(-2.0)])
    assert rows == [[-1.0, -3.0], [-2.0, -2.0]]
    cond = [entries(-1.0, -3.0), entries(-1.0)]  # tie, then -3.0 vs padded -1.0
    assert decide(greedy_token_selection, ["ab", "a"], cond).decision == "a"


def test_greedy_token_selection_with_null_entries_and_full_tie():
    cond = [entries(None, -1.0), entries(None, -1.0)]
    assert decide(greedy_token_selection, ["x", "y"], cond).decision == "x"


def test_unconditional_likelihood_normalized_discounts_likely_choices():
    cond = [entries(-1.0, -1.0), entries(-2.0, -2.0)]
    uncond = [entries(None, -0.2), entries(None, -3.5)]
    # diffs: a: (-1 - 0) + (-1 + 0.2) -> -0.9 mean; b: (-2 - 0) + (-2 + 3.5) -> -0.25 mean.
    d = decide(unconditional_likelihood_normalized, ["a", "b"], cond, uncond)
    assert d.decision == "b"
    assert d.meta_info["normalized_unconditional_prompt_logprobs"] == \
        pytest.approx([-0.9, -0.25])
    assert decide(token_length_normalized, ["a", "b"], cond).decision == "a"


def test_unconditional_difference_treats_null_as_zero_on_both_sides():
    value = UnconditionalLikelihoodNormalized.normalized_difference(
        entries(None, -1.0), entries(-0.5, None))
    assert value == pytest.approx(((0.0 + 0.5) + (-1.0 - 0.0)) / 2)


def test_unconditional_requires_its_logprobs():
    assert unconditional_likelihood_normalized.requires_unconditional_logprobs
    assert not token_length_normalized.requires_unconditional_logprobs
    with pytest.raises(ValueError, match="unconditional"):
        decide(unconditional_likelihood_normalized, ["a"], [entries(-1.0)])
