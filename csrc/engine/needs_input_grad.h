#pragma once

// How split backward's passes narrow a custom Python Function's
// ctx.needs_input_grad while its node runs: the executor (node_executor.cpp)
// calls these hooks, the Python bindings (python_split.cpp) set them.

#include <torch/csrc/autograd/function.h>

namespace torch_ext {

using torch::autograd::Node;

// Custom Python Functions decide what to compute from ctx.needs_input_grad,
// fixed when their forward ran, where generated nodes ask the graph task.
// While a plan with narrows_needs_input_grad runs such a node, the bindings
// narrow needs_input_grad to the gradients the pass computes
// (task_should_compute_output), so a Function that honours it computes dW in
// split backward's weight pass only (pytorch#174017). `narrow` returns a
// token for `restore`, or null if nothing changed.
struct NeedsInputGradHooks {
  void* (*narrow)(Node& fn) = nullptr;
  void (*restore)(Node& fn, void* token) = nullptr;
};
void set_needs_input_grad_hooks(NeedsInputGradHooks hooks);

} // namespace torch_ext
