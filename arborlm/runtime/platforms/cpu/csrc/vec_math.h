// Vector math shared by ArborLM's CPU kernels (AVX-512, per-function target attributes):
// tail masks, widening loads and stores, rounding to bfloat16, exp and silu; and AVX2's
// horizontal sum.

#pragma once

#include <c10/util/BFloat16.h>
#include <cstdint>
#include <immintrin.h>

namespace arborlm_cpu {

// Lanes 0..n-1 of 16 (none for n <= 0, all for n >= 16): a vector loop's tail.
inline __mmask16 lane_mask(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// One float32 or bfloat16 value widened to float32 (exactly), and stored back rounded (bfloat16:
// to nearest even).
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
inline void store_one(float* p, float x) { *p = x; }
inline void store_one(c10::BFloat16* p, float x) { *p = c10::BFloat16(x); }

// 16 float32 values from 16 float32 or bfloat16 (widened exactly: bf16 is float32's top half).
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}
__attribute__((target("avx512f"))) inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// v rounded to T's precision and widened back, as storing it in T and reading it back would
// (bfloat16: nearest even, a NaN quiet, as c10::BFloat16 rounds).
__attribute__((target("avx512f"))) inline __m512 round_to(const float*, __m512 v) { return v; }
__attribute__((target("avx512f"))) inline __m512 round_to(const c10::BFloat16*, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                            _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(r);
}

// e^x: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative
// error ~1e-7), times 2^n. Inputs below -87.3 give 0 or a denormal and above 88.7 infinity,
// as the library's exp does.
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2, high bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);     // ln2, low bits
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Lane t of the result: the sum of a[t]'s 16 lanes, for 16 vectors at once (a transpose-and-add
// tree: ~3 instructions a vector against ~8 for one `_mm512_reduce_add_ps`). Every vector is
// summed by the same tree, ((i + i+8) + (i+4 + i+12)) pairwise down to one, whichever lane t it
// is given in, and never mixed with another's lanes: a dot product reduced here has one value,
// however the vectors were grouped.
__attribute__((target("avx512f"))) inline __m512 sum_lanes16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // b[i]: lanes i and i+8 of a[2i] (128-bit lanes 0-1), a[2i+1] (2-3)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // c[i]: 128-bit lane q holds 4 partial sums of a[4i + q]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // d[i], 128-bit lane q: 2 sums of a[8i + q], 2 of a[8i + 4 + q]
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane 4q + r: the sum of a[4r + q]
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, e);
}

// silu(x) = x / (1 + e^-x).
__attribute__((target("avx512f"))) inline __m512 silu16(__m512 x) {
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                        exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

// The 8 lanes of v summed in one fixed order (the halves, then pairs, then the last two): AVX2
// kernels' horizontal sum, so an output is summed the same way whichever kernel forms it.
__attribute__((target("avx2"))) inline float sum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

}  // namespace arborlm_cpu
