"""ArborLM's own CPU kernels: C++ torch operators and their Python entry points.

The operators (`torch.ops.arborlm.*`, sources in `csrc/`), each what a library call could not do
as fast on a CPU (figures: docs/performance.md, "CPU kernels"; `benchmarks/cpu_kernels.py`):

- `panel_linear` over `pack_panels` weights: the linears of decode batches (one row included).
  A decode step streams every weight from memory; panels of 32 output columns are each one
  sequential stream, read once per call into a register tile of up to 12 rows x 32 columns
  (float32 FMAs; bfloat16 with the AVX512-BF16 dot product: products exact, sums in float32,
  one rounding). Its results do not depend on the number of rows.
- `decode_attention` (and `_paged`, which reads the KV pool in place): one pass per (KV head,
  request) over that request's own keys, with each query's log-sum-exp, so that a cascade's
  shared-prefix part merges with it as one softmax would; `paged_attention_rows`: every token
  of an extend attending as a decode query would (deterministic inference).
- `causal_attention`: an extend's attention as flash attention over register tiles;
  `prefix_attention`: a cascade group's shared prefix in the same tiles, read once.
- `add_rms_norm`, `silu_and_mul` (float32 and bfloat16): one pass over the activations each,
  with the fused decode step's arithmetic (`csrc/row_ops.h`); `argmax_rows`, vectorized.
- `decode_step` / `decode_steps`: a whole decode step of a Llama-family model in one call over
  these kernels (`fused_decode.FusedDecodeStep`); `packed_linear`: a oneDNN-packed weight
  called by number from a compiled graph (`linear.packed_linear`; it needs no AVX-512).
- `quant_linear`: a linear computed from a GGUF tensor's packed blocks (Q8_0, Q4_0/1, Q5_0/1,
  Q4_K, Q5_K, Q6_K): weights dequantized in registers against float activations (AVX-512 FMA
  or AVX512-BF16), AVX512-VNNI integer dot products on activations quantized per block (AVX2's
  byte products without AVX-512), batches in AMX tiles on weights dequantized 32 rows at a
  time where the CPU has AMX, or a portable scalar path (`quant_path(rows)` says which).

The operators live in one extension, built on first use (`kernel_build`: torch's extension
builder, tens of seconds, cached on disk after) and traced by `torch.compile` as opaque calls.
A build that fails leaves the library kernels serving, with a warning.

`available(dtype)`, `attention_available(dtype)` and `elementwise_available(dtype)` say whether
they run here: the instructions (`capabilities`) and a build that succeeded; otherwise callers
keep their library path. `ARBORLM_CPU_KERNELS=0` turns them off (to compare).
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from arborlm.runtime.platforms.cpu import capabilities, kernel_build

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_built: bool | None = None  # None: not tried yet; else whether the operator is registered


def available(dtype: torch.dtype) -> bool:
    """Whether `panel_linear` runs here for `dtype`, building the operators on the first
    call."""
    if os.environ.get("ARBORLM_CPU_KERNELS", "1") == "0" \
            or not capabilities.kernel_instructions(dtype):
        return False
    return _build()


def packed_step_available(dtype: torch.dtype) -> bool:
    """Whether the fused decode step runs here for a model whose linears are all packed GGUF
    blocks: where `available(dtype)`, or in float32 on a CPU with AVX2 and FMA but not AVX-512
    (its attention and row steps then take their AVX2 forms; no panels, no cascade groups)."""
    if available(dtype):
        return True
    return dtype == torch.float32 and capabilities.has_avx2_fma() and quant_linear_available()


def attention_available(dtype: torch.dtype) -> bool:
    """Whether `decode_attention` runs here for `dtype` (float32 or bfloat16 on AVX-512: it
    widens bfloat16 to float32, so it needs no BF16 instructions)."""
    return available(torch.float32) and dtype in (torch.float32, torch.bfloat16)


def elementwise_available(dtype: torch.dtype) -> bool:
    """Whether `add_rms_norm` and `silu_and_mul` run here for `dtype` (float32 or bfloat16 on
    AVX-512: bfloat16 is widened, so it needs no BF16 instructions)."""
    return dtype in (torch.float32, torch.bfloat16) and available(torch.float32)


def packed_linear_available() -> bool:
    """Whether `packed_linear` runs here (the operators built: an x86-64 C++ compiler)."""
    if os.environ.get("ARBORLM_CPU_KERNELS", "1") == "0":
        return False
    return capabilities.is_x86_64() and _build()


def attention_fits(dtype: torch.dtype, group: int, head_dim: int) -> bool:
    """Whether the decode-attention kernels take this dtype and head shape (G query heads per
    KV head, head dim)."""
    return dtype in (torch.float32, torch.bfloat16) and 1 <= group <= 16 \
        and head_dim % 16 == 0 and 0 < head_dim <= 256


def build() -> bool:
    """Build (or load the cached build of) the operators; whether they are registered. A
    failure is logged once and leaves the library kernels serving."""
    return packed_linear_available()


def _build() -> bool:
    global _built
    with _lock:
        if _built is not None:
            return _built
        try:
            kernel_build.load_extension()
        except Exception as exc:  # no compiler, no ninja, a read-only cache: keep the library path
            logger.warning("ArborLM's CPU kernels could not be built (%s); the library "
                           "kernels serve instead", exc)
            _built = False
            return False
        torch.library.register_fake("arborlm::decode_attention")(_decode_attention_shape)
        torch.library.register_fake("arborlm::decode_attention_paged")(_paged_shape)
        torch.library.register_fake("arborlm::paged_attention_rows")(_paged_rows_shape)
        torch.library.register_fake("arborlm::add_rms_norm")(_norm_shape)
        torch.library.register_fake("arborlm::silu_and_mul")(_silu_shape)
        torch.library.register_fake("arborlm::argmax_rows")(_argmax_shape)
        torch.library.register_fake("arborlm::pack_panels")(_pack_panels_shape)
        torch.library.register_fake("arborlm::panel_linear")(_panel_linear_shape)
        torch.library.register_fake("arborlm::causal_attention")(_causal_shape)
        torch.library.register_fake("arborlm::prefix_attention")(_prefix_shape)
        torch.library.register_fake("arborlm::quant_linear")(_quant_linear_shape)
        _built = True
        return True


def _decode_attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            lens: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows n of q `[N, G, D]` (G query heads) attend to the first `lens[n % B]` of their keys
    and values, k/v `[N, W, D]` (rows may be strided, each key contiguous), lens `[B]`: the
    head-major (KV head, request) rows of a decode batch. Returns the output `[N, G, D]` in q's
    dtype (float32 or bfloat16, the same for all three) and the log-sum-exp of each query's
    scaled scores `[N, G]` float32 (-inf, with a zero output, where a row has no keys);
    `attention_available(q.dtype)` must hold."""
    return torch.ops.arborlm.decode_attention(q, k, v, lens, scale)


def _paged_shape(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 slots: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    return q.new_empty(q.shape)


def decode_attention_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           slots: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """`decode_attention` reading the keys from the paged pool: request b's query heads q
    `[B, H, D]` attend to pool rows `slots[b, :lens[b]]` of k/v_pool `[S, Hkv, D]` (its KV head
    h serving query heads h*G to h*G+G-1). Returns `[B, H, D]` in q's dtype (the pools' too,
    float32 or bfloat16); `attention_available(q.dtype)` must hold."""
    return torch.ops.arborlm.decode_attention_paged(q, k_pool, v_pool, slots, lens, scale)


def _paged_rows_shape(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                      slots: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                      scale: float) -> torch.Tensor:
    return q.new_empty(q.shape)


def paged_attention_rows(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         slots: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Every token attending as a decode step's query would: token t's query heads q
    `[T, H, D]` attend to pool rows `slots[rows[t], :lens[t]]` of k/v_pool `[S, Hkv, D]`
    (`slots` is the `req_to_token` table, int64). The result of each token is the one
    `decode_attention_paged` gives for the same keys, however the tokens are batched:
    deterministic inference's extend attention. Returns `[T, H, D]` in q's dtype;
    `attention_available(q.dtype)` must hold."""
    return torch.ops.arborlm.paged_attention_rows(q, k_pool, v_pool, slots, rows, lens, scale)


def _causal_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> torch.Tensor:
    return q.new_empty(q.shape)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Causal attention of T new tokens: q `[T, H, D]` against k/v `[S, Hkv, D]` (S >= T, the
    last T keys the new tokens' own, any before them a cached prefix), query i seeing keys
    0 .. S - T + i; rows may be strided, each head's D values contiguous. Returns `[T, H, D]`
    in q's dtype (float32 or bfloat16, the same for all three); `attention_available(q.dtype)`
    and `attention_fits` must hold."""
    return torch.ops.arborlm.causal_attention(q, k, v, scale)


def _prefix_shape(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  prefix_slots: torch.Tensor, prefix_lens: torch.Tensor, groups: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:2],
                                                                   dtype=torch.float32)


def prefix_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     prefix_slots: torch.Tensor, prefix_lens: torch.Tensor, groups: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cascade decode's shared part (what the fused decode step calls per layer): request b's
    query heads q `[B, H, D]` (contiguous), where `groups[b]` = g >= 0, attend to pool rows
    `prefix_slots[g, :prefix_lens[g]]` of k/v_pool `[S, Hkv, D]`. Returns float32 outputs
    `[B, H, D]` and log-sum-exps `[B, H]` (zero and -inf for requests in no group), to merge
    with the attention over each request's own keys."""
    return torch.ops.arborlm.prefix_attention(q, k_pool, v_pool, prefix_slots, prefix_lens,
                                              groups, scale)


def _norm_shape(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> torch.Tensor:
    return x.new_empty(x.shape)


def _silu_shape(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """RMSNorm of x `[T, H]` (float32 or bfloat16, the weight's dtype) times weight `[H]`;
    with `residual` `[T, H]`, first adds x into it in place and normalizes the sum. The
    arithmetic is the fused decode step's (`csrc/row_ops.h`): in float32, rounded to the
    dtype, times the weight, rounded. `elementwise_available(x.dtype)` must hold."""
    return torch.ops.arborlm.add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` `[T, I]` of gate_up `[T, 2I]` float32 or bfloat16 (gate first), one
    pass, each of the two results rounded to the dtype;
    `elementwise_available(gate_up.dtype)` must hold."""
    return torch.ops.arborlm.silu_and_mul(gate_up)


def _argmax_shape(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[:1], dtype=torch.int64)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value `[B]` int64, of x `[B, V]` float32: the first where
    it repeats, the first NaN where there is one (as `torch.argmax`).
    `elementwise_available(x.dtype)` must hold."""
    return torch.ops.arborlm.argmax_rows(x)


def token_bitmask_available() -> bool:
    """Whether `apply_token_bitmask` runs here (the operators built: an x86-64 C++ compiler;
    AVX-512 is used where the CPU has it)."""
    return packed_linear_available()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                        covered: int) -> None:
    """logits[r, t] = -inf where bit t of bitmask[r] is 0, for each r in `rows` and t <
    `covered`; logits `[B, V]` float32 with contiguous rows, bitmask `[B, W]` int32
    contiguous. `token_bitmask_available()` must hold."""
    torch.ops.arborlm.apply_token_bitmask(logits, bitmask, rows, covered)


PANEL_COLUMNS = 32  # output columns per panel (`csrc/panel_gemm.cpp`)


def _pack_panels_shape(weight: torch.Tensor) -> torch.Tensor:
    out, inp = weight.shape
    panels = -(-out // PANEL_COLUMNS)
    if weight.dtype == torch.float32:
        return weight.new_empty((panels, inp, PANEL_COLUMNS))
    return weight.new_empty((panels, -(-inp // 2), PANEL_COLUMNS, 2))


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight `[out, in]` (float32 or bfloat16) in `panel_linear`'s layout: panels of 32 output
    columns (the last padded with zeros), float32 `[panels, in, 32]`, bfloat16 as column pairs
    `[panels, ceil(in/2), 32, 2]`; `available(weight.dtype)` must hold."""
    return torch.ops.arborlm.pack_panels(weight)


def _panel_linear_shape(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x `[T, in]` times the weight `pack_panels` laid out as `panels` (plus bias `[out]`) ->
    `[T, out_features]` in x's dtype, each output one float32 dot product (in the same order
    for any T) rounded once; `available(x.dtype)` must hold."""
    return torch.ops.arborlm.panel_linear(x, panels, out_features, bias)


# Why packed weights (`--quantization`) cannot run where `quant_linear_available()` is false.
OPERATORS_MISSING = ("ArborLM's CPU operators are not available here (they need an x86-64 CPU "
                     "and a C++ compiler, and ARBORLM_CPU_KERNELS not 0)")


def quant_linear_available() -> bool:
    """Whether `quant_linear` runs here (the operators built: an x86-64 C++ compiler); its
    portable path needs no AVX-512."""
    return packed_linear_available()


# `quant_linear`'s paths (`csrc/quant_linear.cpp`): "portable" (scalar, any x86-64), "avx2"
# (blocks dequantized in registers, 8-lane FMAs: AVX2, FMA, F16C), "avx2_int"
# ("vnni2"'s arithmetic, and outputs, with AVX2's byte products), "float"
# (x widened to float32 against weights dequantized in registers, FMAs: AVX-512 F/BW/VL),
# "bf16" (the kernel's float path on bfloat16 x as it is: `vdpbf16ps` against weights rounded
# to bfloat16, where AVX512-BF16 is granted; float32 x as "float"), "vnni2" (x in two int8 terms
# per block, ~15 bits: AVX512-VNNI), "amx" (bfloat16 x against the weights dequantized to
# bfloat16 a chunk at a time, oneDNN's GEMM: AMX tiles; float32 x as "float"; not
# batch-invariant) and "vnni" (x quantized to int8 per block, as llama.cpp
# does; opt-in only: on SmolLM2-135M's Q4_1 file it agrees with the dequantized model's top-1
# token at too few positions, tests/real_model/test_quantization_smollm2.py).
QUANT_PATHS = ("portable", "avx2", "avx2_int", "float", "bf16", "vnni2", "vnni", "amx")
# From this many rows the float path is the faster (benchmarks/quant_linear.py; figures in
# docs/performance.md); below it, the integer path with two-term activations. The same
# crossover holds without AVX-512, between "avx2" and "avx2_int".
FLOAT_PATH_ROWS = 8
# From this many rows, where the CPU lists AMX-BF16, "amx" (bfloat16 x against the weights
# dequantized to bfloat16, 32 rows at a time, in AMX tiles): level with the float path at 6
# rows, 1.1x it at 8, 1.6x at 16 and 2.6x at 32 (docs/performance.md, "Batch decode in our own
# AMX tiles"; benchmarks/quant_linear.py).
AMX_ROWS = 8


def quant_paths() -> tuple[str, ...]:
    """The `quant_linear` paths this CPU (and its OS) grants."""
    paths = ["portable"]
    if capabilities.has_avx2_fma():
        paths += ["avx2", "avx2_int"]
    if capabilities.has_avx512_quant_float():
        paths += ["float", "bf16"]
    if capabilities.has_avx512_vnni():
        paths += ["vnni2", "vnni"]
    if capabilities.has_avx512_quant_float() and capabilities.has_amx_bf16():
        paths += ["amx"]
    return tuple(paths)


def quant_path(rows: int = 1) -> str:
    """The path `quant_linear` runs for `rows` rows of x: `$ARBORLM_QUANT_PATH` where set (one
    of `QUANT_PATHS`; "float" and "vnni" are only ever chosen this way), else "amx" from
    `AMX_ROWS` rows, "bf16" from `FLOAT_PATH_ROWS` and "vnni2" below, each where the CPU grants
    it, else "bf16"; without AVX-512 "avx2" from `FLOAT_PATH_ROWS` rows and "avx2_int" below;
    else "portable"."""
    forced = os.environ.get("ARBORLM_QUANT_PATH", "")
    if forced:
        if forced not in QUANT_PATHS:
            raise ValueError(f"ARBORLM_QUANT_PATH={forced!r}: one of {', '.join(QUANT_PATHS)}")
        return forced
    here = quant_paths()
    if "vnni2" in here and rows < FLOAT_PATH_ROWS:
        return "vnni2"
    if "amx" in here and rows >= AMX_ROWS:
        return "amx"
    if "bf16" in here:
        return "bf16"
    if "avx2" in here:
        return "avx2_int" if rows < FLOAT_PATH_ROWS else "avx2"
    return "portable"


def batch_invariant_quant_path() -> str:
    """The one path deterministic inference runs for every number of rows: `$ARBORLM_QUANT_PATH`
    where set, else "bf16" (float activations, the default from `FLOAT_PATH_ROWS` rows where
    the CPU lacks AMX: prefill and batches stay fast, and one row loses a little against
    "vnni2"; never "amx", whose prefills are oneDNN's, blocked by rows), else "avx2" (the same
    choice without AVX-512), else "portable"."""
    if os.environ.get("ARBORLM_QUANT_PATH", ""):
        return quant_path()
    here = quant_paths()
    return "bf16" if "bf16" in here else "avx2" if "avx2" in here else "portable"


def pool_passive_switches() -> int:
    """How many times the kernels' thread pool has put its workers to passive waiting (the
    machine oversubscribed: a caller kept waiting by a preempted worker), since the kernels
    loaded."""
    return int(torch.ops.arborlm.pool_passive_switches())


def convert(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)` as the kernels convert between float32 and bfloat16 (on their own pool,
    vectorized; bit for bit torch's rounding), for the tests that hold it to torch's."""
    return torch.ops.arborlm.convert(x, dtype)


def _quant_linear_shape(x: torch.Tensor, weight: torch.Tensor, qtype: int,
                        bias: torch.Tensor | None, path: str) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def quant_linear(x: torch.Tensor, weight: torch.Tensor, qtype: int,
                 bias: torch.Tensor | None = None, path: str | None = None) -> torch.Tensor:
    """x `[T, in]` (float32 or bfloat16) times a GGUF weight kept packed: `weight` `[out, row
    bytes]` uint8, the tensor's rows as the file stores them, of ggml type number `qtype`
    (plus bias `[out]`) -> `[T, out]` in x's dtype. `path` (one of `quant_paths()`) defaults to
    `quant_path(T)`. `quant_linear_available()` must hold."""
    path = path or quant_path(x.shape[0])
    if path == "bf16":
        return torch.ops.arborlm.quant_linear(x, weight, int(qtype), bias, "float")
    if path == "float" and x.dtype == torch.bfloat16:  # the kernel would take bf16 products
        y = torch.ops.arborlm.quant_linear(x.float(), weight, int(qtype), bias, "float")
        return y.bfloat16()
    return torch.ops.arborlm.quant_linear(x, weight, int(qtype), bias, path)
