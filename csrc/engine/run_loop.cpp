// The run loop of one call: the plan (discovered, or given by split
// backward), published to the host task, seeded, then every ready node run
// in the scheduler's order until none is left. Runs inside the host task's
// BackwardDriver (host_task.cpp).

#include "collectives/collective_lane.h"
#include "engine/backward_call.h"
#include "engine/batched_accumulation.h"
#include "engine/current_node.h"
#include "engine/host_task.h"
#include "engine/plan_cache.h"
#include "engine/schedule_replay.h"

#include <ATen/DeviceAccelerator.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/input_metadata.h>

#include <functional>
#include <mutex>

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

std::optional<c10::Stream> producer_stream_of(const at::Tensor& grad) {
  if (!grad.defined()) {
    return std::nullopt;
  }
  return torch::autograd::InputMetadata(grad).stream();
}

} // namespace

BackwardCall::BackwardCall(
    edge_list roots,
    variable_list root_grads,
    edge_list inputs,
    CallOptions options,
    std::vector<PriorityOverride> priority_overrides)
    : roots_(std::move(roots)),
      root_grads_(std::move(root_grads)),
      inputs_(std::move(inputs)),
      options_(options),
      priorities_(std::move(priority_overrides)),
      // Read here, on the caller's thread: past stock's reentrant depth
      // limit the host task runs the driver on a pool thread, whose current
      // streams are not the caller's.
      caller_streams_(current_accelerator_streams()),
      has_accelerator_(
          at::accelerator::getAccelerator(/*checked=*/false).has_value()) {
  if (!options_.accumulate_grad) {
    captured_.resize(inputs_.size());
  }
  root_streams_.reserve(root_grads_.size());
  for (const auto& grad : root_grads_) {
    root_streams_.push_back(producer_stream_of(grad));
  }
}

BackwardCall::~BackwardCall() = default;

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

void BackwardCall::run(Node* host_node) {
  if (trace::enabled()) {
    const char* label = trace_label_ != nullptr ? trace_label_
        : options_.accumulate_grad              ? "backward"
                                                : "grad";
    trace_ = std::make_unique<trace::CallTrace>(label);
    plan_.record_priority_sources = true;
  }
  // The call's span ends, and its events go to the recorder, however run()
  // exits.
  struct FinishTrace {
    trace::CallTrace* trace;
    ~FinishTrace() {
      if (trace != nullptr) {
        trace->finish();
      }
    }
  } finish_trace{trace_.get()};
  current_node_slot_ = current_node_slot(host_node);
  host_nodes_in_graph_ =
      torch::autograd::get_current_graph_task_nodes_in_graph();
  if (!has_plan_) {
    plan_for_call(
        plan_,
        roots_,
        inputs_,
        options_.accumulate_grad,
        priorities_);
  }
  ordered_inputs_.resize(plan_.num_ordered_inputs);
  // Filling the host's nodes_in_graph makes _will_engine_execute_node and
  // register_multi_grad_hook(mode="all") see the real graph.
  publish_plan_to_host_task(plan_);
  if (batch_ != nullptr) {
    // The first final callback, ahead of any a hook queues during the pass;
    // after an error, when final callbacks do not run, the caller flushes.
    torch::autograd::Engine::get_default_engine().queue_callback(
        [batch = batch_] { batch->flush(); });
  }
  // Gradients are accumulated (InputBuffer) and nodes run with grad mode
  // equal to create_graph, as under stock's per-task thread-local state.
  c10::GradMode::set_enabled(options_.create_graph);
  task_autograd_state_ = c10::AutogradState::get_tls_state();
  task_dispatch_keys_ = c10::impl::tls_local_dispatch_key_set();

  int32_t running = kNoSlot;
  try {
    seed();
    const bool traced = trace_ != nullptr;
    if (uses_lanes()) {
      if (traced) {
        run_with_lanes</*kTraced=*/true>();
      } else {
        run_with_lanes</*kTraced=*/false>();
      }
    } else {
      // One loop for both: with a loop per variant GCC stopped inlining the
      // queue's pop (callgrind: +10 instructions per node untraced).
      while (!ready_.empty()) {
        running = ready_.pop();
        if (traced) {
          execute_node</*kTraced=*/true>(running);
        } else {
          execute_node</*kTraced=*/false>(running);
        }
      }
    }
    // Collective results no node read (dropped, or delivered to nodes that
    // do not run) still complete before backward returns. A failure here is
    // no node's.
    running = kNoSlot;
    wait_pending(kNoSlot);
  } catch (...) {
    if (running != kNoSlot) {
      failed_node_ = plan_.slots[running].fn;
    }
    if (lanes_ != nullptr) {
      // Before anything else: a lane may still be running a node of this
      // call. Its queued nodes are dropped.
      lanes_->stop();
    }
    wait_pending_after_error();
    record_held_gradients();
    throw;
  }
  if (lanes_ != nullptr) {
    lanes_->stop();
  }
  record_held_gradients();
  sync_leaf_streams_with_caller();
}

void BackwardCall::build_collective_sequence() {
  sequence_place_.assign(plan_.slots.size(), kNoSlot);
  int32_t place = 0;
  for (const int32_t s : planned_run_slots(plan_)) {
    if (plan_.slots[s].collective) {
      sequence_place_[s] = place++;
    }
  }
}

bool BackwardCall::may_start(int32_t slot) const {
  const int32_t place = sequence_place_[slot];
  if (place == kNoSlot) {
    return true;
  }
  return place == next_in_sequence_ && (runs_in_lane(slot) || !lanes_->busy());
}

void BackwardCall::unpark() {
  for (size_t i = 0; i < parked_.size(); ++i) {
    if (may_start(parked_[i])) {
      ready_.push(ready_key(parked_[i]));
      parked_.erase(parked_.begin() + static_cast<std::ptrdiff_t>(i));
      return; // one node has each place
    }
  }
}

template <bool kTraced>
void BackwardCall::run_with_lanes() {
  build_collective_sequence();
  lanes_ = std::make_unique<CollectiveLanes>();
  // Ctrl-C while the engine waits for a lane (the collective releases the
  // GIL; the engine thread holds none).
  const std::function<void()> check_interrupt =
      host_callbacks().raise_if_interrupted;
  while (true) {
    if (lanes_->busy()) {
      // Waits only when nothing else is ready to run.
      const bool block = ready_.empty();
      for (auto& finished : lanes_->take_finished(block, check_interrupt)) {
        finish_lane_node(
            finished.slot,
            std::move(finished.outputs),
            finished.error);
      }
      if (!lanes_->busy()) {
        // A collective the engine issues itself may have waited for this.
        unpark();
      }
    }
    if (ready_.empty()) {
      if (lanes_->busy()) {
        continue;
      }
      break;
    }
    const int32_t slot = ready_.pop();
    if (!may_start(slot)) {
      parked_.push_back(slot);
      continue;
    }
    if (sequence_place_[slot] != kNoSlot &&
        host_callbacks().collective_check_enabled()) {
      // The ranks agree on this collective before any of them issues it: a
      // mismatch raises here on every rank, where it would hang later.
      const NodeSlot& node = plan_.slots[slot];
      CollectiveCheck check;
      check.node = node.fn;
      check.position = sequence_place_[slot];
      check.inputs = &buffer_of(node).buffer;
      host_callbacks().check_collective(check);
    }
    try {
      if (runs_in_lane(slot)) {
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
    if (sequence_place_[slot] != kNoSlot) {
      ++next_in_sequence_;
      unpark();
    }
  }
  if (host_callbacks().collective_check_enabled()) {
    CollectiveCheck end_of_collectives;
    end_of_collectives.position = next_in_sequence_;
    host_callbacks().check_collective(end_of_collectives);
  }
  // Every node of the sequence ran: nothing the plan runs is left parked.
  TORCH_INTERNAL_ASSERT(
      parked_.empty(),
      "torch_ext: ",
      parked_.size(),
      " collective node(s) never reached their turn in the collective sequence");
}

template void BackwardCall::run_with_lanes<false>();
template void BackwardCall::run_with_lanes<true>();

std::vector<Node*> BackwardCall::planned_order() const {
  return planned_run_order(plan_);
}

namespace {
std::mutex held_stats_mutex;
HeldGradientStats held_stats;
} // namespace

void BackwardCall::record_held_gradients() const {
  if (!plan_.stock_order_known) {
    return;
  }
  std::lock_guard<std::mutex> lock(held_stats_mutex);
  held_stats.ordered_calls += 1;
  held_stats.held_gradients += held_count_;
  held_stats.peak_held_bytes =
      std::max(held_stats.peak_held_bytes, peak_held_bytes_);
}

HeldGradientStats held_gradient_stats(bool reset) {
  std::lock_guard<std::mutex> lock(held_stats_mutex);
  const HeldGradientStats stats = held_stats;
  if (reset) {
    held_stats = HeldGradientStats{};
  }
  return stats;
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
