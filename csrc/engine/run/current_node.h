#pragma once

// Stock's NodeGuard for torch_ext's nodes: where the thread's current
// autograd node lives (current_node.cpp).

#include <torch/csrc/autograd/function.h>

namespace torch_ext {

using torch::autograd::Node;

// The calling thread's "currently evaluating node" slot of stock's NodeGuard,
// or null when it cannot be located safely (current_node.cpp).
c10::intrusive_ptr<Node>* current_node_slot();

// Whether the slot was found and validated. Settled by the process's first
// question (this, or current_node_slot), which probes the calling thread's
// slot and leaves it as it was; never kUnknown once returned.
enum class CurrentNodeState { kUnknown, kAvailable, kUnavailable };
CurrentNodeState current_node_state();

// TORCH_EXT_CURRENT_NODE=off: never look for the slot (the portable path).
// Set by torch_ext/_loader.py, which parses the variable, before the first
// question; after it, the first question's finding stands.
void set_current_node_forced_off(bool off);

} // namespace torch_ext
