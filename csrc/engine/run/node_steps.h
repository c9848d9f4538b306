#pragma once

// The steps of one node that the executor (node_executor.cpp) and the lane
// nodes (run_loop.cpp) share, in stock's order
// (Engine::evaluate_function and call_function in engine.cpp): hooks before
// apply(), validation and post hooks after it, the current-node guard, the
// release of saved variables, and the node's traced span. Inline: they are
// the executor's per-node path.

#include "engine/plan/graph_plan.h"
#include "engine/trace.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>

#include <sstream>
#include <string>
#include <utility>

namespace torch_ext {

// Whether `fn` has a hook of any kind: what a hook does (read a .grad,
// communicate) cannot be seen, so the passes that hold work back (a batched
// accumulation, the collective order check's verdict) stop before one.
inline bool has_any_hooks(Node& fn) {
  return !fn.tensor_pre_hooks().empty() || !fn.pre_hooks().empty() ||
      !fn.post_hooks().empty() || !fn.retains_grad_hooks().empty() ||
      fn.tensor_post_acc_grad_hooks() != nullptr;
}

// The hooks before apply() replace the gradients in place: passing the
// vector by value through each caller moved it twice per node.
inline void call_tensor_pre_hooks(Node& fn, variable_list& inputs) {
  for (const auto& hook : fn.tensor_pre_hooks()) {
    inputs = (*hook)(inputs);
  }
  for (const auto& [_, hook] : fn.retains_grad_hooks()) {
    inputs = (*hook)(inputs);
  }
}

inline void call_pre_hooks(Node& fn, variable_list& inputs) {
  for (const auto& hook : fn.pre_hooks()) {
    inputs = (*hook)(inputs);
  }
}

inline variable_list call_post_hooks(
    Node& fn,
    variable_list outputs,
    const variable_list& inputs,
    bool had_post_hooks) {
  for (const auto& hook : fn.post_hooks()) {
    if (had_post_hooks) {
      outputs = (*hook)(outputs, inputs);
    } else {
      // A pre-hook or the node itself registered this hook while running.
      variable_list null_inputs;
      outputs = (*hook)(outputs, null_inputs);
    }
  }
  return outputs;
}

inline void call_hooks_before_apply(Node& fn, variable_list& inputs) {
  call_tensor_pre_hooks(fn, inputs);
  call_pre_hooks(fn, inputs);
}

// What follows apply(): its outputs checked against the node's edges, then
// its post hooks, which see `inputs` if they were registered before it ran.
inline variable_list validate_and_post_hooks(
    Node& fn,
    variable_list&& outputs,
    const variable_list& inputs,
    bool has_post_hooks) {
  torch::autograd::validate_outputs(
      fn.next_edges(),
      outputs,
      [&](const std::string& msg) {
        std::ostringstream ss;
        ss << "Function " << fn.name() << " returned an " << msg;
        return std::move(ss).str();
      });
  return call_post_hooks(fn, std::move(outputs), inputs, has_post_hooks);
}

// Saved variables are released after a node ran unless the call keeps the
// graph (retain_graph): the one place that rule is written.
inline void release_unless_kept(Node& fn, bool keep_graph) {
  if (!keep_graph) {
    fn.release_variables();
  }
}

// Stock's NodeGuard: `node` is the current node while it runs.
class CurrentNodeGuard {
 public:
  CurrentNodeGuard(c10::intrusive_ptr<Node>* slot, Node& node) : slot_(slot) {
    if (slot_ != nullptr) {
      previous_ = std::exchange(*slot_, node.getptr());
    }
  }
  ~CurrentNodeGuard() {
    if (slot_ != nullptr) {
      *slot_ = std::move(previous_);
    }
  }
  CurrentNodeGuard(const CurrentNodeGuard&) = delete;
  CurrentNodeGuard& operator=(const CurrentNodeGuard&) = delete;

 private:
  c10::intrusive_ptr<Node>* slot_;
  c10::intrusive_ptr<Node> previous_;
};

// Starts the traced span of the node in `index`: its name, sequence_nr,
// effective priority and where that came from.
inline int32_t begin_node_event(
    trace::CallTrace& trace,
    const GraphPlan& plan,
    int32_t index) {
  const NodeSlot& slot = plan.slots[index];
  // name() of a Python Function's node takes the GIL: paid only while tracing.
  std::string name = slot.fn->name();
  const PrioritySource source = plan.priority_sources.empty()
      ? PrioritySource{}
      : plan.priority_sources[index];
  std::string origin_name;
  if (source.origin != nullptr) {
    origin_name = source.origin->name();
  }
  const int32_t event_index = trace.begin(
      trace::Kind::kNode,
      std::move(name),
      trace::traced_sequence_nr(slot.fn->sequence_nr()));
  trace::Event& event = trace.event(event_index);
  event.collective = slot.collective;
  event.priority = plan.priority.empty() ? 0 : plan.priority[index];
  event.priority_from = source.from;
  event.origin_from = source.origin_from;
  if (source.origin != nullptr) {
    event.origin_name = std::move(origin_name);
    event.origin_sequence_nr =
        trace::traced_sequence_nr(source.origin->sequence_nr());
  }
  return event_index;
}

} // namespace torch_ext
