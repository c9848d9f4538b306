#pragma once

// Stock's NodeGuard for torch_ext's nodes: where the thread's current
// autograd node lives (current_node.cpp).

#include <torch/csrc/autograd/function.h>

namespace torch_ext {

using torch::autograd::Node;

// The thread's "currently evaluating node" slot of stock's NodeGuard, or null
// when it cannot be located safely (current_node.cpp). `expected_current` is
// the node the host task made current, used to validate the slot.
c10::intrusive_ptr<Node>* current_node_slot(Node* expected_current);

// Whether current_node_slot found and validated the slot: unknown until the
// first torch_ext backward of the process.
enum class CurrentNodeState { kUnknown, kAvailable, kUnavailable };
CurrentNodeState current_node_state();

// TORCH_EXT_CURRENT_NODE=off: never look for the slot (the portable path).
// Set by torch_ext/_loader.py, which parses the variable, before the first
// backward; after it, the first backward's finding stands.
void set_current_node_forced_off(bool off);

} // namespace torch_ext
