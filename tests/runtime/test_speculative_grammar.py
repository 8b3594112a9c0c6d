"""Grammar-aware speculation: drafts fitted to each request's grammar (`grammar_draft.fit_draft`:
pruned before an illegal token, extended by forced tokens, the matcher's mask left as it was),
and the semantic guard's rollbacks inside a verified run; outputs equal plain decoding's
(`test_speculative.py` holds the oracle drafter these tests share).
"""

from __future__ import annotations

import json

import pytest
import torch

from arborlm.runtime.speculative import ngram
from tests.runtime.test_speculative import GREEDY, PROMPTS, _oracle, _run

OBJECT = {"type": "object", "properties": {"name": {"type": "string"}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
          "uniqueItems": True}


@pytest.fixture(scope="module")
def tiny_grammars(make_tiny_model):
    from transformers import AutoTokenizer

    from arborlm.constrained import create_grammar_backend

    tokenizer = AutoTokenizer.from_pretrained(str(make_tiny_model("llama")))
    return tokenizer, create_grammar_backend("xgrammar", tokenizer, 512, [2])


def _mask(matcher) -> torch.Tensor:
    row = torch.zeros(1, 16, dtype=torch.int32)  # [1, 512 / 32]
    matcher.fill_bitmask(row, 0)
    return row


@pytest.mark.parametrize("schema, text, limit, want, pruned, forced", [
    (OBJECT, '{"name": "ab", "ok": tr', 16, '{"name": "ab", "ok": tru', 0, 1),  # up to the limit
    (OBJECT, '{"name": "ab", "ok": tr', 32, '{"name": "ab", "ok": true}</s>', 0, 4),
    (OBJECT, '{"name": "ab"', 32, '{"name": "ab",', 0, 1),   # the "," after a value is forced
    (OBJECT, '{"name": 5, "ok": true}', 32, '{"name": ', 10, 0),  # a number where a string goes
    (DIGITS, '[1, 1]', 32, '[1, 1', 1, 0),  # the semantic guard (`check_token`) rejects "]"
])
def test_fit_draft_prunes_and_extends(tiny_grammars, schema, text, limit, want, pruned, forced):
    from arborlm.runtime.speculative.grammar_draft import fit_draft

    tokenizer, backend = tiny_grammars
    matcher = backend.compile("json_schema", json.dumps(schema)).matcher()
    prefix = tokenizer.encode(text[:2], add_special_tokens=False)  # a matcher past its start
    for tok in prefix:
        assert matcher.accept_token(tok)
    draft = tokenizer.encode(text, add_special_tokens=False)[len(prefix):]
    before = _mask(matcher)
    fitted = fit_draft(matcher, draft, len(prefix), limit - len(prefix), forced_alone=False)
    assert torch.equal(_mask(matcher), before)  # rolled back exactly
    assert tokenizer.decode(prefix + fitted.tokens) == want
    assert (fitted.pruned, fitted.forced) == (pruned, forced)
    for tok in fitted.tokens:  # every drafted token is one the grammar and its guard allow
        assert matcher.check_token(tok) is None and matcher.accept_token(tok)


def test_fit_draft_forced_alone_only_when_asked(tiny_grammars):
    from arborlm.runtime.speculative.grammar_draft import fit_draft

    tokenizer, backend = tiny_grammars
    matcher = backend.compile("json_schema", json.dumps(OBJECT)).matcher()
    for tok in tokenizer.encode('{"name": "ab"', add_special_tokens=False):
        assert matcher.accept_token(tok)
    assert fit_draft(matcher, [], 0, 8, forced_alone=False).tokens == []
    alone = fit_draft(matcher, [], 0, 8, forced_alone=True)
    assert tokenizer.decode(alone.tokens) == "," and alone.forced == 1
    bad = tokenizer.encode("}", add_special_tokens=False)  # illegal: "ok" is required
    cut = fit_draft(matcher, bad, 0, 8, forced_alone=False)
    assert cut.tokens == [] and cut.pruned == len(bad)


def test_fit_draft_spells_the_forced_string(tiny_grammars):
    """After `{"name": "ab",` the grammar forces the string ` "ok": ` but no token (the mask
    allows ` "` and the tokens of other whitespace): with the tokenizer, it becomes a draft of
    its spelling, also after what a draft kept; a spelling the grammar rejects is cut where it
    goes wrong, the limit holds, and the matcher is left as it was."""
    from arborlm.runtime.speculative.grammar_draft import fit_draft

    tokenizer, backend = tiny_grammars
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    matcher = backend.compile("json_schema", json.dumps(OBJECT)).matcher()
    prefix = encode('{"name": "ab",')
    for tok in prefix:
        assert matcher.accept_token(tok)
    assert matcher.find_jump_forward_tokens() == []  # nothing forced token by token
    at, before = len(prefix), _mask(matcher)
    fitted = fit_draft(matcher, [], at, 16, forced_alone=False, encode=encode)
    assert tokenizer.decode(fitted.tokens) == ' "ok": '
    assert fitted.spelled == len(fitted.tokens) == len(encode(' "ok": ')) > 2
    assert torch.equal(_mask(matcher), before)
    assert fit_draft(matcher, [], at, 16, forced_alone=False).tokens == []  # no tokenizer
    assert fit_draft(matcher, [], at, 2, forced_alone=False, encode=encode).tokens == \
        fitted.tokens[:2]
    # After a kept draft token: the string forced after it.
    after = fit_draft(matcher, encode(' "o'), at, 16, forced_alone=False, encode=encode)
    assert tokenizer.decode(after.tokens) == ' "ok": ' and after.pruned == 0
    assert 0 < after.spelled < len(after.tokens)
    # A tokenizer that spells it wrong: cut before the first token the grammar rejects.
    wrong = fit_draft(matcher, [], at, 16, forced_alone=False,
                      encode=lambda text: encode(' "no": '))
    assert tokenizer.decode(wrong.tokens) == ' "'
    assert torch.equal(_mask(matcher), before)


def test_fit_draft_spells_only_what_the_draft_can_take(tiny_grammars):
    """A `const` of 20,000 characters is one forced string: the tokenizer is handed only as
    many characters as the draft has room for (`MAX_TOKEN_CHARS` per token), not the whole."""
    from arborlm.runtime.speculative import grammar_draft

    tokenizer, backend = tiny_grammars
    seen = []

    def encode(text):
        seen.append(len(text))
        return tokenizer.encode(text, add_special_tokens=False)

    const = "ab" * 10_000
    matcher = backend.compile("json_schema", json.dumps({"const": const})).matcher()
    fitted = grammar_draft.fit_draft(matcher, [], 0, 6, forced_alone=False, encode=encode)
    assert seen and max(seen) <= 6 * grammar_draft.MAX_TOKEN_CHARS
    assert 0 < len(fitted.tokens) <= 6
    assert (json.dumps(const)).startswith(tokenizer.decode(fitted.tokens))


def test_fit_draft_cuts_a_token_the_guard_banned_here(tiny_grammars):
    """A token banned at the current position (a guard rollback's `ban_at`) is masked there
    though the grammar alone accepts it: a draft starting with it is cut whole."""
    from arborlm.runtime.speculative.grammar_draft import fit_draft

    tokenizer, backend = tiny_grammars
    matcher = backend.compile("json_schema", json.dumps(DIGITS)).matcher()
    assert matcher.accept_token(tokenizer.encode("[", add_special_tokens=False)[0])
    draft = tokenizer.encode("1, 2", add_special_tokens=False)
    assert fit_draft(matcher, draft, 1, 8, forced_alone=False).tokens == draft
    matcher.ban_at(1, draft[0])
    before = _mask(matcher)
    cut = fit_draft(matcher, draft, 1, 8, forced_alone=False)
    assert cut.tokens == [] and cut.pruned == len(draft)
    assert torch.equal(_mask(matcher), before)


def test_grammar_aware_drafts_equal_plain(make_tiny_model, monkeypatch):
    """An adversarial drafter: the oracle's drafts, at most two tokens (room for forced ones),
    some with an illegal token (the control byte 0x01) spliced in. The grammar
    cuts them before it (`spec_grammar_pruned_tokens`), every draft verification receives is
    legal for its request's grammar, drafting leaves each matcher's mask as it was, forced
    tokens ride on accepted drafts, and the outputs equal plain decoding's."""
    from arborlm.runtime.speculative import grammar_draft, speculator

    path = str(make_tiny_model("llama"))
    schema = ('{"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, '
              '"n": {"type": "integer"}}, "required": ["name", "n"]}')
    params = [dict(GREEDY, max_new_tokens=40, json_schema=schema)] * 3
    plain, _ = _run(path, PROMPTS[:3], params, spec=False)
    refs = {tuple(p): o["output_ids"] for p, o in zip(PROMPTS, plain)}
    bad = 195  # the byte 0x01: JSON allows no raw control character
    oracle = _oracle(monkeypatch, refs, vocab=256)
    honest = ngram.NgramIndex.draft

    def adversary(self, tokens, k):
        d = honest(self, tokens, min(k, 2))
        return d[:1] + [bad] + d[1:] if len(d) > 1 and len(tokens) % 3 else d

    fit, verified, whole = grammar_draft.fit_draft, [], []

    def checked_fit(matcher, draft, position, limit, **kw):
        before = _mask(matcher)
        out = fit(matcher, draft, position, limit, **kw)
        assert torch.equal(_mask(matcher), before)
        return out

    real_verify = speculator.Speculator.verify

    def checked_verify(self, batch, logits):
        for req, d in zip(batch.reqs, batch.draft_ids):
            walk = req.grammar.copy()  # independent of the rollback under test
            assert all(walk.accept_token(t) for t in d), (d, req.output_ids)
            verified.extend(d)
        computed = real_verify(self, batch, logits)
        whole.extend(len(d) for d, n in zip(batch.draft_ids, computed) if n == len(d) + 1)
        return computed

    monkeypatch.setattr(ngram.NgramIndex, "draft", adversary)
    # Forced tokens riding on n-gram drafts are the subject here: no spelled strings after them
    # (those have a test of their own), so a draft accepted whole is one with forced tokens.
    monkeypatch.setattr(speculator, "_encoder", lambda tokenizer: None)
    monkeypatch.setattr(speculator, "fit_draft", checked_fit)
    monkeypatch.setattr(speculator.Speculator, "verify", checked_verify)
    spec, info = _run(path, PROMPTS[:3], params, spec=True,
                      engine={"speculative_num_draft_tokens": 6})
    assert oracle and verified and bad not in verified
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert info["spec_grammar_pruned_tokens"] > 0
    assert info["spec_grammar_forced_tokens"] > 0
    # A draft longer than the two n-gram tokens accepted whole: forced tokens after them,
    # which jump-forward appended during verification, kept their drafted KV and the
    # verification went on to the bonus token after them.
    assert max(whole) > 2


def test_forced_runs_are_drafts_without_jump_forward(make_tiny_model):
    """With jump-forward off, a constrained request with nothing to copy drafts the runs its
    grammar forces; the outputs equal plain decoding's (jump-forward off as well)."""
    path = str(make_tiny_model("llama"))
    schema = json.dumps(OBJECT)
    params = [dict(GREEDY, max_new_tokens=40, json_schema=schema)] * 2
    engine = {"disable_jump_forward": True, "num_continuous_decode_steps": 1}
    plain, _ = _run(path, PROMPTS[:2], params, spec=False, engine=engine)
    spec, info = _run(path, PROMPTS[:2], params, spec=True, engine=engine)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert info["spec_grammar_forced_tokens"] > 0 and info["spec_accepted_tokens"] > 0


def test_a_drafted_duplicate_rolled_back_inside_the_verified_run(make_tiny_model, monkeypatch):
    """A drafter that proposes, after each element of a uniqueItems array, `", "` and an
    element already in it: the grammar allows the digit (the semantic guard only rejects the
    token that closes the value), so the target verifies it; where the target samples it too,
    the `,` or `]` after it makes the guard roll the value back (`req.rewind_to`) inside the
    verified run, and the request rewinds after the step. Outputs equal plain decoding's.
    (Jump-forward is off on both sides: on, it appends each `", "` and the extend that computes
    it samples the next element, so no decode step would draft there.)"""
    from arborlm.runtime.speculative import speculator

    path = str(make_tiny_model("llama"))
    bracket, comma, space = 64, 17, 226  # the tiny tokenizer's "[", "," and " "
    digits = range(21, 31)  # "0" to "9"
    schema = json.dumps({"type": "array", "items": {"type": "integer", "minimum": 0,
                                                    "maximum": 9},
                         "minItems": 4, "maxItems": 4, "uniqueItems": True})
    params = [dict(GREEDY, max_new_tokens=60, json_schema=schema)] * 4
    engine = {"disable_jump_forward": True, "num_continuous_decode_steps": 1}
    plain, plain_info = _run(path, PROMPTS, params, spec=False, engine=engine)
    assert plain_info["grammar_guard_rollbacks"] > 0

    def duplicate(self, tokens, k):
        if k <= 0 or tokens[-1] not in digits or bracket not in tokens:
            return []
        start = len(tokens) - tokens[::-1].index(bracket)
        seen = [t for t in tokens[start:] if t in digits]
        return [comma, space, seen[len(tokens) % len(seen)]][:k]

    inside = []
    real_verify = speculator.Speculator.verify

    def verify(self, batch, logits):
        computed = real_verify(self, batch, logits)
        inside.extend(r.rewind_to for r, n in zip(batch.reqs, computed)
                      if n > 1 and r.rewind_to is not None)
        return computed

    monkeypatch.setattr(ngram.NgramIndex, "draft", duplicate)
    monkeypatch.setattr(speculator.Speculator, "verify", verify)
    spec, info = _run(path, PROMPTS, params, spec=True, engine=engine)
    assert inside, "no rollback inside a verified run: the test shows nothing"
    assert info["spec_accepted_tokens"] > 0 and info["grammar_guard_rollbacks"] > 0
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    for o in spec:
        assert len(set(json.loads(o["text"]))) == 4
