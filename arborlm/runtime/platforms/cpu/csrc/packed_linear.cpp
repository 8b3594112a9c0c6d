// `arborlm::packed_linear`: a linear through its oneDNN-packed weight, callable from a compiled
// graph.
//
// A batched CPU linear is fastest on the weight oneDNN has packed into its blocked layout
// (`mkldnn::_reorder_linear_weight`), but that packed tensor is opaque: a graph traced by
// `torch.compile` cannot hold it. `PackedLinear` therefore registers its packed weight (and bias)
// here under a number, and a compiled step calls this operator with the number. Written in
// Python, as a `torch.library.custom_op`, each call from Inductor's C++ wrapper crossed into
// Python and back: ~15-20 us, 33 times a step for the 32M model. Here the call stays in C++.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace {

struct Layer {
  at::Tensor packed;                // oneDNN's blocked weight (opaque)
  std::optional<at::Tensor> bias;  // [out] or none
};

std::mutex table_lock;
std::unordered_map<int64_t, Layer>& table() {
  static auto* layers = new std::unordered_map<int64_t, Layer>();  // outlives static teardown
  return *layers;
}

void register_packed_linear(int64_t handle, const at::Tensor& packed,
                            const std::optional<at::Tensor>& bias) {
  std::lock_guard<std::mutex> guard(table_lock);
  table()[handle] = Layer{packed, bias};
}

void forget_packed_linear(int64_t handle) {
  std::lock_guard<std::mutex> guard(table_lock);
  table().erase(handle);
}

at::Tensor packed_linear(const at::Tensor& x, int64_t handle) {
  Layer layer;
  {
    std::lock_guard<std::mutex> guard(table_lock);
    const auto it = table().find(handle);
    TORCH_CHECK(it != table().end(), "packed_linear: no packed layer number ", handle);
    layer = it->second;
  }
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, layer.packed, layer.bias, c10::string_view("none"),
                          c10::List<std::optional<at::Scalar>>(), c10::string_view("")};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(arborlm, m) {
  m.def("packed_linear(Tensor x, int handle) -> Tensor");
  m.def("register_packed_linear(int handle, Tensor packed, Tensor? bias) -> ()");
  m.def("forget_packed_linear(int handle) -> ()");
}

TORCH_LIBRARY_IMPL(arborlm, CPU, m) {
  m.impl("packed_linear", &packed_linear);
}

TORCH_LIBRARY_IMPL(arborlm, CatchAll, m) {
  m.impl("register_packed_linear", &register_packed_linear);
  m.impl("forget_packed_linear", &forget_packed_linear);
}
