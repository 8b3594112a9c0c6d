"""llama.cpp as a benchmark peer: GGUF conversion and greedy generation over token ids.

`convert_to_gguf` runs llama.cpp's own `convert_hf_to_gguf.py` (from the llama-cpp-python
source distribution, see `cpu_vs_llamacpp.py` for the set-up) on a checkpoint made by ArborLM's
model generator. Its byte-level BPE tokenizer is not one the converter knows by hash, so the
converter is told it is GPT-2's pre-tokenizer (and to skip its sentencepiece attempts); the
benchmark feeds token ids, never text, so the choice only has to load.

`LlamaCppPeer` drives llama.cpp through llama-cpp-python's low-level C API (`llama_batch`,
`llama_decode`, sequence copies in the KV memory), the same calls llama.cpp's batched examples
make, so Python adds one `llama_decode` call and one argmax per step: the peer runs at
llama.cpp's speed. `PeerProcess` runs a peer in a process of its own, as `llama-server` would
run: llama.cpp's OpenMP threads and the benchmarked engine's then never share one OpenMP
runtime (in one process libgomp counts both teams against the cores and stops spinning, which
slows both). This module does not measure ArborLM.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

_CONVERT = """
import runpy, sys
src = sys.argv[1]
sys.path.insert(0, src)
sys.path.insert(1, src + "/gguf-py")
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
def no_sentencepiece(self):
    raise FileNotFoundError("a byte-level BPE tokenizer.json, no sentencepiece model")
base.TextModel._set_vocab_sentencepiece = no_sentencepiece
base.TextModel._set_vocab_llama_hf = no_sentencepiece
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", sys.argv[3], "--outtype",
            sys.argv[4]]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def find_llama_cpp_source(given: str | None) -> Path | None:
    """The llama.cpp source tree holding `convert_hf_to_gguf.py`: `given`, `$LLAMA_CPP_SRC`."""
    for cand in (given, os.environ.get("LLAMA_CPP_SRC")):
        if cand:
            p = Path(cand)
            for root in (p, p / "vendor" / "llama.cpp"):
                if (root / "convert_hf_to_gguf.py").is_file():
                    return root
    return None


def convert_to_gguf(model_dir: Path, out: Path, outtype: str, src: Path) -> Path:
    """`model_dir` (Hugging Face layout) -> `out` GGUF of `outtype` (f32 / bf16); cached."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    subprocess.run([sys.executable, "-c", _CONVERT, str(src), str(model_dir), str(tmp), outtype],
                   check=True, capture_output=True)
    tmp.rename(out)
    return out


class LlamaCppPeer:
    """One llama.cpp model + context; greedy generation of token-id prompts, timed."""

    def __init__(self, gguf: Path, *, threads: int, n_ctx: int, n_seq: int,
                 n_batch: int = 2048, unified_kv: bool = True):
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        lc.llama_log_set(_silent_log, ctypes.c_void_p(0))
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = n_ctx, n_batch, min(n_batch, 512)
        cparams.n_seq_max = n_seq
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = unified_kv
        cparams.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.mem = lc.llama_get_memory(self.ctx)
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(n_batch, 0, n_seq)
        self.n_batch = n_batch

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def _decode(self, tokens: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """Entries (token, position, sequence, wants logits) -> argmax ids of the logit rows."""
        b = self.batch
        assert len(tokens) <= self.n_batch
        for i, (tok, pos, seq, logits) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(tokens)
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        n_out = sum(1 for t in tokens if t[3])
        if not n_out:
            return np.empty(0, dtype=np.int64)
        ptr = self.lc.llama_get_logits(self.ctx)
        logits = np.ctypeslib.as_array(ptr, shape=(n_out, self.vocab))
        return logits.argmax(axis=1)

    def _prefill(self, prompts: list[list[int]], start: int, seqs: list[int]) -> list[int]:
        """Prefill `prompts[i][start:]` on sequence `seqs[i]` in batches; first output ids."""
        entries = [(tok, start + j, seq, j == len(p) - start - 1)
                   for p, seq in zip(prompts, seqs) for j, tok in enumerate(p[start:])]
        first: list[int] = []
        for s in range(0, len(entries), self.n_batch):
            first += self._decode(entries[s:s + self.n_batch]).tolist()
        return first

    def generate(self, prompts: list[list[int]], new_tokens: int,
                 shared_prefix: int = 0) -> tuple[list[list[int]], float, float]:
        """Greedy: `new_tokens` ids per prompt, all decoding together.

        With `shared_prefix`, the first that many tokens (the same in every prompt) are
        prefilled once on sequence 0 and copied to the others' KV sequences, as a prefix cache
        would share them. Returns (outputs, seconds to the first tokens, total seconds).
        """
        self.lc.llama_memory_clear(self.mem, True)
        seqs = list(range(len(prompts)))
        t0 = time.perf_counter()
        if shared_prefix:
            self._prefill([prompts[0][:shared_prefix]], 0, [0])
            for s in seqs[1:]:
                self.lc.llama_memory_seq_cp(self.mem, 0, s, 0, shared_prefix)
        outs = [[t] for t in self._prefill(prompts, shared_prefix, seqs)]
        t_first = time.perf_counter() - t0
        for step in range(1, new_tokens):
            ids = self._decode([(o[-1], len(p) + step - 1, s, True)
                                for p, o, s in zip(prompts, outs, seqs)])
            for o, t in zip(outs, ids.tolist()):
                o.append(t)
        return outs, t_first, time.perf_counter() - t0


class PeerProcess:
    """A `LlamaCppPeer` in a child process: the same `generate`, timed in the child."""

    def __init__(self, gguf: Path, **peer_args):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, str(gguf), peer_args), daemon=True)
        self.proc.start()
        child.close()
        self._call("ready")  # raises the child's load error, if any

    def generate(self, prompts: list[list[int]], new_tokens: int,
                 shared_prefix: int = 0) -> tuple[list[list[int]], float, float]:
        return self._call("generate", prompts, new_tokens, shared_prefix)

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("close",))
            self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()

    def _call(self, *message):
        self.conn.send(message)
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(f"llama.cpp peer process: {value}")
        return value


def _serve(conn, gguf: str, peer_args: dict) -> None:
    """The child's loop: build the peer, then answer `ready` / `generate` / `close`."""
    try:
        peer = LlamaCppPeer(Path(gguf), **peer_args)
    except Exception as e:  # noqa: BLE001 - reported to the parent on its first call
        conn.recv()
        conn.send((False, repr(e)))
        return
    while True:
        name, *args = conn.recv()
        if name == "close":
            peer.close()
            return
        try:
            conn.send((True, None if name == "ready" else peer.generate(*args)))
        except Exception as e:  # noqa: BLE001
            conn.send((False, repr(e)))


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _silent_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's log callback: drop its load-time chatter."""
