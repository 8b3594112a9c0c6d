"""Speculative decoding (`arborlm.runtime.speculative`): outputs identical to plain decoding.

Random-weight models rarely repeat their prompts, so most tests draft from an oracle: the
plain run's own output, with some drafts cut short by a wrong token (partly accepted) and some
wrong from their first token (rejected), so verification's accept, reject and bonus paths all
run. Greedy outputs, logprobs, stops inside an accepted run, grammars and seeded sampling must
equal plain decoding's, token for token, and every rejected draft's KV slot must return to the
pool (`debug_integrity` checks the pool and the radix cache whenever the engine idles).
"""

from __future__ import annotations

import json

import pytest
import torch

from arborlm import Engine
from arborlm.errors import InvalidRequestError
from arborlm.runtime.config import EngineArgs
from arborlm.runtime.speculative import ngram
from arborlm.runtime.speculative.ngram import NgramIndex, SharedNgramCache

PROMPTS = [[(11 * i) % 300 + 6 for i in range(13)], [(7 * i) % 250 + 9 for i in range(5)],
           [(5 * i) % 280 + 7 for i in range(21)], [(3 * i) % 290 + 11 for i in range(9)]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
SPEC = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 5}


@pytest.mark.parametrize("tokens, k, want", [
    ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),          # longest suffix [1, 2] recurs
    ([1, 2, 3, 9, 2, 3, 7, 2, 3], 2, [7, 2]),    # the latest occurrence wins
    ([5, 6, 7], 4, []),                          # nothing recurs
    ([4, 4, 4, 4], 5, [4]),                      # a draft never runs past the last token
    ([1, 2, 3, 1, 2], 0, []),
])
def test_ngram_drafts(tokens, k, want):
    assert NgramIndex(1, 4).draft(tokens, k) == want


def test_ngram_index_grows_with_the_sequence():
    index, seq = NgramIndex(2, 3), [10, 11, 12, 13]
    assert index.draft(seq, 3) == []
    seq += [10, 11]
    assert index.draft(seq, 3) == [12, 13, 10]
    seq += [99]
    assert index.draft(seq, 3) == []


def test_shared_ngram_cache_is_bounded_and_keeps_the_newest():
    cache = SharedNgramCache(window=2, max_draft=3, capacity=4)
    cache.add([1, 2, 3, 4, 5, 6])
    assert cache.draft([9, 1, 2], 5) == [3, 4, 5] and len(cache) == 4
    cache.add([7, 8, 9])  # one more n-gram: the oldest, (1, 2), goes
    assert len(cache) == 4 and cache.draft([1, 2], 3) == [] and cache.draft([7, 8], 3) == [9]
    assert cache.draft([5, 6], 2) == []  # nothing followed it


def test_shared_cache_drafts_from_a_finished_request(make_tiny_model):
    """The same prompt twice, one after the other: the second drafts from the first's output
    (its own prompt has nothing to copy at a 2-token window) and equals it."""
    path = str(make_tiny_model("llama"))
    params = dict(GREEDY, max_new_tokens=30)
    with Engine(path, dtype="float32", debug_integrity=True, num_continuous_decode_steps=1,
                speculative_ngram_min_match_window_size=2, **SPEC) as e:
        first = e.generate(input_ids=PROMPTS[0], sampling_params=params)
        before = e.get_server_info()["spec_accepted_tokens"]
        second = e.generate(input_ids=PROMPTS[0], sampling_params=params)
        after = e.get_server_info()["spec_accepted_tokens"]
        assert e.flush_cache()[0]
        third = e.generate(input_ids=PROMPTS[0], sampling_params=params)
        flushed = e.get_server_info()["spec_accepted_tokens"] - after
    assert second["output_ids"] == first["output_ids"] == third["output_ids"]
    assert flushed < (after - before) / 2  # the flush forgot the first two's n-grams
    assert after - before >= 20
    assert second["meta_info"]["spec_accept_length"] > 3


def _oracle(monkeypatch, refs: dict[tuple[int, ...], list[int]], vocab: int) -> list[int]:
    """Draft from `refs` (prompt -> plain output); returns the draft lengths proposed. Every
    fourth draft ends in a wrong token and every fourth starts with one."""
    proposed: list[int] = []

    def draft(self, tokens, k):
        key = next(p for p in refs if tuple(tokens[:len(p)]) == p)
        out, ref = tokens[len(key):], refs[key]
        if k <= 0 or ref[:len(out)] != out:
            return []
        d = list(ref[len(out):len(out) + k])
        if d and len(out) % 4 == 1:
            d[-1] = (d[-1] + 1) % vocab
        elif d and len(out) % 4 == 2:
            d[0] = (d[0] + 1) % vocab
        proposed.append(len(d))
        return d

    monkeypatch.setattr(ngram.NgramIndex, "draft", draft)
    return proposed


def _run(path, prompts, params, *, spec: bool, **kw) -> tuple[list[dict], dict]:
    options = {**(SPEC if spec else {}), **kw.pop("engine", {})}
    with Engine(path, dtype="float32", debug_integrity=True, **options) as e:
        out = e.generate(input_ids=prompts, sampling_params=params, **kw)
        return out, e.get_server_info()


def _plain_and_spec(monkeypatch, path, prompts, params, **kw):
    plain, _ = _run(path, prompts, params, spec=False, **kw)
    refs = {tuple(p): o["output_ids"] for p, o in zip(prompts, plain)}
    proposed = _oracle(monkeypatch, refs, vocab=256)
    spec, info = _run(path, prompts, params, spec=True, **kw)
    assert proposed, "no draft was proposed"
    return plain, spec, info


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_alone_and_batched_equal_plain(make_tiny_model, monkeypatch, arch):
    path = str(make_tiny_model(arch))
    params = [dict(GREEDY, max_new_tokens=n) for n in (24, 7, 31, 16)]
    plain, spec, info = _plain_and_spec(monkeypatch, path, PROMPTS, params)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert info["spec_accepted_tokens"] > 0
    assert info["spec_accepted_tokens"] < info["spec_draft_tokens"]  # some were rejected
    assert info["decode_steps"] < max(p["max_new_tokens"] for p in params) - 1
    assert info["avg_spec_accept_length"] > 1.0
    alone, _ = _run(path, PROMPTS[:1], params[:1], spec=True)
    assert alone[0]["output_ids"] == plain[0]["output_ids"]


@pytest.mark.parametrize("engine", [{}, {"quantization": "q8_0"}], ids=["fused", "eager"])
def test_verify_rows_over_long_shared_prefixes_equal_plain(make_tiny_model, monkeypatch, engine):
    """A verify step runs as decode rows, several per request (`ScheduledBatch._verify_rows`).
    Past 64 tokens those rows, and requests sharing a cached prefix, form cascade groups; with
    `quantization` the decode runs eagerly through the CPU attention backend and its decode
    workspace, which a batch repeating a request must not continue. Outputs and logprobs
    equal plain decoding's."""
    if engine:  # one packed path for any row count: plain decode rows and verify rows differ
        from arborlm.runtime.platforms.cpu import kernels as cpu_kernels

        monkeypatch.setenv("ARBORLM_QUANT_PATH", cpu_kernels.batch_invariant_quant_path())
    path = str(make_tiny_model("llama"))
    shared = [(17 * i) % 280 + 9 for i in range(70)]
    prompts = [shared + [(5 * i + j) % 250 + 7 for i in range(4 + j)] for j in range(3)]
    prompts.append([(3 * i) % 290 + 11 for i in range(90)])
    params = [dict(GREEDY, max_new_tokens=20)] * len(prompts)
    kw = {"return_logprob": True, "engine": engine}
    plain, spec, info = _plain_and_spec(monkeypatch, path, prompts, params, **kw)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert 0 < info["spec_accepted_tokens"] < info["spec_draft_tokens"]
    for a, b in zip(plain, spec):
        la, lb = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        assert all(abs(x[0] - y[0]) <= 1e-5 for x, y in zip(la, lb))


def test_logprobs_equal_plain(make_tiny_model, monkeypatch):
    path = str(make_tiny_model("llama"))
    params = [dict(GREEDY, max_new_tokens=20)] * 2
    plain, spec, _ = _plain_and_spec(monkeypatch, path, PROMPTS[:2], params,
                                     return_logprob=True, top_logprobs_num=3)
    assert_logprobs_equal(plain, spec, 20)


def test_stop_ids_and_lengths_inside_an_accepted_run(make_tiny_model, monkeypatch):
    """Drafts run past a stop token: the output ends at the stop, as in plain decoding."""
    path = str(make_tiny_model("llama"))
    long = [dict(GREEDY, max_new_tokens=30)] * 2
    plain_long, _ = _run(path, PROMPTS[:2], long, spec=False)
    stops = [o["output_ids"][11] for o in plain_long]
    _oracle(monkeypatch, {tuple(p): o["output_ids"] for p, o in zip(PROMPTS, plain_long)}, 256)
    params = [dict(GREEDY, max_new_tokens=30, stop_token_ids=[s]) for s in stops]
    spec, _ = _run(path, PROMPTS[:2], params, spec=True)
    monkeypatch.undo()
    plain, _ = _run(path, PROMPTS[:2], params, spec=False)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert all(len(o["output_ids"]) <= 12 for o in spec)
    assert [o["meta_info"]["finish_reason"] for o in spec] == [
        o["meta_info"]["finish_reason"] for o in plain]


def test_stop_strings_inside_an_accepted_run(make_tiny_model, monkeypatch):
    path = str(make_tiny_model("llama"))
    long = [dict(GREEDY, max_new_tokens=30)]
    plain_long, _ = _run(path, PROMPTS[:1], long, spec=False)
    text = plain_long[0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    _oracle(monkeypatch, {tuple(PROMPTS[0]): plain_long[0]["output_ids"]}, 256)
    params = [dict(GREEDY, max_new_tokens=30, stop=[stop])]
    spec, _ = _run(path, PROMPTS[:1], params, spec=True)
    monkeypatch.undo()
    plain, _ = _run(path, PROMPTS[:1], params, spec=False)
    assert spec[0]["text"] == plain[0]["text"] and len(spec[0]["text"]) < len(text)
    assert spec[0]["output_ids"] == plain[0]["output_ids"]


def test_json_schema_equal_plain(make_tiny_model, monkeypatch):
    path = str(make_tiny_model("llama"))
    schema = ('{"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, '
              '"n": {"type": "integer"}}, "required": ["name", "n"]}')
    params = [dict(GREEDY, max_new_tokens=40, json_schema=schema)] * 2
    plain, spec, _ = _plain_and_spec(monkeypatch, path, PROMPTS[:2], params)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert [o["text"] for o in spec] == [o["text"] for o in plain]


def test_guard_rollback_inside_a_verify_step_equals_plain(make_tiny_model, monkeypatch):
    """A uniqueItems array the tiny model fills with duplicates: the semantic guard rolls the
    value back (`grammar_guard_rollbacks`), with speculation inside a verify step too."""
    path = str(make_tiny_model("llama"))
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    schema = json.dumps({"type": "array", "items": digit, "minItems": 4, "maxItems": 4,
                         "uniqueItems": True})
    params = [dict(GREEDY, max_new_tokens=60, json_schema=schema)] * 4
    plain, spec, info = _plain_and_spec(monkeypatch, path, PROMPTS[:4], params)
    assert info["grammar_guard_rollbacks"] > 0, "no duplicate was rolled back: shows nothing"
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    for o in spec:
        assert o["meta_info"]["finish_reason"]["type"] == "stop"
        assert len(set(json.loads(o["text"]))) == 4


def test_penalties_and_chunked_prefill_equal_plain(make_tiny_model, monkeypatch):
    path = str(make_tiny_model("llama"))
    params = [dict(GREEDY, max_new_tokens=20, frequency_penalty=0.7, repetition_penalty=1.3)] * 3
    plain, spec, _ = _plain_and_spec(monkeypatch, path, PROMPTS[:3], params,
                                     engine={"chunked_prefill_size": 8})
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]


def test_seeded_sampling_equals_plain(make_tiny_model, monkeypatch):
    path = str(make_tiny_model("llama"))
    params = [dict(temperature=0.8, top_p=0.9, max_new_tokens=20, ignore_eos=True,
                   sampling_seed=s) for s in range(4)]
    plain, spec, info = _plain_and_spec(monkeypatch, path, PROMPTS, params)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert info["spec_accepted_tokens"] > 0


def test_sampling_distribution_is_not_biased(make_tiny_model, monkeypatch):
    """Chi-square homogeneity test: the first two tokens of 300 seeded samples with speculation
    (every draft is one fixed token) against 300 other seeds without, over top_k=3."""
    path = str(make_tiny_model("llama"))
    prompt = PROMPTS[0]
    n = 300
    params = dict(temperature=1.5, top_k=3, max_new_tokens=3, ignore_eos=True)
    greedy, _ = _run(path, [prompt], [dict(GREEDY, max_new_tokens=2)], spec=False)
    fixed = greedy[0]["output_ids"][1]
    monkeypatch.setattr(ngram.NgramIndex, "draft", lambda self, tokens, k: [fixed][:k])
    spec, info = _run(path, [prompt] * n,
                      [dict(params, sampling_seed=s) for s in range(n)], spec=True)
    assert info["spec_verifies"] >= n // 2
    monkeypatch.undo()
    plain, _ = _run(path, [prompt] * n,
                    [dict(params, sampling_seed=n + s) for s in range(n)], spec=False)
    assert_same_distribution(spec, plain)


def test_natural_ngram_drafts_on_a_repeating_prompt(make_tiny_model):
    """The real index (no oracle): a prompt that repeats itself, outputs equal plain. (Runs of
    continuous decode steps skip drafting, so they are off here.)"""
    path = str(make_tiny_model("llama"))
    prompts = [[(i % 7) + 5 for i in range(40)], [9, 8, 7, 9, 8, 7, 9, 8, 7, 100, 101]]
    params = [dict(GREEDY, max_new_tokens=30)] * 2
    plain, _ = _run(path, prompts, params, spec=False)
    spec, info = _run(path, prompts, params, spec=True,
                      engine={"num_continuous_decode_steps": 1})
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert info["spec_drafts"] > 0, info


@pytest.mark.parametrize("options, field", [
    ({"speculative_algorithm": "EAGLE"}, "speculative_algorithm"),
    ({"speculative_algorithm": "NGRAM", "page_size": 4}, "page_size"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 0},
     "speculative_num_draft_tokens"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 5,
      "speculative_ngram_max_match_window_size": 3}, "speculative_ngram_max_match_window_size"),
])
def test_bad_options_name_the_field(make_tiny_model, options, field):
    with pytest.raises(InvalidRequestError) as err:
        EngineArgs(model_path=str(make_tiny_model("llama")), **options).resolve()
    assert field in str(err.value) or getattr(err.value, "param", None) == field


def test_small_pool_and_n_equal_plain(make_tiny_model, monkeypatch):
    """Sixteen sequences (n=2) of up to ~90 tokens in 300 KV slots: admission runs them a few
    at a time, and drafts compete for the slots left (without them a step decodes plainly)."""
    path = str(make_tiny_model("llama"))
    prompts = [[(13 * i + j) % 290 + 5 for i in range(20 + 3 * j)] for j in range(8)]
    params = [dict(GREEDY, max_new_tokens=50, n=2)] * 8
    plain, spec, info = _plain_and_spec(monkeypatch, path, prompts, params,
                                        engine={"max_total_tokens": 300})
    assert len(spec) == 16
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert info["spec_accepted_tokens"] > 0


def test_forced_retraction_resumes_exactly(make_tiny_model, monkeypatch):
    from tests.runtime.engine_helpers import DirectScheduler

    path = str(make_tiny_model("llama"))
    texts = ["The quick brown fox", "Once upon a time", "def add(a, b):"]
    params = dict(GREEDY, max_new_tokens=30)
    ref = DirectScheduler(path)
    rids = ref.submit(texts, params)
    ref.run()
    plain = ref.output_ids(rids)
    _oracle(monkeypatch, {tuple(ref.tokenizer.encode(t)): o for t, o in zip(texts, plain)},
            256)
    d = DirectScheduler(path, **SPEC)
    rids = d.submit(texts, params)
    for _ in range(5):  # prefill + a few verify steps
        d.step()
    victim = d.scheduler.running[1]
    assert victim.output_ids and victim.spec.stats["verify_ct"] > 0
    d.scheduler.retract(victim)
    d.run()
    assert victim.retractions == 1
    assert d.output_ids(rids) == plain
    d.scheduler.check_integrity()


def assert_same_distribution(spec: list[dict], plain: list[dict]) -> None:
    """Chi-square test of homogeneity on the first two sampled tokens of two runs (at 0.999):
    speculation must not change what is sampled."""
    cells = sorted({tuple(o["output_ids"][:2]) for o in spec + plain})
    counts = torch.tensor([[sum(tuple(o["output_ids"][:2]) == c for o in run) for c in cells]
                           for run in (spec, plain)], dtype=torch.float64)  # [2, cells]
    expected = counts.sum(0, keepdim=True) * counts.sum(1, keepdim=True) / counts.sum()
    keep = expected.min(0).values >= 5  # the chi-square approximation needs full cells
    stat = float(((counts - expected) ** 2 / expected)[:, keep].sum())
    dof = int(keep.sum()) - 1
    assert dof >= 2
    # The 0.999 quantile of chi-square(dof) is below 10.83 + 3.3 * (dof - 1) for dof <= 20.
    assert stat < 10.83 + 3.3 * (dof - 1), (stat, dof, counts)


def assert_logprobs_equal(plain: list[dict], spec: list[dict], n: int) -> None:
    """Same tokens, `n` of them, each logprob and top logprob within 1e-5 (same top ids)."""
    for a, b in zip(plain, spec):
        assert a["output_ids"] == b["output_ids"]
        la, lb = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        assert len(la) == len(lb) == n
        for (va, ta, *_), (vb, tb, *_) in zip(la, lb):
            assert ta == tb and abs(va - vb) <= 1e-5
        for ra, rb in zip(a["meta_info"]["output_top_logprobs"],
                          b["meta_info"]["output_top_logprobs"]):
            assert [t for _, t, *_ in ra] == [t for _, t, *_ in rb]
            assert all(abs(x[0] - y[0]) <= 1e-5 for x, y in zip(ra, rb))
