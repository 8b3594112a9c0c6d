"""The radix cache inside the engine: exactness, reuse accounting, flush, eviction, policies."""

from __future__ import annotations

import pytest

from arborlm import Engine
from arborlm.radix_cache import NoOpCache, RadixCache
from tests.runtime.engine_helpers import GREEDY, DirectScheduler, hf_logprobs, hf_tokenizer

BASE = ("System: you are a careful assistant that answers briefly. Examples: one, two, three, "
        "four. Question:")


@pytest.fixture(scope="module")
def path(make_tiny_model):
    return str(make_tiny_model("llama"))


def _variants(path: str) -> list[list[int]]:
    """Prompts sharing a prefix of every length with BASE, including all of it."""
    ids = hf_tokenizer(path).encode(BASE)
    tail = hf_tokenizer(path).encode(" and then what?", add_special_tokens=False)
    out = [ids]  # the whole prompt again
    out += [ids[:k] + tail for k in range(1, len(ids) + 1, 3)]
    return out


@pytest.fixture(scope="module")
def reference(path):
    engine = Engine(path, dtype="float32", disable_radix_cache=True)
    return [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"]
            for p in _variants(path)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_identical_with_cache_cold_and_warm(path, reference, page_size):
    engine = Engine(path, dtype="float32", page_size=page_size, debug_integrity=True)
    prompts = _variants(path)
    cold = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    assert cold == reference
    warm = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in warm] == reference
    cached = [o["meta_info"]["cached_tokens"] for o in warm]
    assert all(c % page_size == 0 for c in cached)
    if page_size == 1:
        assert all(c > 0 for c in cached)
    else:
        assert max(cached) >= 2 * page_size
    engine.check_integrity()


def test_cached_tokens_reported(path):
    engine = Engine(path, dtype="float32")
    ids = hf_tokenizer(path).encode(BASE)
    first = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    again = engine.generate(input_ids=ids, sampling_params=GREEDY)
    # everything but the last prompt token (whose logits are needed) comes from the cache
    assert again["meta_info"]["cached_tokens"] == len(ids) - 1
    assert again["output_ids"] == first["output_ids"]
    # the previous output is cached too: a follow-up turn reuses prompt + answer
    turn2 = ids + first["output_ids"] + hf_tokenizer(path).encode(" ok", add_special_tokens=False)
    out = engine.generate(input_ids=turn2, sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] >= len(ids) + len(first["output_ids"]) - 1


def test_extra_key_isolates_namespaces(path):
    engine = Engine(path, dtype="float32")
    ids = hf_tokenizer(path).encode(BASE)
    engine.generate(input_ids=ids, sampling_params=GREEDY, extra_key="tenant-a")
    other = engine.generate(input_ids=ids, sampling_params=GREEDY, extra_key="tenant-b")
    assert other["meta_info"]["cached_tokens"] == 0
    same = engine.generate(input_ids=ids, sampling_params=GREEDY, extra_key="tenant-a")
    assert same["meta_info"]["cached_tokens"] == len(ids) - 1


def test_disable_radix_cache_selects_noop(path):
    engine = Engine(path, dtype="float32", disable_radix_cache=True, debug_integrity=True)
    assert isinstance(engine.scheduler.cache, NoOpCache)
    ids = hf_tokenizer(path).encode(BASE)
    for _ in range(2):
        out = engine.generate(input_ids=ids, sampling_params=GREEDY)
        assert out["meta_info"]["cached_tokens"] == 0
    assert isinstance(Engine(path, dtype="float32").scheduler.cache, RadixCache)


def test_flush_cache_refuses_while_running_then_empties(path):
    d = DirectScheduler(path)
    d.submit(BASE, GREEDY)
    d.step()
    ok, reason = d.scheduler.flush_cache()
    assert not ok and "pending" in reason
    d.run()
    assert d.scheduler.cache.total_size() > 0
    ok, _ = d.scheduler.flush_cache()
    assert ok and d.scheduler.cache.total_size() == 0
    d.scheduler.check_integrity()


def test_prompt_logprobs_are_recomputed_not_taken_from_cache(path):
    engine = Engine(path, dtype="float32")
    ids = hf_tokenizer(path).encode(BASE)
    engine.generate(input_ids=ids, sampling_params=GREEDY)  # warm the cache
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                          return_logprob=True, logprob_start_len=3)
    inp = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in inp] == ids[3:]
    ref = hf_logprobs(path, ids)
    for j, (lp, tid, _) in enumerate(inp):
        assert lp == pytest.approx(float(ref[2 + j, tid]), abs=1e-4)
    assert out["meta_info"]["cached_tokens"] <= 2


def test_eviction_frees_cache_before_retracting(path):
    # A small pool fills with cached prefixes of finished requests; new, unrelated requests
    # must evict them rather than retract anything.
    engine = Engine(path, dtype="float32", max_total_tokens=256, debug_integrity=True)
    tok = hf_tokenizer(path)
    for i in range(8):
        engine.generate(input_ids=tok.encode(f"{i} " * 20), sampling_params=GREEDY)
    info = engine.get_server_info()
    assert info["cached_kv_tokens"] > 100
    engine.generate(input_ids=[tok.encode(f"x{i} " * 20) for i in range(4)],
                    sampling_params=GREEDY)
    assert engine.get_server_info()["retractions"] == 0
    engine.check_integrity()


def test_running_requests_are_findable_while_they_grow(path):
    from arborlm.runtime.scheduler import decode as sched_mod

    d = DirectScheduler(path)
    rid = d.submit(BASE, {**GREEDY, "max_new_tokens": 3 * sched_mod.CACHE_RUNNING_EVERY})[0]
    for _ in range(sched_mod.CACHE_RUNNING_EVERY + 3):
        d.step()
    running = d.scheduler.running[0]
    assert running.cached_len > running.prompt_len  # its own output is now in the tree
    prefix = running.fill_ids[:running.computed_len]
    match = d.scheduler.cache.match_prefix(prefix)
    assert len(match.slots) >= running.prompt_len + sched_mod.CACHE_RUNNING_EVERY - 1
    d.run()
    assert d.builders[rid].finished


def _prime(d: DirectScheduler, text: str) -> None:
    d.submit(text, {**GREEDY, "max_new_tokens": 1})
    d.run()


def test_lpm_orders_by_cached_prefix(path):
    d = DirectScheduler(path, schedule_policy="lpm")
    _prime(d, BASE)
    d.submit(["unrelated words here", BASE + " more", "x"], GREEDY)
    order = [r.rid for r in d.scheduler.waiting.ordered()]
    cached_first = d.scheduler.waiting.ordered()[0]
    assert cached_first.origin_input_ids[:5] == hf_tokenizer(path).encode(BASE)[:5]
    assert len(order) == 3


def test_lpm_aging_admits_uncached_request(path):
    """Regression for SGLang's lpm starvation: a stream of cache-hitting requests must not
    keep an uncached request waiting forever."""
    d = DirectScheduler(path, schedule_policy="lpm", max_running_requests=1)
    _prime(d, BASE)
    starving = d.submit("zzz completely different prompt", {**GREEDY, "max_new_tokens": 1})[0]
    admitted_at = None
    for step in range(200):
        d.submit(BASE + f" q{step}", {**GREEDY, "max_new_tokens": 1})  # keeps arriving
        d.step()
        if d.builders[starving].finished:
            admitted_at = step
            break
    max_wait = d.scheduler.waiting.max_wait_steps
    assert admitted_at is not None and admitted_at <= 2 * max_wait + 4


def test_dfs_weight_keeps_fork_siblings_together(path):
    d = DirectScheduler(path, schedule_policy="dfs-weight")
    a, b = BASE, "Another shared system prompt that is long enough to matter here:"
    _prime(d, a)
    _prime(d, b)
    d.submit([a + " 1", b + " 1", a + " 2", b + " 2", a + " 3"], GREEDY)
    groups = [r.origin_input_ids[:4] == hf_tokenizer(path).encode(a)[:4]
              for r in d.scheduler.waiting.ordered()]
    assert groups in ([True] * 3 + [False] * 2, [False] * 2 + [True] * 3)


def test_requests_arriving_together_share_their_prefix(path):
    engine = Engine(path, dtype="float32", debug_integrity=True)
    shared = BASE * 3
    prompts = [shared + f" q{i}" for i in range(8)]
    outs = engine.generate(prompts, GREEDY)
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    n_shared = len(hf_tokenizer(path).encode(shared)) - 2
    assert cached.count(0) == 1 and all(c >= n_shared for c in cached if c)
    alone = Engine(path, dtype="float32", disable_radix_cache=True).generate(prompts, GREEDY)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in alone]
