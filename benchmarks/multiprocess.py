"""Multi-process vs in-process engine, in one run: offline throughput and IPC round trips.

1. Throughput: the offline workload of `offline_throughput.py` (64 prompts of 32–512 random
   tokens, 64–128 new tokens each, greedy, ignore_eos) on the default model, sent as separate
   requests with at most `--concurrency` in flight (each level in turn), through an in-process
   and a multi-process `Engine`. Runs alternate between the two engines (`--repeats`, the
   order flipped every repeat) so that drifting machine load hits both alike. Prints output
   tokens/s of the median and of the best run of each (the best is the least disturbed by other
   load on a shared machine), their ratios, and the CPU seconds each engine's processes used
   per run (which other load on the machine does not inflate much).
2. Round trip of one small message across the process boundary: (a) a `HealthCheckReq` pushed
   over the typed ZeroMQ queues to a child process that answers `HealthCheckResp` (one hop each
   way); (b) the engine's health check, which goes tokenizer manager → scheduler process →
   detokenizer process → tokenizer manager, including the asyncio hand-offs. Median and p99.

    python benchmarks/multiprocess.py                       # concurrency 16 and 64
    python benchmarks/multiprocess.py --concurrency 16 --repeats 3
    python benchmarks/multiprocess.py --concurrency 1 16 --repeats 3 --num-prompts 16 --dtype auto
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402
from offline_throughput import workload  # noqa: E402

from arborlm.runtime.ipc import IpcAddresses  # noqa: E402
from arborlm.runtime.messages import HealthCheckReq, HealthCheckResp, ShutdownReq  # noqa: E402
from arborlm.runtime.process_utils import StopFlag, spawn_child  # noqa: E402
from arborlm.runtime.zmq_queues import PullQueue, PushQueue, terminate_context  # noqa: E402


class EchoService:
    """Child side of the raw round trip: answers each `HealthCheckReq` at once."""

    def __init__(self, addrs: IpcAddresses):
        self.recv = PullQueue(addrs.tokenizer_to_scheduler, bind=True)
        self.send = PushQueue(addrs.detokenizer_to_tokenizer, bind=False)

    def ready_info(self) -> dict[str, Any]:
        return {}

    def run(self, stop: StopFlag) -> None:
        while not stop.is_set():
            msg = self.recv.get(timeout=1.0)
            if isinstance(msg, HealthCheckReq):
                self.send.put(HealthCheckResp(ok=True))
            elif isinstance(msg, ShutdownReq):
                return

    def close(self) -> None:
        self.recv.close()
        self.send.close()
        terminate_context()


def percentiles(samples: list[float]) -> tuple[float, float]:
    """(median, p99) in microseconds."""
    ordered = sorted(samples)
    return (statistics.median(ordered) * 1e6,
            ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6)


def raw_round_trips(n: int) -> list[float]:
    addrs = IpcAddresses.create()
    pull = PullQueue(addrs.detokenizer_to_tokenizer, bind=True)
    child = spawn_child("echo", "__main__:EchoService", addrs)
    try:
        child.poll_ready(60)
        push = PushQueue(addrs.tokenizer_to_scheduler, bind=False)
        times = []
        for i in range(n + 100):
            t = time.perf_counter()
            push.put(HealthCheckReq())
            assert isinstance(pull.get(timeout=10), HealthCheckResp)
            if i >= 100:  # the first ones warm up the connection
                times.append(time.perf_counter() - t)
        push.put(ShutdownReq())
        child.stop(5)
        push.close()
    finally:
        pull.close()
        addrs.cleanup()
    return times


async def engine_round_trips(engine: Any, n: int) -> list[float]:
    times = []
    for i in range(n + 50):
        t = time.perf_counter()
        assert await engine.client.health_check()
        if i >= 50:
            times.append(time.perf_counter() - t)
    return times


async def run_workload(engine: Any, prompts: list[list[int]], new: list[int],
                       concurrency: int) -> float:
    """Seconds to generate every request with at most `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency)

    async def one(ids: list[int], m: int) -> None:
        async with gate:
            out = await engine.async_generate(
                input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": m,
                                                "ignore_eos": True})
            assert len(out["output_ids"]) == m

    t = time.perf_counter()
    await asyncio.gather(*[one(p, m) for p, m in zip(prompts, new)])
    return time.perf_counter() - t


def cpu_seconds(engine: Any) -> dict[str, float]:
    """User + system CPU seconds so far of this process and of the engine's children."""
    import psutil

    pids = {"this process": os.getpid()}
    if engine.mode == "multiprocess":
        pids.update(engine.client.pids())
    return {name: sum(psutil.Process(pid).cpu_times()[:2]) for name, pid in pids.items()}


def measure(args: argparse.Namespace, engines: dict[str, Any], prompts: list[list[int]],
            new: list[int]) -> dict[tuple[str, int], list[tuple[float, dict[str, float]]]]:
    """(seconds, CPU seconds by process) of every run, by (engine, concurrency)."""
    for engine in engines.values():  # warm-up
        asyncio.run(run_workload(engine, prompts[:4], [8] * 4, 4))
    runs: dict[tuple[str, int], list[tuple[float, dict[str, float]]]] = {}
    for repeat in range(args.repeats):
        for c in args.concurrency:
            order = list(engines.items())
            for name, engine in order[::-1] if repeat % 2 else order:  # ABBA against drift
                engine.flush_cache()
                before = cpu_seconds(engine)
                seconds = asyncio.run(run_workload(engine, prompts, new, c))
                cpu = {k: v - before[k] for k, v in cpu_seconds(engine).items()}
                runs.setdefault((name, c), []).append((seconds, cpu))
    return runs


def report(runs: dict, concurrency: list[int], new_tokens: int) -> None:
    rows = []
    for c in concurrency:
        for label, pick in (("median", statistics.median), ("best", min)):
            ip = new_tokens / pick(s for s, _ in runs[("in-process", c)])
            mp = new_tokens / pick(s for s, _ in runs[("multi-process", c)])
            rows.append((c, label, f"{ip:.1f}", f"{mp:.1f}", f"{mp / ip:.3f}"))
    print(table(rows, ("concurrency", "of runs", "in-process tok/s", "multi-process tok/s",
                       "multi / in")))
    rows = []
    for (name, c), samples in runs.items():
        names = samples[0][1]
        per = {k: statistics.median(cpu[k] for _, cpu in samples) for k in names}
        rows.append((name, c, f"{sum(per.values()):.1f}",
                     ", ".join(f"{k} {v:.2f}" for k, v in per.items())))
    print("CPU seconds per run (medians; the machine's other load not included):")
    print(table(rows, ("engine", "concurrency", "total", "by process")))


def throughput(args: argparse.Namespace, path: str) -> list[tuple]:
    from arborlm import Engine

    t = time.perf_counter()
    engines = {"in-process": Engine(path, dtype=args.dtype)}
    started = {"in-process": time.perf_counter() - t}
    t = time.perf_counter()
    engines["multi-process"] = Engine(path, mode="multiprocess", dtype=args.dtype)
    started["multi-process"] = time.perf_counter() - t
    cfg = engines["in-process"].config.model
    specials = set(engines["in-process"].tokenizer.all_special_ids)
    prompts, new = workload(cfg.vocab_size, specials, args.num_prompts)
    runs = measure(args, engines, prompts, new)
    engine_rtt = asyncio.run(engine_round_trips(engines["multi-process"], args.round_trips))
    for engine in engines.values():
        engine.shutdown()
    print(f"model {path}: {cfg.num_layers} layers, hidden {cfg.hidden_size}; {len(prompts)} "
          f"prompts ({sum(map(len, prompts))} tokens), {sum(new)} new tokens; {args.repeats} "
          f"alternating runs per engine; startup: in-process {started['in-process']:.1f} s, "
          f"multi-process {started['multi-process']:.1f} s")
    report(runs, args.concurrency, sum(new))
    return [("engine health check (3 hops)", *map(lambda x: f"{x:.0f}",
                                                  percentiles(engine_rtt)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None, help="default: the built-in default model")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--round-trips", type=int, default=2000)
    ap.add_argument("--dtype", default="float32",
                    help="both engines' dtype (auto: the serve default)")
    args = ap.parse_args()

    from arborlm.runtime.models.factory import default_model_path

    path = args.model_path or str(default_model_path())
    rtt_rows = throughput(args, path)
    raw = percentiles(raw_round_trips(args.round_trips))
    rtt_rows.insert(0, ("typed queues, child echo (2 hops)", f"{raw[0]:.0f}", f"{raw[1]:.0f}"))
    print(f"round trip of one small message ({args.round_trips} sequential):")
    print(table(rtt_rows, ("path", "median µs", "p99 µs")))


if __name__ == "__main__":
    main()
