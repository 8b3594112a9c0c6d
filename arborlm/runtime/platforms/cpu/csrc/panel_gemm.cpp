// Linears over weights stored in column panels, for CPU decoding: `arborlm::panel_linear`.
//
// A decode step multiplies a few rows (one per running request) by every weight, and the model's
// weights do not fit in the cache, so each step streams them all from memory. oneDNN's packed
// GEMM computes at the machine's peak when the weight is cached but loses ~20% when it streams
// in (32 rows, 2-core Zen 4: 140-175 GFLOP/s cold against 200-220 warm). Here the weight is
// stored as panels of 32 output columns, each panel `[in, 32]` contiguous, so a panel is one
// sequential stream that the hardware prefetchers follow, and every panel is read from memory
// once: while the first two tiles of rows run over a panel they prefetch the next one, and the
// other tiles reuse the panel from the cache. (The prefetch asks for L1, `_MM_HINT_T0`: one
// step's 32M linears at 32 rows ran 4-7% faster than with `_MM_HINT_T1`, alternating rounds.)
//
// The micro-kernel keeps a tile of up to 12 rows x 32 columns in 24 vector accumulators and
// walks `in` front to back: per step two panel loads, one broadcast per row, two FMAs per row.
// bfloat16 panels hold column pairs `[in/2, 32, 2]` for the AVX512-BF16 dot product (bf16 pairs
// multiplied exactly, summed in float32), rounded once to bfloat16 at the end, as a GEMM does.
// Each output element is one dot product summed in the same order whatever the number of rows,
// so a request's results do not depend on which others share its batch.
//
// Compiled with per-function target attributes, so the file builds on any x86-64 compiler;
// `cpu_kernels.py` only calls it on CPUs that have the instructions.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>

#include "kernels.h"
#include "vec_math.h"
#include "thread_pool.h"

namespace {

using arborlm_cpu::lane_mask;

constexpr int64_t kCols = 32;     // output columns per panel: two 16-lane vectors
constexpr int kMaxTileRows = 12;  // rows per tile: 24 accumulators of the 32 registers
// Rows one work item covers: with many rows, (panel, row block) pairs are split over the
// threads so that a few panels still keep every thread busy; a thread's consecutive items share
// a panel, which stays in its L2.
constexpr int64_t kRowBlock = 96;

// One tile: rows x[0..MR) (row stride ldx) times panel w -> y (row stride ldy), `cols` of the
// panel's 32 columns stored. steps: `in` (float32) or `in` pairs (bfloat16). pf: the next panel's
// bytes to prefetch, `pf_lines` cache lines per step, or null.
template <int MR>
__attribute__((target("avx512f"))) void tile_f32(const float* x, int64_t ldx, const float* w,
                                                 int64_t steps, const float* bias, float* y,
                                                 int64_t ldy, int64_t cols, const char* pf,
                                                 int pf_lines) {
  __m512 acc[MR][2];
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < steps; ++k) {
    const __m512 w0 = _mm512_loadu_ps(w + k * kCols);
    const __m512 w1 = _mm512_loadu_ps(w + k * kCols + 16);
    if (pf != nullptr) {
      _mm_prefetch(pf + k * 64 * pf_lines, _MM_HINT_T0);
      if (pf_lines == 2) _mm_prefetch(pf + k * 128 + 64, _MM_HINT_T0);
    }
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      const __m512 xm = _mm512_set1_ps(x[m * ldx + k]);
      acc[m][0] = _mm512_fmadd_ps(xm, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xm, w1, acc[m][1]);
    }
  }
  const __mmask16 m0 = lane_mask(cols), m1 = lane_mask(cols - 16);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) {
    _mm512_mask_storeu_ps(y + m * ldy, m0, _mm512_add_ps(acc[m][0], b0));
    _mm512_mask_storeu_ps(y + m * ldy + 16, m1, _mm512_add_ps(acc[m][1], b1));
  }
}

// x rows are bfloat16 bits; `in` = 2 * steps - odd (an odd `in` ends with a half pair, whose
// high half the panel holds as zero and x must not be read past).
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void tile_bf16(
    const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t steps, const float* bias,
    uint16_t* y, int64_t ldy, int64_t cols, const char* pf, int pf_lines, bool odd) {
  __m512 acc[MR][2];
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int64_t full = steps - (odd ? 1 : 0);
  for (int64_t k = 0; k < steps; ++k) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k * 2 * kCols);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + k * 2 * kCols + kCols);
    if (pf != nullptr) {
      _mm_prefetch(pf + k * 64 * pf_lines, _MM_HINT_T0);
      if (pf_lines == 2) _mm_prefetch(pf + k * 128 + 64, _MM_HINT_T0);
    }
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      const uint16_t* xk = x + m * ldx + 2 * k;
      int32_t pair;
      if (k < full) {
        __builtin_memcpy(&pair, xk, sizeof(pair));
      } else {
        pair = xk[0];
      }
      const __m512bh xm = (__m512bh)_mm512_set1_epi32(pair);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xm, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xm, w1);
    }
  }
  const __mmask16 m0 = lane_mask(cols), m1 = lane_mask(cols - 16);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) {  // round to nearest even, once
    _mm256_mask_storeu_epi16(y + m * ldy, m0,
                             (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][0], b0)));
    _mm256_mask_storeu_epi16(y + m * ldy + 16, m1,
                             (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][1], b1)));
  }
}

using TileF32 = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*,
                         int64_t, int64_t, const char*, int);
using TileBF16 = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*,
                          uint16_t*, int64_t, int64_t, const char*, int, bool);

template <int... R>
constexpr std::array<TileF32, sizeof...(R)> f32_tiles(std::integer_sequence<int, R...>) {
  return {&tile_f32<R + 1>...};
}
template <int... R>
constexpr std::array<TileBF16, sizeof...(R)> bf16_tiles(std::integer_sequence<int, R...>) {
  return {&tile_bf16<R + 1>...};
}
constexpr auto kF32Tiles = f32_tiles(std::make_integer_sequence<int, kMaxTileRows>{});
constexpr auto kBF16Tiles = bf16_tiles(std::make_integer_sequence<int, kMaxTileRows>{});

// Calls tile(row0, rows, panel, pf, pf_lines) over every tile, split over torch's threads.
// Rows are cut into equal tiles of at most 12; the first two tiles of a panel prefetch the
// thread's next panel (panel_bytes each), one line per step (two when a panel has one tile).
template <typename Tile>
void for_each_tile(int64_t rows, int64_t panels, int64_t steps, int64_t panel_bytes,
                   const char* base, const Tile& tile) {
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t block_rows = (rows + blocks - 1) / blocks;
  arborlm_cpu::parallel_for(0, panels * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item / blocks, r0 = item % blocks * block_rows;
      const int64_t r1 = std::min(rows, r0 + block_rows);
      const int64_t tiles = (r1 - r0 + kMaxTileRows - 1) / kMaxTileRows;
      const int64_t per_tile = (r1 - r0 + tiles - 1) / tiles;
      // Prefetch only where this thread goes on to another panel, and only 2 lines a step.
      const bool next = item + 1 < end && (item + 1) / blocks != p;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = r0 + t * per_tile, mr = std::min(per_tile, r1 - m0);
        const char* pf = nullptr;
        int lines = 2;
        if (next && (tiles == 1 || t < 2)) {
          pf = base + (p + 1) * panel_bytes;
          if (tiles > 1) {
            lines = 1;
            pf += t * steps * 64;
          }
        }
        tile(m0, mr, p, pf, lines);
      }
    }
  });
}

bool is_panels_of(const at::Tensor& panels, at::ScalarType dtype) {
  return panels.scalar_type() == dtype && panels.is_contiguous() &&
         ((dtype == at::kFloat && panels.dim() == 3 && panels.size(2) == kCols) ||
          (dtype == at::kBFloat16 && panels.dim() == 4 && panels.size(2) == kCols &&
           panels.size(3) == 2));
}

}  // namespace

namespace arborlm_cpu {

bool panels_hold(const at::Tensor& panels, at::ScalarType dtype, int64_t in, int64_t out) {
  return is_panels_of(panels, dtype) &&
         panels.size(1) == (dtype == at::kFloat ? in : (in + 1) / 2) &&
         panels.size(0) == (out + kCols - 1) / kCols;
}

at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2,
              "pack_panels: weight must be a CPU matrix [out, in], got ", weight.sizes());
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "pack_panels: float32 or bfloat16 only, got ", dtype);
  const int64_t out = weight.size(0), in = weight.size(1);
  const int64_t panels = (out + kCols - 1) / kCols;
  if (dtype == at::kFloat) {  // [panels, in, 32]
    at::Tensor padded = at::zeros({panels * kCols, in}, weight.options());
    padded.narrow(0, 0, out).copy_(weight);
    return padded.view({panels, kCols, in}).transpose(1, 2).contiguous();
  }
  const int64_t pairs = (in + 1) / 2;  // [panels, pairs, 32, 2]
  at::Tensor padded = at::zeros({panels * kCols, pairs * 2}, weight.options());
  padded.narrow(0, 0, out).narrow(1, 0, in).copy_(weight);
  return padded.view({panels, kCols, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

void panel_linear_out(const at::Tensor& x, const at::Tensor& panels, const float* bias,
                      at::Tensor& y) {
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1);
  const int64_t count = panels.size(0), steps = panels.size(1);
  if (rows == 0 || out == 0) return;
  if (x.scalar_type() == at::kFloat) {
    const float* xp = x.data_ptr<float>();
    const float* wp = panels.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t ldy = y.stride(0);
    for_each_tile(rows, count, steps, steps * kCols * 4, reinterpret_cast<const char*>(wp),
                  [&](int64_t m0, int64_t mr, int64_t p, const char* pf, int lines) {
                    kF32Tiles[mr - 1](xp + m0 * in, in, wp + p * steps * kCols, steps,
                                      bias ? bias + p * kCols : nullptr,
                                      yp + m0 * ldy + p * kCols, ldy,
                                      std::min(kCols, out - p * kCols), pf, lines);
                  });
  } else {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
    const auto* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr<c10::BFloat16>());
    auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
    const int64_t ldy = y.stride(0);
    const bool odd = in % 2 == 1;
    for_each_tile(rows, count, steps, steps * kCols * 4, reinterpret_cast<const char*>(wp),
                  [&](int64_t m0, int64_t mr, int64_t p, const char* pf, int lines) {
                    kBF16Tiles[mr - 1](xp + m0 * in, in, wp + p * steps * 2 * kCols, steps,
                                       bias ? bias + p * kCols : nullptr,
                                       yp + m0 * ldy + p * kCols, ldy,
                                       std::min(kCols, out - p * kCols), pf, lines, odd);
                  });
  }
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "panel_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2, "panel_linear: x must be [rows, in], got ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "panel_linear: float32 or bfloat16 only, got ", dtype);
  TORCH_CHECK(is_panels_of(panels, dtype), "panel_linear: panels must be pack_panels' ",
              dtype, " layout, got ", panels.scalar_type(), " ", panels.sizes());
  const int64_t in = x.size(1);
  const int64_t steps = dtype == at::kFloat ? in : (in + 1) / 2;
  TORCH_CHECK(panels.size(1) == steps, "panel_linear: panels are for ", panels.size(1),
              dtype == at::kFloat ? "" : " pairs of", " inputs, x has ", in);
  TORCH_CHECK(out_features > (panels.size(0) - 1) * kCols && out_features <= panels.size(0) * kCols,
              "panel_linear: ", panels.size(0), " panels cannot hold ", out_features, " outputs");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features,
                "panel_linear: bias must be [out] = [", out_features, "], got ", bias->sizes());
    b = bias->to(at::kFloat).contiguous();
  }
  const bool bf16 = dtype == at::kBFloat16;
  TORCH_CHECK(__builtin_cpu_supports("avx512f") && (!bf16 || __builtin_cpu_supports("avx512bf16")),
              "panel_linear: this CPU lacks AVX-512", bf16 ? " BF16" : "");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), out_features}, xc.options());
  panel_linear_out(xc, panels, b.defined() ? b.data_ptr<float>() : nullptr, y);
  return y;
}

}  // namespace arborlm_cpu

TORCH_LIBRARY(arborlm, m) {  // the namespace's one definition; the other files add fragments
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, int out_features, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(arborlm, CPU, m) {
  m.impl("pack_panels", &arborlm_cpu::pack_panels);
  m.impl("panel_linear", &arborlm_cpu::panel_linear);
}
