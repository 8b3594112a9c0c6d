// `quant_linear`'s integer paths four blocks at a time: "vnni" and "vnni2" in 512-bit vectors
// (AVX512-VNNI with AVX512-VBMI) and "avx2_int" in 256-bit halves, the same outputs bit for bit,
// for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q6_K (`quant_linear.cpp` describes the paths).

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_common.h"

namespace arborlm_quant {
namespace {

// ---- "vnni" and "vnni2" four blocks at a time (AVX512-VBMI) --------------------------------
//
// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, and Q4_K and Q6_K (a group: half a super-block), where the CPU also
// has AVX512-VBMI: a group of four weight blocks (128 values) is unpacked into two 512-bit vectors
// of unsigned bytes, the blocks' first 16 values in one and their last 16 in the other, and meets
// x, laid out to match (`WideActs`), in two 512-bit `vpdpbusd` per term: each int32 lane sums 8
// products of one block. Signed types go in with their offset (Q8_0: +128, Q4_0: +8, Q5_0: +16,
// Q6_K: +32: the quants as stored), which is taken off exactly in int32 by starting each lane at
// -offset * (the sum of its x quants); minimums (Q4_1, Q5_1, Q4_K) go through s as
// `quant_linear.cpp`'s per-block `tile` does. Q6_K's scales are per 16 values, so its two vectors'
// products are summed and scaled apart. Per group and row: one conversion and one FMA (two with a
// minimum) on 16 lanes, where `tile` spends that on every block. In a last, part group the missing
// blocks read as zeros, and each output is one sum in a fixed order for any number of rows.

#define VBMI_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,f16c,fma")))

constexpr bool wide_type(int64_t qt) {
  return qt == Q8_0 || qt == Q4_0 || qt == Q4_1 || qt == Q5_0 || qt == Q5_1 || qt == Q4_K ||
         qt == Q6_K;
}
constexpr bool k_quant(int64_t qt) { return qt == Q4_K || qt == Q6_K; }
// Bytes of a 32-value block, or of a K-quant's 256-value super-block.
template <int QT> constexpr int kBlockBytes = QT == Q4_0 ? 18 : QT == Q4_1 ? 20 : QT == Q5_0 ? 22
                                              : QT == Q5_1 ? 24 : QT == Q8_0 ? 34
                                              : QT == Q4_K ? 144 : 210;
// The unsigned quants as stored are the signed value plus this.
constexpr int offset_of(int64_t qt) {
  return qt == Q8_0 ? 128 : qt == Q4_0 ? 8 : qt == Q5_0 ? 16 : qt == Q6_K ? 32 : 0;
}
constexpr bool has_minimum(int64_t qt) { return qt == Q4_1 || qt == Q5_1 || qt == Q4_K; }
constexpr bool two_scales(int64_t qt) { return qt == Q6_K; }

// x in groups of four blocks, per row and group: quants (and the second term's) as
// [block 0..3 values 0..15, block 0..3 values 16..31]; each lane's start, -offset * (sum of
// its 8 quants) (with `two_scales`, 32 starts: the first vector's 4 quants, then the second's);
// each lane's x scale d (/ 256 with a second term); each block's s in its first lane (0 in the
// other three). Blocks past the row's last are zero throughout.
struct WideActs {
  std::vector<int8_t> q, q2;
  std::vector<int32_t> start, start2;
  std::vector<float> d, s;
  int64_t groups, starts;  // starts per group: 16 or 32
  int offset;  // the type's `offset_of`
};

// w sized for `rows` rows of x (its vectors refilled with zeros: a last, part group's missing
// blocks stay so; w is kept by the caller's thread for small calls); returns its groups.
int64_t size_wide_acts(const Activations& a, int64_t rows, int64_t qtype, WideActs& w) {
  w.groups = (a.blocks + 3) / 4;
  w.starts = two_scales(qtype) ? 32 : 16;
  w.offset = offset_of(qtype);
  const int64_t n = rows * w.groups;
  w.q.assign(n * 128, 0);
  w.start.assign(n * w.starts, 0);
  if (a.q2 != nullptr) {
    w.q2.assign(n * 128, 0);
    w.start2.assign(n * w.starts, 0);
  }
  w.d.assign(n * 16, 0.0f);
  w.s.assign(n * 16, 0.0f);
  return n;
}

// x's groups into w, each lane's start summed one quant at a time (the AVX2 path's).
void wide_acts(const Activations& a, int64_t rows, int64_t qtype, WideActs& w) {
  const bool split = a.q2 != nullptr;
  const int offset = offset_of(qtype);
  const int64_t n = size_wide_acts(a, rows, qtype, w);
  arborlm_cpu::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / w.groups, g = i % w.groups;
      for (int k = 0; k < 4 && 4 * g + k < a.blocks; ++k) {
        const int64_t at = t * a.blocks + 4 * g + k;
        for (int term = 0; term < (split ? 2 : 1); ++term) {
          const int8_t* src = (term ? a.q2 : a.q) + at * 32;
          int8_t* dst = (term ? w.q2 : w.q).data() + i * 128 + 16 * k;
          std::memcpy(dst, src, 16);
          std::memcpy(dst + 64, src + 16, 16);
          int32_t* start = (term ? w.start2 : w.start).data() + i * w.starts + 4 * k;
          for (int l = 0; l < 4; ++l) {
            int32_t first = 0, second = 0;
            for (int e = 0; e < 4; ++e) {
              first += dst[4 * l + e];
              second += dst[64 + 4 * l + e];
            }
            if (w.starts == 32) {
              start[l] = -offset * first;
              start[16 + l] = -offset * second;
            } else {
              start[l] = -offset * (first + second);
            }
          }
        }
        for (int l = 0; l < 4; ++l) w.d[i * 16 + 4 * k + l] = split ? a.d[at] / 256.0f : a.d[at];
        w.s[i * 16 + 4 * k] = a.s[at];
      }
    }
  });
}

// `wide_acts` with each lane's start computed in one `vpdpbusd` against ones (the sum of its
// 4 signed quants; exact), for the AVX-512 paths: group i of w (row t, group g).
VBMI_TARGET void wide_group_vnni(const Activations& a, int64_t i, WideActs& w) {
  const bool split = a.q2 != nullptr;
  const int64_t t = i / w.groups, g = i % w.groups;
  const __m512i ones = _mm512_set1_epi8(1), zero = _mm512_setzero_si512();
  const __m512i minus_offset = _mm512_set1_epi32(-w.offset);
  for (int term = 0; term < (split ? 2 : 1); ++term) {
    int8_t* dst = (term ? w.q2 : w.q).data() + i * 128;
    for (int k = 0; k < 4 && 4 * g + k < a.blocks; ++k) {
      const int8_t* src = (term ? a.q2 : a.q) + (t * a.blocks + 4 * g + k) * 32;
      std::memcpy(dst + 16 * k, src, 16);
      std::memcpy(dst + 64 + 16 * k, src + 16, 16);
    }
    const __m512i lo = _mm512_dpbusd_epi32(zero, ones, _mm512_loadu_si512(dst));
    const __m512i hi = _mm512_dpbusd_epi32(zero, ones, _mm512_loadu_si512(dst + 64));
    int32_t* start = (term ? w.start2 : w.start).data() + i * w.starts;
    if (w.starts == 32) {
      _mm512_storeu_si512(start, _mm512_mullo_epi32(lo, minus_offset));
      _mm512_storeu_si512(start + 16, _mm512_mullo_epi32(hi, minus_offset));
    } else {
      _mm512_storeu_si512(start, _mm512_mullo_epi32(_mm512_add_epi32(lo, hi), minus_offset));
    }
  }
  for (int k = 0; k < 4 && 4 * g + k < a.blocks; ++k) {
    const int64_t at = t * a.blocks + 4 * g + k;
    for (int l = 0; l < 4; ++l) w.d[i * 16 + 4 * k + l] = split ? a.d[at] / 256.0f : a.d[at];
    w.s[i * 16 + 4 * k] = a.s[at];
  }
}

void wide_acts_vnni(const Activations& a, int64_t rows, int64_t qtype, WideActs& w) {
  const int64_t n = size_wide_acts(a, rows, qtype, w);
  arborlm_cpu::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) wide_group_vnni(a, i, w);
  });
}

// Byte (or 16-bit word) indices into two 64-byte loads of a group, the first at its start and
// the second at its end - 64: element e of the result is the group's byte (word) pos(e).
template <typename Pos>
BW_TARGET inline __m512i two_load_index(int group_bytes, bool words, Pos pos) {
  alignas(64) uint8_t bytes[64];
  alignas(64) uint16_t ws[32];
  const int second = group_bytes - 64;
  for (int e = 0; e < (words ? 32 : 64); ++e) {
    const int p = pos(e), unit = words ? 2 : 1, n = 64 / unit;
    const int idx = p * unit < 64 ? p : n + p - second / unit;
    if (words) ws[e] = static_cast<uint16_t>(idx); else bytes[e] = static_cast<uint8_t>(idx);
  }
  return words ? _mm512_load_si512(ws) : _mm512_load_si512(bytes);
}

// A group's weights: the two vectors of unsigned quants, the 16 lanes' weight scales and
// (with a minimum) minimums.
struct WideGroup {
  __m512i lo, hi;
  __m512 scale, minimum, scale_hi;  // scale_hi: the second vector's (`two_scales`)
};

// 32 bytes at p and 32 at p + stride, in one vector.
BW_TARGET inline __m512i two_blocks(const uint8_t* p, int stride) {
  const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + stride));
  return _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
}

// The first n bytes of 64 (none for n <= 0).
inline __mmask64 bytes(int n) {
  return n >= 64 ? ~__mmask64(0) : n <= 0 ? __mmask64(0) : (__mmask64(1) << n) - 1;
}

// `two_blocks` where only the first `n` (0-2) of the two exist; the other reads as zeros.
BW_TARGET inline __m512i two_blocks_masked(const uint8_t* p, int stride, int n) {
  const __m256i first = _mm256_maskz_loadu_epi8(n >= 1 ? ~__mmask32(0) : 0, p);
  const __m256i second = _mm256_maskz_loadu_epi8(n >= 2 ? ~__mmask32(0) : 0, p + stride);
  return _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
}

// The half-precision value at p (F16C: exact, as `half_at`).
AVX2_TARGET inline float f16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// A Q4_K super-block's scales and minimums of sub-blocks 4n .. 4n + 3, as `unpack` computes
// them (d * sc, -dmin * m).
AVX2_TARGET inline void k4_scales(const uint8_t* p, int n, __m128* scale, __m128* minimum) {
  int sc[4], m[4];
  for (int j = 0; j < 4; ++j) scale_min_k4(4 * n + j, p + 4, &sc[j], &m[j]);
  *scale = _mm_mul_ps(_mm_set1_ps(f16_at(p)),
                      _mm_cvtepi32_ps(_mm_setr_epi32(sc[0], sc[1], sc[2], sc[3])));
  *minimum = _mm_mul_ps(_mm_set1_ps(-f16_at(p + 2)),
                        _mm_cvtepi32_ps(_mm_setr_epi32(m[0], m[1], m[2], m[3])));
}

// Four values, each to four lanes.
BW_TARGET inline __m512 spread4(__m128 v) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                               _mm512_castps128_ps512(v));
}

// Where a block's quants start (Q5's 4 bytes of 5th bits just before them).
template <int QT> constexpr int kQuantsAt = QT == Q4_0 || QT == Q8_0 ? 2 : QT == Q4_1 ? 4
                                            : QT == Q5_0 ? 6 : 8;

template <int QT>
struct WideUnpack {
  static constexpr int kB = kBlockBytes<QT>, kQs = kQuantsAt<QT>;
  __m512i quants, words;  // vpermt2b / vpermt2w indices (not for Q8_0)

  VBMI_TARGET WideUnpack() {
    if constexpr (QT != Q8_0 && !k_quant(QT)) {
      quants = two_load_index(4 * kB, false, [](int e) { return (e / 16) * kB + kQs + e % 16; });
      // words 0-15: block e / 4's scale d; 16-31: its minimum m (the word after d).
      words = two_load_index(4 * kB, true, [](int e) { return ((e % 16) / 4) * kB / 2 + e / 16; });
    }
  }

  // Group g of a row, of which `nb` blocks (1-4) exist: the others read as zeros (masked loads,
  // which do not touch the bytes they skip). K-quant rows are whole super-blocks.
  VBMI_TARGET inline WideGroup operator()(const uint8_t* row, int64_t g, int nb) const {
    WideGroup u;
    if constexpr (QT == Q4_K) {
      const uint8_t* p = row + (g / 2) * kB;
      const int n = static_cast<int>(g % 2);
      const __m512i v = _mm512_loadu_si512(p + 16 + 64 * n);
      const __m512i mask = _mm512_set1_epi8(0x0F);
      const __m512i low = _mm512_and_si512(v, mask);  // sub-blocks 4n and 4n + 2
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);  // 4n + 1, 4n + 3
      u.lo = _mm512_permutex2var_epi64(low, _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), high);
      u.hi = _mm512_permutex2var_epi64(low, _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15), high);
      __m128 sc, mn;
      k4_scales(p, n, &sc, &mn);
      u.scale = spread4(sc);
      u.minimum = spread4(mn);
    } else if constexpr (QT == Q6_K) {
      const uint8_t* p = row + (g / 2) * kB;
      const int n = static_cast<int>(g % 2);
      const __m512i ql = _mm512_loadu_si512(p + 64 * n);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * n));
      const __m512i h01 = _mm512_inserti64x4(_mm512_castsi256_si512(qh),
                                             _mm256_srli_epi16(qh, 2), 1);
      const __m512i h23 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(qh, 4)),
                                             _mm256_srli_epi16(qh, 6), 1);
      const __m512i mask = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(3);
      // values 0-63 and 64-127 of the half, in order
      const __m512i a = _mm512_or_si512(_mm512_and_si512(ql, mask),
                                        _mm512_slli_epi16(_mm512_and_si512(h01, three), 4));
      const __m512i b = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), mask),
                                        _mm512_slli_epi16(_mm512_and_si512(h23, three), 4));
      u.lo = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(2, 0, 2, 0));
      u.hi = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 1, 3, 1));
      const __m512 sc = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 192 + 8 * n)))),
          _mm512_set1_ps(f16_at(p + 208)));
      u.scale = _mm512_permutexvar_ps(
          _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6), sc);
      u.scale_hi = _mm512_permutexvar_ps(
          _mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7), sc);
      u.minimum = _mm512_setzero_ps();
    } else if constexpr (QT == Q8_0) {
      const uint8_t* p = row + g * 4 * kB;
      const __m512i a = nb == 4 ? two_blocks(p + 2, 34) : two_blocks_masked(p + 2, 34, nb);
      const __m512i b = nb == 4 ? two_blocks(p + 70, 34) : two_blocks_masked(p + 70, 34, nb - 2);
      const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // q + 128
      u.lo = _mm512_xor_si512(_mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(2, 0, 2, 0)), flip);
      u.hi = _mm512_xor_si512(_mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 1, 3, 1)), flip);
      uint16_t d[4] = {0, 0, 0, 0};
      for (int k = 0; k < nb; ++k) std::memcpy(&d[k], p + 34 * k, 2);
      const __m128 d4 = _mm_cvtph_ps(_mm_setr_epi16(static_cast<short>(d[0]),
          static_cast<short>(d[1]), static_cast<short>(d[2]), static_cast<short>(d[3]), 0, 0, 0,
          0));
      u.scale = spread4(d4);
      u.minimum = _mm512_setzero_ps();
    } else {
      const uint8_t* p = row + g * 4 * kB;
      const int valid = nb * kB, second = 4 * kB - 64;
      const __m512i a = nb == 4 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(bytes(valid), p);
      const __m512i b = nb == 4 ? _mm512_loadu_si512(p + second)
                                : _mm512_maskz_loadu_epi8(bytes(valid - second), p + second);
      const __m512i v = _mm512_permutex2var_epi8(a, quants, b);
      const __m512i mask = _mm512_set1_epi8(0x0F);
      u.lo = _mm512_and_si512(v, mask);
      u.hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
      if constexpr (QT == Q5_0 || QT == Q5_1) {  // the 5th bits: bit i of qh for value i
        uint64_t low = 0, high = 0;
        for (int k = 0; k < nb; ++k) {
          uint32_t qh;
          std::memcpy(&qh, p + kB * k + kQs - 4, 4);
          low |= static_cast<uint64_t>(qh & 0xFFFF) << (16 * k);
          high |= static_cast<uint64_t>(qh >> 16) << (16 * k);
        }
        const __m512i sixteen = _mm512_set1_epi8(16);
        u.lo = _mm512_mask_add_epi8(u.lo, low, u.lo, sixteen);
        u.hi = _mm512_mask_add_epi8(u.hi, high, u.hi, sixteen);
      }
      const __m512i w = _mm512_permutex2var_epi16(a, words, b);
      u.scale = _mm512_cvtph_ps(_mm512_castsi512_si256(w));
      u.minimum = has_minimum(QT) ? _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1))
                                  : _mm512_setzero_ps();
    }
    return u;
  }
};

// The 16 lanes' sum: its halves added, then `sum8` (the AVX2 form sums its two halves so).
BW_TARGET inline float sum16(__m512 v) {
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return sum8(_mm256_add_ps(_mm512_castps512_ps256(v), high));
}

// One term's int32 lanes of a group and row: `start` plus both vectors' products, or (two_scales)
// each vector's apart.
template <int QT>
VBMI_TARGET inline void wide_dots(const WideGroup& u, const int8_t* x, const int32_t* start,
                                  __m512i* first, __m512i* second) {
  *first = _mm512_dpbusd_epi32(_mm512_loadu_si512(start), u.lo, _mm512_loadu_si512(x));
  if constexpr (two_scales(QT)) {
    *second = _mm512_dpbusd_epi32(_mm512_loadu_si512(start + 16), u.hi,
                                  _mm512_loadu_si512(x + 64));
  } else {
    *first = _mm512_dpbusd_epi32(*first, u.hi, _mm512_loadu_si512(x + 64));
  }
}

// Columns [j, j + NC) of rows [t0, t0 + MR): each output one pass over its weight row's groups,
// the NC columns side by side so that they share each group's activation loads and their
// accumulator chains run interleaved (a decode row's column otherwise waits on one chain of
// FMAs and its own horizontal sum). Each output's arithmetic is the same whatever NC.
template <int QT, int MR, bool SPLIT, int NC>
VBMI_TARGET inline void wide_columns(const WideActs& a, const WideUnpack<QT>& unpack,
                                     int64_t whole, int tail, int64_t t0, const uint8_t* w,
                                     int64_t row_bytes, int64_t j, const uint8_t* end,
                                     const float* bias, float* y, int64_t ldy) {
  const uint8_t* rows[NC];
  for (int c = 0; c < NC; ++c) {
    rows[c] = w + (j + c) * row_bytes;
    if (t0 == 0) prefetch_ahead(rows[c], row_bytes, end);  // later passes find the tile cached
  }
  __m512 acc[MR][NC];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < NC; ++c) acc[m][c] = _mm512_setzero_ps();
  const int64_t groups = a.groups, starts = a.starts;
  const int8_t* q = a.q.data();
  const int8_t* q2 = a.q2.data();
  const int32_t* start = a.start.data();
  const int32_t* start2 = a.start2.data();
  const float* d = a.d.data();
  const float* s = a.s.data();
  for (int64_t g = 0; g < groups; ++g) {
    const int nb = g < whole ? 4 : tail;
    WideGroup u[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) u[c] = unpack(rows[c], g, nb);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (t0 + m) * groups + g;
      const __m512 dx = _mm512_loadu_ps(d + at * 16);
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) {
        __m512i dot, dot_hi = _mm512_setzero_si512();
        wide_dots<QT>(u[c], q + at * 128, start + at * starts, &dot, &dot_hi);
        if constexpr (SPLIT) {  // 256 dot(w, q) + dot(w, q2): exact in int32 (|.| < 2^26)
          __m512i dot2, dot2_hi = _mm512_setzero_si512();
          wide_dots<QT>(u[c], q2 + at * 128, start2 + at * starts, &dot2, &dot2_hi);
          dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), dot2);
          if constexpr (two_scales(QT)) {
            dot_hi = _mm512_add_epi32(_mm512_slli_epi32(dot_hi, 8), dot2_hi);
          }
        }
        acc[m][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(u[c].scale, dx),
                                    acc[m][c]);
        if constexpr (two_scales(QT)) {
          acc[m][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_hi),
                                      _mm512_mul_ps(u[c].scale_hi, dx), acc[m][c]);
        }
        if constexpr (has_minimum(QT)) {
          acc[m][c] = _mm512_fmadd_ps(u[c].minimum, _mm512_loadu_ps(s + at * 16), acc[m][c]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < NC; ++c)
      y[(t0 + m) * ldy + j + c] = sum16(acc[m][c]) + (bias ? bias[j + c] : 0.0f);
}

// Columns [j0, j1) of rows [t0, t0 + MR), `kWideColumns` at a time where one row passes.
constexpr int kWideColumns = 4;

template <int QT, int MR, bool SPLIT>
VBMI_TARGET void wide_tile(const WideActs& a, const WideUnpack<QT>& unpack, int64_t blocks,
                           int64_t t0, const uint8_t* w, int64_t row_bytes, int64_t j0,
                           int64_t j1, const float* bias, float* y, int64_t ldy) {
  const int64_t whole = blocks / 4;
  const int tail = static_cast<int>(blocks % 4);
  const uint8_t* end = w + ldy * row_bytes;  // y's row stride is the weight's number of rows
  int64_t j = j0;
  if constexpr (MR == 1) {
    for (; j + kWideColumns <= j1; j += kWideColumns) {
      wide_columns<QT, MR, SPLIT, kWideColumns>(a, unpack, whole, tail, t0, w, row_bytes, j, end,
                                                bias, y, ldy);
    }
  }
  for (; j < j1; ++j) {
    wide_columns<QT, MR, SPLIT, 1>(a, unpack, whole, tail, t0, w, row_bytes, j, end, bias, y,
                                   ldy);
  }
}

// The AVX2 form ("avx2_int"), the same outputs bit for bit: each 512-bit vector as two 256-bit
// halves (blocks 0-1, blocks 2-3), `vpdpbusd`'s lanes from `dot4`. Q8_0's quants, whose offset
// 128 would overflow `vpmaddubsw`'s pairs, go in signed as |w| against x with w's sign, which
// forms the same int32 lanes with the offset already off.
struct WideHalves {
  __m256i lo[2], hi[2];
  __m256 scale[2], minimum[2], scale_hi[2];
};

// Two values, each to four lanes.
AVX2_TARGET inline __m256 spread2(float first, float second) {
  return _mm256_set_m128(_mm_set1_ps(second), _mm_set1_ps(first));
}

// Values 2h and 2h + 1 of v, each to four lanes.
AVX2_TARGET inline __m256 spread2(__m128 v, int h) {
  const __m256i at = h ? _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)
                       : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), at);
}

template <int QT>
AVX2_TARGET inline WideHalves wide_unpack_avx2(const uint8_t* row, int64_t g, int nb) {
  constexpr int kB = kBlockBytes<QT>, kQs = kQuantsAt<QT>;
  WideHalves u;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  if constexpr (QT == Q4_K) {
    const uint8_t* p = row + (g / 2) * kB;
    const int n = static_cast<int>(g % 2);
    for (int h = 0; h < 2; ++h) {  // sub-blocks 4n + 2h (low nibbles) and 4n + 2h + 1 (high)
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 + 64 * n +
                                                                             32 * h));
      const __m256i low = _mm256_and_si256(v, mask);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      u.lo[h] = _mm256_permute2x128_si256(low, high, 0x20);
      u.hi[h] = _mm256_permute2x128_si256(low, high, 0x31);
    }
    __m128 sc, mn;
    k4_scales(p, n, &sc, &mn);
    for (int h = 0; h < 2; ++h) {
      u.scale[h] = spread2(sc, h);
      u.minimum[h] = spread2(mn, h);
    }
    return u;
  } else if constexpr (QT == Q6_K) {
    const uint8_t* p = row + (g / 2) * kB;
    const int n = static_cast<int>(g % 2);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * n));
    const __m256i three = _mm256_set1_epi8(3);
    const auto* sc = reinterpret_cast<const int8_t*>(p + 192 + 8 * n);
    const float d = f16_at(p + 208);
    for (int h = 0; h < 2; ++h) {  // values 64h .. 64h + 63: blocks 2h and 2h + 1
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * n));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * n + 32));
      const __m256i l0 = h ? _mm256_and_si256(_mm256_srli_epi16(ql0, 4), mask)
                           : _mm256_and_si256(ql0, mask);
      const __m256i l1 = h ? _mm256_and_si256(_mm256_srli_epi16(ql1, 4), mask)
                           : _mm256_and_si256(ql1, mask);
      const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(qh, 4 * h), three);
      const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(qh, 4 * h + 2), three);
      const __m256i b0 = _mm256_or_si256(l0, _mm256_slli_epi16(h0, 4));
      const __m256i b1 = _mm256_or_si256(l1, _mm256_slli_epi16(h1, 4));
      u.lo[h] = _mm256_permute2x128_si256(b0, b1, 0x20);
      u.hi[h] = _mm256_permute2x128_si256(b0, b1, 0x31);
      u.scale[h] = spread2(d * sc[4 * h], d * sc[4 * h + 2]);
      u.scale_hi[h] = spread2(d * sc[4 * h + 1], d * sc[4 * h + 3]);
      u.minimum[h] = _mm256_setzero_ps();
    }
    return u;
  } else {
    alignas(32) static constexpr uint8_t kZeros[kB] = {};  // a block past the row's last
    const uint8_t* p = row + g * 4 * kB;
    for (int h = 0; h < 2; ++h) {
      const uint8_t* b0 = 2 * h < nb ? p + 2 * h * kB : kZeros;
      const uint8_t* b1 = 2 * h + 1 < nb ? p + (2 * h + 1) * kB : kZeros;
      if constexpr (QT == Q8_0) {
        const __m256i y0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + kQs));
        const __m256i y1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + kQs));
        u.lo[h] = _mm256_permute2x128_si256(y0, y1, 0x20);
        u.hi[h] = _mm256_permute2x128_si256(y0, y1, 0x31);
      } else {
        const __m256i v = _mm256_set_m128i(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + kQs)),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + kQs)));
        u.lo[h] = _mm256_and_si256(v, mask);
        u.hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        if constexpr (QT == Q5_0 || QT == Q5_1) {
          uint32_t qh0, qh1;
          std::memcpy(&qh0, b0 + kQs - 4, 4);
          std::memcpy(&qh1, b1 + kQs - 4, 4);
          u.lo[h] = _mm256_add_epi8(u.lo[h], bits_to_16s((qh0 & 0xFFFF) | (qh1 << 16)));
          u.hi[h] = _mm256_add_epi8(u.hi[h], bits_to_16s((qh0 >> 16) | (qh1 & 0xFFFF0000)));
        }
      }
      u.scale[h] = spread2(f16_at(b0), f16_at(b1));
      u.minimum[h] = has_minimum(QT) ? spread2(f16_at(b0 + 2), f16_at(b1 + 2))
                                     : _mm256_setzero_ps();
    }
    return u;
  }
}

// One half's int32 lanes of one term: `start` plus the products of both vectors' halves, or
// (two_scales) each apart, as `wide_dots`.
template <int QT>
AVX2_TARGET inline void wide_dots_avx2(__m256i lo, __m256i hi, const int8_t* x,
                                       const int32_t* start, __m256i* first, __m256i* second) {
  const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 64));
  const __m256i start_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(start));
  if constexpr (QT == Q8_0) {
    *first = _mm256_add_epi32(dot4(_mm256_abs_epi8(lo), _mm256_sign_epi8(xlo, lo)),
                              dot4(_mm256_abs_epi8(hi), _mm256_sign_epi8(xhi, hi)));
  } else if constexpr (two_scales(QT)) {
    const __m256i start_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(start + 16));
    *first = _mm256_add_epi32(start_lo, dot4(lo, xlo));
    *second = _mm256_add_epi32(start_hi, dot4(hi, xhi));
  } else {
    *first = _mm256_add_epi32(start_lo, _mm256_add_epi32(dot4(lo, xlo), dot4(hi, xhi)));
  }
}

template <int QT, int MR, bool SPLIT>
AVX2_TARGET void wide_tile_avx2(const WideActs& a, int64_t blocks, int64_t t0, const uint8_t* w,
                                int64_t row_bytes, int64_t j0, int64_t j1, const float* bias,
                                float* y, int64_t ldy) {
  const int64_t whole = blocks / 4, tail = blocks % 4;
  const uint8_t* end = w + ldy * row_bytes;
  for (int64_t j = j0; j < j1; ++j) {
    const uint8_t* row = w + j * row_bytes;
    if (t0 == 0) prefetch_ahead(row, row_bytes, end);
    __m256 acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < a.groups; ++g) {
      const WideHalves u = wide_unpack_avx2<QT>(row, g, g < whole ? 4 : static_cast<int>(tail));
      for (int m = 0; m < MR; ++m) {
        const int64_t at = (t0 + m) * a.groups + g;
        for (int h = 0; h < 2; ++h) {
          __m256i dot, dot_hi = _mm256_setzero_si256();
          wide_dots_avx2<QT>(u.lo[h], u.hi[h], a.q.data() + at * 128 + 32 * h,
                             a.start.data() + at * a.starts + 8 * h, &dot, &dot_hi);
          if constexpr (SPLIT) {
            __m256i dot2, dot2_hi = _mm256_setzero_si256();
            wide_dots_avx2<QT>(u.lo[h], u.hi[h], a.q2.data() + at * 128 + 32 * h,
                               a.start2.data() + at * a.starts + 8 * h, &dot2, &dot2_hi);
            dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8), dot2);
            if constexpr (two_scales(QT)) {
              dot_hi = _mm256_add_epi32(_mm256_slli_epi32(dot_hi, 8), dot2_hi);
            }
          }
          const __m256 dx = _mm256_loadu_ps(a.d.data() + at * 16 + 8 * h);
          acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(u.scale[h], dx),
                                      acc[m][h]);
          if constexpr (two_scales(QT)) {
            acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_hi),
                                        _mm256_mul_ps(u.scale_hi[h], dx), acc[m][h]);
          }
          if constexpr (has_minimum(QT)) {
            acc[m][h] = _mm256_fmadd_ps(u.minimum[h],
                                        _mm256_loadu_ps(a.s.data() + at * 16 + 8 * h), acc[m][h]);
          }
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      y[(t0 + m) * ldy + j] = sum8(_mm256_add_ps(acc[m][0], acc[m][1])) + (bias ? bias[j] : 0.0f);
    }
  }
}

template <int QT, bool SPLIT, bool AVX2>
void wide_typed(const Activations& a, int64_t rows, const uint8_t* w, int64_t row_bytes,
                 int64_t out, const float* bias, float* y, uint16_t* narrow) {
  // A decode row's groups in a buffer this thread keeps (as `Scratch` does), a prefill's in
  // the call's own.
  thread_local WideActs reused;
  WideActs own;
  WideActs& wa = rows * a.in * 2 <= Scratch<int8_t>::kReusedBytes ? reused : own;
  if constexpr (AVX2) {
    wide_acts(a, rows, QT, wa);
  } else {
    wide_acts_vnni(a, rows, QT, wa);
  }
  if constexpr (AVX2) {
    over_tiles(rows, out, y, narrow, [&](auto mr, int64_t t0, int64_t j0, int64_t j1) {
      wide_tile_avx2<QT, decltype(mr)::value, SPLIT>(wa, a.blocks, t0, w, row_bytes, j0, j1,
                                                     bias, y, out);
    });
  } else {
    const WideUnpack<QT> unpack;
    over_tiles(rows, out, y, narrow, [&](auto mr, int64_t t0, int64_t j0, int64_t j1) {
      wide_tile<QT, decltype(mr)::value, SPLIT>(wa, unpack, a.blocks, t0, w, row_bytes, j0, j1,
                                                bias, y, out);
    });
  }
}

}  // namespace

bool wide_linear(int64_t qtype, bool split, bool avx2, const Activations& a, int64_t rows,
                 const uint8_t* w, int64_t row_bytes, int64_t out, const float* bias, float* y,
                 uint16_t* narrow) {
  if (!wide_type(qtype) || (!avx2 && !__builtin_cpu_supports("avx512vbmi"))) return false;
  // "avx2_int" is always two-term; "vnni" (one term) runs on AVX-512 only.
  const auto run = [&](auto qt) {
    constexpr int QT = decltype(qt)::value;
    if (avx2) {
      wide_typed<QT, true, true>(a, rows, w, row_bytes, out, bias, y, narrow);
    } else if (split) {
      wide_typed<QT, true, false>(a, rows, w, row_bytes, out, bias, y, narrow);
    } else {
      wide_typed<QT, false, false>(a, rows, w, row_bytes, out, bias, y, narrow);
    }
  };
  switch (qtype) {
    case Q8_0: run(std::integral_constant<int, Q8_0>{}); break;
    case Q4_0: run(std::integral_constant<int, Q4_0>{}); break;
    case Q4_1: run(std::integral_constant<int, Q4_1>{}); break;
    case Q5_0: run(std::integral_constant<int, Q5_0>{}); break;
    case Q5_1: run(std::integral_constant<int, Q5_1>{}); break;
    case Q4_K: run(std::integral_constant<int, Q4_K>{}); break;
    default: run(std::integral_constant<int, Q6_K>{}); break;
  }
  return true;
}

}  // namespace arborlm_quant
