// Linears computed from GGUF's packed blocks, as the file stores them: `arborlm::quant_linear`.
//
// The weight is a GGUF tensor's bytes, one row per output column (`[out, row bytes]` uint8),
// never dequantized into memory. A decode step streams every weight once, so a 4-bit weight
// reads a quarter of bfloat16's bytes. Seven paths, named per call by the caller (`path`;
// `cpu_kernels.quant_path` chooses by the CPU and the number of rows):
//
// - "vnni": integer dot products (AVX512-VNNI `vpdpbusd` on 256-bit vectors), as llama.cpp's CPU
//   backend does: each row of x is first quantized per 32-value block to int8 with a float scale
//   d (d = max|x| / 127, q = round(x / d)) and the block's scaled sum s = d * sum(q). A weight
//   block's 32 quants are unpacked in registers to bytes; `vpdpbusd` multiplies unsigned by
//   signed bytes, so quants with a minimum (Q4_1, Q5_1, K-quants' sub-block minimums) meet the
//   activations unsigned and their minimum is applied through s (Q4_1: d_w * d_x * dot +
//   m_w * s), while signed ones (Q8_0, and Q4_0, Q5_0, Q6_K with their fixed offset taken off in
//   registers) go in as |w| against x with w's sign. Each block's eight int32 lanes (exact) are
//   scaled in float32 and summed once per output at the end. Up to 4 rows share each unpacked
//   weight block; columns are walked in tiles of 64 that stay in L2 while every row passes.
//   Q8_0, Q4_0/1, Q5_0/1, Q4_K and Q6_K go four blocks at a time through 512-bit vectors
//   where the CPU has AVX512-VBMI (`quant_wide.cpp`).
// - "vnni2": the same, with x in two int8 terms per block, x = d (q + q2 / 256) (q2 the
//   residual's quants), so activations keep ~15 bits instead of 8: one more `vpdpbusd` per block
//   and row, 256 dot(w, q) + dot(w, q2) summed exactly in int32.
// - "float": x as it is, against weights dequantized in registers. Each work item unpacks 4
//   weight rows (as above) into a small L1-resident buffer, float32 (scale * q + minimum, one
//   rounding) or, for bfloat16 x where the CPU has AVX512-BF16, bfloat16 (that value rounded
//   once, as a bfloat16 model's weights are; types of at most 32 levels look their 32 possible
//   values up with `vpermw`), and runs up to 6 rows of x over them in register tiles of
//   `vfmadd` or `vdpbf16ps` (products exact, float32 sums). Needs AVX-512 F/BW/VL, not VNNI.
// - "avx2", for CPUs with AVX2, FMA and F16C but not AVX-512 (AMD Zen 2/3, most Intel client
//   cores): four weight rows dequantized in registers to float32 (scale * q + minimum, one
//   rounding, as "float"), then dotted with x in 8-lane FMAs, two rows of x at a time.
// - "avx2_int", for the same CPUs: "vnni2" with AVX2's byte products (`vpmaddubsw`, then
//   `vpmaddwd` against ones) in place of `vpdpbusd`, the same outputs bit for bit (the types
//   `quant_wide.cpp` takes four blocks at a time, in two 256-bit halves).
// - "amx", for batches of bfloat16 x: the weight dequantized to bfloat16 as "float" does, 32 rows
//   at a time, times x in AMX tiles (`quant_amx.cpp`) up to 128 rows where the CPU and OS grant
//   them; above that (prefill), or without the tiles, ~1 MB at a time times x by oneDNN
//   (`amx_linear`, below).
// - "portable", for CPUs without those instructions: each 32-value block dequantized to
//   float32 on the stack and dotted with x unquantized. Compiled for baseline x86-64, so it
//   runs anywhere; slower, never an illegal instruction.
//
// Every path computes each output as one sum in a fixed order whatever the number of rows, so
// a row's result does not depend on the others in its call.
//
// Types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (32-value blocks), Q4_K, Q5_K, Q6_K (256-value super-blocks,
// taken one 32-value sub-block at a time; Q6_K's 16-value scales go to the int32 lanes that hold
// them). Numbers are ggml's type ids.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include <omp.h>

#include "quant_common.h"
#include "vec_math.h"
#include "thread_pool.h"

namespace {

using namespace arborlm_quant;

// Values per block and bytes per block of each type (ggml's `ggml_type_traits`).
bool type_size(int64_t qtype, int64_t* block, int64_t* bytes) {
  switch (qtype) {
    case Q4_0: *block = 32; *bytes = 18; return true;
    case Q4_1: *block = 32; *bytes = 20; return true;
    case Q5_0: *block = 32; *bytes = 22; return true;
    case Q5_1: *block = 32; *bytes = 24; return true;
    case Q8_0: *block = 32; *bytes = 34; return true;
    case Q4_K: *block = 256; *bytes = 144; return true;
    case Q5_K: *block = 256; *bytes = 176; return true;
    case Q6_K: *block = 256; *bytes = 210; return true;
    default: return false;
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// ---- the portable path -----------------------------------------------------------------------

// 32-value block b of a weight row -> float32 (ggml's dequantize_row_* for that block).
void dequant_block(int64_t qtype, const uint8_t* row, int64_t b, float* y) {
  switch (qtype) {
    case Q8_0: {
      const uint8_t* p = row + b * 34;
      const float d = half_at(p);
      for (int i = 0; i < 32; ++i) y[i] = d * static_cast<int8_t>(p[2 + i]);
      return;
    }
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
      const int64_t bytes = qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : qtype == Q5_0 ? 22 : 24;
      const uint8_t* p = row + b * bytes;
      const bool has_min = qtype == Q4_1 || qtype == Q5_1;
      const bool five = qtype == Q5_0 || qtype == Q5_1;
      const float d = half_at(p), m = has_min ? half_at(p + 2) : 0.0f;
      uint32_t qh = 0;
      const int at = has_min ? 4 : 2;
      if (five) std::memcpy(&qh, p + at, 4);
      const uint8_t* qs = p + at + (five ? 4 : 0);
      const int offset = has_min ? 0 : (five ? 16 : 8);
      for (int j = 0; j < 16; ++j) {
        int lo = qs[j] & 0xF, hi = qs[j] >> 4;
        if (five) {
          lo |= ((qh >> j) & 1) << 4;
          hi |= ((qh >> (j + 16)) & 1) << 4;
        }
        y[j] = (lo - offset) * d + m;
        y[j + 16] = (hi - offset) * d + m;
      }
      return;
    }
    case Q4_K: case Q5_K: {
      const bool five = qtype == Q5_K;
      const uint8_t* p = row + (b / 8) * (five ? 176 : 144);
      const int sub = static_cast<int>(b % 8);
      const float d = half_at(p), dmin = half_at(p + 2);
      int sc, m;
      scale_min_k4(sub, p + 4, &sc, &m);
      const uint8_t* qh = p + 16;
      const uint8_t* qs = p + (five ? 48 : 16) + 32 * (sub / 2);
      const int shift = 4 * (sub % 2);
      for (int l = 0; l < 32; ++l) {
        int q = (qs[l] >> shift) & 0xF;
        if (five && (qh[l] >> sub) & 1) q += 16;
        y[l] = d * sc * q - dmin * m;
      }
      return;
    }
    case Q6_K: {
      const uint8_t* p = row + (b / 8) * 210;
      const int c = static_cast<int>(b % 8), n = c / 4, k = c % 4;
      const uint8_t* ql = p + 64 * n + 32 * (k & 1);
      const uint8_t* qh = p + 128 + 32 * n;
      const auto* sc = reinterpret_cast<const int8_t*>(p + 192) + 8 * n + 2 * k;
      const float d = half_at(p + 208);
      for (int l = 0; l < 32; ++l) {
        const int q = ((ql[l] >> (4 * (k >> 1))) & 0xF) | (((qh[l] >> (2 * k)) & 3) << 4);
        y[l] = d * sc[l / 16] * (q - 32);
      }
      return;
    }
    default: TORCH_CHECK(false, "quant_linear: unsupported type ", qtype);
  }
}

void portable(int64_t qtype, const float* x, int64_t rows, int64_t in, const uint8_t* w,
              int64_t row_bytes, int64_t out, const float* bias, float* y) {
  const int64_t blocks = in / 32;
  arborlm_cpu::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> deq(in);
    for (int64_t j = begin; j < end; ++j) {
      const uint8_t* row = w + j * row_bytes;
      for (int64_t b = 0; b < blocks; ++b) dequant_block(qtype, row, b, deq.data() + 32 * b);
      for (int64_t t = 0; t < rows; ++t) {
        const float* xt = x + t * in;
        float sum = 0.0f;
        for (int64_t i = 0; i < in; ++i) sum += deq[i] * xt[i];
        y[t * out + j] = sum + (bias ? bias[j] : 0.0f);
      }
    }
  });
}

// ---- the VNNI path ---------------------------------------------------------------------------

// With q2 (non-null), the block's residual x - d q is quantized too, with step d / 256
// (|residual| <= d / 2, so its quants fit int8 once +-128 is clamped to +-127: signed weights
// negate them): x = d (q + q2 / 256) to within d / 256, and s = d * (sum(q) + sum(q2) / 256).
// The block's values 0-15 in a, 16-31 in b.
VNNI_TARGET inline void quantize_values(__m512 a, __m512 b, int8_t* q, int8_t* q2, float* d,
                                        float* s) {
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float db = amax / 127.0f;
  const float id = db != 0.0f ? 1.0f / db : 0.0f;
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  *d = db;
  float sum = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
  if (q2 != nullptr) {
    const __m512 fine = _mm512_set1_ps(id * 256.0f), step = _mm512_set1_ps(db);
    const __m512 ra = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qa), step, a);
    const __m512 rb = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qb), step, b);
    const __m512i lowest = _mm512_set1_epi32(-127);  // -128 would not survive negation
    const __m512i ra_q = _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(ra, fine)), lowest);
    const __m512i rb_q = _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(rb, fine)), lowest);
    const __m128i sa = _mm512_cvtsepi32_epi8(ra_q), sb = _mm512_cvtsepi32_epi8(rb_q);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q2), sa);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + 16), sb);
    const __m512i wa = _mm512_cvtepi8_epi32(sa), wb = _mm512_cvtepi8_epi32(sb);  // saturated
    sum += static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(wa, wb))) / 256.0f;
  }
  *s = db * sum;
}

VNNI_TARGET void quantize_block(const float* xb, int8_t* q, int8_t* q2, float* d, float* s) {
  quantize_values(_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16), q, q2, d, s);
}

// The same from 32 bfloat16 values, widened (exactly) in registers.
VNNI_TARGET inline __m512 widen16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

VNNI_TARGET void quantize_block_bf16(const uint16_t* xb, int8_t* q, int8_t* q2, float* d,
                                     float* s) {
  quantize_values(widen16(xb), widen16(xb + 16), q, q2, d, s);
}


// One weight block unpacked: 32 quants as bytes (unsigned, or signed where `is_signed`), the
// weight's scale for each of the 8 int32 lanes of the dot product (4 quants a lane), and the
// coefficient of the activation block's scaled sum s.
struct Unpacked {
  __m256i q;
  __m256 scale;
  float min_coef;
};

// Unpacking needs AVX2 only, so the AVX2 integer path shares it; the AVX-512 paths inline it.
AVX2_TARGET inline __m256i nibbles(const uint8_t* qs) {  // 16 bytes -> lows then highs
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}

// Bytes whose bit `bit` of the same byte of `v` is set -> 16, others 0.
AVX2_TARGET inline __m256i bit_to_16s(__m256i v, uint8_t bit) {
  const __m256i b = _mm256_set1_epi8(static_cast<char>(bit));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, b), b), _mm256_set1_epi8(16));
}

template <int QT>
AVX2_TARGET inline Unpacked unpack(const uint8_t* row, int64_t b) {
  Unpacked u;
  if constexpr (QT == Q8_0) {
    const uint8_t* p = row + b * 34;
    u.q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    u.scale = _mm256_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(p)));
    u.min_coef = 0.0f;
  } else if constexpr (QT == Q4_0 || QT == Q4_1) {
    const uint8_t* p = row + b * (QT == Q4_0 ? 18 : 20);
    const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(p));
    u.q = nibbles(p + (QT == Q4_0 ? 2 : 4));
    if constexpr (QT == Q4_0) u.q = _mm256_sub_epi8(u.q, _mm256_set1_epi8(8));  // signed
    u.scale = _mm256_set1_ps(d);
    u.min_coef = QT == Q4_0 ? 0.0f : _cvtsh_ss(*reinterpret_cast<const uint16_t*>(p + 2));
  } else if constexpr (QT == Q5_0 || QT == Q5_1) {
    const uint8_t* p = row + b * (QT == Q5_0 ? 22 : 24);
    const int at = QT == Q5_0 ? 2 : 4;
    const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(p));
    uint32_t qh;
    std::memcpy(&qh, p + at, 4);
    u.q = _mm256_or_si256(nibbles(p + at + 4), bits_to_16s(qh));
    if constexpr (QT == Q5_0) u.q = _mm256_sub_epi8(u.q, _mm256_set1_epi8(16));  // signed
    u.scale = _mm256_set1_ps(d);
    u.min_coef = QT == Q5_0 ? 0.0f : _cvtsh_ss(*reinterpret_cast<const uint16_t*>(p + 2));
  } else if constexpr (QT == Q4_K || QT == Q5_K) {
    const uint8_t* p = row + (b / 8) * (QT == Q5_K ? 176 : 144);
    const int sub = static_cast<int>(b % 8);
    int sc, m;
    scale_min_k4(sub, p + 4, &sc, &m);
    const __m256i v = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(p + (QT == Q5_K ? 48 : 16) + 32 * (sub / 2)));
    __m256i q = _mm256_and_si256(_mm256_srli_epi16(v, 4 * (sub % 2)), _mm256_set1_epi8(0x0F));
    if constexpr (QT == Q5_K) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
      q = _mm256_add_epi8(q, bit_to_16s(qh, static_cast<uint8_t>(1 << sub)));
    }
    u.q = q;
    u.scale = _mm256_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(p)) * sc);
    u.min_coef = -_cvtsh_ss(*reinterpret_cast<const uint16_t*>(p + 2)) * m;
  } else {  // Q6_K
    const uint8_t* p = row + (b / 8) * 210;
    const int c = static_cast<int>(b % 8), n = c / 4, k = c % 4;
    const __m256i ql = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(p + 64 * n + 32 * (k & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * n));
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (k >> 1)),
                                        _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * k), 4),
                                        _mm256_set1_epi8(0x30));
    u.q = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));  // signed, -32..31
    const auto* sc = reinterpret_cast<const int8_t*>(p + 192) + 8 * n + 2 * k;
    const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(p + 208));
    u.scale = _mm256_set_m128(_mm_set1_ps(d * sc[1]), _mm_set1_ps(d * sc[0]));
    u.min_coef = 0.0f;
  }
  return u;
}

// Quants with a fixed offset are made signed in registers (Q4_0: q - 8, Q5_0: q - 16, Q6_K:
// q - 32): applying the offset through s instead would cancel two large terms in float32.
constexpr bool is_signed(int qt) { return qt == Q8_0 || qt == Q4_0 || qt == Q5_0 || qt == Q6_K; }

// Columns [j0, j1) of rows [t0, t0 + MR): each output one pass over its weight row's blocks.
template <int QT, int MR, bool SPLIT>
VNNI_TARGET void tile(const Activations& a, int64_t t0, const uint8_t* w, int64_t row_bytes,
                      int64_t j0, int64_t j1, const float* bias, float* y, int64_t ldy) {
  const uint8_t* end = w + ldy * row_bytes;  // y's row stride is the weight's number of rows
  for (int64_t j = j0; j < j1; ++j) {
    const uint8_t* row = w + j * row_bytes;
    if (t0 == 0) prefetch_ahead(row, row_bytes, end);  // later passes find the tile cached
    __m256 acc[MR];
    float mins[MR];
    for (int m = 0; m < MR; ++m) {
      acc[m] = _mm256_setzero_ps();
      mins[m] = 0.0f;
    }
    for (int64_t b = 0; b < a.blocks; ++b) {
      const Unpacked u = unpack<QT>(row, b);
      __m256i uq = u.q;
      __mmask32 negative = 0;
      if constexpr (is_signed(QT)) {
        negative = _mm256_movepi8_mask(u.q);
        uq = _mm256_abs_epi8(u.q);
      }
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const int64_t at = (t0 + m) * a.blocks + b;
        __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + at * 32));
        if constexpr (is_signed(QT)) {
          xq = _mm256_mask_sub_epi8(xq, negative, _mm256_setzero_si256(), xq);
        }
        __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), uq, xq);
        float dx = a.d[at];
        if constexpr (SPLIT) {  // 256 dot(w, q) + dot(w, q2): exact in int32 (|.| < 2^26)
          __m256i xq2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q2 + at * 32));
          if constexpr (is_signed(QT)) {
            xq2 = _mm256_mask_sub_epi8(xq2, negative, _mm256_setzero_si256(), xq2);
          }
          dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8),
                                 _mm256_dpbusd_epi32(_mm256_setzero_si256(), uq, xq2));
          dx *= 1.0f / 256.0f;
        }
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                 _mm256_mul_ps(u.scale, _mm256_set1_ps(dx)), acc[m]);
        if constexpr (!is_signed(QT)) mins[m] += u.min_coef * a.s[at];
      }
    }
    for (int m = 0; m < MR; ++m) {
      y[(t0 + m) * ldy + j] = sum8(acc[m]) + mins[m] + (bias ? bias[j] : 0.0f);
    }
  }
}

// ---- the AVX2 float path --------------------------------------------------------------------

// Weight block b of a row as 32 float32 values, scale * q + minimum with one rounding (as the
// AVX-512 float path), unpacked in registers by `unpack`.
template <int QT>
AVX2_TARGET inline void dequant_avx2(const uint8_t* row, int64_t b, float* y) {
  const Unpacked u = unpack<QT>(row, b);
  // u.scale's lanes 0-3 cover values 0-15, lanes 4-7 values 16-31 (they differ for Q6_K).
  const __m256 lo_scale = _mm256_permutevar8x32_ps(u.scale, _mm256_setzero_si256());
  const __m256 hi_scale = _mm256_permutevar8x32_ps(u.scale, _mm256_set1_epi32(4));
  const __m256 minimum = _mm256_set1_ps(u.min_coef);  // zero for the signed types
  const __m128i halves[2] = {_mm256_castsi256_si128(u.q), _mm256_extracti128_si256(u.q, 1)};
  for (int c = 0; c < 4; ++c) {
    const __m128i eight = c % 2 ? _mm_srli_si128(halves[c / 2], 8) : halves[c / 2];
    const __m256i q = is_signed(QT) ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
    _mm256_storeu_ps(y + 8 * c, _mm256_fmadd_ps(c < 2 ? lo_scale : hi_scale,
                                                _mm256_cvtepi32_ps(q), minimum));
  }
}

// Outputs [begin, end) of "avx2": four weight rows at a time dequantized to float32 in
// registers (`dequant_avx2`), then each row of x dotted with all four, two rows of x at a time
// (eight accumulators in flight). Each output's sum runs over 8-value chunks in order into one
// vector, reduced once: the same sum whichever rows share the call.
template <int QT>
AVX2_TARGET void avx2_columns(const float* x, int64_t rows, int64_t in, const uint8_t* w,
                              int64_t row_bytes, int64_t out, const float* bias, float* y,
                              int64_t begin, int64_t end) {
  const int64_t blocks = in / 32;
  std::vector<float> deq(4 * in);
  for (int64_t j0 = begin; j0 < end; j0 += 4) {
    const int64_t cols = std::min<int64_t>(4, end - j0);
    for (int64_t c = 0; c < 4; ++c) {
      float* d = deq.data() + c * in;
      if (c < cols) {
        const uint8_t* row = w + (j0 + c) * row_bytes;
        prefetch_ahead(row, row_bytes, w + out * row_bytes);
        for (int64_t b = 0; b < blocks; ++b) dequant_avx2<QT>(row, b, d + 32 * b);
      } else {
        std::fill(d, d + in, 0.0f);
      }
    }
    const float* d0 = deq.data();
    const float* d1 = d0 + in;
    const float* d2 = d1 + in;
    const float* d3 = d2 + in;
    int64_t t = 0;
    for (; t + 2 <= rows; t += 2) {
      const float* xa = x + t * in;
      const float* xb = xa + in;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
      for (int64_t i = 0; i < in; i += 8) {
        const __m256 w0 = _mm256_loadu_ps(d0 + i), w1 = _mm256_loadu_ps(d1 + i);
        const __m256 w2 = _mm256_loadu_ps(d2 + i), w3 = _mm256_loadu_ps(d3 + i);
        const __m256 va = _mm256_loadu_ps(xa + i), vb = _mm256_loadu_ps(xb + i);
        a0 = _mm256_fmadd_ps(w0, va, a0);
        a1 = _mm256_fmadd_ps(w1, va, a1);
        a2 = _mm256_fmadd_ps(w2, va, a2);
        a3 = _mm256_fmadd_ps(w3, va, a3);
        b0 = _mm256_fmadd_ps(w0, vb, b0);
        b1 = _mm256_fmadd_ps(w1, vb, b1);
        b2 = _mm256_fmadd_ps(w2, vb, b2);
        b3 = _mm256_fmadd_ps(w3, vb, b3);
      }
      const __m256 sums[2][4] = {{a0, a1, a2, a3}, {b0, b1, b2, b3}};
      for (int r = 0; r < 2; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          y[(t + r) * out + j0 + c] = sum8(sums[r][c]) + (bias ? bias[j0 + c] : 0.0f);
        }
      }
    }
    for (; t < rows; ++t) {
      const float* xa = x + t * in;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t i = 0; i < in; i += 8) {
        const __m256 va = _mm256_loadu_ps(xa + i);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(d0 + i), va, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(d1 + i), va, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(d2 + i), va, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(d3 + i), va, a3);
      }
      const __m256 sums[4] = {a0, a1, a2, a3};
      for (int64_t c = 0; c < cols; ++c) {
        y[t * out + j0 + c] = sum8(sums[c]) + (bias ? bias[j0 + c] : 0.0f);
      }
    }
  }
}

template <int QT>
void avx2_linear(const float* x, int64_t rows, int64_t in, const uint8_t* w, int64_t row_bytes,
                 int64_t out, const float* bias, float* y) {
  // Grains of 16 outputs (four tiles of four), as "portable".
  arborlm_cpu::parallel_for(0, (out + 15) / 16, 1, [&](int64_t begin, int64_t end) {
    avx2_columns<QT>(x, rows, in, w, row_bytes, out, bias, y, 16 * begin,
                     std::min(out, 16 * end));
  });
}

void avx2(int64_t qtype, const float* x, int64_t rows, int64_t in, const uint8_t* w,
          int64_t row_bytes, int64_t out, const float* bias, float* y) {
  switch (qtype) {
    case Q8_0: return avx2_linear<Q8_0>(x, rows, in, w, row_bytes, out, bias, y);
    case Q4_0: return avx2_linear<Q4_0>(x, rows, in, w, row_bytes, out, bias, y);
    case Q4_1: return avx2_linear<Q4_1>(x, rows, in, w, row_bytes, out, bias, y);
    case Q5_0: return avx2_linear<Q5_0>(x, rows, in, w, row_bytes, out, bias, y);
    case Q5_1: return avx2_linear<Q5_1>(x, rows, in, w, row_bytes, out, bias, y);
    case Q4_K: return avx2_linear<Q4_K>(x, rows, in, w, row_bytes, out, bias, y);
    case Q5_K: return avx2_linear<Q5_K>(x, rows, in, w, row_bytes, out, bias, y);
    case Q6_K: return avx2_linear<Q6_K>(x, rows, in, w, row_bytes, out, bias, y);
    default: TORCH_CHECK(false, "quant_linear: unsupported type ", qtype);
  }
}

// ---- the AVX2 integer path -------------------------------------------------------------------
//
// "avx2_int": "vnni2" for CPUs with AVX2 but not AVX-512. x is quantized per block in two int8
// terms by the same arithmetic on 8-lane vectors, weight blocks are unpacked by the same code,
// and each int32 lane's four byte products (the lane `vpdpbusd` forms) are summed by
// `vpmaddubsw` (adjacent pairs into int16: exact, since |w| <= 128 and |x| <= 127 keep a pair
// within 32,512) and `vpmaddwd` against ones. Signed weights meet x as |w| against x with w's
// sign (`vpsignb`). Every float operation is the one "vnni2" runs, in the same order, so the
// outputs are the same bit for bit (tests/runtime/test_cpu_quant_linear.py checks it where
// AVX512-VNNI runs too).

AVX2_TARGET inline int32_t sum_epi32(__m256i v) {
  const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i h2 = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
  return _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 1)));
}

// Four vectors of 8 int32 -> 32 int8 in order, saturated (as AVX-512's `vpmovsdb`).
AVX2_TARGET inline void store_int8(const __m256i v[4], int8_t* dst) {
  const __m256i pairs = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                           _mm256_packs_epi32(v[2], v[3]));
  // 128-bit lanes interleave the packs: dwords hold v0[0:4] v1[0:4] v2[0:4] v3[0:4] v0[4:8]...
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(pairs, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// `quantize_block` on 8-lane vectors: the same d, q, q2 and s.
AVX2_TARGET void quantize_block_avx2(const float* xb, int8_t* q, int8_t* q2, float* d, float* s) {
  __m256 v[4];
  __m256 amax8 = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  const float db = amax / 127.0f;
  const float id = db != 0.0f ? 1.0f / db : 0.0f;
  __m256i qi[4];
  __m256i total = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    total = _mm256_add_epi32(total, qi[i]);
  }
  store_int8(qi, q);
  *d = db;
  float sum = static_cast<float>(sum_epi32(total));
  if (q2 != nullptr) {
    const __m256 fine = _mm256_set1_ps(id * 256.0f), step = _mm256_set1_ps(db);
    __m256i ri[4];
    __m256i fine_total = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(qi[i]), step, v[i]);
      ri[i] = _mm256_cvtps_epi32(_mm256_mul_ps(r, fine));
      ri[i] = _mm256_min_epi32(_mm256_max_epi32(ri[i], _mm256_set1_epi32(-127)),
                               _mm256_set1_epi32(127));  // as stored
      fine_total = _mm256_add_epi32(fine_total, ri[i]);
    }
    store_int8(ri, q2);
    sum += static_cast<float>(sum_epi32(fine_total)) / 256.0f;
  }
  *s = db * sum;
}

// `tile` with those dot products.
template <int QT, int MR, bool SPLIT>
AVX2_TARGET void tile_avx2(const Activations& a, int64_t t0, const uint8_t* w, int64_t row_bytes,
                           int64_t j0, int64_t j1, const float* bias, float* y, int64_t ldy) {
  const uint8_t* end = w + ldy * row_bytes;  // y's row stride is the weight's number of rows
  for (int64_t j = j0; j < j1; ++j) {
    const uint8_t* row = w + j * row_bytes;
    if (t0 == 0) prefetch_ahead(row, row_bytes, end);  // later passes find the tile cached
    __m256 acc[MR];
    float mins[MR];
    for (int m = 0; m < MR; ++m) {
      acc[m] = _mm256_setzero_ps();
      mins[m] = 0.0f;
    }
    for (int64_t b = 0; b < a.blocks; ++b) {
      const Unpacked u = unpack<QT>(row, b);
      const __m256i uq = is_signed(QT) ? _mm256_abs_epi8(u.q) : u.q;
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const int64_t at = (t0 + m) * a.blocks + b;
        __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + at * 32));
        if constexpr (is_signed(QT)) xq = _mm256_sign_epi8(xq, u.q);
        __m256i dot = dot4(uq, xq);
        float dx = a.d[at];
        if constexpr (SPLIT) {
          __m256i xq2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q2 + at * 32));
          if constexpr (is_signed(QT)) xq2 = _mm256_sign_epi8(xq2, u.q);
          dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8), dot4(uq, xq2));
          dx *= 1.0f / 256.0f;
        }
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                 _mm256_mul_ps(u.scale, _mm256_set1_ps(dx)), acc[m]);
        if constexpr (!is_signed(QT)) mins[m] += u.min_coef * a.s[at];
      }
    }
    for (int m = 0; m < MR; ++m) {
      y[(t0 + m) * ldy + j] = sum8(acc[m]) + mins[m] + (bias ? bias[j] : 0.0f);
    }
  }
}

// ---- the integer paths' driver ---------------------------------------------------------------

template <int QT, int MR, bool SPLIT, bool AVX2>
inline void int_tile(const Activations& a, int64_t t0, const uint8_t* w, int64_t row_bytes,
                     int64_t j0, int64_t j1, const float* bias, float* y, int64_t ldy) {
  if constexpr (AVX2) {
    tile_avx2<QT, MR, SPLIT>(a, t0, w, row_bytes, j0, j1, bias, y, ldy);
  } else {
    tile<QT, MR, SPLIT>(a, t0, w, row_bytes, j0, j1, bias, y, ldy);
  }
}

template <int QT, bool SPLIT, bool AVX2>
void int_linear(const Activations& a, int64_t rows, const uint8_t* w, int64_t row_bytes,
                int64_t out, const float* bias, float* y, uint16_t* narrow) {
  over_tiles(rows, out, y, narrow, [&](auto mr, int64_t t0, int64_t j0, int64_t j1) {
    int_tile<QT, decltype(mr)::value, SPLIT, AVX2>(a, t0, w, row_bytes, j0, j1, bias, y, out);
  });
}

// "vnni" (SPLIT false), "vnni2" (SPLIT true) and, with AVX2, "avx2_int" (SPLIT true). x is
// float32, or bfloat16 (`bf16_x`), each block widened (exactly) as it is quantized. y as
// `over_tiles` writes it (with `narrow`, in bfloat16 there too).
template <bool SPLIT, bool AVX2>
void int_path(int64_t qtype, const void* x, bool bf16_x, int64_t rows, int64_t in,
              const uint8_t* w, int64_t row_bytes, int64_t out, const float* bias, float* y,
              uint16_t* narrow) {
  const int64_t blocks = in / 32;
  thread_local std::vector<int8_t> reused_q, reused_q2;
  thread_local std::vector<float> reused_d, reused_s;
  Scratch<int8_t> q(reused_q, rows * in), q2(reused_q2, SPLIT ? rows * in : 0);
  Scratch<float> d(reused_d, rows * blocks), s(reused_s, rows * blocks);
  int8_t* q2p = SPLIT ? q2.data() : nullptr;
  // Rows are contiguous and `in` a multiple of 32: block i is x[32 i .. 32 i + 32).
  auto* quantize = AVX2 ? &quantize_block_avx2 : &quantize_block;
  const auto* xf = static_cast<const float*>(x);
  const auto* xb = static_cast<const uint16_t*>(x);
  arborlm_cpu::parallel_for(0, rows * blocks, 256, [&](int64_t begin, int64_t end) {
    float widened[32];
    for (int64_t i = begin; i < end; ++i) {
      if (!AVX2 && bf16_x) {
        quantize_block_bf16(xb + i * 32, q.data() + i * 32, q2p ? q2p + i * 32 : nullptr,
                            d.data() + i, s.data() + i);
        continue;
      }
      const float* block = xf + i * 32;
      if (bf16_x) {
        for (int k = 0; k < 32; ++k) {
          const uint32_t bits = static_cast<uint32_t>(xb[i * 32 + k]) << 16;
          std::memcpy(&widened[k], &bits, 4);
        }
        block = widened;
      }
      quantize(block, q.data() + i * 32, q2p ? q2p + i * 32 : nullptr, d.data() + i,
               s.data() + i);
    }
  });
  const Activations a{q.data(), q2p, d.data(), s.data(), in, blocks};
  if (wide_linear(qtype, SPLIT, AVX2, a, rows, w, row_bytes, out, bias, y, narrow)) return;
  switch (qtype) {
    case Q8_0: return int_linear<Q8_0, SPLIT, AVX2>(a, rows, w, row_bytes, out, bias, y, narrow);
    case Q4_0: return int_linear<Q4_0, SPLIT, AVX2>(a, rows, w, row_bytes, out, bias, y, narrow);
    case Q4_1: return int_linear<Q4_1, SPLIT, AVX2>(a, rows, w, row_bytes, out, bias, y, narrow);
    case Q5_0: return int_linear<Q5_0, SPLIT, AVX2>(a, rows, w, row_bytes, out, bias, y, narrow);
    case Q5_1: return int_linear<Q5_1, SPLIT, AVX2>(a, rows, w, row_bytes, out, bias, y, narrow);
    case Q4_K: return int_linear<Q4_K, SPLIT, AVX2>(a, rows, w, row_bytes, out, bias, y, narrow);
    case Q5_K: return int_linear<Q5_K, SPLIT, AVX2>(a, rows, w, row_bytes, out, bias, y, narrow);
    case Q6_K: return int_linear<Q6_K, SPLIT, AVX2>(a, rows, w, row_bytes, out, bias, y, narrow);
    default: TORCH_CHECK(false, "quant_linear: unsupported type ", qtype);
  }
}

// ---- the float path --------------------------------------------------------------------------

// Weight block b of a row as 32 float32 values (0-15 and 16-31): its quants unpacked as for the
// integer path, widened and scaled in registers, value = scale * q + minimum (one rounding).
template <int QT>
BW_TARGET inline void block_f32(const Unpacked& u, __m512* lo, __m512* hi) {
  const __m128i q0 = _mm256_castsi256_si128(u.q), q1 = _mm256_extracti128_si256(u.q, 1);
  __m512i i0, i1;
  if constexpr (is_signed(QT)) {
    i0 = _mm512_cvtepi8_epi32(q0);
    i1 = _mm512_cvtepi8_epi32(q1);
  } else {
    i0 = _mm512_cvtepu8_epi32(q0);
    i1 = _mm512_cvtepu8_epi32(q1);
  }
  // u.scale's lanes 0-3 cover values 0-15, lanes 4-7 values 16-31 (they differ for Q6_K).
  const __m512 s0 = _mm512_broadcastss_ps(_mm256_castps256_ps128(u.scale));
  const __m512 s1 =
      QT == Q6_K ? _mm512_broadcastss_ps(_mm256_extractf128_ps(u.scale, 1)) : s0;
  if constexpr (is_signed(QT)) {
    *lo = _mm512_mul_ps(s0, _mm512_cvtepi32_ps(i0));
    *hi = _mm512_mul_ps(s1, _mm512_cvtepi32_ps(i1));
  } else {
    const __m512 m = _mm512_set1_ps(u.min_coef);
    *lo = _mm512_fmadd_ps(s0, _mm512_cvtepi32_ps(i0), m);
    *hi = _mm512_fmadd_ps(s1, _mm512_cvtepi32_ps(i1), m);
  }
}

// A weight row's `blocks` blocks dequantized into out[0 .. 32 blocks): float32, or bfloat16
// (each float32 value rounded to nearest even, as a bfloat16 model's weights are).
template <int QT>
BW_TARGET void dequant_f32(const uint8_t* row, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 lo, hi;
    block_f32<QT>(unpack<QT>(row, b), &lo, &hi);
    _mm512_storeu_ps(out + 32 * b, lo);
    _mm512_storeu_ps(out + 32 * b + 16, hi);
  }
}

// Types of at most 32 levels (5 bits) look their bfloat16 values up instead: the block's 32
// possible values (scale * level + minimum, the same roundings) are one vector, and each
// quant's low 5 bits pick its value (`vpermw`); signed quants' low bits index levels -16..-1 in
// the table's upper half. Q8_0 and Q6_K (more levels) widen every quant.
template <int QT>
BF16_TARGET inline __m512i block_bf16(const uint8_t* row, int64_t b) {
  const Unpacked u = unpack<QT>(row, b);
  if constexpr (QT == Q8_0 || QT == Q6_K) {
    __m512 lo, hi;
    block_f32<QT>(u, &lo, &hi);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  } else {
    const __m512 low = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 high = _mm512_add_ps(low, _mm512_set1_ps(is_signed(QT) ? -16.0f : 16.0f));
    const __m512 scale = _mm512_broadcastss_ps(_mm256_castps256_ps128(u.scale));
    __m512 t0, t1;
    if constexpr (is_signed(QT)) {
      t0 = _mm512_mul_ps(scale, low);
      t1 = _mm512_mul_ps(scale, high);
    } else {
      const __m512 m = _mm512_set1_ps(u.min_coef);
      t0 = _mm512_fmadd_ps(scale, low, m);
      t1 = _mm512_fmadd_ps(scale, high, m);
    }
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(t1, t0);
    return _mm512_permutexvar_epi16(_mm512_cvtepi8_epi16(u.q), table);
  }
}

template <int QT>
BF16_TARGET void dequant_bf16(const uint8_t* row, int64_t blocks, uint16_t* out) {
  for (int64_t b = 0; b < blocks; ++b) _mm512_storeu_si512(out + 32 * b, block_bf16<QT>(row, b));
}

constexpr int kCols = 4;           // weight rows (outputs) dequantized together
constexpr int kRowsF32 = 6;        // rows of x per register tile: 6 x 4 accumulators
constexpr int kRowsBF16 = 6;
constexpr int64_t kRowChunk = 64;  // rows of x a thread keeps in L2 while it walks the columns

// Rows x[0..MR) (row stride ldx) dotted with kCols weight rows: out[m * kCols + c], each one
// vector of partial sums over `in` reduced at the end, in the same order whatever MR (a row's
// result does not depend on the others in its call), over the dequantized values w [kCols][in].
template <int MR>
BW_TARGET void micro_f32(const float* x, int64_t ldx, const float* w, int64_t in, float* out) {
  __m512 acc[MR][kCols];
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < kCols; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; k += 16) {
    __m512 wv[kCols];
    for (int c = 0; c < kCols; ++c) wv[c] = _mm512_loadu_ps(w + c * in + k);
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
      for (int c = 0; c < kCols; ++c) acc[m][c] = _mm512_fmadd_ps(xv, wv[c], acc[m][c]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < kCols; ++c) out[m * kCols + c] = _mm512_reduce_add_ps(acc[m][c]);
}

template <int MR>
BF16_TARGET void micro_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t in,
                            float* out) {
  __m512 acc[MR][kCols];
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < kCols; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; k += 32) {  // 16 pairs: products exact, float32 sums
    __m512bh wv[kCols];
    for (int c = 0; c < kCols; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * in + k);
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);
      for (int c = 0; c < kCols; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], xv, wv[c]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < kCols; ++c) out[m * kCols + c] = _mm512_reduce_add_ps(acc[m][c]);
}

using MicroF32 = void (*)(const float*, int64_t, const float*, int64_t, float*);
using MicroBF16 = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*);
template <int... R>
constexpr std::array<MicroF32, sizeof...(R)> f32_micros(std::integer_sequence<int, R...>) {
  return {&micro_f32<R + 1>...};
}
template <int... R>
constexpr std::array<MicroBF16, sizeof...(R)> bf16_micros(std::integer_sequence<int, R...>) {
  return {&micro_bf16<R + 1>...};
}
constexpr auto kMicrosF32 = f32_micros(std::make_integer_sequence<int, kRowsF32>{});
constexpr auto kMicrosBF16 = bf16_micros(std::make_integer_sequence<int, kRowsBF16>{});

// x [rows, in] (float32, or bfloat16 bits where BF16) times the weight: work items are (chunk of
// up to 64 rows, group of kCols outputs), chunk-major, split over the threads; each item
// unpacks its group's weight rows into small buffers (L1-resident) and runs the chunk's rows
// over them in register tiles. A decode step (one chunk) reads every weight block once.
template <int QT, bool BF16>
void float_linear(const void* xv, int64_t rows, int64_t in, const uint8_t* w, int64_t row_bytes,
                  int64_t out, const float* bias, float* y) {
  using E = std::conditional_t<BF16, uint16_t, float>;
  constexpr int kRows = BF16 ? kRowsBF16 : kRowsF32;
  const E* x = static_cast<const E*>(xv);
  const int64_t blocks = in / 32;
  const int64_t groups = (out + kCols - 1) / kCols;
  const int64_t chunks = (rows + kRowChunk - 1) / kRowChunk;
  arborlm_cpu::parallel_for(0, chunks * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<E> buf(kCols * in);
    float part[kRows * kCols];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r0 = item / groups * kRowChunk, r1 = std::min(rows, r0 + kRowChunk);
      const int64_t j0 = item % groups * kCols;
      const int64_t cols = std::min<int64_t>(kCols, out - j0);
      for (int c = 0; c < kCols; ++c) {  // a last group's missing rows repeat its last one
        const uint8_t* row = w + (j0 + std::min<int64_t>(c, cols - 1)) * row_bytes;
        if (r0 == 0) prefetch_ahead(row, row_bytes, w + out * row_bytes);
        if constexpr (BF16) {
          dequant_bf16<QT>(row, blocks, buf.data() + c * in);
        } else {
          dequant_f32<QT>(row, blocks, buf.data() + c * in);
        }
      }
      const int64_t tiles = (r1 - r0 + kRows - 1) / kRows;
      const int64_t per_tile = (r1 - r0 + tiles - 1) / tiles;
      for (int64_t t = r0; t < r1; t += per_tile) {
        const int64_t mr = std::min(per_tile, r1 - t);
        if constexpr (BF16) {
          kMicrosBF16[mr - 1](x + t * in, in, buf.data(), in, part);
        } else {
          kMicrosF32[mr - 1](x + t * in, in, buf.data(), in, part);
        }
        for (int64_t m = 0; m < mr; ++m) {
          for (int64_t c = 0; c < cols; ++c) {
            y[(t + m) * out + j0 + c] = part[m * kCols + c] + (bias ? bias[j0 + c] : 0.0f);
          }
        }
      }
    }
  });
}

template <bool BF16>
void float_path(int64_t qtype, const void* x, int64_t rows, int64_t in, const uint8_t* w,
                int64_t row_bytes, int64_t out, const float* bias, float* y) {
  switch (qtype) {
    case Q8_0: return float_linear<Q8_0, BF16>(x, rows, in, w, row_bytes, out, bias, y);
    case Q4_0: return float_linear<Q4_0, BF16>(x, rows, in, w, row_bytes, out, bias, y);
    case Q4_1: return float_linear<Q4_1, BF16>(x, rows, in, w, row_bytes, out, bias, y);
    case Q5_0: return float_linear<Q5_0, BF16>(x, rows, in, w, row_bytes, out, bias, y);
    case Q5_1: return float_linear<Q5_1, BF16>(x, rows, in, w, row_bytes, out, bias, y);
    case Q4_K: return float_linear<Q4_K, BF16>(x, rows, in, w, row_bytes, out, bias, y);
    case Q5_K: return float_linear<Q5_K, BF16>(x, rows, in, w, row_bytes, out, bias, y);
    case Q6_K: return float_linear<Q6_K, BF16>(x, rows, in, w, row_bytes, out, bias, y);
    default: TORCH_CHECK(false, "quant_linear: unsupported type ", qtype);
  }
}

// ---- the "amx" path -------------------------------------------------------------------------
//
// Batches of bfloat16 x: the weight dequantized to bfloat16 (the "bf16" path's values, each
// weight rounded once). Up to `kAmxSplitRows` rows, where the CPU and OS grant AMX tiles, our
// own tile product over 32 dequantized rows at a time (`quant_amx.cpp`); otherwise ~1 MB of rows
// at a time into a scratch that stays in L2, times x by ATen's linear, which is oneDNN's brgemm
// (figures: docs/performance.md, "Batches through oneDNN" and "Batch decode in our own AMX
// tiles"). Not the "bf16" path's order of sums, so deterministic inference never picks it.
// `cpu_kernels.quant_path` picks it from `AMX_ROWS` rows where the CPU lists AMX-BF16.

// Rows j0 .. j0 + n of the weight dequantized to bfloat16 into `out`, on the calling thread.
template <int QT>
void dequant_rows_bf16(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t j0, int64_t n,
                       int64_t in, uint16_t* out) {
  for (int64_t j = j0; j < j0 + n; ++j) {
    prefetch_ahead(w + j * row_bytes, row_bytes, w + rows * row_bytes);
    dequant_bf16<QT>(w + j * row_bytes, in / 32, out + (j - j0) * in);
  }
}

// OpenMP held to one thread on this thread while it lives (the ICV is per thread), so oneDNN
// called inside a pool region runs on the thread that calls it.
class OneOpenMPThread {
 public:
  OneOpenMPThread() : before_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneOpenMPThread() { omp_set_num_threads(before_); }
  OneOpenMPThread(const OneOpenMPThread&) = delete;
  OneOpenMPThread& operator=(const OneOpenMPThread&) = delete;

 private:
  int before_;
};

// Rows [j0, j0 + n) of the packed weight w [rows, row_bytes] -> bfloat16 buf [n, in].
void dequant_rows(int64_t qtype, const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t j0,
                  int64_t n, int64_t in, uint16_t* buf) {
  switch (qtype) {
    case Q8_0: return dequant_rows_bf16<Q8_0>(w, row_bytes, rows, j0, n, in, buf);
    case Q4_0: return dequant_rows_bf16<Q4_0>(w, row_bytes, rows, j0, n, in, buf);
    case Q4_1: return dequant_rows_bf16<Q4_1>(w, row_bytes, rows, j0, n, in, buf);
    case Q5_0: return dequant_rows_bf16<Q5_0>(w, row_bytes, rows, j0, n, in, buf);
    case Q5_1: return dequant_rows_bf16<Q5_1>(w, row_bytes, rows, j0, n, in, buf);
    case Q4_K: return dequant_rows_bf16<Q4_K>(w, row_bytes, rows, j0, n, in, buf);
    case Q5_K: return dequant_rows_bf16<Q5_K>(w, row_bytes, rows, j0, n, in, buf);
    case Q6_K: return dequant_rows_bf16<Q6_K>(w, row_bytes, rows, j0, n, in, buf);
    default: TORCH_CHECK(false, "quant_linear: unsupported type ", qtype);
  }
}

// The prefill form of `amx_linear`: the weight ~1 MB of rows at a time, dequantized on the
// kernels' pool into one scratch, times x by oneDNN on its own threads.
at::Tensor amx_linear_prefill(int64_t qtype, const at::Tensor& x, const uint8_t* w,
                              int64_t row_bytes, int64_t out, const at::Tensor& bias) {
  const int64_t rows = x.size(0), in = x.size(1);
  const int64_t chunk = std::min(out, std::max<int64_t>(16, (int64_t{1} << 20) / (2 * in)));
  thread_local at::Tensor scratch;  // grown, never shrunk
  if (!scratch.defined() || scratch.numel() < chunk * in) {
    scratch = at::empty({chunk * in}, x.options());
  }
  auto* buf = reinterpret_cast<uint16_t*>(scratch.data_ptr<at::BFloat16>());
  const at::Tensor b = bias.defined() ? bias.to(at::kBFloat16) : at::Tensor();
  at::Tensor y = at::empty({rows, out}, x.options());
  for (int64_t j0 = 0; j0 < out; j0 += chunk) {
    const int64_t n = std::min(chunk, out - j0);
    arborlm_cpu::parallel_for(j0, j0 + n, 8, [&](int64_t begin, int64_t end) {
      dequant_rows(qtype, w, row_bytes, out, begin, end - begin, in, buf + (begin - j0) * in);
    });
    y.narrow(1, j0, n).copy_(at::linear(x, scratch.narrow(0, 0, n * in).view({n, in}),
                                        b.defined() ? b.narrow(0, j0, n) : at::Tensor()));
  }
  return y;
}

// x [rows, in] bfloat16 times the packed weight (+ bias float32, or null) -> y [rows, out]
// bfloat16 in AMX tiles (`amx_tile_linear`), each thread dequantizing its own groups of rows.
// Only where `amx_tiles_granted()`.
void amx_tiles(int64_t qtype, const void* x, int64_t rows, int64_t in, const uint8_t* w,
               int64_t row_bytes, int64_t out, const float* bias, void* y) {
  amx_tile_linear(static_cast<const uint16_t*>(x), rows, in, out, bias,
                  [&](int64_t j0, int64_t n, uint16_t* buf) {
                    dequant_rows(qtype, w, row_bytes, out, j0, n, in, buf);
                  },
                  static_cast<uint16_t*>(y));
}

// Above this many rows (prefills) `amx_linear` gives each ~1 MB chunk to oneDNN's own threads.
constexpr int64_t kAmxSplitRows = 128;

// x [rows, in] bfloat16 (contiguous) times the packed weight [out, row bytes] (+ bias float32,
// or undefined) -> [rows, out] bfloat16. Up to `kAmxSplitRows` rows (batch decode): AMX tiles
// (`amx_tile_linear`) where granted; else the outputs
// are split over the kernels' pool in chunks of rows of ~0.5 MB of bfloat16 weights; each
// thread dequantizes a chunk into its own scratch (it stays in L2) and multiplies it by oneDNN
// on that thread alone. (oneDNN's own OpenMP threads, between the pool's regions, spin beside
// the pool's workers on a small machine.) More rows (a prefill: fewer, larger products) take
// `amx_linear_prefill`, which measured faster there (docs/performance.md, "The kernels' thread
// pool").
at::Tensor amx_linear(int64_t qtype, const at::Tensor& x, const uint8_t* w, int64_t row_bytes,
                      int64_t out, const at::Tensor& bias) {
  const int64_t rows = x.size(0), in = x.size(1);
  if (rows > kAmxSplitRows) return amx_linear_prefill(qtype, x, w, row_bytes, out, bias);
  if (amx_tiles_granted()) {
    at::Tensor y = at::empty({rows, out}, x.options());
    amx_tiles(qtype, x.data_ptr(), rows, in, w, row_bytes, out,
              bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr());
    return y;
  }
  const int64_t threads = std::max<int64_t>(at::get_num_threads(), 1);
  const int64_t per_thread = (out + threads - 1) / threads;
  const int64_t chunk = std::min(std::max<int64_t>(16, (int64_t{1} << 19) / (2 * in)),
                                 (per_thread + 15) / 16 * 16);
  const int64_t chunks = (out + chunk - 1) / chunk;
  const at::Tensor b = bias.defined() ? bias.to(at::kBFloat16) : at::Tensor();
  at::Tensor y = at::empty({rows, out}, x.options());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const at::ThreadLocalState state;  // the caller's inference mode, for the pool's threads
  arborlm_cpu::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard same(state);
    const OneOpenMPThread one;
    thread_local at::Tensor scratch;  // grown, never shrunk: one step's calls reuse it
    if (!scratch.defined() || scratch.numel() < chunk * in) {
      scratch = at::empty({chunk * in}, x.options());
    }
    auto* buf = reinterpret_cast<uint16_t*>(scratch.data_ptr<at::BFloat16>());
    for (int64_t c = begin; c < end; ++c) {
      const int64_t j0 = c * chunk, n = std::min(chunk, out - j0);
      dequant_rows(qtype, w, row_bytes, out, j0, n, in, buf);
      const at::Tensor part = at::linear(x, scratch.narrow(0, 0, n * in).view({n, in}),
                                         b.defined() ? b.narrow(0, j0, n) : at::Tensor())
                                  .contiguous();
      const auto* pp = reinterpret_cast<const uint16_t*>(part.data_ptr<at::BFloat16>());
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(yp + r * out + j0, pp + r * n, n * sizeof(uint16_t));
      }
    }
  });
  return y;
}

// The integer paths' run for x (float32, or bfloat16 where `bf16`) into y [rows, out] in x's
// dtype: bfloat16 outputs rounded in the region (`over_tiles`) from float32 sums in a buffer
// this thread keeps, so that a decode step's linears allocate nothing but their outputs.
void int_run(int64_t qtype, const void* x, bool bf16, int64_t rows, int64_t in,
             const uint8_t* w, int64_t row_bytes, int64_t out, const float* bias, bool split,
             bool avx2, void* y) {
  thread_local std::vector<float> reused_y;
  Scratch<float> sums(reused_y, bf16 ? rows * out : 0);
  float* yp = bf16 ? sums.data() : static_cast<float*>(y);
  auto* np = bf16 ? static_cast<uint16_t*>(y) : nullptr;
  auto* fn = avx2    ? &int_path<true, true>
             : split ? &int_path<true, false>
                     : &int_path<false, false>;
  fn(qtype, x, bf16, rows, in, w, row_bytes, out, bias, yp, np);
}

bool cpu_has_avx512_float() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("fma");
}

bool cpu_has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("fma");
}

bool cpu_has_vnni() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
         __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
}

// path: "portable", "avx2" (as portable, FMAs on 8 lanes), "avx2_int" ("vnni2" on AVX2), "vnni"
// (x quantized to int8), "vnni2" (x in two int8 terms), "float" (x
// as it is: bfloat16 through the AVX512-BF16 dot product where the CPU has it, otherwise
// widened to float32 for FMAs) or "amx" (bfloat16 x: oneDNN on dequantized weights; else as
// "float").
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                        const std::optional<at::Tensor>& bias, c10::string_view path) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "quant_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2, "quant_linear: x must be [rows, in], got ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "quant_linear: x float32 or bfloat16 only, got ", dtype);
  int64_t block, bytes;
  TORCH_CHECK(type_size(qtype, &block, &bytes), "quant_linear: unsupported ggml type ", qtype);
  const int64_t rows = x.size(0), in = x.size(1);
  TORCH_CHECK(in % block == 0, "quant_linear: in = ", in, " is not a multiple of the type's ",
              block, "-value block");
  const int64_t row_bytes = in / block * bytes;
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 &&
                  weight.size(1) == row_bytes && weight.is_contiguous(),
              "quant_linear: weight must be contiguous uint8 [out, ", row_bytes, "], got ",
              weight.scalar_type(), " ", weight.sizes());
  const int64_t out = weight.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out,
                "quant_linear: bias must be [out] = [", out, "], got ", bias->sizes());
    b = bias->to(at::kFloat).contiguous();
  }
  const bool split = path == "vnni2", use_vnni = path == "vnni" || split,
             use_amx = path == "amx", use_float = path == "float" || use_amx,
             use_avx2 = path == "avx2", use_avx2_int = path == "avx2_int";
  TORCH_CHECK(use_vnni || use_float || use_avx2 || use_avx2_int || path == "portable",
              "quant_linear: path must be portable, avx2, avx2_int, vnni, vnni2, float or amx, "
              "got ", path);
  TORCH_CHECK(!(use_avx2 || use_avx2_int) || cpu_has_avx2(),
              "quant_linear: this CPU lacks AVX2 with F16C and FMA");
  TORCH_CHECK(!use_vnni || cpu_has_vnni(), "quant_linear: this CPU lacks AVX512-VNNI");
  TORCH_CHECK(!use_float || cpu_has_avx512_float(),
              "quant_linear: this CPU lacks AVX-512 (F, BW, VL) with F16C and FMA");
  const bool bf16_dot = use_float && dtype == at::kBFloat16 &&
                        __builtin_cpu_supports("avx512bf16");
  if (use_amx && bf16_dot && rows > 0 && out > 0) {  // else as "float" (float32 x: FMAs)
    return amx_linear(qtype, x.contiguous(), weight.data_ptr<uint8_t>(), row_bytes, out, b);
  }
  // bfloat16 x goes as it is to the AVX512-BF16 dot product and to the integer paths (which
  // widen each block as they quantize it); the others take float32.
  const bool int_x = use_vnni || use_avx2_int;
  const at::Tensor xc = bf16_dot || int_x ? x.contiguous()
                                          : arborlm_cpu::convert(x.contiguous(), at::kFloat);
  // The integer paths give outputs in x's dtype (`int_run`), the others float32.
  at::Tensor y = at::empty({rows, out}, x.options().dtype(int_x ? dtype : at::kFloat));
  if (rows > 0 && out > 0) {
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    const uint8_t* wp = weight.data_ptr<uint8_t>();
    if (int_x) {
      int_run(qtype, xc.data_ptr(), dtype == at::kBFloat16, rows, in, wp, row_bytes, out, bp,
              split, use_avx2_int, y.data_ptr());
    } else if (bf16_dot) {
      float_path<true>(qtype, xc.data_ptr(), rows, in, wp, row_bytes, out, bp,
                       y.data_ptr<float>());
    } else if (use_float) {
      float_path<false>(qtype, xc.data_ptr(), rows, in, wp, row_bytes, out, bp,
                        y.data_ptr<float>());
    } else {
      (use_avx2 ? &avx2 : &portable)(qtype, xc.data_ptr<float>(), rows, in, wp, row_bytes, out,
                                     bp, y.data_ptr<float>());
    }
  }
  return int_x ? y : arborlm_cpu::convert(y, dtype);
}

}  // namespace

namespace arborlm_cpu {

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                        const std::optional<at::Tensor>& bias, c10::string_view path) {
  return ::quant_linear(x, weight, qtype, bias, path);
}

bool quant_linear_into(const void* x, bool bf16, int64_t rows, int64_t in, const uint8_t* w,
                       int64_t row_bytes, int64_t out, int64_t qtype, const float* bias,
                       c10::string_view path, void* y) {
  static const bool vnni = cpu_has_vnni(), has_avx2 = cpu_has_avx2();
  if (path == "amx" && bf16 && rows > 0 && rows <= kAmxSplitRows && out > 0 &&
      amx_tiles_granted()) {
    amx_tiles(qtype, x, rows, in, w, row_bytes, out, bias, y);
    return true;
  }
  const bool split = path == "vnni2", avx2 = path == "avx2_int";
  // A path this CPU lacks goes to quant_linear, which says so.
  const bool granted = avx2 ? has_avx2 : (split || path == "vnni") && vnni;
  if (!granted || rows <= 0 || out <= 0) return false;
  int_run(qtype, x, bf16, rows, in, w, row_bytes, out, bias, split, avx2, y);
  return true;
}

bool quant_row_bytes(int64_t qtype, int64_t cols, int64_t* bytes) {
  int64_t block, size;
  if (!type_size(qtype, &block, &size) || cols % block != 0) return false;
  *bytes = cols / block * size;
  return true;
}

void dequant_row(int64_t qtype, const uint8_t* row, int64_t cols, float* y) {
  for (int64_t b = 0; b < cols / 32; ++b) dequant_block(qtype, row, b, y + 32 * b);
}

}  // namespace arborlm_cpu

TORCH_LIBRARY_FRAGMENT(arborlm, m) {
  m.def("quant_linear(Tensor x, Tensor weight, int qtype, Tensor? bias, str path) -> Tensor");
}

TORCH_LIBRARY_IMPL(arborlm, CPU, m) {
  m.impl("quant_linear", &quant_linear);
}
