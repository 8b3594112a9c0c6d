// The per-row steps of a Llama-family layer, shared by the fused decode step
// (`decode_step.cpp`) and the eager forward's operators (`elementwise.cpp`), so that a token's
// arithmetic is the same whichever path computes it (batch-invariant results need it): the
// residual add in the activation dtype; RMSNorm in float32, rounded, times the weight and
// rounded again; rotary as `round(round(swapped * sin) + round(x * cos))`; SwiGLU as
// `round(round(silu(gate)) * up)` with the kernels' vectorized exp. For float32 every rounding
// is exact. Sums run in one fixed order per row (16 lanes, then `_mm512_reduce_add_ps`, then
// the tail), whatever the number of rows.

#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace arborlm_cpu {

// Stores v (already of T's precision) into 16 T.
__attribute__((target("avx512f"))) inline void store16(float* p, __m512 v) {
  _mm512_storeu_ps(p, v);
}
__attribute__((target("avx512f"))) inline void store16(c10::BFloat16* p, __m512 v) {
  const __m256i bits = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits);
}

// x + residual in the activation dtype, into residual.
template <typename T>
__attribute__((target("avx512f"))) void add_into(const T* x, T* residual, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    store16(residual + i, round_to(x, _mm512_add_ps(load16(x + i), load16(residual + i))));
  for (; i < n; ++i) residual[i] = T(widen(x[i]) + widen(residual[i]));
}

// weight * round(x * rsqrt(mean(x^2) + eps)), as `RMSNorm.forward`.
template <typename T>
__attribute__((target("avx512f"))) void rms_norm(const T* x, const T* w, T* out, int64_t n,
                                                 float eps) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  float sum = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) sum += widen(x[i]) * widen(x[i]);
  const float rstd = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  const __m512 rv = _mm512_set1_ps(rstd);
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512 normed = round_to(x, _mm512_mul_ps(load16(x + i), rv));
    store16(out + i, round_to(x, _mm512_mul_ps(load16(w + i), normed)));
  }
  for (; i < n; ++i) {
    const T normed = T(widen(x[i]) * rstd);
    out[i] = T(widen(w[i]) * widen(normed));
  }
}

// `rotate` element by element (head dims whose halves are not whole vectors).
template <typename T>
void rotate_scalar(T* x, const T* cos, const T* sin, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  std::vector<float> row(static_cast<size_t>(dim));
  for (int64_t h = 0; h < heads; ++h) {
    T* v = x + h * dim;
    for (int64_t i = 0; i < dim; ++i) row[i] = widen(v[i]);
    for (int64_t i = 0; i < dim; ++i) {
      const float swapped = row[i < half ? i + half : i - half];
      const T a = T(swapped * widen(sin[i]));
      const T b = T(row[i] * widen(cos[i]));
      v[i] = T(widen(a) + widen(b));
    }
  }
}

// Heads [heads, dim] rotated in place: round(round(swapped * sin) + round(x * cos)), where
// swapped = [x2, x1] and sin is the signed table (-sin | sin), as `apply_rotary`.
template <typename T>
__attribute__((target("avx512f"))) void rotate(T* x, const T* cos, const T* sin, int64_t heads,
                                               int64_t dim) {
  const int64_t half = dim / 2;
  if (half % 16 == 0) {
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + h * dim;
      for (int64_t i = 0; i < half; i += 16) {
        const __m512 a = load16(v + i), b = load16(v + half + i);
        const __m512 lo = _mm512_add_ps(round_to(x, _mm512_mul_ps(b, load16(sin + i))),
                                        round_to(x, _mm512_mul_ps(a, load16(cos + i))));
        const __m512 hi = _mm512_add_ps(round_to(x, _mm512_mul_ps(a, load16(sin + half + i))),
                                        round_to(x, _mm512_mul_ps(b, load16(cos + half + i))));
        store16(v + i, round_to(x, lo));
        store16(v + half + i, round_to(x, hi));
      }
    }
    return;
  }
  rotate_scalar(x, cos, sin, heads, dim);
}

// silu(gate) rounded, times up, rounded: [I] from gate_up [2I], with the vectorized exp the
// other kernels use.
template <typename T>
__attribute__((target("avx512f"))) void silu_mul(const T* gate_up, T* out, int64_t inter) {
  int64_t i = 0;
  for (; i + 16 <= inter; i += 16) {
    const __m512 s = round_to(out, arborlm_cpu::silu16(load16(gate_up + i)));
    store16(out + i, round_to(out, _mm512_mul_ps(s, load16(gate_up + inter + i))));
  }
  for (; i < inter; ++i) {
    const float g = widen(gate_up[i]);
    out[i] = T(widen(T(g / (1.0f + std::exp(-g)))) * widen(gate_up[inter + i]));
  }
}

// The same steps for CPUs with AVX2 but not AVX-512 (the fused decode step there): float32 in
// 8-lane vectors, with the same roundings (none but the ops' own in float32) and RMSNorm's sum in
// another order; other dtypes element by element (the step takes float32 only there).
namespace avx2 {

#define ARBORLM_AVX2 __attribute__((target("avx2,fma")))

template <typename T>
ARBORLM_AVX2 void add_into(const T* x, T* residual, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(residual + i,
                       _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(residual + i)));
  }
  for (; i < n; ++i) residual[i] = T(widen(x[i]) + widen(residual[i]));
}

template <typename T>
ARBORLM_AVX2 void rms_norm(const T* x, const T* w, T* out, int64_t n, float eps) {
  float sum = 0.0f;
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    sum = sum8(acc);
  }
  for (; i < n; ++i) sum += widen(x[i]) * widen(x[i]);
  const float rstd = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  i = 0;
  if constexpr (std::is_same_v<T, float>) {
    const __m256 rv = _mm256_set1_ps(rstd);
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                              _mm256_mul_ps(_mm256_loadu_ps(x + i), rv)));
  }
  for (; i < n; ++i) {
    const T normed = T(widen(x[i]) * rstd);
    out[i] = T(widen(w[i]) * widen(normed));
  }
}

template <typename T>
ARBORLM_AVX2 void rotate(T* x, const T* cos, const T* sin, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  if constexpr (std::is_same_v<T, float>) {
    if (half % 8 == 0) {
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x + h * dim;
        for (int64_t i = 0; i < half; i += 8) {
          const __m256 a = _mm256_loadu_ps(v + i), b = _mm256_loadu_ps(v + half + i);
          const __m256 lo = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(sin + i)),
                                          _mm256_mul_ps(a, _mm256_loadu_ps(cos + i)));
          const __m256 hi = _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(sin + half + i)),
                                          _mm256_mul_ps(b, _mm256_loadu_ps(cos + half + i)));
          _mm256_storeu_ps(v + i, lo);
          _mm256_storeu_ps(v + half + i, hi);
        }
      }
      return;
    }
  }
  rotate_scalar(x, cos, sin, heads, dim);
}

template <typename T>
ARBORLM_AVX2 void silu_mul(const T* gate_up, T* out, int64_t inter) {
  for (int64_t i = 0; i < inter; ++i) {
    const float g = widen(gate_up[i]);
    out[i] = T(widen(T(g / (1.0f + std::exp(-g)))) * widen(gate_up[inter + i]));
  }
}

#undef ARBORLM_AVX2

}  // namespace avx2

}  // namespace arborlm_cpu
