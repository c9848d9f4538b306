// Roots and inputs of a call -> graph edges, with stock's checks and
// messages (THPEngine_run_backward in python_engine.cpp).

#include "engine_api.h"

#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/variable.h>

namespace torch_ext {

Edge root_edge(const at::Tensor& root, size_t index) {
  Edge edge = torch::autograd::impl::gradient_edge(root);
  TORCH_CHECK(
      edge.function,
      "element ",
      index,
      " of tensors does not require grad and does not have a grad_fn");
  return edge;
}

Edge input_edge(const at::Tensor& input, bool accumulate_grad) {
  auto grad_fn = input.grad_fn();
  if (!grad_fn) {
    grad_fn = torch::autograd::impl::try_get_grad_accumulator(input);
  }
  if (accumulate_grad) {
    input.retain_grad();
  }
  TORCH_CHECK(
      input.requires_grad(),
      "One of the differentiated Tensors does not require grad");
  if (!grad_fn) {
    // NOTE [ Autograd Unreachable Input ] (stock): an edge to a node of its
    // own, so that edges to nullptr in the graph (e.g. mul by a scalar) are
    // not taken for this input.
    return Edge(c10::make_intrusive<torch::autograd::Identity>(), 0);
  }
  return Edge(std::move(grad_fn), input.output_nr());
}

} // namespace torch_ext
