// The run loop of one call: the plan (discovered, or given by split
// backward), published to the host task, seeded, then every ready node run
// in the scheduler's order until none is left. Runs inside the host task's
// BackwardDriver (host/host_task.cpp), which it publishes its plan to. A call
// whose collectives take turns (lane nodes, the collective order check) runs
// run_in_sequence instead, below: the run loop of a call whose collectives
// take turns, the same on every rank; and the lane nodes, whose hooks run on
// the engine thread, in the executor's steps (node_steps.h), and whose
// apply() runs on their process group's lane (engine/run/collective_lane.h),
// or, on an accelerator, on a side stream (call_lanes.h).

#include "engine/host/host_task.h"
#include "engine/plan/plan_cache.h"
#include "engine/plan/schedule_replay.h"
#include "engine/run/backward_call.h"
#include "engine/run/current_node.h"
#include "engine/run/node_steps.h"
#include "engine/run/run_call.h"
#include "engine/run/running_node.h"

#include <ATen/DeviceAccelerator.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/input_metadata.h>

namespace torch_ext {
namespace {

// Stock GraphTask::stash_current_streams: the caller's current stream on
// every device that already has a context.
std::vector<c10::Stream> current_accelerator_streams() {
  std::vector<c10::Stream> streams;
  const auto accelerator = at::accelerator::getAccelerator(/*checked=*/false);
  if (!accelerator.has_value()) {
    return streams;
  }
  const c10::impl::VirtualGuardImpl guard{*accelerator};
  const auto num_devices = guard.deviceCount();
  for (c10::DeviceIndex index = 0; index < num_devices; ++index) {
    if (at::globalContext().getAcceleratorHooksInterface().hasPrimaryContext(
            index)) {
      streams.push_back(guard.getStream({*accelerator, index}));
    }
  }
  return streams;
}

} // namespace

std::optional<c10::Stream> producer_stream_of(const at::Tensor& grad) {
  if (!grad.defined()) {
    return std::nullopt;
  }
  return torch::autograd::InputMetadata(grad).stream();
}

BackwardCall::BackwardCall(
    edge_list roots,
    variable_list root_grads,
    edge_list inputs,
    CallOptions options,
    CallContext context)
    : roots_(std::move(roots)),
      root_grads_(std::move(root_grads)),
      inputs_(std::move(inputs)),
      options_(options),
      priorities_(std::move(context.priority_overrides)),
      // Read here, on the caller's thread: past stock's reentrant depth
      // limit the host task runs the driver on a pool thread, whose current
      // streams are not the caller's.
      caller_streams_(current_accelerator_streams()),
      has_accelerator_(
          at::accelerator::getAccelerator(/*checked=*/false).has_value()),
      progress_report_(plan_, std::move(context.beside_forward)) {
  if (!options_.accumulate_grad) {
    captured_.resize(inputs_.size());
  }
  root_streams_.reserve(root_grads_.size());
  for (const auto& grad : root_grads_) {
    root_streams_.push_back(producer_stream_of(grad));
  }
}

BackwardCall::~BackwardCall() = default;

void BackwardCall::run_as_split_pass(SplitPass& pass) {
  plan_ = std::move(pass.plan);
  split_pass_ = SplitPassContext(pass.kept, pass.batch);
  if (!pass.root_streams.empty()) {
    root_streams_ = std::move(pass.root_streams);
  }
  tracing_.set_label(pass.trace_label);
}

variable_list run_call(
    edge_list roots,
    variable_list root_grads,
    edge_list inputs,
    CallOptions options,
    CallContext context,
    SplitPass* pass) {
  // grad()/inputs= and split passes run a subset of the nodes.
  const bool filtered = pass != nullptr || !inputs.empty();
  const bool host_keeps_graph =
      options.keep_graph || (pass != nullptr && pass->host_keeps_graph);
  BackwardCall call(
      std::move(roots),
      std::move(root_grads),
      std::move(inputs),
      options,
      std::move(context));
  if (pass != nullptr) {
    call.run_as_split_pass(*pass);
  }
  run_in_host_task(call, host_keeps_graph, filtered);
  return call.take_captured();
}

void BackwardCall::seed() {
  if (plan_.seeds_roots) {
    seed_roots();
  }
  if (plan_.resumes_kept_nodes) {
    // After the root gradients, as a full backward delivers them before any
    // node runs: the kept nodes become ready and run in the scheduler's
    // order (sequence_nr), their order in a full backward, so every input
    // buffer sums its gradients in the same order. They read what was kept
    // (run_node_action), not a buffer.
    for (size_t s = 0; s < plan_.slots.size(); ++s) {
      NodeSlot& slot = plan_.slots[s];
      if (slot.kept != kNoSlot) {
        open_buffer(slot, variable_list());
        ready_.push(ready_key(static_cast<int32_t>(s)));
      }
    }
  }
}

void BackwardCall::seed_roots() {
  if (plan_.single_root) {
    // Stock makes a single root the graph root and runs it whether or not
    // grad()/inputs= needs it (it then runs only its tensor pre-hooks).
    NodeSlot& root = plan_.slots[plan_.root_targets[0]];
    root.pending_edges = 1;
    open_buffer(root, variable_list(root.fn->num_inputs()));
  }
  // Several roots: stock's GraphRoot delivers each gradient along its root
  // edge, in order, like any node's outputs.
  const auto first_root_edge = static_cast<int32_t>(plan_.edge_targets.size());
  for (size_t i = 0; i < roots_.size(); ++i) {
    deliver(
        plan_.root_targets[i],
        roots_[i].input_nr,
        std::move(root_grads_[i]),
        root_streams_[i],
        first_root_edge + static_cast<int32_t>(i));
  }
}

void BackwardCall::run(Node* /*host_node*/) {
  // The call's span ends, and its events go to the recorder, however run()
  // exits.
  const trace::CallTracing::Span span =
      tracing_.start(options_.accumulate_grad ? "backward" : "grad");
  const bool traced = tracing_.recorder() != nullptr;
  if (traced) {
    plan_.record_priority_sources = true;
  }
  current_node_slot_ = current_node_slot();
  host_nodes_in_graph_ =
      torch::autograd::get_current_graph_task_nodes_in_graph();
  // A split pass's plan is given (run_as_split_pass).
  if (!split_pass_.is_pass()) {
    plan_for_call(
        plan_,
        roots_,
        inputs_,
        options_.accumulate_grad,
        priorities_);
  }
  ordered_delivery_.resize(plan_.num_ordered_inputs);
  // Filling the host's nodes_in_graph makes _will_engine_execute_node and
  // register_multi_grad_hook(mode="all") see the real graph.
  publish_plan_to_host_task(plan_);
  plan_collectives();
  split_pass_.flush_batch_when_the_pass_ends();
  // Gradients are accumulated (InputBuffer) and nodes run with grad mode
  // equal to create_graph, as under stock's per-task thread-local state.
  c10::GradMode::set_enabled(options_.create_graph);
  task_autograd_state_ = c10::AutogradState::get_tls_state();
  task_dispatch_keys_ = c10::impl::tls_local_dispatch_key_set();

  int32_t running = kNoSlot;
  try {
    begin_collectives();
    seed();
    if (turns_.takes_turns()) {
      if (traced) {
        run_in_sequence</*kTraced=*/true>();
      } else {
        run_in_sequence</*kTraced=*/false>();
      }
    } else {
      // One loop for both: with a loop per variant GCC stopped inlining the
      // queue's pop (callgrind: +10 instructions per node untraced).
      while (!ready_.empty()) {
        running = ready_.pop();
        if (order_verdicts_.awaits()) {
          order_verdicts_.await_before(running);
        }
        if (traced) {
          execute_node</*kTraced=*/true>(running);
        } else {
          execute_node</*kTraced=*/false>(running);
        }
      }
    }
    order_verdicts_.await_every_verdict();
    // Collective results no node read (dropped, or delivered to nodes that
    // do not run) still complete before backward returns. A failure here is
    // no node's.
    running = kNoSlot;
    deferred_waits_.wait_for(kNoSlot);
  } catch (...) {
    if (running != kNoSlot) {
      failed_node_ = plan_.slots[running].fn;
    }
    // The report, the lanes and the order check (plan_collectives), then the
    // results in flight.
    failure_cleanups_.run();
    record_held_gradients();
    throw;
  }
  lanes_.finish();
  record_held_gradients();
  sync_leaf_streams_with_caller();
}

void BackwardCall::plan_collectives() {
  // Whether the ranks compare the sequence decides whether its collectives
  // take turns, and that decides what the report and the lanes do.
  order_verdicts_.plan();
  turns_.plan(split_pass_.is_pass(), order_verdicts_.checks_order());
  // Each registers for the error path in this order: a lane waiting for its
  // collective's turn gives up rather than issue it (the report abandoned)
  // before the lanes are joined; a lane still running a node of the call is
  // joined, its queued nodes dropped; every exchange of the order check
  // completes all the same.
  if (progress_report_.reports()) {
    progress_report_.plan(
        planned_collectives(plan_).size(),
        /*in_turns=*/turns_.takes_turns(),
        failure_cleanups_);
  }
  lanes_.plan(turns_.takes_turns(), failure_cleanups_);
  order_verdicts_.register_cleanup(failure_cleanups_);
}

void BackwardCall::begin_collectives() {
  if (!turns_.takes_turns() && !order_verdicts_.checks_order()) {
    return;
  }
  const std::vector<int32_t> in_order = planned_collectives(plan_);
  if (turns_.takes_turns()) {
    turns_.begin(in_order);
    lanes_.begin();
  }
  if (order_verdicts_.checks_order()) {
    order_verdicts_.begin(in_order, progress_report_.beside_forward());
  }
}

template <bool kTraced>
void BackwardCall::run_in_sequence() {
  auto unpark = [this] {
    const int32_t slot = turns_.unpark(lanes_);
    if (slot != kNoSlot) {
      ready_.push(ready_key(slot));
    }
  };
  while (true) {
    if (lanes_.busy()) {
      // Waits only when nothing else is ready to run.
      for (auto& finished : lanes_.take_finished(/*block=*/ready_.empty())) {
        finish_lane_node(std::move(finished));
      }
      if (!lanes_.busy()) {
        // A collective the engine issues itself may have waited for this.
        unpark();
      }
    }
    if (ready_.empty()) {
      if (lanes_.busy()) {
        continue;
      }
      break;
    }
    const int32_t slot = ready_.pop();
    if (!turns_.is_turn_of(slot, lanes_)) {
      turns_.park(slot);
      continue;
    }
    if (order_verdicts_.awaits()) {
      order_verdicts_.await_before_turn(
          slot,
          turns_.place_of(slot),
          lanes_.runs_in_lane(slot));
    }
    try {
      if (lanes_.runs_in_lane(slot)) {
        dispatch_to_lane(slot);
      } else {
        execute_node<kTraced>(slot);
      }
    } catch (...) {
      if (failed_node_ == nullptr) {
        failed_node_ = plan_.slots[slot].fn;
      }
      throw;
    }
    if (turns_.started(slot)) {
      unpark();
    }
  }
  turns_.check_none_left_parked();
}

void BackwardCall::dispatch_to_lane(int32_t index) {
  NodeSlot& slot = plan_.slots[index];
  Node& fn = *slot.fn;
  // Asked first: a group the engine can see is unsafe raises here, before
  // any hook of the node has run.
  const uintptr_t group = host().lane_group_key(fn);
  InputBuffer inputs = take_buffer(slot);
  CallLanes::LaneNode lane_node;
  if (trace::CallTrace* trace = tracing_.recorder(); trace != nullptr) {
    lane_node.trace_event = begin_node_event(*trace, plan_, index);
  }
  // The hooks run here, on the engine thread, in execute_node's state; only
  // apply() moves to the lane.
  enter_task_state();
  if (slot.has_pending_wait) {
    deferred_waits_.wait_for(index);
  }
  variable_list grads = std::move(inputs.buffer);
  {
    CurrentNodeGuard current_node(current_node_slot_, fn);
    const RunningNode running{this, &fn};
    RunningNodeScope running_scope(running);
    call_hooks_before_apply(fn, grads);
  }
  if (!options_.keep_graph) {
    fn.will_release_variables();
  }
  lane_node.had_post_hooks = !fn.post_hooks().empty();
  if (lane_node.had_post_hooks) {
    lane_node.inputs = grads;
  }
  // What the lane needs of its planned collective: the report, the order
  // check's verdict it awaits there, and its turn.
  lanes_.dispatch_to_lane(
      group,
      index,
      std::move(grads),
      std::move(lane_node),
      PlannedCollective{
          progress_report_.shared_progress_of(index),
          order_verdicts_.shared(),
          turns_.place_of(index)});
}

void BackwardCall::finish_lane_node(CallLanes::FinishedLaneNode&& finished) {
  const int32_t index = finished.slot;
  Node& fn = *plan_.slots[index].fn;
  CallLanes::LaneNode& lane_node = finished.lane_node;
  trace::EndOnExit end_trace_event(
      lane_node.trace_event == trace::kNoEvent ? nullptr : tracing_.recorder(),
      lane_node.trace_event);
  if (finished.error) {
    failed_node_ = &fn;
    std::rethrow_exception(
        host().name_collective_node_in_error(
            std::move(finished.error),
            fn,
            /*in_lane=*/true));
  }
  enter_task_state();
  variable_list delivered;
  try {
    CurrentNodeGuard current_node(current_node_slot_, fn);
    delivered = validate_and_post_hooks(
        fn,
        std::move(finished.outputs),
        lane_node.inputs,
        lane_node.had_post_hooks);
    lane_node.inputs.clear();
    release_unless_kept(fn, options_.keep_graph);
    deliver_outputs(index, delivered, std::nullopt);
  } catch (...) {
    failed_node_ = &fn;
    throw;
  }
}

std::vector<Node*> BackwardCall::planned_order() const {
  return planned_run_order(plan_);
}

void BackwardCall::record_held_gradients() const {
  if (plan_.stock_order_known) {
    ordered_delivery_.record_held_gradients();
  }
}

bool BackwardCall::host_task_is_current() const {
  return torch::autograd::get_current_graph_task_nodes_in_graph() ==
      host_nodes_in_graph_;
}

const RunningNode* running_node_under_host_task() {
  const RunningNode* running = running_node_now();
  if (running == nullptr || !running->call->host_task_is_current()) {
    return nullptr;
  }
  return running;
}

std::optional<std::vector<Node*>> running_call_planned_order() {
  const RunningNode* running = running_node_under_host_task();
  if (running == nullptr) {
    return std::nullopt;
  }
  return running->call->planned_order();
}

void BackwardCall::sync_leaf_streams_with_caller() {
  // Stock GraphTask::exec_post_processing: the caller may read .grad and the
  // returned gradients on its own streams as soon as backward returns.
  for (const auto& leaf_stream : leaf_streams_) {
    for (const auto& caller_stream : caller_streams_) {
      if (caller_stream.device() != leaf_stream.device() ||
          caller_stream == leaf_stream) {
        continue;
      }
      c10::Event event{leaf_stream.device_type()};
      event.record(leaf_stream);
      caller_stream.wait(event);
    }
  }
}

} // namespace torch_ext
