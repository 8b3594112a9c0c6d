// ArborLM's CPU kernels that other kernels call directly (C++ to C++, no dispatcher).

#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace arborlm_cpu {

// row_gemv.cpp: x [1, in] times weight [out, in] (+ bias [out]) -> [1, out] in x's dtype.
at::Tensor row_gemv(const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias);

// decode_attention.cpp: q [B, H, D] over pool rows slots[b, :lens[b]] of k/v_pool [S, Hkv, D].
at::Tensor decode_attention_paged(const at::Tensor& q, const at::Tensor& k_pool,
                                  const at::Tensor& v_pool, const at::Tensor& slots,
                                  const at::Tensor& lens, double scale);

}  // namespace arborlm_cpu
