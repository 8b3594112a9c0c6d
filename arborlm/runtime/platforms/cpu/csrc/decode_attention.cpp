// Decode attention over each request's own keys, for CPU: `arborlm::decode_attention`.
//
// A decode step has one new query token per request. Row n of the inputs is one (KV head,
// request) pair, laid out head-major as ArborLM's decode workspace keeps them (n = h * B + b):
// its G query heads (the KV head's group) attend to the first lens[b] of its W keys. Done as
// two batched matmuls around a softmax (the library path), every row pays for the batch's
// longest (or padded) key count, the scores make three trips through memory, and the many
// small products run at a fraction of the machine's speed. Here each row is one pass: every
// key and value row is read once, for all G queries together; the scores of a row stay in a
// small per-thread buffer; the softmax uses a vectorized exp; and rows are split over torch's
// threads. Products and sums are float32 (bfloat16 inputs are widened exactly), the output is
// rounded once to the inputs' dtype.
//
// `decode_attention_paged` reads the keys straight from the paged KV pool instead, through each
// request's slot table (no gather, no workspace): the form a compiled decode step calls.
// `paged_attention_rows` runs every token of an extend the same way, as if it were decoded:
// deterministic inference's extend attention (a token's result never depends on where a chunk
// or a cached prefix ended, or on what else was in the batch).
//
// The kernel also returns each query's log-sum-exp of its scaled scores, so that a caller can
// merge this part with attention over other keys (a shared prefix read once for a group of
// requests) as one softmax would.
//
// Compiled with per-function target attributes, so the file builds on any x86-64 compiler;
// `cpu_kernels.py` only calls it on CPUs with AVX-512, and the fused decode step also on CPUs
// with AVX2 (float32, `attend_row_avx2`).

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec_math.h"
#include "thread_pool.h"

namespace {

using arborlm_cpu::exp16;
using arborlm_cpu::load16;
using arborlm_cpu::store_one;

constexpr int64_t kMaxGroup = 16;    // query heads per KV head
constexpr int64_t kMaxHeadDim = 256;
// Fewest multiply-adds a thread is given: below this a thread's start-up outweighs its share.
constexpr int64_t kMinWorkPerThread = 32 * 1024;

// Keys ahead of the one in use whose rows are prefetched. A request's keys lie one slot row
// apart at best and, decoded together with others, a batch's width apart (32 KiB for 32
// requests of the 125M model): the hardware prefetchers do not follow such strides, and each key
// would otherwise cost a full memory latency.
constexpr int64_t kPrefetchAhead = 8;

template <typename T>
inline void prefetch_row(const T* p, int64_t dim) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(T)); b += 64)
    _mm_prefetch(c + b, _MM_HINT_T0);
}

// The pool rows of the next request of a paged batch, brought into L2 while this one computes.
// With 4 KB pages of keys read 256 bytes (one head) at a time, a request's own prefetches
// (above) keep too few lines in flight to cover the memory's latency: the kernel waited on
// memory for most of its time (32 requests x 96 keys x 8 layers, 32M float32, 2 cores: ~20 GB/s
// against the ~30 a plain streaming read reaches). Each of request b's KV-head rows fetches its
// share of request b+1's keys, whole rows (every head) of keys and values, one key per key it
// attends to itself, so the next request finds them in L2: alternating runs, that workload
// 2.2-2.7 -> 2.0-2.3 ms (float32), 1.4-1.7 -> 1.0-1.2 ms (bfloat16).
struct NextRows {
  const char* k = nullptr;
  const char* v = nullptr;
  const int64_t* slots = nullptr;  // the keys to fetch: pool rows slots[0 .. len)
  int64_t len = 0;
  int64_t stride = 0;  // bytes from one pool row to the next
};

inline void prefetch_next(const NextRows& next, int64_t j) {
  const int64_t at = next.slots[j] * next.stride;
  for (int64_t b = 0; b < next.stride; b += 64) {
    _mm_prefetch(next.k + at + b, _MM_HINT_T1);
    _mm_prefetch(next.v + at + b, _MM_HINT_T1);
  }
}

// The scores of one query (its D / 16 chunks `qv`) against a block of 16 keys `kr` (a short
// block repeats a key in its spare lanes): each key's 16-lane products summed by
// `sum_lanes16`, times the scale. Blocks are aligned to the query's first key, so that a key's
// score is computed the same way whichever call computes it.
template <typename T>
__attribute__((target("avx512f"))) inline __m512 score_block(const T* const* kr, const __m512* qv,
                                                             int64_t chunks, __m512 scale) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const __m512 qc = qv[c];
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_fmadd_ps(load16(kr[t] + c * 16), qc, acc[t]);
  }
  return _mm512_mul_ps(arborlm_cpu::sum_lanes16(acc), scale);
}

// One query's scores s[0, len) become its unnormalized softmax weights, in place; returns their
// sum, and their maximum in `top`.
__attribute__((target("avx512f"))) inline float softmax_weights(float* s, int64_t len,
                                                                float* top) {
  __m512 hi = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) hi = _mm512_max_ps(hi, _mm512_loadu_ps(s + j));
  float m = _mm512_reduce_max_ps(hi);
  for (; j < len; ++j) m = std::max(m, s[j]);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j + 16 <= len; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (j < len) {
    const __mmask16 tail = __mmask16((1u << (len - j)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), mv));
    _mm512_mask_storeu_ps(s + j, tail, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
  }
  *top = m;
  return _mm512_reduce_add_ps(sum);
}

// Accumulated values o (D / 16 chunks) times 1 / total, rounded once into out [D].
template <typename T>
__attribute__((target("avx512f"))) inline void store_row(const __m512* o, int64_t chunks,
                                                         float total, T* out) {
  const __m512 inv = _mm512_set1_ps(1.0f / total);
  alignas(64) float row[16];
  for (int64_t c = 0; c < chunks; ++c) {
    _mm512_store_ps(row, _mm512_mul_ps(o[c], inv));
    for (int i = 0; i < 16; ++i) store_one(out + c * 16 + i, row[i]);
  }
}

// One row: q [G, D] against keys/values [len, D] -> out [G, D], lse [G]. Key j is at
// `k + j * stride`, or with a slot table at `k + slots[j] * stride` (the paged pool).
// `scores` holds G * len floats. GROUP and CHUNKS (D / 16) are compile-time constants for the
// common head shapes, so the queries and accumulators live in registers; 0 means "use the
// runtime `group` / `dim`" (any other shape, slower).
template <typename T, int GROUP, int CHUNKS>
__attribute__((target("avx512f"))) void attend_row(const T* q, const T* k, const T* v,
                                                  const int64_t* slots, int64_t stride,
                                                  int64_t len, int64_t group_,
                                                  int64_t dim_, float scale, float* scores,
                                                  T* out, float* lse, const NextRows& next) {
  const int64_t group = GROUP ? GROUP : group_;
  const int64_t chunks = CHUNKS ? CHUNKS : dim_ / 16;
  const int64_t dim = chunks * 16;
  if (len == 0) {  // no keys: no weight anywhere (the caller's other part carries it all)
    for (int64_t i = 0; i < group * dim; ++i) store_one(out + i, 0.0f);
    for (int64_t g = 0; g < group; ++g) lse[g] = -std::numeric_limits<float>::infinity();
    return;
  }
  for (int64_t j = 0; j < kPrefetchAhead && j < len; ++j)
    prefetch_row(k + (slots ? slots[j] : j) * stride, dim);
  __m512 qv[GROUP && CHUNKS ? GROUP * CHUNKS : kMaxGroup * (kMaxHeadDim / 16)];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < chunks; ++c) qv[g * chunks + c] = load16(q + g * dim + c * 16);

  // Scores, 16 keys at a time in blocks aligned to the row's first key, each key's 16-lane
  // products summed by `sum_lanes16`: a key's score is computed the same way whichever call
  // computes it (a decode step, or an extend's token in `paged_attention_rows`).
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - j0);
    const T* kr[16];
    for (int64_t t = 0; t < n; ++t) {
      const int64_t j = j0 + t;
      kr[t] = k + (slots ? slots[j] : j) * stride;
      if (j + kPrefetchAhead < len)
        prefetch_row(k + (slots ? slots[j + kPrefetchAhead] : j + kPrefetchAhead) * stride, dim);
      if (j < next.len) prefetch_next(next, j);
    }
    for (int64_t t = n; t < 16; ++t) kr[t] = kr[0];  // a short block's spare lanes (unused)
    for (int64_t g = 0; g < group; ++g)  // the block's keys stay in L1 for the next query
      _mm512_mask_storeu_ps(scores + g * len + j0, arborlm_cpu::lane_mask(n),
                            score_block(kr, qv + g * chunks, chunks, scale_v));
  }
  for (int64_t j = len; j < next.len; ++j) prefetch_next(next, j);  // the next one is longer

  // Softmax weights (unnormalized) and their sums.
  float total[GROUP ? GROUP : kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    float m;
    total[g] = softmax_weights(scores + g * len, len, &m);
    lse[g] = m + std::log(total[g]);
  }

  // Weighted values: each value row read once for all G queries.
  __m512* o = qv;  // the queries are no longer needed
  for (int64_t i = 0; i < group * chunks; ++i) o[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < kPrefetchAhead && j < len; ++j)
    prefetch_row(v + (slots ? slots[j] : j) * stride, dim);
  for (int64_t j = 0; j < len; ++j) {
    const T* vr = v + (slots ? slots[j] : j) * stride;
    if (j + kPrefetchAhead < len)
      prefetch_row(v + (slots ? slots[j + kPrefetchAhead] : j + kPrefetchAhead) * stride, dim);
    __m512 w[GROUP ? GROUP : kMaxGroup];
    for (int64_t g = 0; g < group; ++g) w[g] = _mm512_set1_ps(scores[g * len + j]);
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 vc = load16(vr + c * 16);
      for (int64_t g = 0; g < group; ++g)
        o[g * chunks + c] = _mm512_fmadd_ps(w[g], vc, o[g * chunks + c]);
    }
  }
  for (int64_t g = 0; g < group; ++g) store_row(o + g * chunks, chunks, total[g], out + g * dim);
}

// Most tokens of one sequence `attend_tokens` takes at once, and most queries one pass of its
// weighted-value loop holds in registers (times D / 16 accumulators each).
constexpr int64_t kTokensPerCall = 8;
constexpr int64_t kAccumulators = 24;
// Most bytes of scores a thread holds for one run of `paged_attention_rows` (a run of 8 tokens
// with 16 query heads each at 8K keys: 4 MiB); longer sequences get shorter runs.
constexpr int64_t kScoreBytes = 4 << 20;

// Weighted values of NP queries (lengths ascending, weights in rows of `scores` `most` apart):
// every value row read once for all of them while all are still reading, each query's sum
// taken key by key as `attend_row` takes it; then each output rounded once.
template <typename T, int CHUNKS, int NP>
__attribute__((target("avx512f"))) void weigh_values(const T* v, const int64_t* slots,
                                                    int64_t stride, const float* scores,
                                                    int64_t most, const int64_t* qlen,
                                                    const float* total, T* const* orow) {
  __m512 o[NP * CHUNKS];
  for (int i = 0; i < NP * CHUNKS; ++i) o[i] = _mm512_setzero_ps();
  const int64_t shared = qlen[0];  // every query reads keys below the shortest's length
  for (int64_t j = 0; j < shared; ++j) {
    const T* vr = v + slots[j] * stride;
    __m512 vc[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) vc[c] = load16(vr + c * 16);
    for (int p = 0; p < NP; ++p) {
      const __m512 w = _mm512_set1_ps(scores[p * most + j]);
      for (int c = 0; c < CHUNKS; ++c) o[p * CHUNKS + c] = _mm512_fmadd_ps(w, vc[c], o[p * CHUNKS + c]);
    }
  }
  for (int p = 0; p < NP; ++p) {  // each query's own last keys
    __m512 acc[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) acc[c] = o[p * CHUNKS + c];
    for (int64_t j = shared; j < qlen[p]; ++j) {
      const T* vr = v + slots[j] * stride;
      const __m512 w = _mm512_set1_ps(scores[p * most + j]);
      for (int c = 0; c < CHUNKS; ++c) acc[c] = _mm512_fmadd_ps(w, load16(vr + c * 16), acc[c]);
    }
    store_row(acc, CHUNKS, total[p], orow[p]);
  }
}

// Tokens i < ntok of one sequence, each with its G query heads (token i's head g at
// q + i * q_token + g * D), attend to the first lens[i] keys of one slot row (lens ascending):
// each query computed exactly as `attend_row` computes a decode step's (the same score blocks,
// softmax and value order), while a block of keys is read from memory once for every token and
// a value row once for up to kAccumulators / CHUNKS queries. `scores` holds ntok * G *
// lens[ntok - 1] floats.
template <typename T, int CHUNKS>
__attribute__((target("avx512f"))) void attend_tokens(const T* q, int64_t q_token, int64_t ntok,
                                                     int64_t group, const int64_t* lens,
                                                     const T* k, const T* v,
                                                     const int64_t* slots, int64_t stride,
                                                     float scale, float* scores, T* out,
                                                     int64_t out_token) {
  constexpr int64_t dim = CHUNKS * 16;
  const int64_t most = lens[ntok - 1];
  const int64_t nq = ntok * group;  // query n: token n / G, head n % G
  int64_t qlen[kTokensPerCall * kMaxGroup];  // per query: its key count, query and output rows
  const T* qrow[kTokensPerCall * kMaxGroup];
  T* orow[kTokensPerCall * kMaxGroup];
  for (int64_t i = 0; i < ntok; ++i)
    for (int64_t g = 0; g < group; ++g) {
      qlen[i * group + g] = lens[i];
      qrow[i * group + g] = q + i * q_token + g * dim;
      orow[i * group + g] = out + i * out_token + g * dim;
    }
  const __m512 scale_v = _mm512_set1_ps(scale);
  alignas(64) float widened[16 * dim];  // bfloat16 keys of a block, widened once for all queries
  for (int64_t j0 = 0; j0 < most; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, most - j0);
    const float* kr[16];
    for (int64_t t = 0; t < n; ++t) {
      const T* src = k + slots[j0 + t] * stride;
      if constexpr (std::is_same_v<T, float>) {
        kr[t] = src;
      } else {  // exact: the products are the same as from the bfloat16 values
        for (int64_t c = 0; c < CHUNKS; ++c)
          _mm512_store_ps(widened + t * dim + c * 16, load16(src + c * 16));
        kr[t] = widened + t * dim;
      }
    }
    for (int64_t t = n; t < 16; ++t) kr[t] = kr[0];
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t len = qlen[i];
      if (len <= j0) continue;
      __m512 qv[CHUNKS];
      for (int64_t c = 0; c < CHUNKS; ++c) qv[c] = load16(qrow[i] + c * 16);
      _mm512_mask_storeu_ps(scores + i * most + j0, arborlm_cpu::lane_mask(len - j0),
                            score_block(kr, qv, CHUNKS, scale_v));
    }
  }
  float total[kTokensPerCall * kMaxGroup];
  for (int64_t i = 0; i < nq; ++i) {
    float m;
    total[i] = softmax_weights(scores + i * most, qlen[i], &m);
  }
  constexpr int64_t per_pass = std::clamp<int64_t>(kAccumulators / CHUNKS, 1, 8);
  for (int64_t first = 0; first < nq; first += per_pass) {
    const int64_t np = std::min(per_pass, nq - first);
    switch (np) {  // a constant count keeps the pass's accumulators in registers
#define ARBORLM_PASS(N)                                                                         \
  case N:                                                                                       \
    if constexpr (N <= per_pass)                                                                \
      weigh_values<T, CHUNKS, N>(v, slots, stride, scores + first * most, most, qlen + first,  \
                                 total + first, orow + first);                                 \
    break;
      ARBORLM_PASS(1) ARBORLM_PASS(2) ARBORLM_PASS(3) ARBORLM_PASS(4)
      ARBORLM_PASS(5) ARBORLM_PASS(6) ARBORLM_PASS(7) ARBORLM_PASS(8)
#undef ARBORLM_PASS
      default: break;
    }
  }
}

using TokensFn = void (*)(const void*, int64_t, int64_t, int64_t, const int64_t*, const void*,
                          const void*, const int64_t*, int64_t, float, float*, void*, int64_t);

template <typename T, int CHUNKS>
void tokens_entry(const void* q, int64_t q_token, int64_t ntok, int64_t group,
                  const int64_t* lens, const void* k, const void* v, const int64_t* slots,
                  int64_t stride, float scale, float* scores, void* out, int64_t out_token) {
  attend_tokens<T, CHUNKS>(static_cast<const T*>(q), q_token, ntok, group, lens,
                           static_cast<const T*>(k), static_cast<const T*>(v), slots, stride,
                           scale, scores, static_cast<T*>(out), out_token);
}

// `attend_tokens` for head dim D, or null where it has no specialization (attend_row serves).
template <typename T>
TokensFn pick_tokens(int64_t dim) {
  switch (dim) {
    case 16: return &tokens_entry<T, 1>;
    case 32: return &tokens_entry<T, 2>;
    case 64: return &tokens_entry<T, 4>;
    case 128: return &tokens_entry<T, 8>;
    case 256: return &tokens_entry<T, 16>;
    default: return nullptr;
  }
}

using RowFn = void (*)(const void*, const void*, const void*, const int64_t*, int64_t, int64_t,
                       int64_t, int64_t, float, float*, void*, float*, const NextRows&);

template <typename T, int GROUP, int CHUNKS>
void row_entry(const void* q, const void* k, const void* v, const int64_t* slots,
               int64_t stride, int64_t len, int64_t group, int64_t dim, float scale,
               float* scores, void* out, float* lse, const NextRows& next) {
  attend_row<T, GROUP, CHUNKS>(static_cast<const T*>(q), static_cast<const T*>(k),
                               static_cast<const T*>(v), slots, stride, len, group, dim, scale,
                               scores, static_cast<T*>(out), lse, next);
}

// The specialized row function for (group, head dim), or the general one.
template <typename T>
RowFn pick_row(int64_t group, int64_t dim) {
#define ARBORLM_ROW(G, D) \
  if (group == G && dim == D) return &row_entry<T, G, D / 16>;
  ARBORLM_ROW(1, 64) ARBORLM_ROW(2, 64) ARBORLM_ROW(3, 64) ARBORLM_ROW(4, 64)
  ARBORLM_ROW(5, 64) ARBORLM_ROW(6, 64) ARBORLM_ROW(7, 64) ARBORLM_ROW(8, 64)
  ARBORLM_ROW(1, 128) ARBORLM_ROW(2, 128) ARBORLM_ROW(3, 128) ARBORLM_ROW(4, 128)
  ARBORLM_ROW(5, 128) ARBORLM_ROW(6, 128) ARBORLM_ROW(7, 128) ARBORLM_ROW(8, 128)
#undef ARBORLM_ROW
  return &row_entry<T, 0, 0>;
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
            const std::vector<int64_t>& lens, double scale, at::Tensor& out, at::Tensor& lse) {
  const int64_t rows = q.size(0), group = q.size(1), dim = q.size(2);
  const int64_t batch = static_cast<int64_t>(lens.size());
  const int64_t k_row = k.stride(0), v_row = v.stride(0);
  const int64_t k_key = k.stride(1), v_key = v.stride(1);
  TORCH_CHECK(k_key == v_key, "decode_attention: k and v must have the same key stride");
  const int64_t most = *std::max_element(lens.begin(), lens.end());
  const int64_t work = std::max<int64_t>(most * group * dim, 1);
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / work);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  float* lp = lse.data_ptr<float>();
  const RowFn row = pick_row<T>(group, dim);
  arborlm_cpu::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(group * std::max<int64_t>(most, 1)));
    for (int64_t n = begin; n < end; ++n) {
      row(qp + n * group * dim, kp + n * k_row, vp + n * v_row, nullptr, k_key,
          lens[n % batch], group, dim, static_cast<float>(scale), scores.data(),
          op + n * group * dim, lp + n * group, NextRows{});
    }
  });
}

std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v, const at::Tensor& lens,
                                                    double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "decode_attention: q [N, G, D], k and v [N, W, D] expected, got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  const int64_t rows = q.size(0), group = q.size(1), dim = q.size(2);
  TORCH_CHECK(k.size(0) == rows && v.size(0) == rows && k.size(2) == dim && v.size(2) == dim &&
                  v.size(1) == k.size(1),
              "decode_attention: k and v must be [N, W, D] = [", rows, ", W, ", dim, "], got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(dim % 16 == 0 && dim > 0 && dim <= kMaxHeadDim,
              "decode_attention: head dim must be a multiple of 16 up to ", kMaxHeadDim, ", got ",
              dim);
  TORCH_CHECK(group >= 1 && group <= kMaxGroup, "decode_attention: 1 to ", kMaxGroup,
              " query heads per row, got ", group);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "decode_attention: q, k and v dtypes differ: ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1,
              "decode_attention: k and v rows must be contiguous in the head dim");
  TORCH_CHECK(lens.dim() == 1 && lens.numel() >= 1 && rows % lens.numel() == 0,
              "decode_attention: lens must be [B] with N = ", rows, " a multiple of B, got ",
              lens.sizes());
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), "decode_attention: this CPU lacks AVX-512");
  const at::Tensor lc = lens.to(at::kLong).contiguous();
  std::vector<int64_t> lv(lc.data_ptr<int64_t>(), lc.data_ptr<int64_t>() + lc.numel());
  for (const int64_t n : lv)
    TORCH_CHECK(n >= 0 && n <= k.size(1), "decode_attention: a length of ", n,
                " is outside the ", k.size(1), " keys");
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  at::Tensor lse = at::empty({rows, group}, qc.options().dtype(at::kFloat));
  if (rows == 0) return {out, lse};
  if (qc.scalar_type() == at::kFloat) {
    attend<float>(qc, k, v, lv, scale, out, lse);
  } else if (qc.scalar_type() == at::kBFloat16) {
    attend<c10::BFloat16>(qc, k, v, lv, scale, out, lse);
  } else {
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16 only, got ", qc.scalar_type());
  }
  return {out, lse};
}


// ---- CPUs with AVX2 but not AVX-512 (float32 only) -------------------------------------------
//
// `attend_row`'s result computed more plainly: each query's scores in 8-lane dot products, its
// softmax with the library's exp, the weighted values summed in an L1-resident row. Serves the
// fused decode step on such CPUs (`decode_step.cpp`); sums run in other orders than the AVX-512
// rows', so results agree to float32 rounding, not bit for bit.

#define AVX2_TARGET __attribute__((target("avx2,fma")))

AVX2_TARGET inline float dot_avx2(const float* a, const float* b, int64_t dim) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < dim; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  return arborlm_cpu::sum8(acc);
}

// Query heads q [group, dim] over keys/values at rows slots[j] (j < len) of k and v (row
// stride `stride`): out [group, dim] and each head's log-sum-exp.
AVX2_TARGET void attend_row_avx2(const float* q, const float* k, const float* v,
                                 const int64_t* slots, int64_t stride, int64_t len,
                                 int64_t group, int64_t dim, float scale, float* scores,
                                 float* out, float* lse) {
  for (int64_t g = 0; g < group; ++g) {
    float* o = out + g * dim;
    std::fill(o, o + dim, 0.0f);
    if (len == 0) {
      lse[g] = -std::numeric_limits<float>::infinity();
      continue;
    }
    const float* qg = q + g * dim;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < len; ++j) {
      scores[j] = dot_avx2(qg, k + slots[j] * stride, dim) * scale;
      top = std::max(top, scores[j]);
    }
    float total = 0.0f;
    for (int64_t j = 0; j < len; ++j) {
      scores[j] = std::exp(scores[j] - top);
      total += scores[j];
    }
    for (int64_t j = 0; j < len; ++j) {
      const float* vr = v + slots[j] * stride;
      const __m256 w = _mm256_set1_ps(scores[j]);
      for (int64_t i = 0; i < dim; i += 8)
        _mm256_storeu_ps(o + i, _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + i),
                                                _mm256_loadu_ps(o + i)));
    }
    const __m256 inv = _mm256_set1_ps(1.0f / total);
    for (int64_t i = 0; i < dim; i += 8)
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), inv));
    lse[g] = top + std::log(total);
  }
}

void row_entry_avx2(const void* q, const void* k, const void* v, const int64_t* slots,
                    int64_t stride, int64_t len, int64_t group, int64_t dim, float scale,
                    float* scores, void* out, float* lse, const NextRows&) {
  attend_row_avx2(static_cast<const float*>(q), static_cast<const float*>(k),
                  static_cast<const float*>(v), slots, stride, len, group, dim, scale, scores,
                  static_cast<float*>(out), lse);
}

// Rows b of q attend to pool rows slots[row_of[b], :lens[b]] (row_of null: slots[b, ...]),
// with the AVX-512 rows where `wide`, else the AVX2 ones (float32).
template <typename T>
void attend_paged(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                  const at::Tensor& slots, const int64_t* row_of,
                  const std::vector<int64_t>& lens, double scale, at::Tensor& out,
                  float* lse_out, bool wide) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_pool.size(1), group = heads / kv_heads;
  const int64_t width = slots.size(1);
  const int64_t most = *std::max_element(lens.begin(), lens.end());
  const int64_t grain = std::max<int64_t>(
      1, kMinWorkPerThread / std::max<int64_t>(most * group * dim, 1));
  const T* qp = q.data_ptr<T>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const RowFn row = wide ? pick_row<T>(group, dim) : &row_entry_avx2;
  const TokensFn tokens =
      wide && row_of != nullptr && lse_out == nullptr ? pick_tokens<T>(dim) : nullptr;
  if (tokens != nullptr) {
    // Runs of up to kTokensPerCall consecutive tokens of one sequence (one slot row, lengths
    // one apart), each run and KV head one work item; fewer per run at long lengths, so that a
    // thread's scores stay within kScoreBytes.
    const int64_t per_run = std::clamp<int64_t>(
        kScoreBytes / static_cast<int64_t>(sizeof(float) * group * std::max<int64_t>(most, 1)),
        1, kTokensPerCall);
    std::vector<int64_t> runs;  // first token of each run, then batch
    for (int64_t b = 0; b < batch; ++b)
      if (runs.empty() || b - runs.back() == per_run || row_of[b] != row_of[b - 1] ||
          lens[b] != lens[b - 1] + 1)
        runs.push_back(b);
    const int64_t nruns = static_cast<int64_t>(runs.size());
    runs.push_back(batch);
    const int64_t run_grain = std::max<int64_t>(
        1, kMinWorkPerThread / std::max<int64_t>(per_run * most * group * dim, 1));
    arborlm_cpu::parallel_for(0, nruns * kv_heads, run_grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(static_cast<size_t>(per_run * group * most));
      for (int64_t n = begin; n < end; ++n) {
        const int64_t r = n / kv_heads, h = n % kv_heads, b = runs[r];
        tokens(qp + (b * heads + h * group) * dim, heads * dim, runs[r + 1] - b, group,
               lens.data() + b, kp + h * dim, vp + h * dim, sp + row_of[b] * width,
               kv_heads * dim, static_cast<float>(scale), scores.data(),
               op + (b * heads + h * group) * dim, heads * dim);
      }
    });
    return;
  }
  // Rows n = b * Hkv + h: request b's KV head h; key j at pool row slots[b, j], head h.
  arborlm_cpu::parallel_for(0, batch * kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(group * std::max<int64_t>(most, 1)));
    std::vector<float> lse(static_cast<size_t>(group));
    for (int64_t n = begin; n < end; ++n) {
      const int64_t b = n / kv_heads, h = n % kv_heads;
      NextRows next;  // head h's share of request b+1's keys (see `NextRows`); queries of
      // one sequence (row_of) share their keys, which are in cache already
      if (b + 1 < batch && row_of == nullptr) {
        const int64_t share = (lens[b + 1] + kv_heads - 1) / kv_heads;
        const int64_t first = std::min(h * share, lens[b + 1]);
        next = {reinterpret_cast<const char*>(kp), reinterpret_cast<const char*>(vp),
                sp + (b + 1) * width + first, std::min(share, lens[b + 1] - first),
                static_cast<int64_t>(kv_heads * dim * sizeof(T))};
      }
      const int64_t* own = sp + (row_of != nullptr ? row_of[b] : b) * width;
      row(qp + (b * heads + h * group) * dim, kp + h * dim, vp + h * dim, own,
          kv_heads * dim, lens[b], group, dim, static_cast<float>(scale), scores.data(),
          op + (b * heads + h * group) * dim, lse.data(), next);
      if (lse_out != nullptr) std::copy(lse.begin(), lse.end(), lse_out + b * heads + h * group);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> paged(const at::Tensor& q, const at::Tensor& k_pool,
                                          const at::Tensor& v_pool, const at::Tensor& slots,
                                          const std::optional<at::Tensor>& rows,
                                          const at::Tensor& lens, double scale, bool want_lse) {
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu(),
              "decode_attention_paged: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes(),
              "decode_attention_paged: q [B, H, D], k_pool and v_pool [S, Hkv, D] expected, "
              "got ", q.sizes(), ", ", k_pool.sizes(), ", ", v_pool.sizes());
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_pool.size(1);
  TORCH_CHECK(k_pool.size(2) == dim && kv_heads > 0 && heads % kv_heads == 0,
              "decode_attention_paged: pool heads [", kv_heads, ", ", k_pool.size(2),
              "] do not fit q's [", heads, ", ", dim, "]");
  TORCH_CHECK(dim % 16 == 0 && dim > 0 && dim <= kMaxHeadDim,
              "decode_attention_paged: head dim must be a multiple of 16 up to ", kMaxHeadDim,
              ", got ", dim);
  TORCH_CHECK(heads / kv_heads <= kMaxGroup, "decode_attention_paged: at most ", kMaxGroup,
              " query heads per KV head, got ", heads / kv_heads);
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() &&
                  q.scalar_type() == v_pool.scalar_type(),
              "decode_attention_paged: q and pool dtypes differ: ", q.scalar_type(), ", ",
              k_pool.scalar_type(), ", ", v_pool.scalar_type());
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(),
              "decode_attention_paged: the pools must be contiguous");
  const bool mapped = rows.has_value() && rows->defined();
  TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == at::kLong &&
                  (mapped || slots.size(0) == batch),
              "decode_attention_paged: slots must be int64 [B, W] with B = ", batch, ", got ",
              slots.scalar_type(), " ", slots.sizes());
  TORCH_CHECK(lens.dim() == 1 && lens.numel() == batch,
              "decode_attention_paged: lens must be [B] = [", batch, "], got ", lens.sizes());
  const bool wide = __builtin_cpu_supports("avx512f");
  TORCH_CHECK(wide || (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                       q.scalar_type() == at::kFloat),
              "decode_attention_paged: this CPU lacks AVX-512 (or AVX2 with FMA, for float32)");
  const at::Tensor sc = slots.contiguous();
  const at::Tensor lc = lens.to(at::kLong).contiguous();
  std::vector<int64_t> lv(lc.data_ptr<int64_t>(), lc.data_ptr<int64_t>() + lc.numel());
  const int64_t table_rows = sc.size(0), width = sc.size(1);
  at::Tensor rc;
  if (mapped) {
    TORCH_CHECK(rows->dim() == 1 && rows->numel() == batch,
                "paged_attention_rows: rows must be [T] = [", batch, "], got ", rows->sizes());
    rc = rows->to(at::kLong).contiguous();
  }
  const int64_t* row_of = mapped ? rc.data_ptr<int64_t>() : nullptr;
  // Each slot row is checked once, up to the longest length read from it.
  std::vector<int64_t> longest(static_cast<size_t>(table_rows), 0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t r = mapped ? row_of[b] : b;
    TORCH_CHECK(r >= 0 && r < table_rows, "paged_attention_rows: row ", r, " is outside the ",
                table_rows, " slot rows");
    TORCH_CHECK(lv[b] >= 0 && lv[b] <= width, "decode_attention_paged: a length of ", lv[b],
                " is outside the ", width, " slots of a row");
    longest[r] = std::max(longest[r], lv[b]);
  }
  const int64_t* sp = sc.data_ptr<int64_t>();
  const int64_t num_slots = k_pool.size(0);
  for (int64_t r = 0; r < table_rows; ++r) {
    for (int64_t j = 0; j < longest[r]; ++j) {
      const int64_t s = sp[r * width + j];
      TORCH_CHECK(s >= 0 && s < num_slots, "decode_attention_paged: slot ", s,
                  " is outside the pool's ", num_slots);
    }
  }
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  at::Tensor lse = want_lse ? at::empty({batch, heads}, q.options().dtype(at::kFloat))
                            : at::Tensor();
  if (batch == 0) return {out, lse};
  float* lp = want_lse ? lse.data_ptr<float>() : nullptr;
  if (qc.scalar_type() == at::kFloat) {
    attend_paged<float>(qc, k_pool, v_pool, sc, row_of, lv, scale, out, lp, wide);
  } else if (qc.scalar_type() == at::kBFloat16) {
    attend_paged<c10::BFloat16>(qc, k_pool, v_pool, sc, row_of, lv, scale, out, lp, wide);
  } else {
    TORCH_CHECK(false, "decode_attention_paged: float32 or bfloat16 only, got ",
                qc.scalar_type());
  }
  return {out, lse};
}

// Every query token of an extend (or any batch) attends on its own: token t's query heads
// q [T, H, D] over pool rows slots[rows[t], :lens[t]], with the arithmetic of a decode step's
// query, so that a token's attention does not depend on how its sequence was split into steps.
at::Tensor paged_attention_rows(const at::Tensor& q, const at::Tensor& k_pool,
                                const at::Tensor& v_pool, const at::Tensor& slots,
                                const at::Tensor& rows, const at::Tensor& lens, double scale) {
  return std::get<0>(paged(q, k_pool, v_pool, slots, rows, lens, scale, false));
}

}  // namespace

namespace arborlm_cpu {

at::Tensor decode_attention_paged(const at::Tensor& q, const at::Tensor& k_pool,
                                  const at::Tensor& v_pool, const at::Tensor& slots,
                                  const at::Tensor& lens, double scale) {
  return std::get<0>(paged(q, k_pool, v_pool, slots, std::nullopt, lens, scale, false));
}

std::tuple<at::Tensor, at::Tensor> decode_attention_paged_lse(
    const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
    const at::Tensor& slots, const at::Tensor& lens, double scale) {
  return paged(q, k_pool, v_pool, slots, std::nullopt, lens, scale, true);
}

}  // namespace arborlm_cpu

TORCH_LIBRARY_FRAGMENT(arborlm, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor lens, float scale) -> "
        "(Tensor, Tensor)");
  m.def("decode_attention_paged(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, "
        "Tensor lens, float scale) -> Tensor");
  m.def("paged_attention_rows(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, "
        "Tensor rows, Tensor lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(arborlm, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention_paged", &arborlm_cpu::decode_attention_paged);
  m.impl("paged_attention_rows", &paged_attention_rows);
}
