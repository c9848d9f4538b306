#pragma once

// What this thread runs for torch_ext right now: the node the executor runs
// (node_executor.cpp sets it around every node) and the call it belongs to.
// The run layer's face to the bindings, which need no more of BackwardCall:
// a collective's backward formula hands its in-flight result to the engine
// here (deferred_waits.cpp), and torch_ext._current_execution_order asks for
// the running call's order.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <optional>
#include <utility>
#include <vector>

namespace torch_ext {

class BackwardCall;
using torch::autograd::Node;

struct RunningNode {
  BackwardCall* call;
  Node* node;
};

namespace detail {
// Constant-initialised, so every file reads it directly, with no thread-local
// wrapper call.
inline thread_local const RunningNode* running_node = nullptr;
} // namespace detail

// The innermost node running on this thread, or null.
inline const RunningNode* running_node_now() {
  return detail::running_node;
}

// Makes `node` the running node for a scope: the executor, around every
// node's hooks and apply().
class RunningNodeScope {
 public:
  explicit RunningNodeScope(const RunningNode& node)
      : previous_(std::exchange(detail::running_node, &node)) {}
  ~RunningNodeScope() {
    detail::running_node = previous_;
  }
  RunningNodeScope(const RunningNodeScope&) = delete;
  RunningNodeScope& operator=(const RunningNodeScope&) = delete;

 private:
  const RunningNode* previous_;
};

// The running node, if this thread runs it under its call's host task right
// now; null outside torch_ext, and in a backward nested in a node (stock's
// engine, reentrant checkpoint), which makes its own graph task current. The
// one test of "this thread is under my host task" (run_loop.cpp). Portable:
// the host task is recognised by its node set, not through the current-node
// slot (current_node.cpp).
const RunningNode* running_node_under_host_task();

// The nodes of the call whose node this thread runs under its host task, in
// the order the call runs them (replayed from its plan); nullopt when there
// is no such call.
std::optional<std::vector<Node*>> running_call_planned_order();

// Called by a collective's backward formula while a torch_ext call runs it as
// a node: `result` is the collective's output, still in flight. The engine
// waits on it just before the first thing that reads it (the node it is
// delivered to, an accumulation into the same input, or the end of the
// call), so every node scheduled in between overlaps the communication.
// Returns false, and records nothing, when this thread is not running a
// torch_ext node right now (stock engine, a compiled graph, a nested
// backward); the caller must then wait itself (deferred_waits.cpp).
bool defer_wait_to_first_use(const at::Tensor& result);

} // namespace torch_ext
