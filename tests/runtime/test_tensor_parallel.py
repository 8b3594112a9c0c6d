"""Tensor parallelism on CPU (gloo, real rank processes on loopback): TP=2 greedy tokens equal
TP=1's and their logprobs agree within 1e-4 (float32) on each tiny architecture, with KV heads
split and replicated; the same across two "nodes" (node 1 started as `arborlm serve --node-rank
1`); and a killed rank ends the engine with an error naming it, with no hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from arborlm import Engine
from arborlm.errors import InvalidRequestError, ModelLoadError
from arborlm.runtime.config import ModelConfig
from arborlm.runtime.distributed.group import free_loopback_address
from arborlm.runtime.distributed.shard import TPShard
from tests.runtime.engine_helpers import PROMPTS

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
LOGPROB_TOL = 1e-4
HANG_S = 120.0  # a call still unanswered after this has hung


def _generate(path, prompts=PROMPTS[:4], **options) -> list[dict]:
    engine = Engine(str(path), dtype="float32", max_total_tokens=4096, **options)
    try:
        first = engine.generate(prompts, GREEDY, return_logprob=True, top_logprobs_num=2)
        again = engine.generate(prompts, GREEDY, return_logprob=True,
                                top_logprobs_num=2)  # prefix-cache hits
        return first + again
    finally:
        engine.shutdown()


def _assert_same(ref: list[dict], got: list[dict], tol: float = LOGPROB_TOL) -> None:
    """Greedy tokens equal, their logprobs within `tol`. A token may differ only where the
    reference's two best were within `2 tol` of each other: a tie that the sums' rounding
    decides (the int8 paths' tolerance is wide enough to hold such ties); that request's
    comparison ends there, its continuations being different texts."""
    for a, b in zip(ref, got, strict=True):
        assert len(b["output_ids"]) == len(a["output_ids"])
        la = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
        lb = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
        tops = a["meta_info"]["output_top_logprobs"]
        for i, (ta, tb) in enumerate(zip(a["output_ids"], b["output_ids"], strict=True)):
            if ta != tb:
                gap = tops[i][0][0] - tops[i][1][0]
                assert gap < 2 * tol, (i, ta, tb, gap)
                break
            assert abs(la[i] - lb[i]) < tol, (i, la[i], lb[i])


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),  # 4 heads, 2 KV heads: one KV head per rank
    ("llama", {"num_kv_heads": 1}),  # one KV head, replicated on both ranks
    ("llama", {"vocab_size": 515, "tie_word_embeddings": True}),  # rank 1's rows padded; tied
    ("qwen2", {}),  # q/k/v biases (column-parallel), no o bias
    ("qwen3", {}),  # q/k RMSNorm per head
])
def test_tp2_greedy_equals_tp1(make_tiny_model, arch, overrides):
    path = make_tiny_model(arch, **overrides)
    _assert_same(_generate(path), _generate(path, tp_size=2))


def test_tp2_with_chunks_pages_and_shared_prefixes(make_tiny_model):
    """Chunked prefill, pages of 4 and prompts sharing a long prefix (cache hits, in-batch
    prefix dedup): the rows of `req_to_token` rank 0 writes reach the other rank every step."""
    system = "You are a helpful assistant. Answer briefly and precisely. " * 3
    prompts = [system + p for p in PROMPTS]
    options = {"chunked_prefill_size": 16, "page_size": 4, "max_running_requests": 4}
    _assert_same(_generate(make_tiny_model("llama"), prompts, **options),
                 _generate(make_tiny_model("llama"), prompts, tp_size=2, **options))


def test_tp2_across_two_nodes_on_loopback(make_tiny_model):
    """Node 1 runs only its rank (`arborlm serve --node-rank 1`) and takes the model and options
    from node 0; it exits 0 when node 0's engine shuts down."""
    path = make_tiny_model("llama")
    addr = free_loopback_address()
    node1 = subprocess.Popen([sys.executable, "-m", "arborlm.server", "--tp-size", "2",
                              "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr])
    try:
        got = _generate(path, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr)
        assert node1.wait(timeout=HANG_S) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
    _assert_same(_generate(path), got)


def test_idle_longer_than_the_timeout_keeps_the_ranks(make_tiny_model):
    """While rank 0 idles it sends keep-alives, so the other ranks' wait for the next batch
    (bounded by dist_timeout) never runs out: after idling several timeouts long the engine
    serves the same tokens."""
    engine = Engine(str(make_tiny_model("llama")), dtype="float32", max_total_tokens=4096,
                    tp_size=2, dist_timeout=4.0)
    try:
        want = engine.generate(PROMPTS[0], GREEDY)["output_ids"]
        leader = engine.client.scheduler.runner.leader
        deadline = time.monotonic() + HANG_S
        while leader.keep_alives < 6:  # idle >= 6 s: one keep-alive a second at most
            assert time.monotonic() < deadline, "no keep-alives"
            time.sleep(0.1)
        assert engine.generate(PROMPTS[0], GREEDY)["output_ids"] == want
    finally:
        engine.shutdown()


def test_killed_rank_ends_the_engine_with_its_name(make_tiny_model):
    engine = Engine(str(make_tiny_model("llama")), dtype="float32", max_total_tokens=4096,
                    tp_size=2)
    try:
        leader = engine.client.scheduler.runner.leader
        assert leader.group.backend == "gloo"  # CPU ranks (CUDA ones: NCCL, gpu_check.py)
        worker = leader.workers[1]
        assert len(engine.generate(PROMPTS[0], GREEDY)["output_ids"]) == 12
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        start = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(engine.generate, PROMPTS[1], GREEDY)
            with pytest.raises(RuntimeError, match=rf"tensor-parallel rank 1 \(pid {worker.pid}\)"
                                                   r" exited with code -9"):
                call.result(timeout=HANG_S)
        assert time.monotonic() - start < HANG_S
        assert not engine.client.healthy()
    finally:
        engine.shutdown()


def test_model_that_does_not_split_is_refused_before_any_rank_starts(make_tiny_model):
    with pytest.raises(ModelLoadError, match="tp_size 3 does not divide 4 attention heads"):
        Engine(str(make_tiny_model("llama")), dtype="float32", tp_size=3)


def test_an_engine_on_a_node_other_than_0_is_refused(make_tiny_model):
    with pytest.raises(InvalidRequestError, match="arborlm serve --node-rank 1"):
        Engine(str(make_tiny_model("llama")), dtype="float32", tp_size=2, nnodes=2,
               node_rank=1, dist_init_addr="127.0.0.1:1")


def test_shard_ranges_and_vocabulary_padding(make_tiny_model):
    """Each rank's slice of a tensor, for split and replicated KV heads and a vocabulary the
    ranks do not divide (the last rank's rows padded with zeros)."""
    config = ModelConfig.from_path(make_tiny_model("llama"), "float32").replace(
        num_heads=8, num_kv_heads=2, vocab_size=10, head_dim=2, intermediate_size=8)
    shards = [TPShard.of(config, r, 4) for r in range(4)]
    assert [s.kv_head_start for s in shards] == [0, 0, 1, 1]  # 2 KV heads over 4 ranks
    assert {(s.num_heads, s.num_kv_heads, s.vocab_rows) for s in shards} == {(2, 1, 3)}
    k = torch.arange(4 * 3).reshape(4, 3)  # 2 KV heads of dim 2, rows by head
    assert shards[3].take("model.layers.0.self_attn.k_proj.weight", k).tolist() == k[2:].tolist()
    q = torch.arange(16)
    assert shards[1].take("model.layers.0.self_attn.q_proj.bias", q).tolist() == [4, 5, 6, 7]
    o = torch.arange(3 * 16).reshape(3, 16)  # columns by query head
    assert shards[2].take("model.layers.0.self_attn.o_proj.weight", o).tolist() == \
        o[:, 8:12].tolist()
    bias = torch.ones(3)
    assert shards[0].take("model.layers.0.mlp.down_proj.bias", bias).tolist() == [1, 1, 1]
    assert shards[1].take("model.layers.0.mlp.down_proj.bias", bias).tolist() == [0, 0, 0]
    emb = torch.arange(10).unsqueeze(1).float()  # [vocab 10, hidden 1]
    parts = [s.take("model.embed_tokens.weight", emb).squeeze(1).tolist() for s in shards]
    assert parts == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 0]]
    norm = torch.ones(5)
    assert shards[2].take("model.layers.0.input_layernorm.weight", norm) is norm
