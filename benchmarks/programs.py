"""LLM programs through the DSL against the server: radix cache on vs off, in one run.

Workloads shaped like the SGLang paper's (all greedy, each program an independent request
stream, every workload submitted with `run_batch` so the server batches the programs):

- few_shot_mc      few-shot multiple choice: a long shared few-shot prefix, one question, and
                   `select` over four option letters (MMLU-style).
- tree_of_thought  a shared instruction context and a question; `fork` into plans, `fork`
                   each plan into steps (nested), then `select` the best plan.
- multi_turn_chat  a shared system prompt and three user turns, each answered by a `gen`.
- json_decode      a shared extraction prompt and a `gen` constrained by a JSON schema.

Two servers on the same model are started here one after the other — the second with
`--disable-radix-cache` — unless `--url-on` / `--url-off` name running ones. Before each
workload the cache is flushed, so every figure includes filling the cache. Reported per
workload: programs/s with the cache on and off, the speedup, the prompt tokens the server
actually prefilled, the cache hit rate (cached / (cached + prefilled) prompt tokens), and
whether both runs produced the same text. The DSL skips its prefill-only warm-ups against the
cache-off server (they would only cost time), so "off" is the best the DSL does without a cache.

    python benchmarks/programs.py                       # the default model, servers started here
    python benchmarks/programs.py --scale 2 --model-path /path/to/model
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from program_workloads import WORKLOADS  # noqa: E402

import arborlm as sgl  # noqa: E402

READY = re.compile(r"ArborLM server ready at (http://[\d.]+:\d+)")
STARTUP_TIMEOUT_S = 300.0
WORKLOAD_SIZES = {"few_shot_mc": 16, "tree_of_thought": 8, "multi_turn_chat": 8,
                  "json_decode": 8}


class Server:
    """`python -m arborlm.server` in a subprocess on a free port; stopped with SIGTERM."""

    def __init__(self, model_path: str | None, flags: list[str]):
        self.log = Path(tempfile.mkstemp(prefix="arborlm-bench-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "arborlm.server", "--host", "127.0.0.1", "--port", "0",
               *(["--model-path", model_path] if model_path else []), *flags]
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = self._wait_ready()

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log.read_text()[-3000:]}")
            match = READY.search(self.log.read_text(errors="replace"))
            if match:
                return match.group(1)
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.unlink(missing_ok=True)


def run_workload(backend: Any, name: str, scale: float) -> dict[str, Any]:
    program, batch = WORKLOADS[name](max(1, round(scale * WORKLOAD_SIZES[name])))
    assert sgl.flush_cache(backend)
    before = backend.get_server_info()
    start = time.perf_counter()
    states = program.run_batch(batch, backend=backend, temperature=0)
    elapsed = time.perf_counter() - start
    after = backend.get_server_info()
    errors = [s.error() for s in states if s.error() is not None]
    if errors:
        raise RuntimeError(f"{name}: {len(errors)} programs failed, first: {errors[0]!r}")
    prefilled = after["prefill_tokens"] - before["prefill_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    return {"programs": len(states), "seconds": elapsed, "throughput": len(states) / elapsed,
            "prefilled": prefilled, "hit_rate": cached / max(1, cached + prefilled),
            "texts": [s.text() for s in states]}


def run_all(url: str, names: list[str], scale: float) -> dict[str, dict[str, Any]]:
    with sgl.RuntimeEndpoint(url) as backend:
        return {name: run_workload(backend, name, scale) for name in names}


def grammar_enforced(url: str) -> bool:
    with sgl.RuntimeEndpoint(url) as backend:
        out = backend.request({"text": "x", "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "regex": "(zq){3}"}})
    return out["text"] == "zqzqzq"


def measure(args: argparse.Namespace, names: list[str]) -> tuple[dict, dict, bool]:
    results: dict[str, dict] = {}
    grammar = False
    for key, url, flags in (("on", args.url_on, []),
                            ("off", args.url_off, ["--disable-radix-cache"])):
        server = None
        if url is None:
            print(f"starting a server with the radix cache {key} ...", flush=True)
            server = Server(args.model_path, flags)
            url = server.url
        try:
            results[key] = run_all(url, names, args.scale)
            grammar = grammar or grammar_enforced(url)
        finally:
            if server is not None:
                server.stop()
    return results["on"], results["off"], grammar


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None, help="default: the built-in default model")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the program counts")
    ap.add_argument("--workloads", default=",".join(WORKLOAD_SIZES))
    ap.add_argument("--url-on", default=None, help="a running server with the radix cache")
    ap.add_argument("--url-off", default=None, help="a running server without it")
    args = ap.parse_args()
    names = [n for n in args.workloads.split(",") if n]
    on, off, grammar = measure(args, names)
    header = ("workload", "programs", "on prog/s", "off prog/s", "speedup", "on prefilled",
              "off prefilled", "on hit rate", "off hit rate", "same text")
    rows = []
    for name in names:
        a, b = on[name], off[name]
        same = sum(x == y for x, y in zip(a["texts"], b["texts"]))
        rows.append((name, a["programs"], f"{a['throughput']:.2f}", f"{b['throughput']:.2f}",
                     f"{a['throughput'] / b['throughput']:.2f}x", a["prefilled"],
                     b["prefilled"], f"{a['hit_rate']:.1%}", f"{b['hit_rate']:.1%}",
                     f"{same}/{a['programs']}"))
    from common import table

    print(table(rows, header))
    print(f"model: {args.model_path or 'the built-in default model'}; json_schema "
          f"{'enforced' if grammar else 'NOT enforced (no grammar support in this server)'}")


if __name__ == "__main__":
    main()
