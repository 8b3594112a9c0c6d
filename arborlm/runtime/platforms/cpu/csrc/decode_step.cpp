// A whole decode step of a Llama-family model in one call: `arborlm::decode_step`.
//
// A decode step's arithmetic is the weights streaming through `panel_linear`; what is left is
// the glue between the 8-40 layers' kernels. Compiled by Inductor, that glue is ~40 operator
// calls through the dispatcher, a graph wrapper around them and a few single-threaded fused
// kernels per layer: at batch 1, 0.3-0.45 ms a step on the 2-core development machine against
// 1.2 ms of linears (32M bfloat16); with 32 requests, ~1 ms against 5. Here the layers run in a
// C++ loop that calls the kernels directly and does the small elementwise steps inline, row by
// row, vectorized (AVX-512; bfloat16 rounded to nearest even after every op, as eager does).
//
// The arithmetic is the eager model's, op for op and rounding for rounding (`models/llama.py`,
// as `transformers` computes it): residual adds in the activation dtype; RMSNorm in float32,
// rounded, then times the weight and rounded again; rotary as `x * cos + swapped(x) * sin`
// with each product and the sum rounded; SwiGLU as `silu(gate)` rounded, times `up`, rounded;
// the linears and attention are ArborLM's kernels. In float32 every rounding is exact. (Sums,
// RMSNorm's and the linears', run in their own orders.)
//
// `arborlm::decode_steps` runs several greedy steps in one call, each feeding the argmax of the
// last (`argmax_rows`, greedy sampling's own), so that a run of steps pays the scheduler's
// per-step Python once (`num_continuous_decode_steps`).
//
// Weights per layer, in this order (`Tensor?[]`; a missing bias is None): input norm, qkv,
// qkv bias, o, o bias, post-attention norm, gate_up, gate_up bias, down, down bias; then the
// embedding, the final norm and the head. The linears are `pack_panels` layouts, their biases
// float32.
//
// Or GGUF blocks kept packed (`--quantization`; `quant_linear.cpp`), as `packed` says, a flat
// list of records `weight index, kind, n, (tensor index, ggml type) * n`: the weight at that
// index is computed from the n packed tensors named (indices into `weights`; parts after the
// first come after the standard entries), stacked by rows. Kind 0 is one `QuantLinear` (its
// bias added by the kernel, in float32), kind 1 a `QuantLinearStack` (the parts' outputs
// concatenated, then its bias added in the activation dtype), kind 2 the packed embedding
// (`QuantEmbedding`: a looked-up row decoded to float32, then rounded to the activation dtype).
// Every packed linear runs on the one `quant_path` given ("portable", "float", "bf16", "vnni",
// "vnni2": `cpu_kernels.quant_linear`'s paths, with its conversions), so each is the eager
// module's arithmetic.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels.h"
#include "row_ops.h"
#include "vec_math.h"
#include "thread_pool.h"

namespace {

constexpr int64_t kPerLayer = 10;

// Whether the CPU has AVX-512 (ArborLM's kernels, panels among them); without it, AVX2 serves a
// step whose linears are all packed blocks, in float32.
bool wide() {
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f"));
  return has;
}

// x [rows, in] (contiguous) times a linear's panels (+ its float32 bias) -> [rows, out].
at::Tensor linear(const at::Tensor& x, const at::Tensor& panels,
                  const std::optional<at::Tensor>& bias, int64_t out) {
  at::Tensor y = at::empty({x.size(0), out}, x.options());
  arborlm_cpu::panel_linear_out(x, panels, bias ? bias->data_ptr<float>() : nullptr, y);
  return y;
}

// Whether `panels` hold a linear from `in` to `out` in `dtype` (`pack_panels`' layout).
void check_linear(const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                  at::ScalarType dtype, int64_t in, int64_t out, int64_t index) {
  TORCH_CHECK(wide(), "decode_step: weight ", index, " is in panels, which need AVX-512");
  TORCH_CHECK(arborlm_cpu::panels_hold(panels, dtype, in, out), "decode_step: weight ", index,
              " must be the panels of a ", in, " -> ", out, " linear in ", dtype, ", got ",
              panels.scalar_type(), " ", panels.sizes());
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                        bias->dim() == 1 && bias->size(0) == out),
              "decode_step: bias ", index + 1, " must be float32 [", out, "]");
}

// One linear of a step: `pack_panels` panels, or packed GGUF parts stacked by rows (indices
// into the weights).
struct Linear {
  int64_t panels = -1;
  std::vector<std::pair<int64_t, int64_t>> parts;  // (weight index of the blocks, ggml type)
  bool stack = false;  // a QuantLinearStack: its bias is added after the parts, in x's dtype
  std::optional<at::Tensor> bias;
  // One packed part (not a stack): its blocks and row bytes, checked, for `quant_linear_into`.
  const uint8_t* blocks = nullptr;
  int64_t row_bytes = 0;
};

using Weights = std::vector<std::optional<at::Tensor>>;

// x times packed blocks on `path`, converting as `cpu_kernels.quant_linear` does.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                         const std::optional<at::Tensor>& bias, const std::string& path) {
  if (path == "bf16") return arborlm_cpu::quant_linear(x, blocks, qtype, bias, "float");
  if (path == "float" && x.scalar_type() == at::kBFloat16)
    return arborlm_cpu::convert(arborlm_cpu::quant_linear(arborlm_cpu::convert(x, at::kFloat),
                                                          blocks, qtype, bias, "float"),
                                at::kBFloat16);
  return arborlm_cpu::quant_linear(x, blocks, qtype, bias, path);
}

// x [rows, in] (contiguous) times `l` -> [rows, out] in x's dtype: into `into` (made on first
// use, [rows, out] in x's dtype, kept by the caller from layer to layer) where one packed part
// runs on an integer path, its inputs checked once a call (no per-call checks or tensors).
at::Tensor apply(const Weights& w, const Linear& l, const at::Tensor& x, int64_t out,
                 const std::string& path, at::Tensor& into) {
  if (l.blocks != nullptr) {
    if (!into.defined()) into = at::empty({x.size(0), out}, x.options());
    if (arborlm_cpu::quant_linear_into(x.data_ptr(), x.scalar_type() == at::kBFloat16,
                                       x.size(0), x.size(1), l.blocks, l.row_bytes, out,
                                       l.parts[0].second,
                                       l.bias ? l.bias->data_ptr<float>() : nullptr, path,
                                       into.data_ptr())) {
      return into;
    }
  }
  if (l.panels >= 0) return linear(x, *w[l.panels], l.bias, out);
  if (!l.stack) return packed_linear(x, *w[l.parts[0].first], l.parts[0].second, l.bias, path);
  std::vector<at::Tensor> ys;
  for (const auto& [index, qtype] : l.parts)
    ys.push_back(packed_linear(x, *w[index], qtype, std::nullopt, path));
  at::Tensor y = at::cat(ys, 1);
  if (l.bias) y.add_(l.bias->to(y.scalar_type()));
  return y;
}

// Names the packed weight `l` reads to the pool (`arborlm_cpu::prefetch_hint`), before the serial
// steps that precede it: its last part's end, which the pool's first worker takes first.
void hint(const Weights& w, const Linear& l) {
  if (l.panels >= 0) return;
  const at::Tensor& t = *w[l.parts.back().first];
  arborlm_cpu::prefetch_hint(t.data_ptr(), static_cast<int64_t>(t.nbytes()));
}

using arborlm_cpu::widen;

// The per-row steps: the AVX-512 ones (those the eager operators share), or on a CPU with AVX2
// but not AVX-512 (float32 only there) `row_ops.h`'s plainer ones.

template <typename T>
void add_into(const T* x, T* residual, int64_t n) {
  wide() ? arborlm_cpu::add_into(x, residual, n) : arborlm_cpu::avx2::add_into(x, residual, n);
}

template <typename T>
void rms_norm(const T* x, const T* w, T* out, int64_t n, float eps) {
  wide() ? arborlm_cpu::rms_norm(x, w, out, n, eps)
         : arborlm_cpu::avx2::rms_norm(x, w, out, n, eps);
}

template <typename T>
void rotate(T* x, const T* cos, const T* sin, int64_t heads, int64_t dim) {
  wide() ? arborlm_cpu::rotate(x, cos, sin, heads, dim)
         : arborlm_cpu::avx2::rotate(x, cos, sin, heads, dim);
}

template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t inter) {
  wide() ? arborlm_cpu::silu_mul(gate_up, out, inter)
         : arborlm_cpu::avx2::silu_mul(gate_up, out, inter);
}

// fn(b) for every row b of a step, split over torch's threads when there are enough rows: the
// per-row glue (norms, rotary, SwiGLU, key stores) of a 32-row step takes ~0.5 ms on one core,
// ~1 ms at 64 rows; below kGlueRowsPerThread rows a thread's start costs more than its share.
constexpr int64_t kGlueRowsPerThread = 8;

template <typename Fn>
void each_row(int64_t rows, const Fn& fn) {
  if (rows < 2 * kGlueRowsPerThread) {
    for (int64_t b = 0; b < rows; ++b) fn(b);
    return;
  }
  arborlm_cpu::parallel_for(0, rows, kGlueRowsPerThread, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) fn(b);
  });
}

// Cascade groups of a decode batch: requests b with groups[b] = g >= 0 share the prefix held
// by pool rows slots[g, :lens[g]] (their own slots then start after it).
struct Cascade {
  at::Tensor slots, lens, groups;
};

// own (T [B, H, D], attention over each request's own keys) becomes the softmax over both
// parts: own and pre (float32) weighted by their log-sum-exps; rows without a prefix part
// (pre_lse -inf) keep theirs.
template <typename T>
void merge_rows(T* own, const float* own_lse, const float* pre, const float* pre_lse,
                int64_t rows, int64_t dim) {
  for (int64_t n = 0; n < rows; ++n) {
    if (std::isinf(pre_lse[n])) continue;
    const float mx = std::max(own_lse[n], pre_lse[n]);
    const float a = std::exp(own_lse[n] - mx), b = std::exp(pre_lse[n] - mx);
    const float inv = 1.0f / (a + b);
    T* o = own + n * dim;
    const float* p = pre + n * dim;
    for (int64_t d = 0; d < dim; ++d) o[d] = T((widen(o[d]) * a + p[d] * b) * inv);
  }
}

void merge(at::Tensor& own, const at::Tensor& own_lse, const at::Tensor& pre,
           const at::Tensor& pre_lse) {
  const int64_t rows = own.size(0) * own.size(1), dim = own.size(2);
  if (own.scalar_type() == at::kFloat) {
    merge_rows(own.data_ptr<float>(), own_lse.data_ptr<float>(), pre.data_ptr<float>(),
               pre_lse.data_ptr<float>(), rows, dim);
  } else {
    merge_rows(own.data_ptr<c10::BFloat16>(), own_lse.data_ptr<float>(), pre.data_ptr<float>(),
               pre_lse.data_ptr<float>(), rows, dim);
  }
}

// The checked inputs of a call: the weights (a missing optional one as nullopt), the linears
// (four per layer, then the head), the pools, the activation dtype, the packed embedding's type
// (-1: float rows), the packed linears' path and the cascade groups (if any).
struct Inputs {
  Weights w;
  std::vector<Linear> linears;
  std::vector<at::Tensor> k_pool, v_pool;
  at::ScalarType dtype;
  int64_t embed_qtype = -1;
  std::string path;
  bool cascade;
  Cascade groups;
};

template <typename T>
at::Tensor step(const Inputs& in, const at::Tensor& token, const at::Tensor& position,
                const at::Tensor& slot, const at::Tensor& slots, const at::Tensor& lens,
                const at::Tensor& cos_table, const at::Tensor& sin_table, double eps,
                double scale, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
                const Cascade* cascade) {
  const auto& w = in.w;
  const auto& k_pool = in.k_pool;
  const auto& v_pool = in.v_pool;
  const int64_t layers = static_cast<int64_t>(k_pool.size());
  const at::Tensor& embed = *w[layers * kPerLayer];
  const at::Tensor& final_norm = *w[layers * kPerLayer + 1];
  const int64_t hidden = final_norm.size(0), rows = token.numel();
  const int64_t* tok = token.data_ptr<int64_t>();
  const int64_t* pos = position.data_ptr<int64_t>();
  const int64_t* where = slot.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(tok[b] >= 0 && tok[b] < embed.size(0), "decode_step: token ", tok[b],
                " outside the vocab");
    TORCH_CHECK(pos[b] >= 0 && pos[b] < cos_table.size(0), "decode_step: position ", pos[b],
                " outside the rotary table");
  }
  const auto opts = final_norm.options();
  const float fe = static_cast<float>(eps);
  at::Tensor residual = at::empty({rows, hidden}, opts);  // the embeddings
  if (in.embed_qtype < 0) {
    each_row(rows, [&](int64_t b) {
      std::memcpy(residual.data_ptr<T>() + b * hidden, embed.data_ptr<T>() + tok[b] * hidden,
                  hidden * sizeof(T));
    });
  } else {  // decode the looked-up rows
    const int64_t row_bytes = embed.size(1);
    each_row(rows, [&](int64_t b) {
      std::vector<float> row(hidden);
      arborlm_cpu::dequant_row(in.embed_qtype, embed.data_ptr<uint8_t>() + tok[b] * row_bytes,
                               hidden, row.data());
      T* dst = residual.data_ptr<T>() + b * hidden;
      for (int64_t i = 0; i < hidden; ++i) dst[i] = static_cast<T>(row[i]);
    });
  }
  at::Tensor x;  // the previous layer's MLP output (none before the first layer)
  at::Tensor h = at::empty({rows, hidden}, opts);
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const int64_t qkv_size = q_size + 2 * kv_size;
  at::Tensor q = at::empty({rows, heads, head_dim}, opts);  // attention's queries, contiguous
  at::Tensor act = at::empty({rows, inter}, opts);
  // Where `apply` writes the packed linears' outputs (made by the first that needs each), one
  // buffer per linear of a layer: each output is read (down's by the next layer's first step)
  // before that linear runs again.
  at::Tensor qkv_out, o_out, gate_up_out, down_out, head_out;
  T* r = residual.data_ptr<T>();
  T* hp = h.data_ptr<T>();
  hint(w, in.linears[0]);
  for (int64_t l = 0; l < layers; ++l) {
    const auto* lw = &w[l * kPerLayer];
    const Linear* ll = &in.linears[4 * l];
    each_row(rows, [&](int64_t b) {
      if (x.defined()) add_into(x.data_ptr<T>() + b * hidden, r + b * hidden, hidden);
      rms_norm(r + b * hidden, lw[0]->data_ptr<T>(), hp + b * hidden, hidden, fe);
    });
    at::Tensor qkv = apply(w, ll[0], h, qkv_size, in.path, qkv_out);
    hint(w, ll[1]);
    T* k_dst = k_pool[l].data_ptr<T>();
    T* v_dst = v_pool[l].data_ptr<T>();
    each_row(rows, [&](int64_t b) {
      T* row = qkv.data_ptr<T>() + b * qkv_size;
      rotate(row, cos_table.data_ptr<T>() + pos[b] * head_dim,
             sin_table.data_ptr<T>() + pos[b] * head_dim, heads + kv_heads, head_dim);
      std::memcpy(q.data_ptr<T>() + b * q_size, row, q_size * sizeof(T));
      std::memcpy(k_dst + where[b] * kv_size, row + q_size, kv_size * sizeof(T));
      std::memcpy(v_dst + where[b] * kv_size, row + q_size + kv_size, kv_size * sizeof(T));
    });
    at::Tensor attn;
    if (cascade == nullptr) {
      attn = arborlm_cpu::decode_attention_paged(q, k_pool[l], v_pool[l], slots, lens, scale);
    } else {  // own keys (slots, lens) and the group's prefix, merged by log-sum-exp
      auto [own, own_lse] =
          arborlm_cpu::decode_attention_paged_lse(q, k_pool[l], v_pool[l], slots, lens, scale);
      auto [pre, pre_lse] = arborlm_cpu::prefix_attention(
          q, k_pool[l], v_pool[l], cascade->slots, cascade->lens, cascade->groups, scale);
      merge(own, own_lse, pre, pre_lse);
      attn = own;
    }
    at::Tensor o = apply(w, ll[1], attn.view({rows, q_size}), hidden, in.path, o_out);
    hint(w, ll[2]);
    each_row(rows, [&](int64_t b) {
      add_into(o.data_ptr<T>() + b * hidden, r + b * hidden, hidden);
      rms_norm(r + b * hidden, lw[5]->data_ptr<T>(), hp + b * hidden, hidden, fe);
    });
    at::Tensor gate_up = apply(w, ll[2], h, 2 * inter, in.path, gate_up_out);
    hint(w, ll[3]);
    each_row(rows, [&](int64_t b) {
      silu_mul(gate_up.data_ptr<T>() + b * 2 * inter, act.data_ptr<T>() + b * inter, inter);
    });
    x = apply(w, ll[3], act, hidden, in.path, down_out);
    hint(w, in.linears[4 * (l + 1)]);  // the next layer's qkv, or after the last the head
  }
  each_row(rows, [&](int64_t b) {
    if (x.defined()) add_into(x.data_ptr<T>() + b * hidden, r + b * hidden, hidden);
    rms_norm(r + b * hidden, final_norm.data_ptr<T>(), hp + b * hidden, hidden, fe);
  });
  // float32 logits [rows, V], widened on the kernels' pool (`arborlm_cpu::convert`)
  return arborlm_cpu::convert(
      apply(w, in.linears[4 * layers], h, embed.size(0), in.path, head_out), at::kFloat);
}

// A packed record (see the top of this file): the weight it computes, its kind, its parts.
struct Record {
  int64_t index, kind;
  Linear linear;
};

std::vector<Record> read_packed(c10::ArrayRef<int64_t> packed, int64_t num_weights) {
  std::vector<Record> records;
  size_t i = 0;
  while (i < packed.size()) {
    TORCH_CHECK(i + 3 <= packed.size(), "decode_step: packed record ", records.size(),
                " is cut short");
    const int64_t index = packed[i], kind = packed[i + 1], n = packed[i + 2];
    TORCH_CHECK(index >= 0 && index < num_weights && kind >= 0 && kind <= 2 && n >= 1 &&
                    (kind != 2 || n == 1) && i + 3 + 2 * n <= packed.size(),
                "decode_step: bad packed record ", records.size());
    Linear l;
    l.stack = kind == 1;
    for (int64_t p = 0; p < n; ++p) {
      const int64_t part = packed[i + 3 + 2 * p], qtype = packed[i + 4 + 2 * p];
      TORCH_CHECK(part >= 0 && part < num_weights, "decode_step: packed part ", part,
                  " outside the weights");
      l.parts.emplace_back(part, qtype);
    }
    records.push_back({index, kind, std::move(l)});
    i += 3 + 2 * n;
  }
  return records;
}

// Whether packed parts hold an in -> out linear: uint8 rows of whole blocks, out rows in all.
void check_packed(const Weights& w, const Linear& l, int64_t in, int64_t out, int64_t index) {
  int64_t rows = 0;
  for (const auto& [part, qtype] : l.parts) {
    TORCH_CHECK(w[part].has_value(), "decode_step: packed part ", part, " is missing");
    const at::Tensor& t = *w[part];
    int64_t bytes;
    TORCH_CHECK(arborlm_cpu::quant_row_bytes(qtype, in, &bytes), "decode_step: weight ", index,
                ": ggml type ", qtype, " has no packed kernel for rows of ", in, " values");
    TORCH_CHECK(t.scalar_type() == at::kByte && t.dim() == 2 && t.is_contiguous() &&
                    t.size(1) == bytes,
                "decode_step: packed part ", part, " of weight ", index,
                " must be contiguous uint8 [rows, ", bytes, "], got ", t.scalar_type(), " ",
                t.sizes());
    rows += t.size(0);
  }
  TORCH_CHECK(rows == out, "decode_step: weight ", index, "'s packed parts hold ", rows,
              " rows, not ", out);
}

// Checks everything but the per-step slots (`check_slots`) and tokens (`step` checks those).
Inputs check_inputs(const at::Tensor& token, const at::Tensor& position, const at::Tensor& slots,
                    const at::Tensor& lens, const c10::List<std::optional<at::Tensor>>& weights,
                    at::TensorList k_pool, at::TensorList v_pool, const at::Tensor& cos_table,
                    const at::Tensor& sin_table, int64_t heads, int64_t kv_heads,
                    int64_t head_dim, int64_t intermediate,
                    const std::optional<at::Tensor>& prefix_slots,
                    const std::optional<at::Tensor>& prefix_lens,
                    const std::optional<at::Tensor>& groups, c10::ArrayRef<int64_t> packed,
                    c10::string_view quant_path) {
  const int64_t layers = static_cast<int64_t>(k_pool.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_pool.size()) == layers,
              "decode_step: one K and one V pool per layer expected");
  const int64_t standard = layers * kPerLayer + 3;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == standard ||
                  (!packed.empty() && static_cast<int64_t>(weights.size()) > standard),
              "decode_step: ", standard, " weights expected for ", layers, " layers, got ",
              weights.size());
  Inputs in;
  in.w.reserve(weights.size());
  for (size_t i = 0; i < weights.size(); ++i) {
    std::optional<at::Tensor> t = weights.get(i);
    in.w.push_back(t.has_value() && t->defined() ? t : std::nullopt);
  }
  const auto& w = in.w;
  for (int64_t l = 0; l <= layers; ++l) {
    const std::vector<int64_t> required = l < layers
        ? std::vector<int64_t>{0, 1, 3, 5, 6, 8}
        : std::vector<int64_t>{0, 1, 2};
    for (const int64_t i : required)
      TORCH_CHECK(w[l * kPerLayer + i].has_value(), "decode_step: weight ", l * kPerLayer + i,
                  " is missing");
  }
  const int64_t rows = token.numel();
  TORCH_CHECK(rows > 0 && position.numel() == rows && token.is_contiguous() &&
                  position.is_contiguous() && token.scalar_type() == at::kLong &&
                  position.scalar_type() == at::kLong,
              "decode_step: token, position and slot must be one int64 per request");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == rows && lens.numel() == rows,
              "decode_step: slots must be [", rows, ", W] and lens [", rows, "]");
  TORCH_CHECK(head_dim % 2 == 0 && cos_table.size(1) == head_dim && sin_table.size(1) == head_dim,
              "decode_step: rotary tables must be [P, ", head_dim, "]");
  in.k_pool.assign(k_pool.begin(), k_pool.end());
  in.v_pool.assign(v_pool.begin(), v_pool.end());
  const auto& kp = in.k_pool;
  const auto& vp = in.v_pool;
  for (int64_t l = 0; l < layers; ++l)
    TORCH_CHECK(kp[l].is_contiguous() && vp[l].is_contiguous() && kp[l].dim() == 3 &&
                    kp[l].size(1) == kv_heads && kp[l].size(2) == head_dim &&
                    vp[l].sizes() == kp[l].sizes(),
                "decode_step: the pools must be contiguous [S, ", kv_heads, ", ", head_dim, "]");
  const at::Tensor& final_norm = *w[layers * kPerLayer + 1];
  const at::Tensor& embed = *w[layers * kPerLayer];
  in.dtype = final_norm.scalar_type();
  TORCH_CHECK(in.dtype == at::kFloat || in.dtype == at::kBFloat16,
              "decode_step: float32 or bfloat16 only, got ", in.dtype);
  TORCH_CHECK(final_norm.dim() == 1 && embed.dim() == 2,
              "decode_step: the final norm must be [hidden] and the embedding [vocab, hidden]");
  const int64_t hidden = final_norm.size(0), vocab = embed.size(0);
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;

  auto records = read_packed(packed, static_cast<int64_t>(w.size()));
  in.path = std::string(quant_path);
  TORCH_CHECK(records.empty() || in.path == "portable" || in.path == "float" ||
                  in.path == "bf16" || in.path == "vnni" || in.path == "vnni2" ||
                  in.path == "avx2" || in.path == "avx2_int" || in.path == "amx",
              "decode_step: quant_path must be portable, avx2, avx2_int, float, bf16, vnni, "
              "vnni2 or amx, got '", in.path, "'");
  TORCH_CHECK(wide() || (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         in.dtype == at::kFloat),
              "decode_step: this CPU lacks AVX-512 (or AVX2 with FMA, for float32)");
  auto find = [&](int64_t index) -> const Record* {
    for (const Record& r : records)
      if (r.index == index) return &r;
    return nullptr;
  };
  if (const Record* e = find(layers * kPerLayer); e != nullptr) {
    TORCH_CHECK(e->kind == 2 && e->linear.parts[0].first == layers * kPerLayer,
                "decode_step: the packed embedding's record must be of kind 2, on itself");
    int64_t bytes;
    in.embed_qtype = e->linear.parts[0].second;
    TORCH_CHECK(arborlm_cpu::quant_row_bytes(in.embed_qtype, hidden, &bytes) && hidden % 32 == 0,
                "decode_step: ggml type ", in.embed_qtype, " cannot hold embeddings of ", hidden);
    TORCH_CHECK(embed.scalar_type() == at::kByte && embed.is_contiguous() &&
                    embed.size(1) == bytes,
                "decode_step: the packed embedding must be contiguous uint8 [vocab, ", bytes,
                "], got ", embed.scalar_type(), " ", embed.sizes());
  } else {
    TORCH_CHECK(embed.scalar_type() == in.dtype && embed.is_contiguous() &&
                    embed.size(1) == hidden,
                "decode_step: the embedding must be contiguous [vocab, ", hidden, "] in ",
                in.dtype);
  }
  // (weight index, bias index or -1, in, out) of each linear: four per layer, then the head.
  std::vector<std::array<int64_t, 4>> shapes;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t i = l * kPerLayer;
    shapes.push_back({i + 1, i + 2, hidden, q_size + 2 * kv_size});
    shapes.push_back({i + 3, i + 4, q_size, hidden});
    shapes.push_back({i + 6, i + 7, hidden, 2 * intermediate});
    shapes.push_back({i + 8, i + 9, intermediate, hidden});
  }
  shapes.push_back({layers * kPerLayer + 2, -1, hidden, vocab});
  size_t used = in.embed_qtype >= 0 ? 1 : 0;
  for (const auto& [index, bias_index, n_in, n_out] : shapes) {
    const std::optional<at::Tensor> bias = bias_index >= 0 ? w[bias_index] : std::nullopt;
    Linear l;
    if (const Record* r = find(index); r != nullptr) {
      TORCH_CHECK(r->kind != 2, "decode_step: weight ", index, " is a linear, not kind 2");
      l = r->linear;
      ++used;
      check_packed(w, l, n_in, n_out, index);
      if (r->kind == 0 && l.parts.size() == 1) {
        l.blocks = w[l.parts[0].first]->data_ptr<uint8_t>();
        l.row_bytes = w[l.parts[0].first]->size(1);
      }
      TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                            bias->dim() == 1 && bias->size(0) == n_out),
                  "decode_step: bias ", index + 1, " must be float32 [", n_out, "]");
    } else {
      check_linear(*w[index], bias, in.dtype, n_in, n_out, index);
      l.panels = index;
    }
    l.bias = bias;
    in.linears.push_back(std::move(l));
  }
  TORCH_CHECK(used == records.size(), "decode_step: a packed record names no linear");
  in.cascade = prefix_slots.has_value() && prefix_slots->defined();
  TORCH_CHECK(in.cascade == (prefix_lens.has_value() && prefix_lens->defined()) &&
                  in.cascade == (groups.has_value() && groups->defined()),
              "decode_step: prefix_slots, prefix_lens and groups come together");
  if (in.cascade) in.groups = {*prefix_slots, *prefix_lens, *groups};
  TORCH_CHECK(!in.cascade || wide(), "decode_step: cascade groups need AVX-512");
  return in;
}

// Every slot a step writes its new keys to must be a pool row.
void check_slots(const at::Tensor& slot, int64_t pool_rows) {
  TORCH_CHECK(slot.is_contiguous() && slot.scalar_type() == at::kLong,
              "decode_step: token, position and slot must be one int64 per request");
  const int64_t* where = slot.data_ptr<int64_t>();
  for (int64_t i = 0; i < slot.numel(); ++i)
    TORCH_CHECK(where[i] >= 0 && where[i] < pool_rows, "decode_step: slot ", where[i],
                " outside the pool");
}

at::Tensor run_step(const Inputs& in, const at::Tensor& token, const at::Tensor& position,
                    const at::Tensor& slot, const at::Tensor& slots, const at::Tensor& lens,
                    const at::Tensor& cos_table, const at::Tensor& sin_table, double eps,
                    double scale, int64_t heads, int64_t kv_heads, int64_t head_dim,
                    int64_t intermediate) {
  const Cascade* cp = in.cascade ? &in.groups : nullptr;
  if (in.dtype == at::kFloat)
    return step<float>(in, token, position, slot, slots, lens, cos_table, sin_table, eps, scale,
                       heads, kv_heads, head_dim, intermediate, cp);
  return step<c10::BFloat16>(in, token, position, slot, slots, lens, cos_table, sin_table, eps,
                             scale, heads, kv_heads, head_dim, intermediate, cp);
}

at::Tensor decode_step(const at::Tensor& token, const at::Tensor& position,
                       const at::Tensor& slot, const at::Tensor& slots, const at::Tensor& lens,
                       const c10::List<std::optional<at::Tensor>>& weights,
                       at::TensorList k_pool, at::TensorList v_pool,
                       const at::Tensor& cos_table, const at::Tensor& sin_table, double eps,
                       double scale, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       int64_t intermediate, const std::optional<at::Tensor>& prefix_slots,
                       const std::optional<at::Tensor>& prefix_lens,
                       const std::optional<at::Tensor>& groups, c10::IntArrayRef packed,
                       c10::string_view quant_path) {
  const Inputs in = check_inputs(token, position, slots, lens, weights, k_pool, v_pool,
                                 cos_table, sin_table, heads, kv_heads, head_dim, intermediate,
                                 prefix_slots, prefix_lens, groups, packed, quant_path);
  TORCH_CHECK(slot.numel() == token.numel(),
              "decode_step: token, position and slot must be one int64 per request");
  check_slots(slot, in.k_pool[0].size(0));
  return run_step(in, token, position, slot, slots, lens, cos_table, sin_table, eps, scale, heads,
                  kv_heads, head_dim, intermediate);
}

// `steps` greedy decode steps in one call: step i feeds each request the argmax of step i-1's
// logits (step 0: `token`) at position + i, writes its keys to slot[i, b] and attends to the
// first lens[b] + i keys of its `slots` row (which must already hold every step's slot).
// Returns the chosen tokens [steps, B] (`argmax_rows`, greedy sampling's own argmax).
at::Tensor decode_steps(const at::Tensor& token, const at::Tensor& position,
                        const at::Tensor& slot, const at::Tensor& slots, const at::Tensor& lens,
                        const c10::List<std::optional<at::Tensor>>& weights,
                        at::TensorList k_pool, at::TensorList v_pool,
                        const at::Tensor& cos_table, const at::Tensor& sin_table, double eps,
                        double scale, int64_t heads, int64_t kv_heads, int64_t head_dim,
                        int64_t intermediate, const std::optional<at::Tensor>& prefix_slots,
                        const std::optional<at::Tensor>& prefix_lens,
                        const std::optional<at::Tensor>& groups, c10::IntArrayRef packed,
                        c10::string_view quant_path) {
  const Inputs in = check_inputs(token, position, slots, lens, weights, k_pool, v_pool,
                                 cos_table, sin_table, heads, kv_heads, head_dim, intermediate,
                                 prefix_slots, prefix_lens, groups, packed, quant_path);
  const int64_t rows = token.numel();
  TORCH_CHECK(slot.dim() == 2 && slot.size(0) >= 1 && slot.size(1) == rows,
              "decode_steps: slot must be [steps, ", rows, "], got ", slot.sizes());
  check_slots(slot, in.k_pool[0].size(0));
  const int64_t steps = slot.size(0);
  const at::Tensor first_lens = lens.to(at::kLong).contiguous();
  const int64_t longest =
      *std::max_element(first_lens.data_ptr<int64_t>(), first_lens.data_ptr<int64_t>() + rows);
  TORCH_CHECK(longest + steps - 1 <= slots.size(1), "decode_steps: ", steps,
              " steps need slot rows of ", longest + steps - 1, ", got ", slots.size(1));
  at::Tensor chosen = at::empty({steps, rows}, token.options());
  at::Tensor tok = token;
  for (int64_t i = 0; i < steps; ++i) {
    const at::Tensor logits =
        run_step(in, tok, position + i, slot[i], slots, first_lens + i, cos_table, sin_table,
                 eps, scale, heads, kv_heads, head_dim, intermediate);
    chosen[i].copy_(arborlm_cpu::argmax_rows(logits));
    tok = chosen[i];
  }
  return chosen;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(arborlm, m) {
  m.def("decode_step(Tensor token, Tensor position, Tensor slot, Tensor slots, Tensor lens, "
        "Tensor?[] weights, Tensor(a!)[] k_pool, Tensor(b!)[] v_pool, Tensor cos_table, "
        "Tensor sin_table, float eps, float scale, int heads, int kv_heads, int head_dim, "
        "int intermediate, Tensor? prefix_slots=None, Tensor? prefix_lens=None, "
        "Tensor? groups=None, int[] packed=[], str quant_path=\"\") -> Tensor");
  m.def("decode_steps(Tensor token, Tensor position, Tensor slot, Tensor slots, Tensor lens, "
        "Tensor?[] weights, Tensor(a!)[] k_pool, Tensor(b!)[] v_pool, Tensor cos_table, "
        "Tensor sin_table, float eps, float scale, int heads, int kv_heads, int head_dim, "
        "int intermediate, Tensor? prefix_slots=None, Tensor? prefix_lens=None, "
        "Tensor? groups=None, int[] packed=[], str quant_path=\"\") -> Tensor");
}

TORCH_LIBRARY_IMPL(arborlm, CPU, m) {
  m.impl("decode_step", &decode_step);
  m.impl("decode_steps", &decode_steps);
}
