#pragma once

// The engine's entry point, shared by the torch.library op registrations
// (ops.cpp) and the Python bindings (python_bindings.cpp).

#include "engine/backward_call.h"

namespace torch_ext {

// Runs backward from `roots` (seeded with `root_grads`) on torch_ext's engine,
// inside one stock graph task, on the calling thread; the caller must not hold
// the GIL. Semantics are those of torch::autograd::Engine::execute: with
// `inputs` empty, every reachable node runs; otherwise only nodes on a path to
// an input run, and grad() (accumulate_grad false) returns the gradient of
// each input, undefined where none arrived. `priority_overrides` apply to
// this call only, over the priority table.
variable_list run_backward(
    const edge_list& roots,
    variable_list root_grads,
    const edge_list& inputs,
    CallOptions options,
    std::vector<PriorityOverride> priority_overrides = {});

// Anomaly mode reports the failing node's forward stack. The stack lives in
// Python (PyAnomalyMetadata); the bindings install a copier so this C++ core
// needs no Python headers.
using AnomalyMetadataCopier = void (*)(Node& from, Node& to);
void set_anomaly_metadata_copier(AnomalyMetadataCopier copier);

} // namespace torch_ext
