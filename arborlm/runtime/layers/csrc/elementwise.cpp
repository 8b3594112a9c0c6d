// Fused float32 elementwise kernels for the eager CPU forward: `arborlm::add_rms_norm` and
// `arborlm::silu_and_mul`; and `arborlm::argmax_rows`, greedy sampling's row-wise argmax.
//
// Through ATen, a residual add and RMSNorm are six passes over the activations (add, pow, mean,
// add, rsqrt, two multiplies) and SwiGLU three (silu, its temporary, the multiply); at a 512-token
// prefill each pass is a megabyte or more. Here each is one pass per row: the row is summed in
// registers while it is added, then normalized while it is still in cache; silu and the product
// are computed together. The arithmetic is ATen's (`x * rsqrt(mean(x^2) + eps) * w`;
// `g / (1 + exp(-g)) * u`), with float32 sums in another order and a vectorized exp within a few
// units in the last place of the library's.
//
// Compiled with per-function target attributes, so the file builds on any x86-64 compiler;
// `cpu_kernels.py` only calls it on CPUs with AVX-512.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include "kernels.h"
#include "vec_math.h"

namespace {

using arborlm_cpu::silu16;
using arborlm_cpu::lane_mask;

// Fewest elements a thread is given: below this a thread's start-up outweighs its share.
constexpr int64_t kMinElementsPerThread = 16 * 1024;

// One row: residual += x (when given), then out = r * rsqrt(mean(r^2) + eps) * w.
__attribute__((target("avx512f"))) void norm_row(const float* x, float* residual,
                                                 const float* w, float* out, int64_t n,
                                                 float eps) {
  const float* r = residual ? residual : x;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lane_mask(n - i);
    __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    if (residual) {
      v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, residual + i));
      _mm512_mask_storeu_ps(residual + i, m, v);
    }
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float rstd = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + eps);
  const __m512 s = _mm512_set1_ps(rstd);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lane_mask(n - i);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, r + i), s);
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i)));
  }
}

at::Tensor add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                        const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "add_rms_norm: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "add_rms_norm: float32 only, got ", x.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "add_rms_norm: x must be [T, H] with contiguous "
              "rows, got ", x.sizes(), " strides ", x.strides());
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "add_rms_norm: weight must be [", n,
              "], got ", weight.sizes());
  float* rp = nullptr;
  int64_t r_row = 0;
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->sizes() == x.sizes() &&
                    residual->stride(1) == 1,
                "add_rms_norm: residual must be float32 ", x.sizes(), " with contiguous rows");
    rp = residual->data_ptr<float>();
    r_row = residual->stride(0);
  }
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), "add_rms_norm: this CPU lacks AVX-512");
  const at::Tensor wc = weight.contiguous();
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t x_row = x.stride(0);
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      norm_row(xp + t * x_row, rp ? rp + t * r_row : nullptr, wp, op + t * n, n,
               static_cast<float>(eps));
  });
  return out;
}

__attribute__((target("avx512f"))) void silu_mul_row(const float* g, const float* u, float* out,
                                                     int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lane_mask(n - i);
    const __m512 silu = silu16(_mm512_maskz_loadu_ps(m, g + i));
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(m, u + i)));
  }
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kFloat,
              "silu_and_mul: float32 CPU tensors only, got ", gate_up.scalar_type());
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
              "silu_and_mul: gate_up must be [T, 2I] with contiguous rows, got ",
              gate_up.sizes());
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), "silu_and_mul: this CPU lacks AVX-512");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t g_row = gate_up.stride(0);
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(inter, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      silu_mul_row(gp + t * g_row, gp + t * g_row + inter, op + t * inter, inter);
  });
  return out;
}

// The index of a row's largest value, the first where it repeats; a NaN counts as larger than
// any number, so the first NaN wins (torch.argmax's rule). Two vectorized passes over the row:
// its maximum (NaNs noted on the way), then the first element equal to it. ATen's CPU argmax
// compares element by element: 32 rows of 8,192 logits take it ~115 us, this ~16 us.
__attribute__((target("avx512f"))) int64_t argmax_row(const float* x, int64_t n) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lane_mask(n - i);
    const __m512 v = _mm512_mask_loadu_ps(top, m, x + i);  // lanes past the end: -inf
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, v);
  }
  if (nan) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(x[i])) return i;
  }
  const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(lane_mask(n - i), _mm512_maskz_loadu_ps(
                                                      lane_mask(n - i), x + i), best, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;  // unreachable: the maximum is one of the row's values
}

}  // namespace

namespace arborlm_cpu {

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "argmax_rows: float32 CPU tensors only, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1,
              "argmax_rows: x must be [B, V] with V > 0 and contiguous rows, got ", x.sizes());
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), "argmax_rows: this CPU lacks AVX-512");
  const int64_t rows = x.size(0), n = x.size(1), row = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, 4 * kMinElementsPerThread / n);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) op[b] = argmax_row(xp + b * row, n);
  });
  return out;
}

}  // namespace arborlm_cpu

TORCH_LIBRARY_FRAGMENT(arborlm, m) {
  m.def("add_rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(arborlm, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &arborlm_cpu::argmax_rows);
}
