"""Online serving: request throughput and latency of `arborlm serve` under load, one run.

Starts the server (or uses `--url`), streams requests to the native `/generate` and reports
request throughput, output tokens/s, time to first token (TTFT) and time per output token
(TPOT = (latency - TTFT) / (output tokens - 1)), median and p99. Workloads:

- `random`: `--num-prompts` prompts of 32–512 random tokens, 16–128 new tokens each, sent at a
  Poisson rate (`--request-rate`) and at unbounded concurrency (all at once).
- `shared-prefix` (the radix-cache workload): 8 groups × 16 requests; each group shares a
  1,024-token system prompt, each request adds a 64-token question and asks for 32 new tokens;
  unbounded concurrency.

The peer is the same server with `--disable-radix-cache`, run on the same workloads in the same
run, so the table shows what prefix reuse buys (and what it costs on prompts that share
nothing). Greedy decoding with `ignore_eos`, so every request produces its asked length.

    python benchmarks/serving.py                       # the default model, both servers
    python benchmarks/serving.py --num-prompts 32 --request-rate 2 --skip-peer
    python benchmarks/serving.py --url http://127.0.0.1:30000   # a running server only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

READY = re.compile(r"ArborLM server ready at (http://[\d.]+:\d+)")
FIRST_REGULAR_ID = 16  # below: special tokens of the built-in tokenizers


@dataclass
class Request:
    input_ids: list[int]
    max_new_tokens: int


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    error: str = ""


# --- workloads -----------------------------------------------------------------------------------


def random_workload(n: int, vocab: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(FIRST_REGULAR_ID, vocab) for _ in range(rng.randint(32, 512))],
                    rng.randint(16, 128)) for _ in range(n)]


def shared_prefix_workload(vocab: int, seed: int, groups: int = 8, per_group: int = 16,
                           system_len: int = 1024, question_len: int = 64,
                           new_tokens: int = 32) -> list[Request]:
    rng = random.Random(seed)
    tok = lambda k: [rng.randrange(FIRST_REGULAR_ID, vocab) for _ in range(k)]  # noqa: E731
    out = []
    for _ in range(groups):
        system = tok(system_len)
        out += [Request(system + tok(question_len), new_tokens) for _ in range(per_group)]
    rng.shuffle(out)
    return out


# --- client --------------------------------------------------------------------------------------


async def send(client: httpx.AsyncClient, req: Request) -> Result:
    body = {"input_ids": req.input_ids, "stream": True,
            "sampling_params": {"max_new_tokens": req.max_new_tokens, "temperature": 0,
                                "ignore_eos": True}}
    start = time.perf_counter()
    ttft, tokens = 0.0, 0
    try:
        async with client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                return Result(False, error=f"{r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Result(False, error=str(event["error"]))
                tokens = event["meta_info"]["completion_tokens"]
                if tokens and not ttft:
                    ttft = time.perf_counter() - start
    except httpx.HTTPError as e:
        return Result(False, error=repr(e))
    return Result(True, ttft, time.perf_counter() - start, tokens)


async def run_load(url: str, requests: list[Request], rate: float,
                   seed: int) -> tuple[list[Result], float]:
    """Send `requests` at a Poisson `rate` per second (inf: all at once); results and wall."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(send(client, req)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def summarize(results: list[Result], wall: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0].error}")
    ttft = sorted(r.ttft for r in ok)
    tpot = sorted((r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1)
    return {"req/s": len(ok) / wall, "out tok/s": sum(r.output_tokens for r in ok) / wall,
            "ttft p50": _pct(ttft, 50), "ttft p99": _pct(ttft, 99),
            "tpot p50": _pct(tpot, 50), "tpot p99": _pct(tpot, 99), "wall": wall}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


# --- servers -------------------------------------------------------------------------------------


class Server:
    """`python -m arborlm.server` on a free port, stopped with SIGTERM."""

    def __init__(self, flags: list[str]):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="arborlm-bench-", suffix=".log")
        self.proc = subprocess.Popen([sys.executable, "-m", "arborlm.server", "--port", "0",
                                      *flags], stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self.url = self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float = 600) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = Path(self.log.name).read_text(errors="replace")
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{text}")
            match = READY.search(text)
            if match:
                return match.group(1)
            time.sleep(0.5)
        raise RuntimeError("server not ready in time")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def bench_server(url: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    info = httpx.get(url + "/get_model_info", timeout=30).json()
    vocab = info["vocab_size"]
    warm = random_workload(4, vocab, seed=99)
    asyncio.run(run_load(url, warm, float("inf"), 0))
    rows = {}
    loads = [(f"random, Poisson {args.request_rate:g} req/s",
              random_workload(args.num_prompts, vocab, args.seed), args.request_rate),
             ("random, all at once", random_workload(args.num_prompts, vocab, args.seed),
              float("inf")),
             ("shared prefix 8x16, all at once", shared_prefix_workload(vocab, args.seed),
              float("inf"))]
    for name, requests, rate in loads:
        httpx.post(url + "/flush_cache", timeout=60)
        before = _prompt_tokens(url)
        results, wall = asyncio.run(run_load(url, requests, rate, args.seed))
        rows[name] = summarize(results, wall)
        cached, computed = (a - b for a, b in zip(_prompt_tokens(url), before))
        rows[name]["cache hit"] = cached / (cached + computed) if cached + computed else 0.0
    return rows


def _prompt_tokens(url: str) -> tuple[int, int]:
    """(prompt tokens served from the cache, prompt tokens computed) since the server started."""
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    return info["cached_tokens"], info["prefill_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="benchmark this running server (no peer)")
    ap.add_argument("--model-path", default=None, help="default: the built-in default model")
    ap.add_argument("--engine-mode", default=None, help="server --engine-mode")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-peer", action="store_true", help="no --disable-radix-cache run")
    args = ap.parse_args()

    flags = ["--model-path", args.model_path] if args.model_path else []
    flags += ["--engine-mode", args.engine_mode] if args.engine_mode else []
    runs: dict[str, dict[str, dict[str, float]]] = {}
    if args.url:
        runs["server"] = bench_server(args.url, args)
    else:
        for label, extra in [("radix cache", []), ("no cache (peer)", ["--disable-radix-cache"])]:
            if extra and args.skip_peer:
                continue
            server = Server(flags + extra)
            try:
                runs[label] = bench_server(server.url, args)
            finally:
                server.stop()
    header = ("server", "workload", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms",
              "TPOT p50 ms", "TPOT p99 ms", "cache hit")
    rows = [(label, name, f"{m['req/s']:.2f}", f"{m['out tok/s']:.1f}",
             f"{1e3 * m['ttft p50']:.0f}", f"{1e3 * m['ttft p99']:.0f}",
             f"{1e3 * m['tpot p50']:.1f}", f"{1e3 * m['tpot p99']:.1f}", f"{m['cache hit']:.0%}")
            for label, per_load in runs.items() for name, m in per_load.items()]
    print(f"model {args.model_path or 'default'}; {args.num_prompts} random prompts "
          f"(32-512 tokens in, 16-128 out); shared prefix: 8 groups x 16, 1024 + 64 tokens in, "
          f"32 out; greedy, ignore_eos; streaming /generate")
    print(table(rows, header))
    if len(runs) == 2:
        cached, peer = runs["radix cache"], runs["no cache (peer)"]
        for name in cached:
            print(f"{name}: radix / no cache = {cached[name]['req/s'] / peer[name]['req/s']:.2f}x "
                  f"req/s, TTFT p50 {cached[name]['ttft p50'] / peer[name]['ttft p50']:.2f}x")


if __name__ == "__main__":
    main()
