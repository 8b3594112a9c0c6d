// `quant_linear`'s "amx" path for batch decode (up to 128 rows of bfloat16 x, `kAmxSplitRows` in
// quant_linear.cpp): AMX tiles driven here, on weights dequantized to bfloat16 32 rows at a time
// into a buffer that stays in L1/L2, in place of a oneDNN call per ~0.5 MB chunk (its dispatch
// and its reorder of the weight into AMX's layout each cost a pass that the product itself does
// not need).
//
// The product is computed transposed: C = W x^T, so the weight's rows, as dequantized, are the
// A tiles (16 weight rows x 32 values, read straight from the buffer), and x, laid out once per
// call in AMX's pair-interleaved B layout, is the B tiles (16 k-pairs x 16 rows of x). Eight
// tiles: four float32 accumulators (two halves of 32 weight rows x two tiles of 16 rows of x),
// two A and two B. `tdpbf16ps` multiplies bfloat16 pairs exactly and sums in float32; the sums
// are transposed on the way out, the bias (float32) added, and each output rounded to bfloat16
// once. Each output is one sum in a fixed order whatever the other rows are, but not the "bf16"
// path's order, nor oneDNN's above 128 rows: deterministic inference, which needs one order for
// every number of rows, never picks "amx".

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cpuid.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_common.h"

namespace arborlm_quant {
namespace {

#define AMX_TARGET \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,f16c,fma")))

constexpr int64_t kGroup = 32;  // weight rows dequantized together: two A tiles
constexpr int64_t kTile = 16;   // rows of an A tile, and rows of x in a B tile

// ldtilecfg's 64-byte operand, palette 1: every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// x [rows, in] bfloat16 -> B tiles: for tile t of 16 rows and step s of 32 values, 16 lines of
// 16 (row, pair) dwords: xp[((t * steps + s) * 16 + kp) * 16 + j] = the pair
// (x[16t + j][32s + 2kp], x[16t + j][32s + 2kp + 1]), zeros past the last row. `tiles` is even
// (the kernel takes pairs).
void lay_out_x(const uint16_t* x, int64_t rows, int64_t in, int64_t tiles, uint32_t* xp) {
  const int64_t steps = in / 32;
  std::memset(xp, 0, sizeof(uint32_t) * tiles * steps * 16 * 16);
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t t = m / kTile, j = m % kTile;
    const auto* row = reinterpret_cast<const uint32_t*>(x + m * in);
    for (int64_t s = 0; s < steps; ++s) {
      uint32_t* dst = xp + (t * steps + s) * 16 * 16 + j;
      for (int64_t kp = 0; kp < 16; ++kp) dst[kp * 16] = row[s * 16 + kp];
    }
  }
}

// The 16 x 16 float32 sums c[i][j] (weight row i, row j of x) -> y[m0 + j][n0 + i] (+ bias),
// rounded to bfloat16; `count` columns and `valid` rows of them are kept.
AMX_TARGET void write_tile(const float* c, int64_t m0, int64_t valid, int64_t n0, int64_t count,
                           const float* bias, int64_t out, uint16_t* y) {
  const __mmask16 keep = static_cast<__mmask16>((1u << count) - 1);
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                              11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
  for (int64_t j = 0; j < valid; ++j) {
    const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, c + j, 4), b);
    _mm256_mask_storeu_epi16(y + (m0 + j) * out + n0, keep, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// Weight rows [j0, j1) of y: each group of 32 dequantized into `wbuf` [32][in], then every pair
// of x's tiles run over it.
AMX_TARGET void tile_rows(const DequantRows& dequant, const uint32_t* xp, int64_t rows,
                          int64_t tiles, int64_t in, int64_t out, int64_t j0, int64_t j1,
                          const float* bias, uint16_t* wbuf, uint16_t* y) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  alignas(64) float c[4][kTile * kTile];
  const int64_t steps = in / 32, stride = in * 2, x_tile = steps * 16 * 16;
  for (int64_t g = j0; g < j1; g += kGroup) {
    const int64_t n = std::min(kGroup, j1 - g);
    dequant(g, n, wbuf);
    if (n < kGroup) std::memset(wbuf + n * in, 0, sizeof(uint16_t) * (kGroup - n) * in);
    for (int64_t t = 0; t < tiles; t += 2) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const uint32_t* b0 = xp + t * x_tile;
      const uint32_t* b1 = b0 + x_tile;
      for (int64_t s = 0; s < steps; ++s) {
        _tile_loadd(4, wbuf + s * 32, stride);
        _tile_loadd(5, wbuf + kTile * in + s * 32, stride);
        _tile_loadd(6, b0 + s * 256, 64);
        _tile_loadd(7, b1 + s * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      for (int half = 0; half < 2; ++half) {
        const int64_t count = std::min<int64_t>(kTile, n - half * kTile);
        if (count <= 0) continue;
        for (int k = 0; k < 2; ++k) {
          const int64_t m0 = (t + k) * kTile, valid = std::min<int64_t>(kTile, rows - m0);
          if (valid > 0) {
            write_tile(c[half * 2 + k], m0, valid, g + half * kTile, count, bias, out, y);
          }
        }
      }
    }
  }
  _tile_release();
}

bool cpu_has_amx_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
  return tile && bf16 && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bf16");
}

}  // namespace

bool amx_tiles_granted() {
  // Linux hands out the tiles' register state only on request (ARCH_REQ_XCOMP_PERM for
  // XFEATURE_XTILEDATA, once per process); an instruction before it faults.
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return cpu_has_amx_bf16() && syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return granted;
}

void amx_tile_linear(const uint16_t* x, int64_t rows, int64_t in, int64_t out, const float* bias,
                     const DequantRows& dequant, uint16_t* y) {
  const int64_t tiles = ((rows + kTile - 1) / kTile + 1) / 2 * 2;
  thread_local std::vector<uint32_t> laid;
  laid.resize(tiles * (in / 32) * 16 * 16);
  lay_out_x(x, rows, in, tiles, laid.data());
  const int64_t groups = (out + kGroup - 1) / kGroup;
  const uint32_t* xp = laid.data();
  arborlm_cpu::parallel_for_balanced(0, groups, 1, 4, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint16_t> wbuf;
    wbuf.resize(kGroup * in);
    tile_rows(dequant, xp, rows, tiles, in, out, begin * kGroup, std::min(out, end * kGroup),
              bias, wbuf.data(), y);
  });
}

}  // namespace arborlm_quant
