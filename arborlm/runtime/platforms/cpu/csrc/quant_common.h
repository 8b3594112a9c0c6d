// What quant_linear.cpp, quant_wide.cpp and quant_amx.cpp share: ggml's type numbers, the target
// attributes, x quantized per block (`Activations`), a few AVX2 byte helpers, the column-tile
// driver, and the AMX tile product's entry points.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "vec_math.h"
#include "thread_pool.h"

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
// What unpacking a block needs (no VNNI): shared by the integer path and the float path.
#define BW_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c,fma")))

namespace arborlm_quant {

using arborlm_cpu::sum8;

enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13,
                       Q6_K = 14 };

// K-quants' 6-bit scale and minimum of sub-block j (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// A call's buffer of n T's (contents unspecified): up to kReusedBytes, a vector the calling
// thread keeps from call to call (`reused`, a thread_local of the caller), so that a decode
// step's ~50 small linears allocate nothing; larger (a prefill's), the call's own, freed when it
// returns, so that no thread holds a prefill's buffers after it.
template <typename T>
class Scratch {
 public:
  static constexpr int64_t kReusedBytes = int64_t{1} << 18;

  Scratch(std::vector<T>& reused, int64_t n) {
    if (n * static_cast<int64_t>(sizeof(T)) <= kReusedBytes) {
      if (static_cast<int64_t>(reused.size()) < n) reused.resize(n);
      p_ = reused.data();
    } else {
      own_.reset(new T[n]);  // left uninitialized, as at::empty's
      p_ = own_.get();
    }
  }
  T* data() { return p_; }

 private:
  std::unique_ptr<T[]> own_;
  T* p_;
};

// Rows of x quantized per 32-value block: quants [rows, in] int8, scales d and scaled sums
// d * sum(q) [rows, in / 32].
struct Activations {
  const int8_t* q;
  const int8_t* q2;  // "vnni2": the second term's quants (residual / (d / 256)), else null
  const float* d;
  const float* s;
  int64_t in, blocks;
};

// Q5's fifth bits: bit i of `bits` -> byte i = 16, or 0.
AVX2_TARGET inline __m256i bits_to_16s(uint32_t bits) {
  // Byte i takes byte i / 8 of `bits`, then is tested against bit i % 8.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i b = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, b), b),
                          _mm256_set1_epi8(16));
}

// Products of w's unpacked quants (`uq`: unsigned, or |w| for signed types) with x's quants,
// each int32 lane the sum of four (as `vpdpbusd` into zero).
AVX2_TARGET inline __m256i dot4(__m256i uq, __m256i xq) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(uq, xq), _mm256_set1_epi16(1));
}

// How far ahead of the weight row in use the kernels request the next rows' bytes. A decode step
// streams every weight once, mostly from memory, in rows of a few hundred bytes to a few KB; left
// to the hardware prefetchers (which start over at each 4 KB page), the loads of the row in use
// wait on memory for most of a batch-1 step. 2 KB measured best of 1-8 KB on SmolLM2's shapes
// (docs/performance.md).
constexpr int64_t kPrefetchAhead = 2048;

// Requests the cache lines of [row + kPrefetchAhead, + row_bytes) that lie before `end` (the
// weight's end): one row's worth, kPrefetchAhead bytes ahead.
inline void prefetch_ahead(const uint8_t* row, int64_t row_bytes, const uint8_t* end) {
  const uint8_t* p = row + kPrefetchAhead;
  const uint8_t* stop = std::min(p + row_bytes, end);
  for (; p < stop; p += 64) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

constexpr int kMaxRows = 4;       // rows sharing each unpacked weight block
constexpr int64_t kColTile = 64;  // columns whose weight rows stay cached while all rows pass
// Chunks per thread (`parallel_for_balanced`): on the 2-vCPU development VM a decode linear's
// fixed halves ended ~7 us apart on average (0.4 ms of a 4 ms q4_0 token spent waiting).
constexpr int64_t kSplit = 8;

// Columns in tiles of `kColTile` across threads (claimed in `kSplit` chunks each); in each,
// rows `kMaxRows` at a time: tile(std::integral_constant<int, MR>, t0, j0, j1), which writes
// y [rows, out]. With one pass of rows (at most `kMaxRows`) no weight is read twice, so the
// tiles are 16 columns instead. With `narrow`, each chunk's columns of y are then rounded to
// bfloat16 into narrow [rows, out] by the thread that computed them, while they are in its
// cache (the caller would otherwise convert all of y alone after the region).
template <typename Tile>
void over_tiles(int64_t rows, int64_t out, const float* y, uint16_t* narrow, const Tile& tile) {
  const int64_t width = rows <= kMaxRows ? 16 : kColTile;
  const int64_t tiles = (out + width - 1) / width;
  arborlm_cpu::parallel_for_balanced(0, tiles, 1, kSplit, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t j0 = c * width, j1 = std::min(out, j0 + width);
      for (int64_t t0 = 0; t0 < rows; t0 += kMaxRows) {
        switch (std::min<int64_t>(kMaxRows, rows - t0)) {
          case 4: tile(std::integral_constant<int, 4>{}, t0, j0, j1); break;
          case 3: tile(std::integral_constant<int, 3>{}, t0, j0, j1); break;
          case 2: tile(std::integral_constant<int, 2>{}, t0, j0, j1); break;
          default: tile(std::integral_constant<int, 1>{}, t0, j0, j1); break;
        }
      }
    }
    if (narrow != nullptr) {
      const int64_t j0 = begin * width, j1 = std::min(out, end * width);
      for (int64_t t = 0; t < rows; ++t) {
        arborlm_cpu::to_bf16(y + t * out + j0, narrow + t * out + j0, j1 - j0);
      }
    }
  });
}

// "vnni" / "vnni2" (`split`) or, with `avx2`, "avx2_int" four blocks at a time (`quant_wide.cpp`)
// where it takes `qtype` (the 32-value types, Q4_K and Q6_K; AVX-512 also needs AVX512-VBMI):
// y [rows, out] = x (as `a`) times the packed weight (+ bias), and with `narrow` y in bfloat16
// there too (`over_tiles`). False where it does not.
bool wide_linear(int64_t qtype, bool split, bool avx2, const Activations& a, int64_t rows,
                 const uint8_t* w, int64_t row_bytes, int64_t out, const float* bias, float* y,
                 uint16_t* narrow);

// Weight rows [j0, j0 + n) dequantized to bfloat16 into buf [n][in], on the calling thread.
using DequantRows = std::function<void(int64_t j0, int64_t n, uint16_t* buf)>;

// Whether this CPU has AMX-BF16 tiles and the OS grants them to this process (`quant_amx.cpp`).
bool amx_tiles_granted();

// y [rows, out] bfloat16 = x [rows, in] bfloat16 times the weight that `dequant` yields
// (+ bias float32, or null) through AMX tiles (`quant_amx.cpp`), on the kernels' pool. Only
// where `amx_tiles_granted()`; `in` a multiple of 32.
void amx_tile_linear(const uint16_t* x, int64_t rows, int64_t in, int64_t out, const float* bias,
                     const DequantRows& dequant, uint16_t* y);

}  // namespace arborlm_quant
