// ArborLM's CPU kernels that other kernels call directly (C++ to C++, no dispatcher).

#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace arborlm_cpu {

// panel_gemm.cpp: whether `panels` are `pack_panels`' layout of an in -> out weight in dtype;
// x [rows, in] times them (+ bias, float32 [out] or null) into y [rows, out] (rows contiguous,
// y's row stride free), in x's dtype.
bool panels_hold(const at::Tensor& panels, at::ScalarType dtype, int64_t in, int64_t out);
void panel_linear_out(const at::Tensor& x, const at::Tensor& panels, const float* bias,
                      at::Tensor& y);

// decode_attention.cpp: q [B, H, D] over pool rows slots[b, :lens[b]] of k/v_pool [S, Hkv, D].
at::Tensor decode_attention_paged(const at::Tensor& q, const at::Tensor& k_pool,
                                  const at::Tensor& v_pool, const at::Tensor& slots,
                                  const at::Tensor& lens, double scale);

// ... with each query's log-sum-exp [B, H] float32 too.
std::tuple<at::Tensor, at::Tensor> decode_attention_paged_lse(
    const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
    const at::Tensor& slots, const at::Tensor& lens, double scale);

// prefill_attention.cpp: cascade decode's shared part. Rows b of q [B, H, D] with groups[b] = g
// >= 0 attend to pool rows prefix_slots[g, :prefix_lens[g]]; float32 outputs [B, H, D] and
// log-sum-exps [B, H] (zero and -inf for rows in no group).
std::tuple<at::Tensor, at::Tensor> prefix_attention(const at::Tensor& q,
                                                    const at::Tensor& k_pool,
                                                    const at::Tensor& v_pool,
                                                    const at::Tensor& prefix_slots,
                                                    const at::Tensor& prefix_lens,
                                                    const at::Tensor& groups, double scale);

// elementwise.cpp: each row's argmax [B] int64 of x [B, V] float32 (the first where the maximum
// repeats; a NaN wins, as torch.argmax): greedy sampling's.
at::Tensor argmax_rows(const at::Tensor& x);

}  // namespace arborlm_cpu
