"""Continuous decode steps: several greedy decode steps in one C++ call
(`arborlm::decode_steps`, `num_continuous_decode_steps`), with no scheduling between them.

A run of S steps must give exactly the tokens that S scheduled steps give (and, in float32,
transformers' greedy tokens): the same stops (stop ids, stop strings, lengths) at the same
places, every KV slot of the steps after a request's end returned to the pool, the prefix cache
intact. Requests whose next token is not a plain argmax (sampling, logprobs, penalties, bans
before min_new_tokens) and steps with a request waiting run one at a time. Requests on a shared
cached prefix run ahead with cascade attention. A pool too small for the steps ahead falls back
to single steps.
"""

from __future__ import annotations

import pytest
import torch

from arborlm import Engine
from arborlm.errors import InvalidRequestError
from arborlm.runtime.config import EngineArgs
from arborlm.runtime.platforms.cpu import fused_decode
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from arborlm.runtime.platforms.cpu import linear as cpu_linear
from tests.runtime.engine_helpers import GREEDY, DirectScheduler, hf_greedy

# These tests follow the kernels that run without deterministic inference (the causal
# kernel, cascade attention, oneDNN above 128 rows); bfloat16 engines turn it on by default.
NOT_DETERMINISTIC = {"enable_deterministic_inference": False}

pytestmark = pytest.mark.skipif(
    not (cpu_kernels.attention_available(torch.float32) and cpu_linear.packing_available()),
    reason="ArborLM's CPU kernels do not run on this machine")

PROMPTS = [[(11 * i) % 300 + 6 for i in range(13)], [(7 * i) % 250 + 9 for i in range(5)],
           [(5 * i) % 280 + 7 for i in range(21)], [(3 * i) % 290 + 11 for i in range(9)]]
NEW = [14, 5, 23, 9]


def _runs(monkeypatch) -> list[tuple[int, int, bool]]:
    """(steps, batch size, with cascade groups) of every `run_ahead` call from now on."""
    runs: list[tuple[int, int, bool]] = []
    run_ahead = fused_decode.FusedDecodeStep.run_ahead
    cascade_inputs = fused_decode.cascade_inputs
    grouped: list[bool] = []

    def spy_cascade(batch, ahead=0):
        out = cascade_inputs(batch, ahead)
        grouped.append(out is not None)
        return out

    def spy(self, batch, slots):
        out = run_ahead(self, batch, slots)
        runs.append((slots.shape[0], batch.batch_size, grouped[-1]))
        return out

    monkeypatch.setattr(fused_decode, "cascade_inputs", spy_cascade)
    monkeypatch.setattr(fused_decode.FusedDecodeStep, "run_ahead", spy)
    return runs


def _generate(engine: Engine, prompts=PROMPTS, new=NEW, **extra) -> list[dict]:
    return engine.generate(input_ids=prompts, sampling_params=[
        dict(GREEDY, max_new_tokens=n, **extra) for n in new])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runs_of_steps_give_the_tokens_of_single_steps(make_tiny_model, monkeypatch, dtype):
    if dtype == "bfloat16" and not cpu_kernels.available(torch.bfloat16):
        pytest.skip("this CPU lacks AVX512-BF16")
    path = str(make_tiny_model("llama"))
    runs = _runs(monkeypatch)
    with Engine(path, dtype=dtype, **NOT_DETERMINISTIC, num_continuous_decode_steps=4,
                debug_integrity=True) as e:
        ahead = _generate(e)
        info = e.get_server_info()
    # Runs of 4 while every request has 4 more to make, then shorter ones; the batch shrinks
    # from 4 requests to 1 as they finish.
    assert runs and all(2 <= s <= 4 for s, _, _ in runs)
    assert {b for _, b, _ in runs} >= {4, 1} and (4, 4, False) in runs
    assert info["decode_steps"] == max(NEW) - 1
    with Engine(path, dtype=dtype, **NOT_DETERMINISTIC, num_continuous_decode_steps=1) as e:
        single = _generate(e)
    assert len(runs) == sum(s > 1 for s, _, _ in runs)  # none ran with 1 step
    for prompt, n, a, s in zip(PROMPTS, NEW, ahead, single):
        assert a["output_ids"] == s["output_ids"]
        assert len(a["output_ids"]) == n and a["meta_info"]["finish_reason"]["type"] == "length"
        if dtype == "float32":
            assert a["output_ids"] == hf_greedy(path, prompt, n)


def test_stops_inside_a_run_free_the_slots_after_them(make_tiny_model, monkeypatch):
    """A stop id met and a stop string matched in the middle of a run end their requests
    where single steps would; the KV slots of the run's later steps go back to the pool and the
    cache holds exactly what single steps leave in it."""
    path = str(make_tiny_model("llama"))
    runs = _runs(monkeypatch)
    one = DirectScheduler(path, num_continuous_decode_steps=1)
    rids = one.submit(["The quick brown fox", "Once upon a time"],
                      dict(GREEDY, max_new_tokens=20))
    one.run()
    tokens = one.output_ids(rids)
    text = one.builders[rids[1]].result()["text"]
    stop_id, stop_str = tokens[0][6], text[len(text) // 2:len(text) // 2 + 3]
    assert stop_id not in tokens[0][:6]

    def decode(ds: DirectScheduler) -> list[dict]:
        rids = ds.submit(["The quick brown fox", "Once upon a time"],
                         [dict(GREEDY, max_new_tokens=20, stop_token_ids=[stop_id]),
                          dict(GREEDY, max_new_tokens=20, stop=[stop_str])])
        ds.run()
        return [ds.builders[r].result() for r in rids]

    one.scheduler.flush_cache()
    single = decode(one)
    ahead_ds = DirectScheduler(path, num_continuous_decode_steps=8)
    ahead = decode(ahead_ds)
    assert runs and runs[0] == (8, 2, False)
    for a, s in zip(ahead, single):
        assert a["output_ids"] == s["output_ids"] and a["text"] == s["text"]
        assert a["meta_info"]["finish_reason"] == s["meta_info"]["finish_reason"]
    assert ahead[0]["output_ids"][-1] == stop_id and len(ahead[0]["output_ids"]) == 7
    assert ahead[1]["meta_info"]["finish_reason"]["matched"] == stop_str
    assert len(ahead[1]["output_ids"]) < 20
    for ds in (one, ahead_ds):
        ds.scheduler.check_integrity()  # free + cached == all: nothing leaked
    assert ahead_ds.scheduler.cache.total_size() == one.scheduler.cache.total_size()
    assert ahead_ds.scheduler.runner.allocator.available_size() \
        == one.scheduler.runner.allocator.available_size()


@pytest.mark.parametrize("odd", [
    dict(temperature=0.8, sampling_seed=3),
    dict(frequency_penalty=0.5),
    dict(logit_bias={"7": 2.0}),
    dict(min_new_tokens=12, ignore_eos=False),
], ids=["sampled", "penalty", "bias", "min-tokens"])
def test_steps_whose_logits_are_not_a_plain_argmax_run_one_at_a_time(make_tiny_model,
                                                                      monkeypatch, odd):
    path = str(make_tiny_model("llama"))
    runs = _runs(monkeypatch)
    params = [dict(GREEDY, max_new_tokens=12), dict(GREEDY, max_new_tokens=12, **odd)]
    with Engine(path, dtype="float32", num_continuous_decode_steps=4) as e:
        outs = e.generate(input_ids=PROMPTS[:2], sampling_params=params)
    assert runs == []
    assert outs[0]["output_ids"] == hf_greedy(path, PROMPTS[0], 12)


def test_logprobs_and_waiting_requests_take_single_steps(make_tiny_model, monkeypatch):
    path = str(make_tiny_model("llama"))
    runs = _runs(monkeypatch)
    with Engine(path, dtype="float32", num_continuous_decode_steps=4) as e:
        out = e.generate(input_ids=PROMPTS[0], sampling_params=dict(GREEDY, max_new_tokens=9),
                         return_logprob=True)
        assert runs == [] and len(out["meta_info"]["output_token_logprobs"]) == 9
    ds = DirectScheduler(path, num_continuous_decode_steps=4)
    ds.submit(["The quick brown fox"], dict(GREEDY, max_new_tokens=30))
    ds.step()  # the prefill
    ds.submit(["Hello"], dict(GREEDY, max_new_tokens=30))
    before = ds.scheduler.stats["decode_steps"]
    ds.step()  # the new request's prefill: nothing decodes
    assert ds.scheduler.stats["decode_steps"] == before
    ds.step()  # a run of 4 for both
    assert ds.scheduler.stats["decode_steps"] == before + 4


def test_requests_on_a_shared_prefix_run_ahead_with_cascade_attention(make_tiny_model,
                                                                      monkeypatch):
    path = str(make_tiny_model("llama"))
    runs = _runs(monkeypatch)
    shared = [(7 * i) % 400 + 10 for i in range(90)]  # > CASCADE_MIN_PREFIX tokens
    prompts = [shared + [20 + j, 30 + j, 40 + 2 * j] for j in range(3)]
    new = [10, 7, 10]
    with Engine(path, dtype="float32", num_continuous_decode_steps=3) as e:
        e.generate(input_ids=shared + [5], sampling_params={"max_new_tokens": 1})
        outs = _generate(e, prompts, new)
    assert (3, 3, True) in runs
    for prompt, n, out in zip(prompts, new, outs):
        assert out["output_ids"] == hf_greedy(path, prompt, n)


def test_a_pool_too_small_for_the_steps_ahead_falls_back_to_single_steps(make_tiny_model,
                                                                         monkeypatch):
    """Two requests whose prompts and outputs overfill the pool: a run of 8 while there is
    room, then single steps where the steps ahead find no slots (and a retraction where the
    step itself finds none); the tokens are transformers'."""
    from arborlm.runtime.request import Req
    from arborlm.runtime.sampling_params import SamplingParams
    from arborlm.runtime.scheduler.decode import DecodeScheduler

    path = str(make_tiny_model("llama"))
    runs = _runs(monkeypatch)
    asked: list[int] = []
    steps_ahead = DecodeScheduler.steps_ahead
    monkeypatch.setattr(DecodeScheduler, "steps_ahead",
                        lambda self, batch, **kw: asked.append(steps_ahead(self, batch, **kw))
                        or asked[-1])
    prompts = [[(11 * i) % 300 + 6 for i in range(40)], [(7 * i) % 250 + 9 for i in range(40)]]
    ds = DirectScheduler(path, num_continuous_decode_steps=8, max_total_tokens=100,
                         disable_radix_cache=True)
    for i, p in enumerate(prompts):
        params = SamplingParams.from_dict(dict(GREEDY, max_new_tokens=12))
        ds.scheduler.add_request(Req(f"r{i}", p, params, seed=0))
    done: dict = {}
    for _ in range(200):
        for out in ds.scheduler.step():
            done.setdefault(out.rid, []).extend(out.new_token_ids)
        if ds.scheduler.is_idle:
            break
    assert (8, 2, False) in runs
    assert sum(k > 1 for k in asked) > len(runs)  # some runs found no room
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(path, p, 12)
    ds.scheduler.check_integrity()


def test_the_default_runs_ahead_within_its_time_budget(make_tiny_model, monkeypatch):
    path = str(make_tiny_model("llama"))
    runs = _runs(monkeypatch)
    with Engine(path, dtype="float32") as e:  # num_continuous_decode_steps unset
        out = e.generate(input_ids=PROMPTS[0], sampling_params=dict(GREEDY, max_new_tokens=40))
    assert runs and max(s for s, _, _ in runs) == 8  # a tiny model's step is well under 6 ms
    assert out["output_ids"] == hf_greedy(path, PROMPTS[0], 40)


def test_the_option_is_checked():
    with pytest.raises(InvalidRequestError, match="num_continuous_decode_steps must be >= 1"):
        EngineArgs(num_continuous_decode_steps=0).resolve()


def test_decode_steps_arguments_are_checked():
    one = torch.zeros(1, dtype=torch.int64)
    pool = [torch.zeros(8, 1, 16)]
    table = torch.zeros(4, 16)
    hidden, vec = 16, torch.ones(16)
    layer = [vec, cpu_kernels.pack_panels(torch.zeros(48, hidden)), None,
             cpu_kernels.pack_panels(torch.zeros(16, 16)), None, vec,
             cpu_kernels.pack_panels(torch.zeros(64, 16)), None,
             cpu_kernels.pack_panels(torch.zeros(16, 32)), None]
    tail = [torch.zeros(10, hidden), vec, cpu_kernels.pack_panels(torch.zeros(10, 16))]
    args = (layer + tail, pool, pool, table, table, 1e-6, 0.25, 1, 1, 16, 32)
    with pytest.raises(RuntimeError, match=r"slot must be \[steps, 1\]"):
        torch.ops.arborlm.decode_steps(one, one, one, one.view(1, 1), one, *args)
    with pytest.raises(RuntimeError, match="slot 9 outside the pool"):
        torch.ops.arborlm.decode_steps(one, one, torch.tensor([[1], [9]]), one.view(1, 1),
                                       one + 1, *args)
    with pytest.raises(RuntimeError, match="3 steps need slot rows of 4, got 2"):
        torch.ops.arborlm.decode_steps(one, one, torch.tensor([[1], [2], [3]]),
                                       torch.tensor([[1, 2]]), one + 2, *args)
    # Three steps from token 3 at position 0 over slots 1-3: every step's position and slot
    # is its own, and the tokens are argmaxes of a vocabulary of 10.
    out = torch.ops.arborlm.decode_steps(one + 3, one, torch.tensor([[1], [2], [3]]),
                                         torch.tensor([[1, 2, 3]]), one + 1, *args)
    assert out.shape == (3, 1) and out.dtype == torch.int64 and 0 <= int(out.min()) <= 9
