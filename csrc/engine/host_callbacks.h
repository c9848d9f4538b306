#pragma once

// What the engine asks of the language that hosts it: the one interface
// through which engine/ reaches Python. The engine declares it here and
// includes no Python header; the bindings install Python's answers when
// torch_ext._C is imported (PyInit__C, bindings/python_bindings.cpp), before
// any backward runs. Until then, each question has the answer of a process
// without Python: no node is a collective, nothing is narrowed, no check.
//
// Every entry is a plain function pointer, called where the engine needs
// the answer; those that need the GIL take it themselves.

#include "collectives/collective_role.h"

#include <torch/csrc/autograd/function.h>

#include <cstdint>
#include <exception>

namespace torch_ext {

using torch::autograd::Node;
using torch::autograd::variable_list;

// What the collective order check compares across ranks, before a collective
// starts; at the end of a call's collectives `node` is null and `position`
// their count. Adding what the ranks compare is one field here and its
// reading in the bindings (bindings/python_collectives.cpp).
struct CollectiveCheck {
  // The node about to issue the collective; null at the end.
  const Node* node = nullptr;
  // Its place in the call's collective sequence; the count at the end.
  int32_t position = 0;
  // The gradients it was given; null at the end.
  const variable_list* inputs = nullptr;
};

struct HostCallbacks {
  // The collective role of `fn`'s class (collective_role.h), decided once per
  // class and cached: discovery asks for every node, without the GIL.
  CollectiveRole (*collective_role)(const Node& fn) = [](const Node&) {
    return CollectiveRole::kNone;
  };
  // Whether the launch node `fn` hands its result to the engine in flight
  // (BackwardCall::defer_wait_to_first_use): torch_ext's own collective ops.
  bool (*defers_its_wait)(const Node& fn) = [](const Node&) { return false; };
  // The process group whose lane runs the lane node `fn`, as an opaque key.
  // Throws for a group the host can see is unsafe (DDP reducing on it).
  uintptr_t (*lane_group_key)(const Node& fn) = [](const Node&) -> uintptr_t {
    return 0;
  };
  // The collective order check (torch_ext.check_collective_order): whether
  // it is on, and its question, asked before each collective a call issues
  // and once at the end. Throws on a mismatch with the other ranks.
  bool (*collective_check_enabled)() = [] { return false; };
  void (*check_collective)(const CollectiveCheck& check) =
      [](const CollectiveCheck&) {};
  // Throws if a signal handler raised (Ctrl-C), for the engine thread while
  // it waits for a lane.
  void (*raise_if_interrupted)() = [] {};
  // Makes an error raised by the lane node `fn` name it.
  std::exception_ptr (
      *name_lane_node_in_error)(std::exception_ptr error, const Node& fn) =
      [](std::exception_ptr error, const Node&) { return error; };
  // Split backward's passes narrow a custom Function's ctx.needs_input_grad
  // to the gradients the pass computes while its node runs
  // (GraphPlan::narrows_needs_input_grad, pytorch#174017). `narrow` returns
  // a token for `restore`, or null if nothing changed.
  void* (*narrow_needs_input_grad)(Node& fn) = [](Node&) -> void* {
    return nullptr;
  };
  void (*restore_needs_input_grad)(Node& fn, void* token) = [](Node&, void*) {};
  // Anomaly mode: the failing node's forward stack, which lives in the host,
  // copied to the node the host task reports instead (its driver).
  void (*copy_anomaly_metadata)(Node& from, Node& to) = [](Node&, Node&) {};
};

namespace detail {
inline HostCallbacks installed_host_callbacks;
} // namespace detail

// Installs the host's answers; once, at import, before any backward.
inline void install_host_callbacks(const HostCallbacks& callbacks) {
  detail::installed_host_callbacks = callbacks;
}

inline const HostCallbacks& host_callbacks() {
  return detail::installed_host_callbacks;
}

} // namespace torch_ext
