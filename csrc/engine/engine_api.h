#pragma once

// The engine's entry point, shared by the torch.library op registrations
// (ops.cpp) and the Python bindings (python_bindings.cpp). The engine's
// questions to Python go through engine/host_interface.h.

#include "engine/call_context.h"
#include "engine/call_options.h"

#include <torch/csrc/autograd/function.h>

#include <vector>

namespace torch_ext {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

// Runs backward from `roots` (seeded with `root_grads`) on torch_ext's engine,
// inside one stock graph task, on the calling thread; the caller must not hold
// the GIL. Semantics are those of torch::autograd::Engine::execute: with
// `inputs` empty, every reachable node runs; otherwise only nodes on a path to
// an input run, and grad() (accumulate_grad false) returns the gradient of
// each input, undefined where none arrived. `context` is the call's own
// (call_context.h): its priorities, and the overlap it runs in, if any.
variable_list run_backward(
    const edge_list& roots,
    variable_list root_grads,
    const edge_list& inputs,
    CallOptions options,
    CallContext context = {});

} // namespace torch_ext
