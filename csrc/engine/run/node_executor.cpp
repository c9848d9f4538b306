// Executor: runs one node and routes its outputs, in stock's order:
// tensor pre-hooks -> retains_grad hooks -> node pre-hooks ->
// will_release_variables -> apply -> validate_outputs -> post hooks ->
// release_variables -> deliver each output to its next edge's input buffer.
// (Engine::evaluate_function and call_function in engine.cpp.) The steps it
// shares with lane nodes are in node_steps.h; a gradient into an input the
// plan orders goes through OrderedDelivery (ordered_delivery.h); lane nodes
// are run_loop.cpp's. Per node, each feature the call holds
// (backward_call.h) costs a test of a bool, a flag of the node's slot or a
// null pointer when it is off.

#include "engine/host_interface.h"
#include "engine/planned_collective_start.h"
#include "engine/run/backward_call.h"
#include "engine/run/node_steps.h"
#include "engine/run/running_node.h"

#include <ATen/DeviceAccelerator.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_is_any_true.h>
#include <ATen/ops/isnan.h>
#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/graph_task.h>

namespace torch_ext {
namespace {

using torch::autograd::AnomalyMode;

variable_list apply_and_post_hooks(
    Node& fn,
    variable_list&& inputs,
    bool keep_graph) {
  if (!keep_graph) {
    fn.will_release_variables();
  }
  const bool has_post_hooks = !fn.post_hooks().empty();
  variable_list outputs;
  if (has_post_hooks) {
    // Post hooks receive the inputs, so keep a copy. AccumulateGrad steals an
    // incoming gradient only when its refcount is at most 1 + has_post_hooks
    // (accumulate_grad.cpp), which is exactly this one extra reference.
    auto inputs_copy = inputs;
    outputs = fn(std::move(inputs_copy));
  } else {
    outputs = fn(std::move(inputs));
  }
  return validate_and_post_hooks(
      fn,
      std::move(outputs),
      inputs,
      has_post_hooks);
}

variable_list call_function(
    Node& fn,
    variable_list&& buffered,
    bool keep_graph) {
  // Owned here, as stock's call_function owns its inputs: whatever apply()
  // left of them is freed when this returns, before release_variables and
  // before the outputs are delivered.
  variable_list inputs = std::move(buffered);
  call_hooks_before_apply(fn, inputs);
  return apply_and_post_hooks(fn, std::move(inputs), keep_graph);
}

void check_outputs_for_nan(Node& fn, const variable_list& outputs) {
  at::AutoGradMode grad_mode(false);
  for (size_t i = 0; i < outputs.size(); ++i) {
    const auto& output = outputs[i];
    at::OptionalDeviceGuard guard(device_of(output));
    TORCH_CHECK(
        !output.defined() || !at::isnan(output)._is_any_true().item<bool>(),
        "Function '",
        fn.name(),
        "' returned nan values in its ",
        i,
        "th output.");
  }
}

// Before a node reads its inputs, make its stream wait for the streams that
// produced them (InputBuffer::add recorded the events). Inlined by hand: once
// execute_node had a traced and an untraced instantiation, GCC stopped
// inlining it (callgrind: +4 instructions per node on a CPU chain).
C10_ALWAYS_INLINE void wait_for_ready_inputs(
    InputBuffer& inputs,
    const std::optional<c10::Stream>& node_stream) {
  for (size_t pos = 0; pos < inputs.ready_events.size(); ++pos) {
    if (!inputs.buffer[pos].defined() ||
        !at::accelerator::isAccelerator(inputs.buffer[pos].device().type())) {
      continue;
    }
    const auto& ready_stream = inputs.ready_streams[pos];
    TORCH_INTERNAL_ASSERT(ready_stream && node_stream);
    if (*node_stream != *ready_stream) {
      TORCH_INTERNAL_ASSERT(inputs.ready_events[pos]);
      node_stream->wait(inputs.ready_events[pos].value());
    }
  }
}

void prepare_for_accelerator_grad(InputBuffer& inputs, const at::Tensor& grad) {
  // is_cpu() first: isAccelerator asks getAccelerator, ~130 instructions.
  if (inputs.ready_events.size() == inputs.buffer.size() || !grad.defined() ||
      grad.is_cpu() || !at::accelerator::isAccelerator(grad.device().type())) {
    return;
  }
  const size_t n = inputs.buffer.size();
  inputs.opt_accum_streams.resize(n);
  inputs.ready_events.resize(n);
  inputs.ready_streams.resize(n);
}

// ctx.needs_input_grad of a custom Python Function, narrowed for the pass
// while the node runs (GraphPlan::narrows_needs_input_grad).
class NarrowedNeedsInputGrad {
 public:
  NarrowedNeedsInputGrad(Node& fn, bool narrow)
      : fn_(fn),
        token_(narrow ? host().narrow_needs_input_grad(fn) : nullptr) {}
  ~NarrowedNeedsInputGrad() {
    if (token_ != nullptr) {
      host().restore_needs_input_grad(fn_, token_);
    }
  }
  NarrowedNeedsInputGrad(const NarrowedNeedsInputGrad&) = delete;
  NarrowedNeedsInputGrad& operator=(const NarrowedNeedsInputGrad&) = delete;

 private:
  Node& fn_;
  void* token_;
};

} // namespace

ReadyNode BackwardCall::ready_key(int32_t target) const {
  return torch_ext::ready_key(
      plan_,
      target,
      plan_.slots[target].has_pending_wait);
}

void BackwardCall::add_to_input(
    int32_t target,
    uint32_t input_nr,
    at::Tensor&& grad,
    const std::optional<c10::Stream>& producer_stream) {
  NodeSlot& slot = plan_.slots[target];
  InputBuffer& inputs = buffer_of(slot);
  if (slot.has_pending_wait && inputs.buffer[input_nr].defined()) {
    // Accumulating reads both gradients.
    deferred_waits_.wait_for(target);
  }
  prepare_for_accelerator_grad(inputs, grad);
  inputs.add(
      input_nr,
      std::move(grad),
      producer_stream,
      stream_of(*slot.fn),
      slot.fn);
}

void BackwardCall::deliver(
    int32_t target,
    uint32_t input_nr,
    at::Tensor&& grad,
    const std::optional<c10::Stream>& producer_stream,
    int32_t edge) {
  NodeSlot& slot = plan_.slots[target];
  const bool ready = --slot.pending_edges == 0;
  if (!slot.inputs.has_value()) {
    if (!slot.should_execute()) {
      // Off every path to an input of grad()/backward(inputs=); a pending
      // result here is waited on at the end of the call.
      return;
    }
    open_buffer(slot, variable_list(slot.fn->num_inputs()));
  }
  if (deferred_waits_.any()) {
    deferred_waits_.note_delivery(target, grad);
  }
  const int32_t ordered = edge == kNoEdge || plan_.ordered_input_of_edge.empty()
      ? kNoSlot
      : plan_.ordered_input_of_edge[edge];
  if (ordered == kNoSlot) {
    add_to_input(target, input_nr, std::move(grad), producer_stream);
  } else {
    ordered_delivery_.arrive(
        ordered,
        plan_.stock_rank_of_edge[edge],
        std::move(grad),
        producer_stream,
        ready,
        [&](at::Tensor&& in_turn, const std::optional<c10::Stream>& stream) {
          add_to_input(target, input_nr, std::move(in_turn), stream);
        });
  }
  if (ready) {
    ready_.push(ready_key(target));
  }
}

void BackwardCall::capture(
    int32_t index,
    const variable_list& seen,
    const std::optional<c10::Stream>& node_stream) {
  for (size_t c = plan_.slots[index].first_capture;
       c < plan_.captures.size() && plan_.captures[c].slot == index;
       ++c) {
    const Capture& capture = plan_.captures[c];
    captured_[capture.output_index] = seen[capture.input_nr];
    if (node_stream) {
      leaf_streams_.insert(*node_stream);
    }
  }
}

std::optional<variable_list> BackwardCall::run_node_action(
    int32_t index,
    variable_list&& buffered,
    const std::optional<c10::Stream>& node_stream) {
  NodeSlot& slot = plan_.slots[index];
  Node& fn = *slot.fn;
  const bool keep_graph = options_.keep_graph;
  if (!slot.delivers_outputs()) {
    // Captured but not run: its tensor pre-hooks still see the gradient
    // (stock NOTE [Hooks ordering]).
    call_tensor_pre_hooks(fn, buffered);
    capture(index, buffered, node_stream);
    if (slot.action == NodeAction::kCaptureAndKeep) {
      // Its node pre-hooks run now, and the later pass runs only apply():
      // every hook runs once across the passes.
      call_pre_hooks(fn, buffered);
      split_pass_.kept(slot.kept).inputs = std::move(buffered);
    }
    return std::nullopt;
  }
  if (slot.first_capture != kNoSlot) {
    // Needed and captured: the capture sees the gradient before its hooks,
    // which run in call_function.
    capture(index, buffered, node_stream);
  }
  split_pass_.before_node(fn);
  // A collective's backward formula may hand its in-flight result to this
  // call (defer_wait_to_first_use) while the node runs.
  const RunningNode running{this, &fn};
  RunningNodeScope running_scope(running);
  switch (slot.action) {
    case NodeAction::kRun: {
      if (split_pass_.takes_accumulation(fn, buffered)) {
        return variable_list(); // what an AccumulateGrad returns
      }
      NarrowedNeedsInputGrad narrowed(fn, plan_.narrows_needs_input_grad);
      variable_list outputs;
      if (slot.collective || slot.collective_wait) {
        try {
          PlannedCollectiveStart start(
              progress_report_.progress_of(index),
              turns_.turn_of(index));
          outputs = call_function(fn, std::move(buffered), keep_graph);
          start.started();
        } catch (...) {
          std::rethrow_exception(
              host().name_collective_node_in_error(
                  std::current_exception(),
                  fn,
                  /*in_lane=*/false));
        }
      } else {
        outputs = call_function(fn, std::move(buffered), keep_graph);
      }
      release_unless_kept(fn, keep_graph);
      return outputs;
    }
    case NodeAction::kRunAndKeep:
      return run_and_keep(index, std::move(buffered));
    case NodeAction::kResumeKept: {
      KeptNode& kept = split_pass_.kept(slot.kept);
      if (kept.outputs.has_value()) {
        variable_list outputs = std::move(*kept.outputs);
        kept.outputs.reset();
        return outputs;
      }
      // Its pre-hooks ran in the earlier pass, on these same gradients.
      TORCH_INTERNAL_ASSERT(kept.inputs.has_value());
      variable_list inputs = std::move(*kept.inputs);
      kept.inputs.reset();
      NarrowedNeedsInputGrad narrowed(fn, plan_.narrows_needs_input_grad);
      variable_list outputs =
          apply_and_post_hooks(fn, std::move(inputs), keep_graph);
      release_unless_kept(fn, keep_graph);
      return outputs;
    }
    case NodeAction::kCaptureOnly:
    case NodeAction::kCaptureAndKeep:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled node action");
}

variable_list BackwardCall::run_and_keep(
    int32_t index,
    variable_list&& buffered) {
  const NodeSlot& slot = plan_.slots[index];
  Node& fn = *slot.fn;
  KeptNode& kept = split_pass_.kept(slot.kept);
  // Its pre-hooks run once, here; the later pass may run apply() again on
  // the same gradients, so its saved variables stay.
  variable_list inputs = std::move(buffered);
  call_hooks_before_apply(fn, inputs);
  variable_list inputs_for_later_pass = inputs;
  variable_list outputs;
  {
    NarrowedNeedsInputGrad narrowed(fn, plan_.narrows_needs_input_grad);
    outputs = apply_and_post_hooks(fn, std::move(inputs), /*keep_graph=*/true);
  }
  auto for_later_pass = [&](size_t i) {
    return plan_.later_pass_edge[slot.first_edge + i] != 0;
  };
  // A gradient into a node that only captures for the later pass is
  // delivered now, but is the later pass's work all the same.
  auto later_side = [&](size_t i) {
    const int32_t target = plan_.target_of(index, i);
    return for_later_pass(i) ||
        (target != kNoSlot &&
         plan_.slots[target].action == NodeAction::kCaptureAndKeep);
  };
  bool later_side_complete = true;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (later_side(i) && !outputs[i].defined()) {
      later_side_complete = false;
    }
  }
  if (later_side_complete) {
    // It computed the later pass's gradients already (a custom Function
    // that ignores what it is asked for, pytorch#174017): keep them, and the
    // later pass does not run it again.
    variable_list kept_outputs(outputs.size());
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (for_later_pass(i)) {
        kept_outputs[i] = std::move(outputs[i]);
      }
    }
    kept.outputs = std::move(kept_outputs);
    release_unless_kept(fn, options_.keep_graph);
  } else {
    // Partial: the later pass computes every one of them again.
    kept.inputs = std::move(inputs_for_later_pass);
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (for_later_pass(i)) {
        outputs[i] = at::Tensor();
      }
    }
  }
  return outputs;
}

template <bool kTraced>
void BackwardCall::execute_node(int32_t index) {
  NodeSlot& slot = plan_.slots[index];
  Node& fn = *slot.fn;
  InputBuffer inputs = take_buffer(slot);

  CurrentNodeGuard current_node(current_node_slot_, fn);
  // While tracing, the node's effective priority is its profiler event's one
  // input (torch.profiler with record_shapes=True shows it among the
  // "Concrete Inputs").
  c10::IValue traced_priority;
  if constexpr (kTraced) {
    traced_priority = plan_.priority.empty() ? 0 : plan_.priority[index];
  }
  // RECORD_FUNCTION's guard, built only when a callback (the profiler)
  // wants it, as Node::operator() does: constructing and destroying an
  // inactive RecordFunction cost ~140 instructions per node (callgrind).
  std::optional<at::RecordFunction> record;
  if (auto callbacks =
          at::getStepCallbacksUnlessEmpty(at::RecordScope::FUNCTION);
      C10_UNLIKELY(callbacks.has_value())) {
    record.emplace(std::move(*callbacks));
    ::at::detail::record_function_with_scope(
        *record,
        c10::str("autograd::engine::evaluate_function: ", fn.name()),
        kTraced ? c10::ArrayRef<const c10::IValue>(traced_priority)
                : c10::ArrayRef<const c10::IValue>());
  }
  int32_t trace_event = trace::kNoEvent;
  if constexpr (kTraced) {
    trace_event = begin_node_event(*tracing_.recorder(), plan_, index);
    tracing_.running_node_event = trace_event;
  }
  trace::EndOnExit end_trace_event(
      kTraced ? tracing_.recorder() : nullptr,
      trace_event);

  enter_task_state();

  auto node_stream = inputs.opt_overridden_consumer_stream.has_value()
      ? inputs.opt_overridden_consumer_stream
      : stream_of(fn);
  c10::OptionalStreamGuard node_stream_guard{node_stream};
  wait_for_ready_inputs(inputs, node_stream);
  if (C10_UNLIKELY(slot.runs_in_lane) && node_stream.has_value() &&
      turns_.takes_turns()) {
    // A lane node on an accelerator: its collective is issued on the
    // lane's side stream, so the streams of the nodes run after it do not
    // wait for the communication; its outputs carry that stream, and their
    // readers wait on it through their input buffers' events.
    // Its group is not needed (one side stream per device), but asking
    // refuses one the engine can see is unsafe, as on CPU.
    host().lane_group_key(fn);
    node_stream = lanes_.move_to_side_stream(*node_stream, inputs.buffer);
    node_stream_guard.reset_stream(*node_stream);
  }
  if (slot.has_pending_wait) {
    // A collective's result arrived here in flight; this is its first reader.
    deferred_waits_.wait_for(index);
  }

  std::optional<variable_list> ran =
      run_node_action(index, std::move(inputs.buffer), node_stream);
  if (!ran.has_value()) {
    return;
  }
  deliver_outputs(index, *ran, node_stream);
}

template void BackwardCall::execute_node<false>(int32_t index);
template void BackwardCall::execute_node<true>(int32_t index);

void BackwardCall::deliver_outputs(
    int32_t index,
    variable_list& outputs,
    const std::optional<c10::Stream>& node_stream) {
  const NodeSlot& slot = plan_.slots[index];
  Node& fn = *slot.fn;
  if (outputs.empty()) {
    // A leaf (AccumulateGrad): its stream wrote .grad.
    if (node_stream) {
      leaf_streams_.insert(*node_stream);
    }
    return;
  }
  if (AnomalyMode::is_enabled() && AnomalyMode::should_check_nan()) {
    check_outputs_for_nan(fn, outputs);
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    const int32_t target = plan_.target_of(index, i);
    if (target == kNoSlot) {
      continue;
    }
    deliver(
        target,
        fn.next_edge(i).input_nr,
        std::move(outputs[i]),
        node_stream,
        static_cast<int32_t>(slot.first_edge + i));
  }
}

} // namespace torch_ext
