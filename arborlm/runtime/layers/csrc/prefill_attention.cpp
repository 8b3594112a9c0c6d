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
//   tile (up to 12 rows x 64 dims) adds probabilities times values into the rows' float32
//   outputs, rescaled by the change of maximum as it loads them.
// - Key panels past a tile's last visible key are never computed; keys a row may not see within
//   a computed panel get probability 0.
//
// Query i of T new tokens sees keys 0 .. S - T + i of the S keys: a plain prompt (S = T) or an
// extend on a cached prefix (its S - T prefix keys first). Products and sums are float32
// (bfloat16 inputs are widened exactly), the output is rounded once to the inputs' dtype; as
// in ATen's kernel, the scale multiplies the scores and bfloat16 probabilities are rounded to
// bfloat16 before they weight the values.
//
// Compiled with per-function target attributes, so the file builds on any x86-64 compiler;
// `cpu_kernels.py` only calls it on CPUs with AVX-512.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec_math.h"

namespace {

using arborlm_cpu::exp16;
using arborlm_cpu::round_to;

constexpr int64_t kKeys = 32;         // keys per panel: two 16-lane vectors
constexpr int kMaxRows = 12;          // rows per register tile
constexpr int64_t kQueryBlock = 48;   // query rows per work item
constexpr int64_t kKeyBlock = 256;    // keys per online-softmax step
constexpr int64_t kMaxHeadDim = 256;
constexpr int kMaxVectors = 4;        // head-dim vectors per output tile (64 dims)

inline __mmask16 lane_mask(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

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
    for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_mul_ps(_mm512_loadu_ps(o + m * ldo + 16 * j), a);
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

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
inline void store_one(float* p, float x) { *p = x; }
inline void store_one(c10::BFloat16* p, float x) { *p = c10::BFloat16(x); }  // nearest even

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

  // K^T panels [Hkv, panels, D, 32] (keys past the end zero), and float32 values when the
  // inputs are bfloat16 ([Hkv, S, D]; float32 values are read in place).
  std::vector<float> kpack(kv_heads * panels * dim * kKeys);
  at::parallel_for(0, kv_heads * panels, 8, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / panels, p = item % panels;
      float* dst = kpack.data() + item * dim * kKeys;
      for (int64_t j = 0; j < kKeys; ++j) {
        const int64_t key = p * kKeys + j;
        if (key >= keys) {
          for (int64_t d = 0; d < dim; ++d) dst[d * kKeys + j] = 0.0f;
          continue;
        }
        const T* src = kp + key * ks0 + g * ks1;
        for (int64_t d = 0; d < dim; ++d) dst[d * kKeys + j] = widen(src[d]);
      }
    }
  });
  std::vector<float> vpack;
  if constexpr (!std::is_same_v<T, float>) {
    vpack.resize(kv_heads * keys * dim);
    at::parallel_for(0, kv_heads * keys, 64, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t g = item / keys, key = item % keys;
        const T* src = vp + key * vs0 + g * vs1;
        float* dst = vpack.data() + item * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = widen(src[d]);
      }
    });
  }

  const int64_t blocks = (tokens + kQueryBlock - 1) / kQueryBlock;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(kQueryBlock * dim), o(kQueryBlock * dim), s(kQueryBlock * kKeyBlock);
    float m[kQueryBlock], l[kQueryBlock], alpha[kQueryBlock];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, q0 = item % blocks * kQueryBlock;
      const int64_t g = h / group, rows = std::min(kQueryBlock, tokens - q0);
      const float* kg = kpack.data() + g * panels * dim * kKeys;
      const float* vg;
      int64_t ldv;
      if constexpr (std::is_same_v<T, float>) {
        vg = vp + g * vs1;
        ldv = vs0;
      } else {
        vg = vpack.data() + g * keys * dim;
        ldv = dim;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const T* src = qp + (q0 + r) * qs0 + h * qs1;
        for (int64_t d = 0; d < dim; ++d) qs[r * dim + d] = widen(src[d]);
        m[r] = -std::numeric_limits<float>::infinity();
        l[r] = 0.0f;
      }
      std::fill(o.begin(), o.begin() + rows * dim, 0.0f);
      const int64_t key_end = offset + q0 + rows;  // keys the block's last row sees
      for (int64_t kb = 0; kb < key_end; kb += kKeyBlock) {
        const int64_t width = std::min(kKeyBlock, key_end - kb);
        // Scores, tile by tile, only over panels the tile's last row can see.
        for (int64_t t0 = 0; t0 < rows; t0 += kMaxRows) {
          const int64_t mr = std::min<int64_t>(kMaxRows, rows - t0);
          const int64_t seen = std::min(width, offset + q0 + t0 + mr - kb);
          for (int64_t p = 0; p * kKeys < seen; ++p) {
            kQkTiles[mr - 1](qs.data() + t0 * dim, dim, kg + (kb / kKeys + p) * dim * kKeys,
                             fscale, s.data() + t0 * kKeyBlock + p * kKeys, kKeyBlock);
          }
        }
        const int64_t padded = (width + kKeys - 1) / kKeys * kKeys;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t cnt = std::min(width, offset + q0 + r + 1 - kb);
          softmax_step<T>(s.data() + r * kKeyBlock, cnt, padded, m[r], l[r], alpha[r]);
        }
        // Probabilities times values, into the outputs.
        for (int64_t c = 0; c < dim; c += 16 * kMaxVectors) {
          const int64_t nv = std::min<int64_t>(kMaxVectors, (dim - c) / 16);
          const int64_t tile = pv_rows(static_cast<int>(nv));
          for (int64_t t0 = 0; t0 < rows; t0 += tile) {
            const int64_t mr = std::min(tile, rows - t0);
            const int64_t seen = std::min(width, offset + q0 + t0 + mr - kb);
            if (seen <= 0) continue;
            kPvTiles[nv - 1][mr - 1](s.data() + t0 * kKeyBlock, kKeyBlock, vg + kb * ldv + c,
                                     ldv, seen, alpha + t0, o.data() + t0 * dim + c, dim);
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.0f / l[r];
        T* dst = op + ((q0 + r) * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) store_one(dst + d, o[r * dim + d] * inv);
      }
    }
  });
}

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
}

TORCH_LIBRARY_IMPL(arborlm, CPU, m) { m.impl("causal_attention", &causal_attention); }
