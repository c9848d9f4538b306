// Every torch_ext schema, in one TORCH_LIBRARY block: the engine's entry
// points callable as torch.ops.torch_ext.*. Arguments the schema language
// cannot express (GradientEdge roots, Python callables) go through
// python_bindings.cpp instead.

#include "engine_api.h"

#include <torch/library.h>

#include <Python.h>

namespace torch_ext {
namespace {

// PythonEngine::execute refuses to run while the GIL is held (nodes written
// in Python take it themselves). The dispatcher may call these kernels from
// Python with the GIL held; release it for the duration of the call.
class ReleaseGilIfHeld {
 public:
  ReleaseGilIfHeld()
      : saved_(
            Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread()
                                                     : nullptr) {}
  ~ReleaseGilIfHeld() {
    if (saved_ != nullptr) {
      PyEval_RestoreThread(saved_);
    }
  }
  ReleaseGilIfHeld(const ReleaseGilIfHeld&) = delete;
  ReleaseGilIfHeld& operator=(const ReleaseGilIfHeld&) = delete;

 private:
  PyThreadState* saved_;
};

edge_list root_edges(at::TensorList tensors) {
  edge_list roots;
  roots.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    roots.push_back(root_edge(tensors[i], i));
  }
  return roots;
}

variable_list root_gradients(
    at::TensorList tensors,
    const c10::List<std::optional<at::Tensor>>& grad_tensors) {
  TORCH_CHECK(
      tensors.size() == grad_tensors.size(),
      "got ",
      tensors.size(),
      " tensors and ",
      grad_tensors.size(),
      " gradients");
  variable_list grads;
  grads.reserve(grad_tensors.size());
  for (size_t i = 0; i < grad_tensors.size(); ++i) {
    std::optional<at::Tensor> grad = grad_tensors[i];
    if (grad.has_value()) {
      grads.push_back(*grad);
    } else {
      TORCH_CHECK(
          !tensors[i].requires_grad(),
          "element ",
          i,
          " of gradients tuple is None, but the corresponding Tensor requires grad");
      grads.emplace_back();
    }
  }
  return grads;
}

edge_list input_edges(
    const std::optional<at::TensorList>& inputs,
    bool accumulate_grad) {
  edge_list edges;
  if (inputs.has_value()) {
    for (const auto& input : *inputs) {
      edges.push_back(input_edge(input, accumulate_grad));
    }
  }
  return edges;
}

void backward_kernel(
    at::TensorList tensors,
    const c10::List<std::optional<at::Tensor>>& grad_tensors,
    bool retain_graph,
    bool create_graph,
    std::optional<at::TensorList> inputs) {
  auto grads = root_gradients(tensors, grad_tensors);
  auto roots = root_edges(tensors);
  TORCH_CHECK(
      !inputs.has_value() || !inputs->empty(),
      "`inputs` argument to `backward()` cannot be empty.");
  auto input_list = input_edges(inputs, /*accumulate_grad=*/true);
  ReleaseGilIfHeld no_gil;
  run_backward(
      roots,
      std::move(grads),
      input_list,
      {retain_graph, create_graph, /*accumulate_grad=*/true});
}

std::vector<std::optional<at::Tensor>> grad_kernel(
    at::TensorList outputs,
    at::TensorList inputs,
    const c10::List<std::optional<at::Tensor>>& grad_outputs,
    bool retain_graph,
    bool create_graph,
    bool allow_unused) {
  auto grads = root_gradients(outputs, grad_outputs);
  auto roots = root_edges(outputs);
  auto input_list = input_edges(inputs, /*accumulate_grad=*/false);
  variable_list results;
  {
    ReleaseGilIfHeld no_gil;
    results = run_backward(
        roots,
        std::move(grads),
        input_list,
        {retain_graph, create_graph, /*accumulate_grad=*/false});
  }
  std::vector<std::optional<at::Tensor>> returned;
  returned.reserve(results.size());
  for (size_t i = 0; i < results.size(); ++i) {
    TORCH_CHECK(
        allow_unused || results[i].defined(),
        "The differentiated Tensor at index ",
        i,
        " appears to not have been used in the graph. Set allow_unused=True "
        "if this is the desired behavior.");
    if (results[i].defined()) {
      returned.emplace_back(std::move(results[i]));
    } else {
      returned.emplace_back(std::nullopt);
    }
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
