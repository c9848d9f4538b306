// Roots, root gradients and inputs -> BackwardRequest, with stock's checks in
// stock's order (THPEngine_run_backward). See backward_request.h.

#include "engine/backward_request.h"

#include <ATen/LegacyBatchedTensorImpl.h>
#include <ATen/LegacyVmapMode.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils.h>
#include <torch/csrc/utils/python_numbers.h>

#include <variant>

namespace torch_ext {
namespace {

// A root or an input as a call names it: a tensor, or the edge of a
// torch.autograd.graph.GradientEdge.
using GraphEndpoint = std::variant<at::Tensor, Edge>;

void check_not_batched(const at::Tensor& tensor, bool is_root, size_t i) {
  TORCH_CHECK(
      !at::isBatchedTensor(tensor),
      "torch.autograd.grad(outputs, inputs, grad_outputs) called inside ",
      "torch.vmap. We do not support the case where any ",
      is_root ? "outputs" : "inputs",
      " are vmapped tensors (",
      is_root ? "output " : "input ",
      i,
      " is being vmapped over). Please "
      "call autograd.grad() outside torch.vmap or file a bug report "
      "with your use case.");
}

// Adds roots, each followed by its gradient, then inputs, checking each as
// stock does at the same point.
class RequestBuilder {
 public:
  RequestBuilder(
      size_t num_roots,
      size_t num_root_grads,
      CallOptions options,
      bool allow_unreachable) {
    TORCH_CHECK(
        num_roots == num_root_grads,
        "got ",
        num_roots,
        " tensors and ",
        num_root_grads,
        " gradients");
    // accumulate_grad: the user called backward() rather than grad().
    TORCH_CHECK(
        !options.accumulate_grad ||
            at::impl::VmapMode::current_vmap_level() == 0,
        "backward() called inside torch.vmap. This is not supported, "
        "please call backward() outside torch.vmap or instead use "
        "torch.autograd.grad inside torch.vmap");
    request_.options = options;
    request_.allow_unreachable = allow_unreachable;
    request_.roots.reserve(num_roots);
    request_.root_grads.reserve(num_roots);
  }

  void add_root(const GraphEndpoint& root) {
    const size_t i = request_.roots.size();
    last_root_tensor_ = std::nullopt;
    if (const auto* tensor = std::get_if<at::Tensor>(&root)) {
      check_not_batched(*tensor, /*is_root=*/true, i);
      last_root_tensor_ = *tensor;
      request_.roots.push_back(torch::autograd::impl::gradient_edge(*tensor));
    } else {
      request_.roots.push_back(std::get<Edge>(root));
    }
    TORCH_CHECK(
        request_.roots.back().function,
        "element ",
        i,
        " of tensors does not require grad and does not have a grad_fn");
  }

  // The gradient of the root added last; nullopt for None.
  void add_root_grad(std::optional<at::Tensor> grad) {
    const size_t i = request_.root_grads.size();
    if (!grad.has_value()) {
      TORCH_CHECK(
          last_root_tensor_.has_value(),
          "element ",
          i,
          " of gradients tuple is None, but the corresponding output is a GradientEdge."
          "This is not supported.");
      TORCH_CHECK(
          !last_root_tensor_->requires_grad(),
          "element ",
          i,
          " of gradients tuple is None, but the corresponding Tensor requires grad");
    }
    request_.root_grads.push_back(grad.has_value() ? *grad : at::Tensor());
  }

  void expect_inputs(size_t count) {
    request_.has_inputs = true;
    request_.inputs.reserve(count);
  }

  void add_input(const GraphEndpoint& input) {
    if (const auto* tensor = std::get_if<at::Tensor>(&input)) {
      check_not_batched(*tensor, /*is_root=*/false, request_.inputs.size());
      request_.inputs.push_back(
          input_edge(*tensor, request_.options.accumulate_grad));
    } else {
      request_.inputs.push_back(std::get<Edge>(input));
    }
  }

  BackwardRequest finish(std::vector<PriorityOverride> priority_overrides) {
    request_.priority_overrides = std::move(priority_overrides);
    return std::move(request_);
  }

 private:
  BackwardRequest request_;
  std::optional<at::Tensor> last_root_tensor_;
};

c10::intrusive_ptr<Node> node_of(PyObject* obj) {
  if (THPFunction_Check(obj)) {
    return reinterpret_cast<THPFunction*>(obj)->cdata;
  }
  if (torch::autograd::THPCppFunction_Check(obj)) {
    return reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata;
  }
  return {};
}

// A Tensor or a GradientEdge; nullopt for anything else.
std::optional<GraphEndpoint> endpoint_of(PyObject* obj) {
  if (THPVariable_Check(obj)) {
    return THPVariable_Unpack(obj);
  }
  if (!PyObject_IsInstance(obj, THPGradientEdgeClass)) {
    return std::nullopt;
  }
  PyObject* grad_fn = PyTuple_GetItem(obj, 0);
  const auto output_nr = THPUtils_unpackLong(PyTuple_GetItem(obj, 1));
  auto node = node_of(grad_fn);
  TORCH_CHECK(
      node,
      "GradientEdge's first object must be an autograd.graph.Node but got ",
      THPUtils_typename(grad_fn));
  return Edge(std::move(node), static_cast<uint32_t>(output_nr));
}

} // namespace

// [(node, priority, propagate), ...] as built by torch_ext.priority.
std::vector<PriorityOverride> parse_priority_overrides(PyObject* overrides) {
  std::vector<PriorityOverride> parsed;
  if (overrides == nullptr || overrides == Py_None) {
    return parsed;
  }
  THPObjectPtr items{
      PySequence_Fast(overrides, "priorities must be a sequence")};
  if (!items) {
    throw python_error();
  }
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(items.get());
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(items.get(), i);
    TORCH_CHECK_TYPE(
        PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 3,
        "priorities must hold (node, priority, propagate) tuples");
    NodePriority priority;
    priority.priority = THPUtils_unpackLong(PyTuple_GET_ITEM(item, 1));
    priority.propagate = PyObject_IsTrue(PyTuple_GET_ITEM(item, 2)) == 1;
    parsed.push_back({checked_node_of(PyTuple_GET_ITEM(item, 0)), priority});
  }
  return parsed;
}

// PythonEngine::execute refuses to run while the GIL is held (nodes written
// in Python take it themselves). Python entry points hold it; the dispatcher
// may call the ops with or without it.
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

edge_list gradient_edges_from_python(PyObject* tuple) {
  edge_list edges;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); ++i) {
    PyObject* item = PyTuple_GET_ITEM(tuple, i);
    TORCH_CHECK_TYPE(
        !THPVariable_Check(item) && endpoint_of(item).has_value(),
        "expected a torch.autograd.graph.GradientEdge, but got ",
        THPUtils_typename(item));
    edges.push_back(std::get<Edge>(*endpoint_of(item)));
  }
  return edges;
}

PyObject* wrap_tensors(const variable_list& tensors) {
  THPObjectPtr result{PyTuple_New(static_cast<Py_ssize_t>(tensors.size()))};
  if (!result) {
    return nullptr;
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    PyTuple_SET_ITEM(
        result.get(),
        static_cast<Py_ssize_t>(i),
        THPVariable_Wrap(tensors[i]));
  }
  return result.release();
}

c10::intrusive_ptr<Node> checked_node_of(PyObject* obj) {
  auto node = node_of(obj);
  TORCH_CHECK_TYPE(
      node,
      "expected a torch.autograd.graph.Node, but got ",
      THPUtils_typename(obj));
  return node;
}

BackwardRequest request_from_python(
    PyObject* tensors,
    PyObject* grad_tensors,
    PyObject* inputs,
    CallOptions options,
    bool allow_unreachable,
    PyObject* priorities) {
  TORCH_CHECK(
      PyTuple_Check(tensors),
      "tensors argument is expected to be a tuple, but got ",
      THPUtils_typename(tensors));
  TORCH_CHECK(
      PyTuple_Check(grad_tensors),
      "grad_tensors argument is expected to be a tuple, but got ",
      THPUtils_typename(grad_tensors));
  const Py_ssize_t num_tensors = PyTuple_GET_SIZE(tensors);
  RequestBuilder builder(
      num_tensors,
      PyTuple_GET_SIZE(grad_tensors),
      options,
      allow_unreachable);
  for (Py_ssize_t i = 0; i < num_tensors; ++i) {
    auto root = endpoint_of(PyTuple_GET_ITEM(tensors, i));
    TORCH_CHECK(
        root.has_value(),
        "element ",
        i,
        " of tensors tuple is neither a Tensor nor a GradientEdge");
    builder.add_root(*root);
    PyObject* grad = PyTuple_GET_ITEM(grad_tensors, i);
    TORCH_CHECK(
        THPVariable_Check(grad) || grad == Py_None,
        "element ",
        i,
        " of gradients tuple is not a Tensor or None");
    builder.add_root_grad(
        grad == Py_None ? std::nullopt
                        : std::optional<at::Tensor>(THPVariable_Unpack(grad)));
  }
  if (inputs != nullptr) {
    TORCH_CHECK(
        PyTuple_CheckExact(inputs),
        "inputs to run_backward must be a tuple");
    const Py_ssize_t num_inputs = PyTuple_GET_SIZE(inputs);
    builder.expect_inputs(num_inputs);
    for (Py_ssize_t i = 0; i < num_inputs; ++i) {
      PyObject* input_obj = PyTuple_GET_ITEM(inputs, i);
      auto input = endpoint_of(input_obj);
      TORCH_CHECK(
          input.has_value(),
          "all inputs have to be Tensors or GradientEdges, but got ",
          THPUtils_typename(input_obj));
      builder.add_input(*input);
    }
  }
  return builder.finish(parse_priority_overrides(priorities));
}

BackwardRequest request_from_tensors(
    at::TensorList roots,
    const c10::List<std::optional<at::Tensor>>& root_grads,
    const std::optional<at::TensorList>& inputs,
    CallOptions options,
    bool allow_unreachable) {
  RequestBuilder builder(
      roots.size(),
      root_grads.size(),
      options,
      allow_unreachable);
  for (size_t i = 0; i < roots.size(); ++i) {
    builder.add_root(roots[i]);
    builder.add_root_grad(root_grads.get(i));
  }
  if (inputs.has_value()) {
    builder.expect_inputs(inputs->size());
    for (const auto& input : *inputs) {
      builder.add_input(input);
    }
  }
  return builder.finish({});
}

variable_list run(BackwardRequest request) {
  variable_list results;
  {
    ReleaseGilIfHeld no_gil;
    results = run_backward(
        request.roots,
        std::move(request.root_grads),
        request.inputs,
        request.options,
        std::move(request.priority_overrides));
  }
  if (!request.options.accumulate_grad && request.has_inputs) {
    for (size_t i = 0; i < results.size(); ++i) {
      TORCH_CHECK(
          request.allow_unreachable || results[i].defined(),
          "The differentiated Tensor at index ",
          i,
          " appears to not have been used in the graph. Set allow_unused=True "
          "if this is the desired behavior.");
    }
  }
  return results;
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
