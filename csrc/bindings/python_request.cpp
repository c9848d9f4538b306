// Python arguments -> BackwardRequest, with stock's checks in stock's order
// (THPEngine_run_backward). See python_request.h.

#include "bindings/python_request.h"
#include "bindings/python_overlap.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils.h>
#include <torch/csrc/utils/python_numbers.h>

namespace torch_ext {
namespace {

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
    PyObject* priorities,
    PyObject* handed) {
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
  return builder.finish(
      {parse_priority_overrides(priorities),
       handed_backward_from_python(handed)});
}

} // namespace torch_ext
