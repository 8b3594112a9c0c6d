"""Sampling semantics of docs/api.md, checked against transformers logits where it has them."""

from __future__ import annotations

import pytest
import torch

from arborlm import Engine
from tests.runtime.engine_helpers import GREEDY, PROMPTS, hf_logprobs, hf_tokenizer


@pytest.fixture(scope="module")
def path(make_tiny_model):
    return str(make_tiny_model("llama"))


@pytest.fixture(scope="module")
def engine(path):
    return Engine(path, dtype="float32", debug_integrity=True)


def test_stop_string_trimmed_and_reported(engine):
    base = engine.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 24})["text"]
    assert len(base) > 8
    stop = base[4:7]
    idx = base.index(stop)
    out = engine.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 24, "stop": stop})
    assert out["text"] == base[:idx]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = engine.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 24, "stop": [stop],
                                        "no_stop_trim": True})
    assert kept["text"].startswith(base[:idx + len(stop)]) and base.startswith(kept["text"])


def test_stop_token_ids_and_min_new_tokens(engine):
    base = engine.generate(PROMPTS[1], GREEDY)["output_ids"]
    stop_id = base[2]
    first = base.index(stop_id)
    out = engine.generate(PROMPTS[1], {**GREEDY, "stop_token_ids": [stop_id]})
    assert out["output_ids"] == base[:first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    # min_new_tokens bans the stop id until it is reached
    out = engine.generate(PROMPTS[1], {**GREEDY, "stop_token_ids": [stop_id],
                                       "min_new_tokens": 6})
    assert len(out["output_ids"]) >= 6
    assert stop_id not in out["output_ids"][:5]


def test_eos_stops_unless_ignored(engine, path):
    eos = hf_tokenizer(path).eos_token_id
    biased = {**GREEDY, "logit_bias": {str(eos): 100.0}, "ignore_eos": False}
    out = engine.generate(PROMPTS[0], biased)
    assert out["output_ids"] == [eos]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    out = engine.generate(PROMPTS[0], {**biased, "ignore_eos": True, "max_new_tokens": 3})
    assert out["output_ids"] == [eos] * 3


def test_seed_gives_same_output_whatever_the_batch(engine):
    params = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 7}
    alone = engine.generate(PROMPTS[2], params)["output_ids"]
    others = {"temperature": 1.0, "max_new_tokens": 20, "ignore_eos": True}
    batch = engine.generate([PROMPTS[0], PROMPTS[2], PROMPTS[4]], [others, params, others])
    assert batch[1]["output_ids"] == alone
    other_seed = engine.generate(PROMPTS[2], {**params, "sampling_seed": 8})["output_ids"]
    assert other_seed != alone


def test_n_samples(engine):
    outs = engine.generate(PROMPTS[0], {"temperature": 1.0, "max_new_tokens": 10, "n": 3,
                                        "ignore_eos": True, "sampling_seed": 1})
    assert isinstance(outs, list) and len(outs) == 3
    assert len({tuple(o["output_ids"]) for o in outs}) == 3
    assert len({o["meta_info"]["id"] for o in outs}) == 3
    again = engine.generate(PROMPTS[0], {"temperature": 1.0, "max_new_tokens": 10, "n": 3,
                                         "ignore_eos": True, "sampling_seed": 1})
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]


def test_top_k_1_and_tiny_top_p_are_greedy(engine):
    greedy = engine.generate(PROMPTS[3], GREEDY)["output_ids"]
    for extra in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        out = engine.generate(PROMPTS[3], {**GREEDY, "temperature": 1.0, **extra})
        assert out["output_ids"] == greedy, extra


def _reference_penalized(path, prompt_ids, steps, freq=0.0, pres=0.0, rep=1.0):
    """Greedy decoding with penalties applied by hand to transformers' logits."""
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(steps):
        logits = _raw_logits(path, ids)
        counts = torch.zeros_like(logits)
        for t in out:
            counts[t] += 1
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[torch.tensor(ids)] = True
        pen = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, pen, logits)
        logits = logits - freq * counts - pres * (counts > 0).float()
        tok = int(torch.argmax(logits))
        out.append(tok)
        ids.append(tok)
    return out


def _raw_logits(path, ids):
    from tests.runtime.engine_helpers import hf_model

    with torch.no_grad():
        return hf_model(path)(torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("kw", [{"frequency_penalty": 1.5}, {"presence_penalty": 1.0},
                                {"repetition_penalty": 1.8}])
def test_penalties_match_reference(engine, path, kw):
    prompt_ids = hf_tokenizer(path).encode(PROMPTS[4])
    out = engine.generate(input_ids=prompt_ids, sampling_params={**GREEDY, "max_new_tokens": 10,
                                                                  **kw})
    ref = _reference_penalized(path, prompt_ids, 10, freq=kw.get("frequency_penalty", 0.0),
                               pres=kw.get("presence_penalty", 0.0),
                               rep=kw.get("repetition_penalty", 1.0))
    assert out["output_ids"] == ref
    plain = engine.generate(input_ids=prompt_ids, sampling_params={**GREEDY, "max_new_tokens": 10})
    assert plain["output_ids"] != ref or len(set(ref)) == len(ref)


def test_logit_bias_forces_token(engine):
    out = engine.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 4,
                                       "logit_bias": {"42": 100.0}})
    assert out["output_ids"] == [42] * 4


def test_output_and_input_logprobs_match_reference(engine, path):
    prompt_ids = hf_tokenizer(path).encode(PROMPTS[1])
    out = engine.generate(input_ids=prompt_ids, sampling_params={**GREEDY, "max_new_tokens": 5},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=3,
                          token_ids_logprob=[5, 9], return_text_in_logprobs=True)
    meta = out["meta_info"]
    full = prompt_ids + out["output_ids"]
    ref = hf_logprobs(path, full)  # [len, V]
    inp = meta["input_token_logprobs"]
    assert len(inp) == len(prompt_ids)
    assert inp[0][0] is None and inp[0][1] == prompt_ids[0]
    for pos in range(1, len(prompt_ids)):
        lp, tid, text = inp[pos]
        assert tid == prompt_ids[pos]
        assert lp == pytest.approx(float(ref[pos - 1, tid]), abs=1e-4)
        assert isinstance(text, str)
    for k, (lp, tid, _) in enumerate(meta["output_token_logprobs"]):
        pos = len(prompt_ids) - 1 + k
        assert tid == out["output_ids"][k]
        assert lp == pytest.approx(float(ref[pos, tid]), abs=1e-4)
        top = meta["output_top_logprobs"][k]
        assert len(top) == 3 and top[0][1] == tid  # greedy: the chosen token is the top one
        assert [e[0] for e in top] == sorted([e[0] for e in top], reverse=True)
        ids_lp = meta["output_token_ids_logprobs"][k]
        assert [e[1] for e in ids_lp] == [5, 9]
        assert ids_lp[0][0] == pytest.approx(float(ref[pos, 5]), abs=1e-4)
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(
        prompt_ids)


def test_logprob_start_len_and_prefill_only(engine, path):
    prompt_ids = hf_tokenizer(path).encode(PROMPTS[6])
    out = engine.generate(input_ids=prompt_ids, sampling_params={"max_new_tokens": 0},
                          return_logprob=True, logprob_start_len=5)
    assert out["output_ids"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    inp = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in inp] == prompt_ids[5:]
    ref = hf_logprobs(path, prompt_ids)
    assert inp[0][0] == pytest.approx(float(ref[4, prompt_ids[5]]), abs=1e-4)
    assert inp[0][2] is None  # no text unless asked
    assert "input_token_logprobs" not in engine.generate(PROMPTS[0], GREEDY)["meta_info"]


def test_chunked_input_logprobs(path):
    chunked = Engine(path, dtype="float32", chunked_prefill_size=4)
    prompt_ids = hf_tokenizer(path).encode(PROMPTS[6])
    out = chunked.generate(input_ids=prompt_ids, sampling_params={"max_new_tokens": 0},
                           return_logprob=True, logprob_start_len=2)
    ref = hf_logprobs(path, prompt_ids)
    inp = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in inp] == prompt_ids[2:]
    for j, (lp, tid, _) in enumerate(inp):
        assert lp == pytest.approx(float(ref[1 + j, tid]), abs=1e-4)
