// Fused elementwise kernels for the eager CPU forward (float32 and bfloat16):
// `arborlm::add_rms_norm` and `arborlm::silu_and_mul`; `arborlm::argmax_rows`, greedy
// sampling's row-wise argmax; and `arborlm::apply_token_bitmask`, a grammar's packed mask
// applied to float32 logits.
//
// Through ATen, a residual add and RMSNorm are six passes over the activations (add, pow, mean,
// add, rsqrt, two multiplies) and SwiGLU three (silu, its temporary, the multiply); at a 512-token
// prefill each pass is a megabyte or more. Here each row is added, summed and normalized while it
// is in cache, and silu and the product are computed together. The arithmetic is the fused decode step's, row for row (`row_ops.h`), so
// a token's values do not depend on which path computed them; against ATen's
// (`x * rsqrt(mean(x^2) + eps) * w`; `g / (1 + exp(-g)) * u`) float32 sums run in another order
// and the vectorized exp is within a few units in the last place of the library's.
//
// Compiled with per-function target attributes, so the file builds on any x86-64 compiler;
// `cpu_kernels.py` only calls it on CPUs with AVX-512.

#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include "kernels.h"
#include "row_ops.h"
#include "vec_math.h"
#include "thread_pool.h"

namespace {

using arborlm_cpu::lane_mask;

// Fewest elements a thread is given: below this a thread's start-up outweighs its share.
constexpr int64_t kMinElementsPerThread = 16 * 1024;

// Rows t: residual[t] += x[t] (when given), then out[t] = RMSNorm(residual[t] or x[t]) times
// the weight, with the fused decode step's arithmetic (`row_ops.h`).
template <typename T>
void norm_rows(const at::Tensor& x, T* rp, int64_t r_row, const at::Tensor& weight,
               at::Tensor& out, double eps) {
  const int64_t rows = x.size(0), n = x.size(1), x_row = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float fe = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(n, 1));
  arborlm_cpu::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* src = xp + t * x_row;
      if (rp != nullptr) {
        arborlm_cpu::add_into(src, rp + t * r_row, n);
        src = rp + t * r_row;
      }
      arborlm_cpu::rms_norm(src, wp, op + t * n, n, fe);
    }
  });
}

at::Tensor add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                        const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "add_rms_norm: CPU tensors only");
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && weight.scalar_type() == dtype,
              "add_rms_norm: float32 or bfloat16 x and weight of one dtype, got ", dtype, " and ",
              weight.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "add_rms_norm: x must be [T, H] with contiguous "
              "rows, got ", x.sizes(), " strides ", x.strides());
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "add_rms_norm: weight must be [", n,
              "], got ", weight.sizes());
  const bool with_residual = residual.has_value() && residual->defined();
  if (with_residual)
    TORCH_CHECK(residual->scalar_type() == dtype && residual->sizes() == x.sizes() &&
                    residual->stride(1) == 1,
                "add_rms_norm: residual must be ", dtype, " ", x.sizes(),
                " with contiguous rows");
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), "add_rms_norm: this CPU lacks AVX-512");
  const at::Tensor wc = weight.contiguous();
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const int64_t r_row = with_residual ? residual->stride(0) : 0;
  if (dtype == at::kFloat) {
    norm_rows<float>(x, with_residual ? residual->data_ptr<float>() : nullptr, r_row, wc, out,
                     eps);
  } else {
    norm_rows<c10::BFloat16>(x, with_residual ? residual->data_ptr<c10::BFloat16>() : nullptr,
                             r_row, wc, out, eps);
  }
  return out;
}

template <typename T>
void silu_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, g_row = gate_up.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(inter, 1));
  arborlm_cpu::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      arborlm_cpu::silu_mul(gp + t * g_row, op + t * inter, inter);
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  const at::ScalarType dtype = gate_up.scalar_type();
  TORCH_CHECK(gate_up.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16),
              "silu_and_mul: float32 or bfloat16 CPU tensors only, got ", dtype);
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
              "silu_and_mul: gate_up must be [T, 2I] with contiguous rows, got ",
              gate_up.sizes());
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), "silu_and_mul: this CPU lacks AVX-512");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (out.numel() == 0) return out;
  if (dtype == at::kFloat) {
    silu_rows<float>(gate_up, out);
  } else {
    silu_rows<c10::BFloat16>(gate_up, out);
  }
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

// The same rule, one element at a time (CPUs without AVX-512).
int64_t argmax_row_scalar(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

// Logits x[t] = -inf where bit t of the packed mask is 0, for t < n: 16 lanes at a time from 16
// bits of a 32-bit word, one masked store each.
__attribute__((target("avx512f"))) void mask_row(float* x, const int32_t* bits, int64_t n) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) {
    const uint32_t word = static_cast<uint32_t>(bits[i / 32]);
    const __mmask16 allowed = static_cast<__mmask16>(word >> (i % 32));
    _mm512_mask_storeu_ps(x + i, static_cast<__mmask16>(~allowed) & lane_mask(n - i), neg_inf);
  }
}

// The same, one element at a time (CPUs without AVX-512).
void mask_row_scalar(float* x, const int32_t* bits, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!((static_cast<uint32_t>(bits[i / 32]) >> (i % 32)) & 1u))
      x[i] = -std::numeric_limits<float>::infinity();
}

// logits [B, V] float32 (contiguous rows): for each row r in `rows`, logits[r, t] = -inf where
// bit t of bitmask[r] ([B, W] int32, little-endian bit order) is 0, for t < covered (<= 32 W).
// It writes each row once (`benchmarks/grammar_engines.py` compares it with numpy's unpack).
void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, at::IntArrayRef rows,
                         int64_t covered) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.stride(1) == 1,
              "apply_token_bitmask: logits must be float32 [B, V] with contiguous rows, got ",
              logits.scalar_type(), " ", logits.sizes());
  TORCH_CHECK(bitmask.device().is_cpu() && bitmask.scalar_type() == at::kInt &&
                  bitmask.dim() == 2 && bitmask.is_contiguous() &&
                  bitmask.size(0) == logits.size(0),
              "apply_token_bitmask: bitmask must be contiguous int32 [", logits.size(0),
              ", W], got ", bitmask.scalar_type(), " ", bitmask.sizes());
  TORCH_CHECK(covered >= 0 && covered <= logits.size(1) && covered <= 32 * bitmask.size(1),
              "apply_token_bitmask: covered ", covered, " is past the logits or the mask");
  const bool wide = __builtin_cpu_supports("avx512f");
  for (const int64_t r : rows) {
    TORCH_CHECK(r >= 0 && r < logits.size(0), "apply_token_bitmask: row ", r, " outside [0, ",
                logits.size(0), ")");
    float* x = logits.data_ptr<float>() + r * logits.stride(0);
    const int32_t* bits = bitmask.data_ptr<int32_t>() + r * bitmask.size(1);
    wide ? mask_row(x, bits, covered) : mask_row_scalar(x, bits, covered);
  }
}

}  // namespace

namespace arborlm_cpu {

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "argmax_rows: float32 CPU tensors only, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1,
              "argmax_rows: x must be [B, V] with V > 0 and contiguous rows, got ", x.sizes());
  const bool wide = __builtin_cpu_supports("avx512f");
  const int64_t rows = x.size(0), n = x.size(1), row = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, 4 * kMinElementsPerThread / n);
  arborlm_cpu::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      op[b] = wide ? argmax_row(xp + b * row, n) : argmax_row_scalar(xp + b * row, n);
  });
  return out;
}

}  // namespace arborlm_cpu

TORCH_LIBRARY_FRAGMENT(arborlm, m) {
  m.def("add_rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, int[] rows, int covered) -> ()");
}

TORCH_LIBRARY_IMPL(arborlm, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &arborlm_cpu::argmax_rows);
  m.impl("apply_token_bitmask", &apply_token_bitmask);
}
