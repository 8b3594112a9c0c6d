"""STANDALONE speculative decoding (`speculative.draft_model`): a draft model drafts, the target
verifies, and outputs equal plain decoding's token for token in float32.

Three drafts of the tiny target, each with its tokenizer: the target itself (every draft is
accepted), a noisy copy (the target's weights with noise in one layer: drafts partly accepted,
so the accept, reject and bonus paths all run) and a one-layer model from the model factory
(different random weights: drafts almost always rejected, so back-off runs). `debug_integrity`
checks the target's pool, the radix cache and the draft pool (every draft cache freed) whenever
the engine idles.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from arborlm import Engine
from arborlm.errors import InvalidRequestError
from arborlm.runtime.config import EngineArgs
from tests.runtime.test_speculative import assert_logprobs_equal, assert_same_distribution

PROMPTS = [[(11 * i) % 300 + 6 for i in range(13)], [(7 * i) % 250 + 9 for i in range(5)],
           [(5 * i) % 280 + 7 for i in range(21)], [(3 * i) % 290 + 11 for i in range(9)]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def drafts(make_tiny_model, tmp_path_factory) -> dict[str, str]:
    from transformers import AutoModelForCausalLM

    target = make_tiny_model("llama")
    noisy = tmp_path_factory.mktemp("noisy_draft")
    model = AutoModelForCausalLM.from_pretrained(str(target), torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        w = model.model.layers[1].mlp.down_proj.weight
        w.add_(torch.randn(w.shape, generator=gen) * w.std() * 0.6)
    model.save_pretrained(str(noisy))
    for f in Path(target).iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, noisy / f.name)
    return {"self": str(target), "noisy": str(noisy),
            "one_layer": str(make_tiny_model("llama", num_layers=1))}


def _run(path, prompts, params, draft=None, steps=4, **kw):
    engine = kw.pop("engine", {})
    if draft is not None:
        engine = dict(engine, speculative_algorithm="STANDALONE",
                      speculative_draft_model_path=draft, speculative_num_steps=steps)
    with Engine(path, dtype="float32", debug_integrity=True, **engine) as e:
        out = e.generate(input_ids=prompts, sampling_params=params, **kw)
        return out, e.get_server_info()


def _ids(outs) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("kind", ["self", "noisy", "one_layer"])
def test_greedy_alone_and_batched_equal_plain(make_tiny_model, drafts, kind):
    path = str(make_tiny_model("llama"))
    params = [dict(GREEDY, max_new_tokens=n) for n in (24, 7, 31, 16)]
    plain, _ = _run(path, PROMPTS, params)
    spec, info = _run(path, PROMPTS, params, drafts[kind])
    assert _ids(spec) == _ids(plain)
    alone, alone_info = _run(path, PROMPTS[:1], params[:1], drafts[kind])
    assert alone[0]["output_ids"] == plain[0]["output_ids"]
    assert info["spec_draft_tokens"] > 0
    accepted, drafted = info["spec_accepted_tokens"], info["spec_draft_tokens"]
    if kind == "self":  # the target drafting for itself: every draft token is accepted
        assert accepted == drafted
        meta = alone[0]["meta_info"]
        assert meta["spec_accept_length"] > 4.0  # 4 drafts + the bonus, after the first
        assert meta["spec_verify_ct"] < 24 // 4
        assert info["decode_steps"] < max(p["max_new_tokens"] for p in params) // 3
    elif kind == "noisy":
        assert 0 < accepted < drafted
        assert info["avg_spec_accept_length"] > 1.0
    else:  # nothing in common with the target: rejected drafts, then back-off
        assert accepted < drafted / 2


def test_flush_cache_between_requests(make_tiny_model, drafts):
    """`flush_cache` (the benchmark's between requests) with a draft model: the same output
    before and after, every draft cache freed."""
    path = str(make_tiny_model("llama"))
    with Engine(path, dtype="float32", debug_integrity=True, speculative_algorithm="STANDALONE",
                speculative_draft_model_path=drafts["self"]) as e:
        first = e.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert e.flush_cache()[0]
        second = e.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    assert first["output_ids"] == second["output_ids"]
    assert second["meta_info"]["spec_verify_ct"] > 0


def test_logprobs_equal_plain(make_tiny_model, drafts):
    path = str(make_tiny_model("llama"))
    params = [dict(GREEDY, max_new_tokens=20)] * 2
    kw = {"return_logprob": True, "top_logprobs_num": 3}
    plain, _ = _run(path, PROMPTS[:2], params, **kw)
    spec, info = _run(path, PROMPTS[:2], params, drafts["noisy"], **kw)
    assert info["spec_accepted_tokens"] > 0
    assert_logprobs_equal(plain, spec, 20)


def test_json_schema_and_stop_string_equal_plain(make_tiny_model, drafts):
    path = str(make_tiny_model("llama"))
    schema = ('{"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, '
              '"n": {"type": "integer"}}, "required": ["name", "n"]}')
    params = [dict(GREEDY, max_new_tokens=40, json_schema=schema)] * 3
    plain, _ = _run(path, PROMPTS[:3], params)
    spec, info = _run(path, PROMPTS[:3], params, drafts["self"])
    assert _ids(spec) == _ids(plain) and [o["text"] for o in spec] == [o["text"] for o in plain]
    assert info["spec_accepted_tokens"] > 0
    long, _ = _run(path, PROMPTS[:2], [dict(GREEDY, max_new_tokens=30)] * 2)
    stops = [o["text"][len(o["text"]) // 2:len(o["text"]) // 2 + 3] for o in long]
    params = [dict(GREEDY, max_new_tokens=30, stop=[s]) for s in stops]
    plain, _ = _run(path, PROMPTS[:2], params)
    spec, _ = _run(path, PROMPTS[:2], params, drafts["self"])
    assert [o["text"] for o in spec] == [o["text"] for o in plain]
    assert _ids(spec) == _ids(plain)
    assert all(len(s["text"]) < len(o["text"]) for s, o in zip(spec, long))


def test_small_pools_n_and_retraction_equal_plain(make_tiny_model, drafts):
    """Sixteen sequences (n=2) in 300 KV slots: admission runs them a few at a time, the
    draft pool (as large) runs short and evicts the caches of requests not drafting, and
    retractions drop caches that the next draft rebuilds."""
    path = str(make_tiny_model("llama"))
    prompts = [[(13 * i + j) % 290 + 5 for i in range(20 + 3 * j)] for j in range(8)]
    params = [dict(GREEDY, max_new_tokens=50, n=2)] * 8
    engine = {"max_total_tokens": 300}
    plain, _ = _run(path, prompts, params, engine=engine)
    spec, info = _run(path, prompts, params, drafts["noisy"], engine=engine)
    assert len(spec) == 16 and _ids(spec) == _ids(plain)
    assert info["spec_accepted_tokens"] > 0 and info["retractions"] > 0


def test_sampling_distribution_is_not_biased(make_tiny_model, drafts):
    """Chi-square homogeneity test: the first two tokens of 300 seeded samples with the target
    drafting for itself (greedy drafts: the argmax, accepted with its probability) against 300
    other seeds without, over top_k=3."""
    path = str(make_tiny_model("llama"))
    n = 300
    params = dict(temperature=1.5, top_k=3, max_new_tokens=3, ignore_eos=True)
    spec, info = _run(path, [PROMPTS[0]] * n,
                      [dict(params, sampling_seed=s) for s in range(n)], drafts["self"], steps=2)
    assert info["spec_verifies"] >= n // 2
    assert 0 < info["spec_accepted_tokens"] < info["spec_draft_tokens"]
    plain, _ = _run(path, [PROMPTS[0]] * n, [dict(params, sampling_seed=n + s) for s in range(n)])
    assert_same_distribution(spec, plain)


def test_seeded_sampling_equals_plain(make_tiny_model, drafts):
    path = str(make_tiny_model("llama"))
    params = [dict(temperature=0.8, top_p=0.9, max_new_tokens=20, ignore_eos=True,
                   sampling_seed=s) for s in range(4)]
    plain, _ = _run(path, PROMPTS, params)
    spec, info = _run(path, PROMPTS, params, drafts["noisy"])
    assert _ids(spec) == _ids(plain)
    assert info["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("options, field, words", [
    ({"speculative_algorithm": "STANDALONE"}, "speculative_draft_model_path", "needs"),
    ({"speculative_draft_model_path": "random-llama-40m"}, "speculative_draft_model_path",
     "STANDALONE"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "x",
      "speculative_num_steps": 0}, "speculative_num_steps", "[1, 64]"),
])
def test_bad_options_name_the_field(make_tiny_model, options, field, words):
    with pytest.raises(InvalidRequestError) as err:
        EngineArgs(model_path=str(make_tiny_model("llama")), **options).resolve()
    assert err.value.param == field and words in str(err.value)


def test_a_draft_with_another_vocabulary_is_refused_at_start(make_tiny_model):
    other = str(make_tiny_model("llama", vocab_size=384))
    with pytest.raises(InvalidRequestError) as err:
        Engine(str(make_tiny_model("llama")), dtype="float32",
               speculative_algorithm="STANDALONE", speculative_draft_model_path=other)
    assert err.value.param == "speculative_draft_model_path"
    assert "384" in str(err.value) and "512" in str(err.value)


def test_a_draft_with_another_tokenizer_is_refused_at_start(make_tiny_model, tmp_path):
    """Same vocabulary size, tokens mapped differently (two ids swapped)."""
    target = Path(make_tiny_model("llama"))
    for f in target.iterdir():
        shutil.copy(f, tmp_path / f.name)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(InvalidRequestError) as err:
        Engine(str(target), dtype="float32", speculative_algorithm="STANDALONE",
               speculative_draft_model_path=str(tmp_path))
    assert err.value.param == "speculative_draft_model_path"
    assert "tokenizer" in str(err.value)
