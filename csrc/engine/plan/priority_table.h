#pragma once

// Backward priorities set with torch_ext.set_priority.
//
// Stock's only lever is grad_fn._set_sequence_nr, which rewrites the number the
// profiler uses to link backward nodes to forward ops and boosts one node only
// once it is ready. torch_ext keeps priorities in this table instead: keyed by
// node, never touching sequence_nr, and an entry lives as long as its node.

#include <torch/csrc/autograd/function.h>

#include <c10/util/flat_hash_map.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace torch_ext {

struct NodePriority {
  int64_t priority = 0;
  // Whether every node on a path from the roots to this one runs with at
  // least this priority, so the engine drives straight to it.
  bool propagate = true;
};

void set_node_priority(
    const c10::intrusive_ptr<torch::autograd::Node>& node,
    NodePriority priority);
// Whether the node had a priority.
bool clear_node_priority(torch::autograd::Node* node);
std::optional<NodePriority> node_priority(torch::autograd::Node* node);

// A priority given for one call only (backward(..., priorities=...)); it
// overrides the table's entry for that node.
struct PriorityOverride {
  c10::intrusive_ptr<torch::autograd::Node> node;
  NodePriority priority;
};

// The priorities that apply to one call: the table's live entries, taken
// once under its lock, with `overrides` on top. Discovery then looks every
// node up without locking. Empty in the common case, where taking it costs
// one atomic load.
class CallPriorities {
 public:
  explicit CallPriorities(std::vector<PriorityOverride> overrides);

  bool empty() const {
    return by_node_.empty();
  }

  std::optional<NodePriority> lookup(torch::autograd::Node* node) const;
  // Whether the node's priority is the call's own (an override), for tracing.
  bool is_call_override(torch::autograd::Node* node) const;

 private:
  ska::flat_hash_map<torch::autograd::Node*, NodePriority> by_node_;
  // The nodes the call's overrides name: a handful.
  std::vector<torch::autograd::Node*> overridden_;
  // The nodes in by_node_, alive for the call: a node that died during it
  // could otherwise hand its address, and its priority, to a node that
  // backward creates (create_graph).
  std::vector<c10::intrusive_ptr<torch::autograd::Node>> keep_alive_;
};

} // namespace torch_ext
