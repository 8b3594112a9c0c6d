// ArborLM's CPU kernels that other kernels call directly (C++ to C++, no dispatcher).

#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

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

// quant_linear.cpp: x [rows, in] (float32 or bfloat16) times a GGUF weight kept packed (`weight`
// [out, row bytes] uint8 of ggml type `qtype`; + bias, float32 [out]) on the kernel path named
// ("portable", "float", "vnni", "vnni2") -> [rows, out] in x's dtype (`arborlm::quant_linear`).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                        const std::optional<at::Tensor>& bias, c10::string_view path);
// The same on an integer path ("vnni", "vnni2", "avx2_int") or, for bfloat16 x of up to 128
// rows where the CPU and OS grant AMX tiles, "amx" (false for any other, or no rows), into
// y [rows, out] in x's dtype (float32, or bfloat16 where `bf16`), from raw pointers: for
// the fused decode step, whose weights and paths are checked once a call (the path must be
// one this CPU grants, the weight rows of `row_bytes` whole blocks of `in` values).
bool quant_linear_into(const void* x, bool bf16, int64_t rows, int64_t in, const uint8_t* w,
                       int64_t row_bytes, int64_t out, int64_t qtype, const float* bias,
                       c10::string_view path, void* y);
// Whether `qtype` packs rows of `cols` values (whole blocks), and their bytes.
bool quant_row_bytes(int64_t qtype, int64_t cols, int64_t* bytes);
// One packed row of `cols` values (whole blocks) decoded to float32, as ggml decodes it.
void dequant_row(int64_t qtype, const uint8_t* row, int64_t cols, float* y);

// elementwise.cpp: each row's argmax [B] int64 of x [B, V] float32 (the first where the maximum
// repeats; a NaN wins, as torch.argmax): greedy sampling's.
at::Tensor argmax_rows(const at::Tensor& x);

}  // namespace arborlm_cpu
