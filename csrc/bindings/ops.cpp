// The engine's entry points as torch.ops.torch_ext.* schemas, in this one
// TORCH_LIBRARY block. The namespace's other ops are registered from Python,
// each kind in one place: the collectives (torch.library.custom_op, with
// their fakes and autograd) in torch_ext/ops/collectives.py, the Triton-backed
// multi-tensor kernels (torch.library.triton_op) in torch_ext/kernels.py; a
// TORCH_LIBRARY_FRAGMENT nowhere. Arguments the schema language cannot
// express (GradientEdge roots, Python callables) go through the Python
// bindings (python_bindings.cpp) instead.

#include "bindings/python_request.h"

#include <torch/library.h>

namespace torch_ext {
namespace {

void backward_kernel(
    at::TensorList tensors,
    const c10::List<std::optional<at::Tensor>>& grad_tensors,
    bool retain_graph,
    bool create_graph,
    std::optional<at::TensorList> inputs) {
  // torch.autograd.backward's own check, made in Python before its engine call.
  TORCH_CHECK(
      !inputs.has_value() || !inputs->empty(),
      "`inputs` argument to `backward()` cannot be empty.");
  run_releasing_gil(request_from_tensors(
      tensors,
      grad_tensors,
      inputs,
      {retain_graph, create_graph, /*accumulate_grad=*/true},
      /*allow_unreachable=*/true));
}

std::vector<std::optional<at::Tensor>> grad_kernel(
    at::TensorList outputs,
    at::TensorList inputs,
    const c10::List<std::optional<at::Tensor>>& grad_outputs,
    bool retain_graph,
    bool create_graph,
    bool allow_unused) {
  variable_list results = run_releasing_gil(request_from_tensors(
      outputs,
      grad_outputs,
      inputs,
      {retain_graph, create_graph, /*accumulate_grad=*/false},
      allow_unused));
  std::vector<std::optional<at::Tensor>> returned;
  returned.reserve(results.size());
  for (auto& result : results) {
    returned.emplace_back(
        result.defined() ? std::optional<at::Tensor>(std::move(result))
                         : std::nullopt);
  }
  return returned;
}

} // namespace

TORCH_LIBRARY(torch_ext, m) {
  m.def(
      "backward(Tensor[] tensors, Tensor?[] grad_tensors, bool retain_graph=False, "
      "bool create_graph=False, Tensor[]? inputs=None) -> ()");
  m.def(
      "grad(Tensor[] outputs, Tensor[] inputs, Tensor?[] grad_outputs, "
      "bool retain_graph=False, bool create_graph=False, bool allow_unused=False) "
      "-> Tensor?[]");
}

// The engine entry points take the autograd graph as it is: they run above
// autograd, like torch.autograd.backward itself.
TORCH_LIBRARY_IMPL(torch_ext, CompositeImplicitAutograd, m) {
  m.impl("backward", backward_kernel);
  m.impl("grad", grad_kernel);
}

} // namespace torch_ext
