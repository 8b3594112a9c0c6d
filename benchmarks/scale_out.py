"""Scale-out: cache-aware vs round-robin routing over 2 replicas, on a multi-tenant workload.

8 tenants, each with its own system prompt, × 32 requests (the system prompt + a question of
its own), shuffled, sent 16 at a time through `arborlm router` to two `arborlm serve` workers.
Each worker's KV pool (`--max-total-tokens`) holds about half the tenants' prompts beside the
running requests: round-robin makes each worker cache every tenant (and evict), cache-aware
keeps each tenant on one worker. For each policy: the cache hit rate (cached prompt tokens /
prompt tokens, from the responses' `meta_info`) and the throughput (output tokens/s, end to
end). The policies alternate, `--rounds` times each (caches flushed between runs); medians.
`--mode dp` runs the same workload on one `arborlm serve --dp-size 2` per policy
(`--load-balance-method`) instead of a router over two servers.

    python benchmarks/scale_out.py                         # random-llama-40m, 2 rounds
    python benchmarks/scale_out.py --mode dp
    python benchmarks/scale_out.py --model-path /path/to/model --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

READY = re.compile(r"ArborLM server ready at (http://[\d.]+:\d+)")
TENANTS, PER_TENANT = 8, 32
WORDS = ("alpha beta gamma delta river mountain cloud stone garden window paper light city "
         "music number table orange silver forest engine market winter signal harbor").split()


@contextlib.contextmanager
def process(cmd: list[str], timeout_s: float = 600.0) -> Iterator[str]:
    """Run `cmd` (a server or router) until its ready line; yield its URL; SIGTERM it after."""
    log = Path(tempfile.mkstemp(prefix="scale-out-", suffix=".log")[1])
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + timeout_s
        while not (match := READY.search(log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[2]} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.unlink(missing_ok=True)


def workload(system_words: int, question_words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    systems = [f"Tenant {t}: " + " ".join(rng.choices(WORDS, k=system_words))
               for t in range(TENANTS)]
    prompts = [f"{system}\nQuestion {i}: " + " ".join(rng.choices(WORDS, k=question_words))
               for system in systems for i in range(PER_TENANT)]
    rng.shuffle(prompts)
    return prompts


def run(router: str, prompts: list[str], new_tokens: int, concurrency: int) -> dict[str, float]:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    with httpx.Client(base_url=router, timeout=600) as client:
        def one(prompt: str) -> dict:
            r = client.post("/generate", json={"text": prompt, "sampling_params": params})
            r.raise_for_status()
            return r.json()["meta_info"]

        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            metas = list(pool.map(one, prompts))
        wall = time.perf_counter() - start
        client.post("/flush_cache").raise_for_status()
    prompt = sum(m["prompt_tokens"] for m in metas)
    return {"hit_rate": sum(m["cached_tokens"] for m in metas) / prompt,
            "tok_s": sum(m["completion_tokens"] for m in metas) / wall, "wall_s": wall}


@contextlib.contextmanager
def front(server: list[str], policy: str, workers: list[str]) -> Iterator[str]:
    """The URL requests go to: a router over the `workers` (the same two servers for every
    run, caches flushed in between), or without workers one server with two replicas."""
    if workers:
        cmd = [sys.executable, "-m", "arborlm.routing.cli", "--port", "0", "--policy", policy,
               "--worker-urls", *workers]
    else:
        cmd = [*server, "--dp-size", "2", "--load-balance-method", policy]
    with process(cmd) as url:
        yield url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default="random-llama-40m")
    parser.add_argument("--max-total-tokens", type=int, default=2560,
                        help="each worker's KV pool in tokens")
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--question-words", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--mode", choices=("router", "dp"), default="router")
    args = parser.parse_args()
    server = [sys.executable, "-m", "arborlm.server", "--model-path", args.model_path,
              "--port", "0", "--max-total-tokens", str(args.max_total_tokens)]
    prompts = workload(args.system_words, args.question_words)
    results: dict[str, list[dict[str, float]]] = {"cache_aware": [], "round_robin": []}
    with contextlib.ExitStack() as stack:
        workers = [] if args.mode == "dp" else [stack.enter_context(process(server))
                                                 for _ in range(2)]
        for round_ in range(args.rounds):
            for policy in results:
                with front(server, policy, workers) as url:
                    r = run(url, prompts, args.new_tokens, args.concurrency)
                results[policy].append(r)
                print(f"round {round_ + 1} {policy:12s} hit rate {r['hit_rate']:.3f}  "
                      f"{r['tok_s']:7.1f} tok/s  ({r['wall_s']:.1f} s)", flush=True)
    med = {p: {k: statistics.median(r[k] for r in rs) for k in ("hit_rate", "tok_s")}
           for p, rs in results.items()}
    ca, rr = med["cache_aware"], med["round_robin"]
    print(f"\n{len(prompts)} requests ({TENANTS} tenants x {PER_TENANT}), 2 replicas "
          f"({args.mode}), "
          f"medians of {args.rounds} rounds")
    print(f"{'policy':12s} {'hit rate':>9s} {'tok/s':>8s}")
    for policy, m in med.items():
        print(f"{policy:12s} {m['hit_rate']:9.3f} {m['tok_s']:8.1f}")
    print(f"cache_aware / round_robin: hit rate x{ca['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}"
          f", throughput x{ca['tok_s'] / rr['tok_s']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
