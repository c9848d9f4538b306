#pragma once

// One request builder for every entry point into torch_ext's engine:
// torch_ext._C.run_backward (torch.autograd's engine call), the ops
// torch.ops.torch_ext.backward/grad and split backward's input pass. Each
// turns its roots, root gradients, inputs and flags into a BackwardRequest
// here, so the checks and messages are stock's, made in stock's order
// (THPEngine_run_backward in torch/csrc/autograd/python_engine.cpp), in one
// place.

#include "engine/engine_api.h"

#include <Python.h>

#include <optional>

namespace torch_ext {

// What the engine runs: validated edges and the call's options.
struct BackwardRequest {
  edge_list roots;
  variable_list root_grads; // undefined for a root that needs none
  edge_list inputs;
  // The call named inputs, even none: grad() returns one gradient each.
  bool has_inputs = false;
  CallOptions options;
  // grad(allow_unused=True): an input no gradient reached is not an error.
  bool allow_unreachable = false;
  std::vector<PriorityOverride> priority_overrides;
};

// torch._C._EngineBase.run_backward's arguments (tensors, grad_tensors,
// inputs, flags) and torch_ext's `priorities`, [(node, priority,
// propagate)]; `inputs` and `priorities` are null when not given.
BackwardRequest request_from_python(
    PyObject* tensors,
    PyObject* grad_tensors,
    PyObject* inputs,
    CallOptions options,
    bool allow_unreachable,
    PyObject* priorities);

// The same from tensors (the ops' schemas): every root and input a Tensor.
BackwardRequest request_from_tensors(
    at::TensorList roots,
    const c10::List<std::optional<at::Tensor>>& root_grads,
    const std::optional<at::TensorList>& inputs,
    CallOptions options,
    bool allow_unreachable);

// Runs `request` on torch_ext's engine, releasing the GIL if the caller holds
// it. For grad() (inputs named, accumulate_grad false): the gradient of each
// input, with stock's error for an unreachable one unless allowed.
variable_list run(BackwardRequest request);

// [(node, priority, propagate), ...] as built by torch_ext.priority.
std::vector<PriorityOverride> parse_priority_overrides(PyObject* overrides);

// The edges of a tuple of torch.autograd.graph.GradientEdges.
edge_list gradient_edges_from_python(PyObject* tuple);

// The edge whose gradient grad()/backward(inputs=) is asked for, as stock's
// run_backward resolves a tensor input: its grad_fn, or its AccumulateGrad if
// it is a leaf, or an edge to a fresh node when it has neither (unreachable).
// backward(inputs=) also retains the gradient of a non-leaf input.
Edge input_edge(const at::Tensor& input, bool accumulate_grad);

// A tuple of the tensors (None for an undefined one).
PyObject* wrap_tensors(const variable_list& tensors);

// The C++ node behind a torch.autograd.graph.Node, or a TypeError.
c10::intrusive_ptr<Node> checked_node_of(PyObject* obj);

} // namespace torch_ext
