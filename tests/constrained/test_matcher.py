"""Matcher state: stop tokens, rollback, copy, reset, special tokens, jump-forward."""

from __future__ import annotations

import json

import pytest
import torch

from arborlm.constrained import create_grammar_backend
from arborlm.constrained.base import GrammarBackend, GrammarMatcher
from arborlm.constrained.bitmask import allocate_token_bitmask, apply_token_bitmask_
from tests.constrained.conftest import EOS, VOCAB
from tests.constrained.driver import closing_bias, force_text, generate

PERSON = json.dumps({"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"],
    "additionalProperties": False})


def _allowed(matcher: GrammarMatcher, vocab_size: int) -> set[int]:
    mask = allocate_token_bitmask(1, vocab_size)
    matcher.fill_bitmask(mask, 0)
    return {t for t in range(vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1}


def test_stop_token_only_where_complete_and_terminates(backend: GrammarBackend) -> None:
    matcher = backend.compile("regex", "ab|abcd").matcher()
    assert not matcher.accept_token(EOS)  # nothing matched yet
    assert force_text(matcher, backend.vocab, "ab") is not None
    assert EOS in _allowed(matcher, VOCAB) and matcher.is_completed()
    assert matcher.accept_token(EOS) and matcher.is_terminated()
    assert _allowed(matcher, VOCAB) == set()
    assert not matcher.accept_token(EOS)


def test_rejected_token_leaves_state_unchanged(backend: GrammarBackend, tokenizer) -> None:
    matcher = backend.compile("json_schema", PERSON).matcher()
    before = _allowed(matcher, VOCAB)
    bad = tokenizer.encode("x", add_special_tokens=False)[0]
    assert not matcher.accept_token(bad)
    assert _allowed(matcher, VOCAB) == before


def test_rollback_restores_the_mask(backend: GrammarBackend) -> None:
    compiled = backend.compile("json_schema", PERSON)
    result = generate(compiled.matcher(), backend.vocab, seed=3,
                      bias=closing_bias(backend.vocab))
    assert result.terminated and len(result.token_ids) > 8
    matcher = compiled.matcher()
    masks = []  # masks[i]: allowed set before token i
    for token in result.token_ids:
        masks.append(_allowed(matcher, VOCAB))
        assert matcher.accept_token(token)
    assert matcher.accept_token(EOS) and matcher.is_terminated()
    matcher.rollback(1)  # the stop token
    assert not matcher.is_terminated() and matcher.is_completed()
    matcher.rollback(4)
    assert _allowed(matcher, VOCAB) == masks[-4]
    matcher.rollback(0)
    matcher.rollback(2)
    assert _allowed(matcher, VOCAB) == masks[-6]
    for token in result.token_ids[-6:]:  # replaying reaches the same end
        assert matcher.accept_token(token)
    assert matcher.accept_token(EOS) and matcher.is_terminated()


def test_copy_is_independent_and_reset_restarts(backend: GrammarBackend, tokenizer) -> None:
    compiled = backend.compile("choices", json.dumps(["red", "green"]))
    matcher = compiled.matcher()
    start = _allowed(matcher, VOCAB)
    assert force_text(matcher, backend.vocab, "gr") is not None
    fork = matcher.copy()
    assert force_text(fork, backend.vocab, "een") is not None and fork.accept_token(EOS)
    assert fork.is_terminated() and not matcher.is_terminated()
    assert force_text(matcher, backend.vocab, "een") is not None
    fork.rollback(1)
    assert not fork.is_terminated()
    matcher.reset()
    assert _allowed(matcher, VOCAB) == start and not matcher.is_completed()


def test_every_stop_token_ends_the_grammar(tokenizer) -> None:
    stops = [EOS, 5]  # </s> and <|im_end|>
    for name in ("xgrammar", "outlines"):
        backend = create_grammar_backend(name, tokenizer, VOCAB, stops)
        for stop in stops:
            matcher = backend.compile("regex", "ok").matcher()
            assert force_text(matcher, backend.vocab, "ok") is not None
            assert set(stops) <= _allowed(matcher, VOCAB)
            assert matcher.accept_token(stop) and matcher.is_terminated(), (name, stop)


def test_special_tokens_never_appear_inside_strings(backend: GrammarBackend) -> None:
    """Regression: xgrammar's own tokenizer info let <unk>/<s> through as literal text."""
    matcher = backend.compile("json_schema", json.dumps({"type": "string"})).matcher()
    assert force_text(matcher, backend.vocab, '"abc') is not None
    allowed = _allowed(matcher, VOCAB)
    assert len(allowed) > 100
    assert not allowed & set(range(6))  # <unk> <s> </s> <pad> <|im_start|> <|im_end|>


def test_padded_model_vocabulary_is_masked(tokenizer) -> None:
    """Logits wider than the tokenizer (a padded lm_head) never sample a padding id."""
    padded = VOCAB + 64
    for name in ("xgrammar", "outlines"):
        backend = create_grammar_backend(name, tokenizer, padded, [EOS])
        matcher = backend.compile("json_schema", json.dumps({"type": "string"})).matcher()
        mask = allocate_token_bitmask(1, padded)
        matcher.fill_bitmask(mask, 0)
        logits = torch.full((1, padded + 32), 50.0)  # even wider than the mask
        logits[0, :VOCAB] = 0.0
        apply_token_bitmask_(logits, mask)
        assert torch.isinf(logits[0, VOCAB:]).all(), name
        assert torch.isfinite(logits[0, :VOCAB]).any()


def test_jump_forward_string_on_forced_key(xgrammar: GrammarBackend) -> None:
    matcher = xgrammar.compile("json_schema", PERSON).matcher()
    assert matcher.find_jump_forward_string() == '{"name": "'
    assert force_text(matcher, xgrammar.vocab, '{"name": "Al"') is not None
    before = _allowed(matcher, VOCAB)
    assert matcher.find_jump_forward_string() == ', "age": '
    assert _allowed(matcher, VOCAB) == before  # state untouched
    assert force_text(matcher, xgrammar.vocab, ', "age": 7}') is not None
    assert matcher.find_jump_forward_string() == ""


def test_outlines_jump_forward_string_is_the_forced_tokens_text(backends) -> None:
    outlines = backends["outlines"]
    matcher = outlines.compile("regex", "~~~~~~~~(a|b)").matcher()
    forced = matcher.find_jump_forward_tokens()
    assert forced
    assert matcher.find_jump_forward_string() == b"".join(
        outlines.vocab.decoded[t] for t in forced).decode()


def test_jump_forward_tokens_are_the_only_allowed_tokens(backend: GrammarBackend) -> None:
    compiled = backend.compile("regex", "~~~~~~~~(a|b)")
    matcher = compiled.matcher()
    forced = matcher.find_jump_forward_tokens()
    text = b"".join(backend.vocab.decoded[t] for t in forced)
    assert forced and b"~~~~~~~~".startswith(text)
    for token in forced:
        assert _allowed(matcher, VOCAB) == {token}
        assert matcher.accept_token(token)


def _model_logits(prefix: list[int]) -> torch.Tensor:
    """A deterministic stand-in for a model: logits depend only on the tokens so far."""
    gen = torch.Generator().manual_seed(hash(tuple(prefix)) % (2**31))
    return torch.randn(1, VOCAB, generator=gen)  # [1, V]


def _greedy(compiled, jump_forward: bool) -> tuple[list[int], int]:
    matcher, mask, out, steps = compiled.matcher(), allocate_token_bitmask(1, VOCAB), [], 0
    while not matcher.is_terminated() and len(out) < 200:
        logits = _model_logits(out)
        steps += 1
        matcher.fill_bitmask(mask, 0)
        apply_token_bitmask_(logits, mask)
        token = int(logits.argmax())
        assert matcher.accept_token(token)
        out.append(token)
        if jump_forward and not matcher.is_terminated():
            for forced in matcher.find_jump_forward_tokens():
                assert matcher.accept_token(forced)
                out.append(forced)
    return out, steps


@pytest.mark.parametrize("spec", [
    json.dumps({"type": "object", "properties": {"~~~~x": {"enum": ["~~~~~~a", "~~~~~~b"]},
                                                 "n": {"type": "integer"}},
                "required": ["~~~~x", "n"], "additionalProperties": False}),
    PERSON,
])
def test_jump_forward_keeps_greedy_output_and_saves_steps(backend: GrammarBackend,
                                                          spec: str) -> None:
    compiled = backend.compile("json_schema", spec)
    plain, plain_steps = _greedy(compiled, jump_forward=False)
    jumped, jumped_steps = _greedy(compiled, jump_forward=True)
    assert jumped == plain
    assert plain_steps == len(plain)
    if "~~~~x" in spec:
        assert jumped_steps < plain_steps  # decode steps saved


def test_mask_reuse_follows_every_state_change(backend: GrammarBackend) -> None:
    """A matcher copies its last mask when asked again in the same state (the decode loop's
    jump-forward probe, then the step's mask): after each accept, rejected accept, rollback,
    reset and the stop token, every fill, first or repeated, equals that of a fresh matcher
    given the same tokens."""
    compiled = backend.compile("json_schema", PERSON)
    result = generate(compiled.matcher(), backend.vocab, seed=5,
                      bias=closing_bias(backend.vocab))
    matcher = compiled.matcher()
    taken: list[int] = []
    width = (VOCAB + 31) // 32

    def check() -> None:
        fresh = compiled.matcher()
        for token in taken:
            assert fresh.accept_token(token)
        expected = allocate_token_bitmask(1, VOCAB)
        fresh.fill_bitmask(expected, 0)
        for _ in range(2):  # the second fill is the copy
            got = torch.full((2, width), 7, dtype=torch.int32)
            matcher.fill_bitmask(got, 1)
            assert torch.equal(got[1], expected[0])

    for token in result.token_ids:
        check()
        assert not matcher.accept_token(EOS)  # the object is not complete: state unchanged
        check()
        assert matcher.accept_token(token)
        taken.append(token)
    check()
    matcher.rollback(3)
    del taken[-3:]
    check()
    for token in result.token_ids[-3:]:
        assert matcher.accept_token(token)
        taken.append(token)
    check()
    assert matcher.accept_token(EOS) and matcher.is_terminated()
    taken.append(EOS)
    check()
    matcher.rollback(1)
    taken.pop()
    check()
    matcher.reset()
    taken.clear()
    check()


class _CountedFills:
    """A grammar engine's object with its mask-writing method counted (the rest passed on)."""

    def __init__(self, inner, method: str) -> None:
        self._inner, self._method, self.calls = inner, method, 0

    def __getattr__(self, name: str):
        value = getattr(self._inner, name)
        if name != self._method:
            return value

        def counted(*args):
            self.calls += 1
            return value(*args)

        return counted


def test_a_second_fill_in_the_same_state_does_not_ask_the_engine(backend: GrammarBackend,
                                                                  tokenizer) -> None:
    matcher = backend.compile("json_schema", PERSON).matcher()
    attr, method = (("_matcher", "fill_next_token_bitmask") if backend.name == "xgrammar"
                    else ("_guide", "write_mask_into"))
    engine = _CountedFills(getattr(matcher, attr), method)
    setattr(matcher, attr, engine)
    mask = allocate_token_bitmask(1, VOCAB)
    matcher.fill_bitmask(mask, 0)
    matcher.fill_bitmask(mask, 0)
    assert engine.calls == 1
    assert not matcher.accept_token(tokenizer.encode("x", add_special_tokens=False)[0])
    matcher.fill_bitmask(mask, 0)  # a rejected token leaves the state, and the mask, as it was
    assert engine.calls == 1
    assert matcher.accept_token(tokenizer.encode("{", add_special_tokens=False)[0])
    matcher.fill_bitmask(mask, 0)
    assert engine.calls == 2
