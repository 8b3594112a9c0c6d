// One-row products y = x W^T for CPU decoding at batch 1: `arborlm::row_gemv`.
//
// At batch 1 a linear layer reads its whole weight to produce one row, so its speed is memory
// bandwidth. These kernels stream each weight row once, front to back (one stream per thread,
// which the hardware prefetcher follows best), with four independent accumulators so that the
// adds' latency never stalls the loads, and split the rows over torch's threads. float32 sums
// with FMAs; bfloat16 with AVX512-BF16 dot products (bf16 pairs multiplied exactly, summed in
// float32), rounded once to bfloat16 at the end, as a GEMM does.
//
// Compiled with per-function target attributes, so the file builds on any x86-64 compiler;
// `cpu_kernels.py` only calls it on CPUs that have the instructions.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "kernels.h"

namespace {

// Fewest weight bytes a thread is given: below this a thread's start-up outweighs its share.
constexpr int64_t kMinBytesPerThread = 64 * 1024;

// bias: float32 [out] or null, added before the (bfloat16) rounding as a GEMM's epilogue does.
__attribute__((target("avx512f"))) void rows_f32(const float* x, const float* w,
                                                 const float* bias, float* y, int64_t in,
                                                 int64_t begin, int64_t end) {
  for (int64_t o = begin; o < end; ++o) {
    const float* row = w + o * in;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= in; i += 64) {
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(row + i), _mm512_loadu_ps(x + i), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(row + i + 16), _mm512_loadu_ps(x + i + 16), a1);
      a2 = _mm512_fmadd_ps(_mm512_loadu_ps(row + i + 32), _mm512_loadu_ps(x + i + 32), a2);
      a3 = _mm512_fmadd_ps(_mm512_loadu_ps(row + i + 48), _mm512_loadu_ps(x + i + 48), a3);
    }
    for (; i < in; i += 16) {
      const int64_t left = in - i;
      const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, row + i), _mm512_maskz_loadu_ps(m, x + i), a0);
    }
    const float sum =
        _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    y[o] = bias ? sum + bias[o] : sum;
  }
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) void rows_bf16(
    const c10::BFloat16* x_, const c10::BFloat16* w_, const float* bias, c10::BFloat16* y,
    int64_t in, int64_t begin, int64_t end) {
  const auto* x = reinterpret_cast<const uint16_t*>(x_);
  const auto* w = reinterpret_cast<const uint16_t*>(w_);
  for (int64_t o = begin; o < end; ++o) {
    const uint16_t* row = w + o * in;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 128 <= in; i += 128) {  // 32 bf16 per vector
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(row + i),
                            (__m512bh)_mm512_loadu_si512(x + i));
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(row + i + 32),
                            (__m512bh)_mm512_loadu_si512(x + i + 32));
      a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(row + i + 64),
                            (__m512bh)_mm512_loadu_si512(x + i + 64));
      a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(row + i + 96),
                            (__m512bh)_mm512_loadu_si512(x + i + 96));
    }
    for (; i < in; i += 32) {
      const int64_t left = in - i;
      const __mmask32 m = left >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << left) - 1);
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m, row + i),
                            (__m512bh)_mm512_maskz_loadu_epi16(m, x + i));
    }
    const float sum =
        _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    y[o] = c10::BFloat16(bias ? sum + bias[o] : sum);  // round to nearest even, once
  }
}

}  // namespace

namespace arborlm_cpu {

at::Tensor row_gemv(const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "row_gemv: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "row_gemv: x must be one row [1, in], got ",
              x.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1),
              "row_gemv: weight must be [out, in] with in = ", x.size(1), ", got ",
              weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(),
              "row_gemv: x and weight dtypes differ: ", x.scalar_type(), " vs ",
              weight.scalar_type());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0),
                "row_gemv: bias must be [out] = [", weight.size(0), "], got ", bias->sizes());
    b = bias->to(at::kFloat).contiguous();
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = weight.contiguous();
  const int64_t out = wc.size(0), in = wc.size(1);
  at::Tensor y = at::empty({1, out}, xc.options());
  if (out == 0) return y;
  const int64_t row_bytes = std::max<int64_t>(in * wc.element_size(), 1);
  const int64_t threads = std::max<int64_t>(at::get_num_threads(), 1);
  // Equal shares for every thread, but no share under kMinBytesPerThread.
  const int64_t grain = std::max((out + threads - 1) / threads,
                                 (kMinBytesPerThread + row_bytes - 1) / row_bytes);
  const bool bf16 = xc.scalar_type() == at::kBFloat16;
  TORCH_CHECK(__builtin_cpu_supports("avx512f") && (!bf16 || __builtin_cpu_supports("avx512bf16")),
              "row_gemv: this CPU lacks AVX-512", bf16 ? " BF16" : "");
  if (xc.scalar_type() == at::kFloat) {
    const float* xp = xc.data_ptr<float>();
    const float* wp = wc.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) {
      rows_f32(xp, wp, bp, yp, in, begin, end);
    });
  } else if (bf16) {
    const auto* xp = xc.data_ptr<c10::BFloat16>();
    const auto* wp = wc.data_ptr<c10::BFloat16>();
    auto* yp = y.data_ptr<c10::BFloat16>();
    at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) {
      rows_bf16(xp, wp, bp, yp, in, begin, end);
    });
  } else {
    TORCH_CHECK(false, "row_gemv: float32 or bfloat16 only, got ", xc.scalar_type());
  }
  return y;
}

}  // namespace arborlm_cpu

TORCH_LIBRARY(arborlm, m) {
  m.def("row_gemv(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(arborlm, CPU, m) { m.impl("row_gemv", &arborlm_cpu::row_gemv); }
