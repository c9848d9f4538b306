#pragma once

// Collectives get an automatic backward priority: their gradient
// communication is what the rest of backward should overlap, so the engine
// drives to their nodes first (propagating, like torch_ext.launch_first, but
// below it so an explicit launch_first still wins).

#include <torch/csrc/autograd/function.h>

#include <cstdint>

namespace torch_ext {

// Below LAUNCH_FIRST (INT64_MAX), above anything a user would pick by hand.
inline constexpr int64_t kCollectivePriority = int64_t{1} << 62;

// Whether `fn` is the backward node of a collective: one of torch_ext's
// collective ops (torch_ext::all_to_all_single, all_reduce,
// all_reduce_coalesced, reduce_scatter_tensor, all_gather_into_tensor) or one of PyTorch's
// functional collectives (_c10d_functional::*, _c10d_functional_autograd::*).
// Both are torch.library ops with a Python autograd formula, so their nodes
// are PyNodes of a generated Function class named after the op. Runs during
// discovery, for every node, without the GIL.
bool is_collective_node(const torch::autograd::Node& fn);

// Whether the collective node `fn` hands its result to the engine in flight
// (BackwardCall::defer_wait_to_first_use): torch_ext's own collective ops.
bool defers_its_wait(const torch::autograd::Node& fn);

// `example` is the node of a Python autograd.Function (a PyNode), whose type
// is_collective_node must recognise.
void remember_python_node_type(const torch::autograd::Node& example);

// Switch for the automatic priority (on by default).
void set_auto_collective_priority(bool enabled);
bool auto_collective_priority();

} // namespace torch_ext
