// Causal attention of an extend's new tokens, for CPU: `arborlm::causal_attention`.
//
// A prefill's attention is a few percent of its FLOPs, but ATen's CPU flash kernel runs it far
// below the machine's speed: a 512-token causal prompt of 8 heads x 64 dims computes ~75 GFLOP/s
// of the causal FLOPs on a 2-core Zen 4, where the same machine's matmuls reach ~190, so it took
// ~20% of a 32M model's prefill. This is flash attention over the same data, built like
// `panel_gemm.cpp`'s linears:
//
// - Each KV head's keys are packed once per call as panels of 32 keys, `[D, 32]` each (K^T in
//   slices), so that scores come from a register tile of up to 12 query rows x 32 keys: per head
//   dim two loads, one broadcast and two FMAs per row. Values are read in place (float32) or
//   widened once into a float32 copy (bfloat16).
// - A work item is one query head's block of 48 rows. It walks the keys in blocks of 256: the
//   scores of the block land in a per-thread buffer (48 KiB), each row takes its online-softmax
//   step (new maximum, vectorized exp, sum) over the keys it may see, and a second register
//   tile (24 accumulators: 6 rows x 64 dims, up to 12 rows for narrower heads) adds
//   probabilities times values into the rows' float32 outputs, rescaled by the change of
//   maximum as it loads them.
// - Key panels past a tile's last visible key are never computed; keys a row may not see within
//   a computed panel get probability 0.
//
// Query i of T new tokens sees keys 0 .. S - T + i of the S keys: a plain prompt (S = T) or an
// extend on a cached prefix (its S - T prefix keys first). Products and sums are float32
// (bfloat16 inputs are widened exactly), the output is rounded once to the inputs' dtype; as
// in ATen's kernel, the scale multiplies the scores and bfloat16 probabilities are rounded to
// bfloat16 before they weight the values.
//
// `arborlm::prefix_attention`, cascade decode's shared part (`decode_step` calls it per layer),
// runs the same core: each group's prefix is packed per (group, KV head) from the pool's slots,
// a work item is one query head of a block of the group's members, and it returns float32
// outputs with log-sum-exps, to be merged with the attention over the members' own keys. The
// packs live in buffers the calling thread keeps between calls (fresh pages would cost a fault
// each, as much as a cascade layer's packing).
//
// Compiled with per-function target attributes, so the file builds on any x86-64 compiler;
// `cpu_kernels.py` only calls it on CPUs with AVX-512.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "vec_math.h"
#include "thread_pool.h"

namespace {

using arborlm_cpu::exp16;
using arborlm_cpu::lane_mask;
using arborlm_cpu::round_to;
using arborlm_cpu::store_one;
using arborlm_cpu::widen;

constexpr int64_t kKeys = 32;         // keys per panel: two 16-lane vectors
constexpr int kMaxRows = 12;          // rows per register tile
constexpr int64_t kQueryBlock = 48;   // query rows per work item
constexpr int64_t kKeyBlock = 256;    // keys per online-softmax step
constexpr int64_t kMaxHeadDim = 256;
constexpr int kMaxVectors = 4;        // head-dim vectors per output tile (64 dims)

// s[m, 0:32] = scale * q[m, :] . kp[:, 0:32] for MR rows of q (row stride dim), kp one key
// panel.
template <int MR>
__attribute__((target("avx512f"))) void qk_tile(const float* q, int64_t dim, const float* kp,
                                                float scale, float* s, int64_t lds) {
  __m512 acc[MR][2];
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const __m512 k0 = _mm512_loadu_ps(kp + d * kKeys);
    const __m512 k1 = _mm512_loadu_ps(kp + d * kKeys + 16);
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      const __m512 qm = _mm512_set1_ps(q[m * dim + d]);
      acc[m][0] = _mm512_fmadd_ps(qm, k0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(qm, k1, acc[m][1]);
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(s + m * lds, _mm512_mul_ps(acc[m][0], sv));
    _mm512_storeu_ps(s + m * lds + 16, _mm512_mul_ps(acc[m][1], sv));
  }
}

// o[m, 0:16 NV] = o[m, :] * alpha[m] + sum over k < keys of p[m, k] * v[k, 0:16 NV].
template <int MR, int NV>
__attribute__((target("avx512f"))) void pv_tile(const float* p, int64_t ldp, const float* v,
                                                int64_t ldv, int64_t keys, const float* alpha,
                                                float* o, int64_t ldo) {
  __m512 acc[MR][NV];
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) {
    const __m512 a = _mm512_set1_ps(alpha[m]);
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j)
      acc[m][j] = _mm512_mul_ps(_mm512_loadu_ps(o + m * ldo + 16 * j), a);
  }
  for (int64_t k = 0; k < keys; ++k) {
    __m512 vk[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) vk[j] = _mm512_loadu_ps(v + k * ldv + 16 * j);
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      const __m512 pm = _mm512_set1_ps(p[m * ldp + k]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_fmadd_ps(pm, vk[j], acc[m][j]);
    }
  }
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(o + m * ldo + 16 * j, acc[m][j]);
  }
}

// Rows of a value tile of NV vectors: 24 accumulators at most, 12 rows at most.
constexpr int pv_rows(int nv) { return std::min(kMaxRows, 24 / nv); }

using QkTile = void (*)(const float*, int64_t, const float*, float, float*, int64_t);
using PvTile = void (*)(const float*, int64_t, const float*, int64_t, int64_t, const float*,
                        float*, int64_t);

template <int... R>
constexpr std::array<QkTile, sizeof...(R)> qk_tiles(std::integer_sequence<int, R...>) {
  return {&qk_tile<R + 1>...};
}
template <int NV, int... R>
constexpr std::array<PvTile, sizeof...(R)> pv_tiles(std::integer_sequence<int, R...>) {
  return {&pv_tile<std::min(R + 1, pv_rows(NV)), NV>...};
}
constexpr auto kQkTiles = qk_tiles(std::make_integer_sequence<int, kMaxRows>{});
constexpr std::array<std::array<PvTile, kMaxRows>, kMaxVectors> kPvTiles = {
    pv_tiles<1>(std::make_integer_sequence<int, kMaxRows>{}),
    pv_tiles<2>(std::make_integer_sequence<int, kMaxRows>{}),
    pv_tiles<3>(std::make_integer_sequence<int, kMaxRows>{}),
    pv_tiles<4>(std::make_integer_sequence<int, kMaxRows>{})};

// One row's online-softmax step over its `cnt` visible scores of this key block (of `width`
// computed): s becomes the probabilities (zero past cnt), and m, l and alpha are updated. The
// probabilities multiply the values rounded to T, their sum l is kept unrounded, as ATen's
// flash kernel (and so transformers) does for bfloat16.
template <typename T>
__attribute__((target("avx512f"))) void softmax_step(float* s, int64_t cnt, int64_t width,
                                                     float& m, float& l, float& alpha) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (cnt <= 0) {
    std::fill(s, s + width, 0.0f);
    alpha = 1.0f;
    return;
  }
  __m512 mx = _mm512_set1_ps(neg_inf);
  for (int64_t j = 0; j < cnt; j += 16) {
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf), lane_mask(cnt - j),
                                                s + j));
  }
  const float mn = std::max(m, _mm512_reduce_max_ps(mx));
  alpha = std::exp(m - mn);  // 0 on the first block (m = -inf)
  const __m512 shift = _mm512_set1_ps(mn);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < cnt; j += 16) {
    const __mmask16 mask = lane_mask(cnt - j);
    const __m512 e = _mm512_maskz_mov_ps(
        mask, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j), shift)));
    _mm512_mask_storeu_ps(s + j, mask, round_to(static_cast<const T*>(nullptr), e));
    sum = _mm512_add_ps(sum, e);
  }
  std::fill(s + cnt, s + width, 0.0f);
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = mn;
}

// A float buffer of n for one call, `which` of two: kept between calls on the calling thread up
// to kKeptFloats each (a fresh allocation of this size is fresh pages, and their faults cost as
// much as a cascade layer's packing itself), a fresh one in `fresh` beyond.
constexpr int64_t kKeptFloats = int64_t{1} << 21;  // 8 MiB

float* call_buffer(int which, int64_t n, std::vector<float>& fresh) {
  thread_local std::vector<float> kept[2];
  if (n <= kKeptFloats) {
    if (static_cast<int64_t>(kept[which].size()) < n) kept[which].resize(n);
    return kept[which].data();
  }
  fresh.resize(n);
  return fresh.data();
}

// Scratch of one thread's work items: a block's queries, scores, outputs and softmax state.
struct Scratch {
  explicit Scratch(int64_t dim)
      : q(kQueryBlock * dim), o(kQueryBlock * dim), s(kQueryBlock * kKeyBlock) {}
  std::vector<float> q, o, s;
  float m[kQueryBlock], l[kQueryBlock], alpha[kQueryBlock];
};

// Flash attention of `rows` (at most kQueryBlock) float32 queries in w.q against packed keys
// kg (K^T panels) and float32 values vg (row stride ldv): row r sees the first visible[r] >= 1
// keys, visible non-decreasing. Leaves the unnormalized outputs in w.o, the row maxima in w.m
// and the sums of exponentials in w.l.
template <typename T>
void flash_rows(Scratch& w, int64_t rows, int64_t dim, const float* kg, const float* vg,
                int64_t ldv, const int64_t* visible, float scale) {
  for (int64_t r = 0; r < rows; ++r) {
    w.m[r] = -std::numeric_limits<float>::infinity();
    w.l[r] = 0.0f;
  }
  std::fill(w.o.begin(), w.o.begin() + rows * dim, 0.0f);
  const int64_t key_end = visible[rows - 1];
  for (int64_t kb = 0; kb < key_end; kb += kKeyBlock) {
    const int64_t width = std::min(kKeyBlock, key_end - kb);
    // Scores, tile by tile, only over panels the tile's last row can see.
    for (int64_t t0 = 0; t0 < rows; t0 += kMaxRows) {
      const int64_t mr = std::min<int64_t>(kMaxRows, rows - t0);
      const int64_t seen = std::min(width, visible[t0 + mr - 1] - kb);
      for (int64_t p = 0; p * kKeys < seen; ++p) {
        kQkTiles[mr - 1](w.q.data() + t0 * dim, dim, kg + (kb / kKeys + p) * dim * kKeys, scale,
                         w.s.data() + t0 * kKeyBlock + p * kKeys, kKeyBlock);
      }
    }
    const int64_t padded = (width + kKeys - 1) / kKeys * kKeys;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t cnt = std::min(width, visible[r] - kb);
      softmax_step<T>(w.s.data() + r * kKeyBlock, cnt, padded, w.m[r], w.l[r], w.alpha[r]);
    }
    // Probabilities times values, into the outputs.
    for (int64_t c = 0; c < dim; c += 16 * kMaxVectors) {
      const int64_t nv = std::min<int64_t>(kMaxVectors, (dim - c) / 16);
      const int64_t tile = pv_rows(static_cast<int>(nv));
      for (int64_t t0 = 0; t0 < rows; t0 += tile) {
        const int64_t mr = std::min(tile, rows - t0);
        const int64_t seen = std::min(width, visible[t0 + mr - 1] - kb);
        if (seen <= 0) continue;
        kPvTiles[nv - 1][mr - 1](w.s.data() + t0 * kKeyBlock, kKeyBlock, vg + kb * ldv + c, ldv,
                                 seen, w.alpha + t0, w.o.data() + t0 * dim + c, dim);
      }
    }
  }
}

// Keys `count` of one KV head as K^T panels [panels, D, 32] (past the end zero): key j is
// `dim` values at src(j).
template <typename T, typename Src>
void pack_keys(float* dst, int64_t count, int64_t dim, const Src& src) {
  const int64_t panels = (count + kKeys - 1) / kKeys;
  for (int64_t p = 0; p < panels; ++p) {
    float* panel = dst + p * dim * kKeys;
    for (int64_t j = 0; j < kKeys; ++j) {
      const int64_t key = p * kKeys + j;
      if (key >= count) {
        for (int64_t d = 0; d < dim; ++d) panel[d * kKeys + j] = 0.0f;
        continue;
      }
      const T* row = src(key);
      for (int64_t d = 0; d < dim; ++d) panel[d * kKeys + j] = widen(row[d]);
    }
  }
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
            at::Tensor& out) {
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t keys = k.size(0), kv_heads = k.size(1), group = heads / kv_heads;
  const int64_t offset = keys - tokens;  // query i sees keys 0 .. offset + i
  const int64_t panels = (keys + kKeys - 1) / kKeys;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1);

  // K^T panels [Hkv, panels, D, 32], and float32 values when the inputs are bfloat16
  // ([Hkv, S, D]; float32 values are read in place).
  std::vector<float> kfresh, vfresh;
  float* kpack = call_buffer(0, kv_heads * panels * dim * kKeys, kfresh);
  arborlm_cpu::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      pack_keys<T>(kpack + g * panels * dim * kKeys, keys, dim,
                   [&](int64_t key) { return kp + key * ks0 + g * ks1; });
  });
  float* vpack = nullptr;
  if constexpr (!std::is_same_v<T, float>) {
    vpack = call_buffer(1, kv_heads * keys * dim, vfresh);
    arborlm_cpu::parallel_for(0, kv_heads * keys, 64, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t g = item / keys, key = item % keys;
        const T* src = vp + key * vs0 + g * vs1;
        float* dst = vpack + item * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = widen(src[d]);
      }
    });
  }

  const int64_t blocks = (tokens + kQueryBlock - 1) / kQueryBlock;
  const float fscale = static_cast<float>(scale);
  arborlm_cpu::parallel_for(0, heads * blocks, 1, [&](int64_t begin, int64_t end) {
    Scratch w(dim);
    int64_t visible[kQueryBlock];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, q0 = item % blocks * kQueryBlock;
      const int64_t g = h / group, rows = std::min(kQueryBlock, tokens - q0);
      const float* vg;
      int64_t ldv;
      if constexpr (std::is_same_v<T, float>) {
        vg = vp + g * vs1;
        ldv = vs0;
      } else {
        vg = vpack + g * keys * dim;
        ldv = dim;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const T* src = qp + (q0 + r) * qs0 + h * qs1;
        for (int64_t d = 0; d < dim; ++d) w.q[r * dim + d] = widen(src[d]);
        visible[r] = offset + q0 + r + 1;
      }
      flash_rows<T>(w, rows, dim, kpack + g * panels * dim * kKeys, vg, ldv, visible, fscale);
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.0f / w.l[r];
        T* dst = op + ((q0 + r) * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) store_one(dst + d, w.o[r * dim + d] * inv);
      }
    }
  });
}

// Cascade decode's shared part: the query heads of each group's members (q [B, H, D]) against
// the group's prefix, pool rows prefix_slots[g, :prefix_lens[g]]; rows in no group (groups[b]
// < 0) are left out. Float32 outputs [B, H, D] (normalized) and log-sum-exps [B, H].
template <typename T>
void attend_prefix(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                   const at::Tensor& prefix_slots, const std::vector<int64_t>& prefix_lens,
                   const std::vector<std::vector<int64_t>>& members, double scale,
                   at::Tensor& out, at::Tensor& lse) {
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k_pool.size(1);
  const int64_t group = heads / kv_heads, num_groups = prefix_slots.size(0);
  const int64_t width = prefix_slots.size(1);
  const int64_t panels = (width + kKeys - 1) / kKeys;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int64_t* sp = prefix_slots.data_ptr<int64_t>();
  const int64_t row_stride = kv_heads * dim;
  // Per (group, KV head): K^T panels and float32 values of the prefix.
  std::vector<float> kfresh, vfresh;
  float* kpack = call_buffer(0, num_groups * kv_heads * panels * dim * kKeys, kfresh);
  float* vpack = call_buffer(1, num_groups * kv_heads * width * dim, vfresh);
  arborlm_cpu::parallel_for(0, num_groups * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / kv_heads, h = item % kv_heads, count = prefix_lens[g];
      const int64_t* slots = sp + g * width;
      pack_keys<T>(kpack + item * panels * dim * kKeys, count, dim,
                   [&](int64_t key) { return kp + slots[key] * row_stride + h * dim; });
      float* dst = vpack + item * width * dim;
      for (int64_t key = 0; key < count; ++key) {
        const T* src = vp + slots[key] * row_stride + h * dim;
        for (int64_t d = 0; d < dim; ++d) dst[key * dim + d] = widen(src[d]);
      }
    }
  });
  // Work items: (group, query head, block of members).
  std::vector<std::array<int64_t, 3>> items;
  for (int64_t g = 0; g < num_groups; ++g)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t m0 = 0; m0 < static_cast<int64_t>(members[g].size()); m0 += kQueryBlock)
        items.push_back({g, h, m0});
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  arborlm_cpu::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch w(dim);
    int64_t visible[kQueryBlock];
    for (int64_t i = begin; i < end; ++i) {
      const auto [g, h, m0] = items[i];
      const int64_t kv = h / group, item = g * kv_heads + kv;
      const auto& rows_of = members[g];
      const int64_t rows = std::min<int64_t>(kQueryBlock, rows_of.size() - m0);
      for (int64_t r = 0; r < rows; ++r) {
        const T* src = qp + (rows_of[m0 + r] * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) w.q[r * dim + d] = widen(src[d]);
        visible[r] = prefix_lens[g];
      }
      flash_rows<T>(w, rows, dim, kpack + item * panels * dim * kKeys,
                    vpack + item * width * dim, dim, visible, fscale);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t b = rows_of[m0 + r];
        const float inv = 1.0f / w.l[r];
        float* dst = op + (b * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = w.o[r * dim + d] * inv;
        lp[b * heads + h] = w.m[r] + std::log(w.l[r]);
      }
    }
  });
}

}  // namespace

namespace arborlm_cpu {

std::tuple<at::Tensor, at::Tensor> prefix_attention(const at::Tensor& q,
                                                    const at::Tensor& k_pool,
                                                    const at::Tensor& v_pool,
                                                    const at::Tensor& prefix_slots,
                                                    const at::Tensor& prefix_lens,
                                                    const at::Tensor& groups, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && k_pool.dim() == 3 &&
                  k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  v_pool.sizes() == k_pool.sizes() && k_pool.size(2) == q.size(2) &&
                  q.size(1) % k_pool.size(1) == 0,
              "prefix_attention: contiguous q [B, H, D] and pools [S, Hkv, D] expected, got ",
              q.sizes(), ", ", k_pool.sizes());
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(2) <= kMaxHeadDim,
              "prefix_attention: head dim must be a multiple of 16 up to ", kMaxHeadDim);
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              "prefix_attention: q and pool dtypes differ");
  const int64_t batch = q.size(0), num_groups = prefix_slots.size(0);
  TORCH_CHECK(prefix_slots.dim() == 2 && prefix_slots.is_contiguous() &&
                  prefix_slots.scalar_type() == at::kLong && prefix_lens.numel() == num_groups &&
                  groups.numel() == batch && groups.scalar_type() == at::kLong,
              "prefix_attention: prefix_slots int64 [G, P], prefix_lens [G] and groups int64 "
              "[B] expected");
  const at::Tensor pl = prefix_lens.to(at::kLong).contiguous();
  std::vector<int64_t> lens(pl.data_ptr<int64_t>(), pl.data_ptr<int64_t>() + num_groups);
  const int64_t* sp = prefix_slots.data_ptr<int64_t>();
  for (int64_t g = 0; g < num_groups; ++g) {
    TORCH_CHECK(lens[g] >= 1 && lens[g] <= prefix_slots.size(1), "prefix_attention: group ", g,
                "'s prefix of ", lens[g], " keys is outside 1..", prefix_slots.size(1));
    for (int64_t j = 0; j < lens[g]; ++j)
      TORCH_CHECK(sp[g * prefix_slots.size(1) + j] >= 0 &&
                      sp[g * prefix_slots.size(1) + j] < k_pool.size(0),
                  "prefix_attention: slot ", sp[g * prefix_slots.size(1) + j],
                  " is outside the pool");
  }
  std::vector<std::vector<int64_t>> members(num_groups);
  const at::Tensor gc = groups.contiguous();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t g = gc.data_ptr<int64_t>()[b];
    TORCH_CHECK(g < num_groups, "prefix_attention: group ", g, " of row ", b, " is not one of ",
                num_groups);
    if (g >= 0) members[g].push_back(b);
  }
  at::Tensor out = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
  at::Tensor lse = at::full({batch, q.size(1)}, -std::numeric_limits<float>::infinity(),
                            q.options().dtype(at::kFloat));
  if (q.scalar_type() == at::kFloat) {
    attend_prefix<float>(q, k_pool, v_pool, prefix_slots, lens, members, scale, out, lse);
  } else if (q.scalar_type() == at::kBFloat16) {
    attend_prefix<c10::BFloat16>(q, k_pool, v_pool, prefix_slots, lens, members, scale, out,
                                 lse);
  } else {
    TORCH_CHECK(false, "prefix_attention: float32 or bfloat16 only, got ", q.scalar_type());
  }
  return {out, lse};
}

}  // namespace arborlm_cpu

namespace {

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "causal_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(),
              "causal_attention: q [T, H, D], k and v [S, Hkv, D] expected, got ", q.sizes(),
              ", ", k.sizes(), ", ", v.sizes());
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k.size(1);
  TORCH_CHECK(k.size(2) == dim && kv_heads > 0 && heads % kv_heads == 0,
              "causal_attention: k/v heads [", kv_heads, ", ", k.size(2), "] do not fit q's [",
              heads, ", ", dim, "]");
  TORCH_CHECK(k.size(0) >= tokens, "causal_attention: ", tokens, " queries need at least as many "
              "keys, got ", k.size(0));
  TORCH_CHECK(dim % 16 == 0 && dim > 0 && dim <= kMaxHeadDim,
              "causal_attention: head dim must be a multiple of 16 up to ", kMaxHeadDim,
              ", got ", dim);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "causal_attention: q, k and v dtypes differ: ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), "causal_attention: this CPU lacks AVX-512");
  // Rows may be strided (slices of a fused projection); each head's D values contiguous.
  const at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous();
  const at::Tensor kc = k.stride(2) == 1 ? k : k.contiguous();
  const at::Tensor vc = v.stride(2) == 1 ? v : v.contiguous();
  at::Tensor out = at::empty({tokens, heads, dim}, q.options());
  if (tokens == 0) return out;
  if (q.scalar_type() == at::kFloat) {
    attend<float>(qc, kc, vc, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    attend<c10::BFloat16>(qc, kc, vc, scale, out);
  } else {
    TORCH_CHECK(false, "causal_attention: float32 or bfloat16 only, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(arborlm, m) {
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("prefix_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor prefix_slots, "
        "Tensor prefix_lens, Tensor groups, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(arborlm, CPU, m) {
  m.impl("causal_attention", &causal_attention);
  m.impl("prefix_attention", &arborlm_cpu::prefix_attention);
}
