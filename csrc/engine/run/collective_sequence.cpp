// The collective sequence (collective_sequence.h): its turns, the order
// check and the report around them, and its lanes; the run loop of a call
// whose collectives take turns, the same on every rank; and the lane nodes,
// whose hooks run on the engine thread, in the executor's steps
// (node_steps.h), and whose apply() runs on their process group's lane
// (engine/run/collective_lane.h), or, on an accelerator, on a side stream.

#include "engine/run/collective_sequence.h"
#include "engine/host_callbacks.h"
#include "engine/plan/schedule_replay.h"
#include "engine/run/backward_call.h"
#include "engine/run/node_steps.h"
#include "engine/run/running_node.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <functional>

namespace torch_ext {

std::vector<int32_t> CollectiveSequence::planned_collectives() const {
  std::vector<int32_t> in_order;
  for (const int32_t s : planned_run_slots(plan_)) {
    if (plan_.slots[s].collective) {
      in_order.push_back(s);
    }
  }
  return in_order;
}

void CollectiveSequence::plan(bool split_pass, FailureCleanups& cleanups) {
  const bool check_enabled = (plan_.has_lanes || plan_.has_collectives) &&
      host_callbacks().collective_check_enabled();
  // Lane nodes need turns; so does the order check, whose verdict each
  // collective awaits by its place. Not split backward's passes, whose kept
  // and resumed nodes the sequence does not replay: there the ranks still
  // compare the collectives the plan will start, before the first starts.
  takes_turns_ =
      (plan_.has_lanes || (plan_.has_collectives && check_enabled)) &&
      plan_.seeds_roots && !plan_.resumes_kept_nodes && !split_pass;
  checks_order_ = check_enabled;
  if (progress_ != nullptr) {
    // In turns, each planned collective waits for its turn (may_start): the
    // forward's collectives may then take turns with them.
    progress_->planned(
        planned_collectives().size(),
        /*in_turns=*/takes_turns_);
  }
  if (progress_ != nullptr || checks_order_ || takes_turns_) {
    cleanups.add(*this);
  }
}

void CollectiveSequence::begin() {
  if (!takes_turns_ && !checks_order_) {
    return;
  }
  const std::vector<int32_t> in_order = planned_collectives();
  if (takes_turns_) {
    place_.assign(plan_.slots.size(), kNoSlot);
    for (size_t i = 0; i < in_order.size(); ++i) {
      place_[in_order[i]] = static_cast<int32_t>(i);
    }
    lanes_.emplace();
  }
  if (checks_order_) {
    std::vector<CheckedCollective> checked;
    checked.reserve(in_order.size());
    for (const int32_t s : in_order) {
      checked.push_back({plan_.slots[s].fn, plan_.slots[s].fn->sequence_nr()});
    }
    order_check_ = host_callbacks().begin_collective_check(checked);
    awaits_order_check_ = order_check_ != nullptr;
  }
}

void CollectiveSequence::await_order_check_before(int32_t slot) {
  const NodeSlot& node = plan_.slots[slot];
  // A hook may communicate (DDP's all_reduce, FSDP's reduce-scatter, a
  // user's), on any group: none runs before the ranks agree, or a divergence
  // would leave that group out of step on the ranks whose hook got there
  // first. A lane node's collective awaits the verdict on its lane instead
  // (PlannedCollectiveStart; its hooks run here), where there are lanes:
  // split backward's passes run it inline.
  const bool on_a_lane = takes_turns_ && runs_in_lane(slot);
  if (has_any_hooks(*node.fn)) {
    order_check_->await(CollectiveOrderCheck::kEveryCollective);
    awaits_order_check_ = false;
  } else if (node.collective && !on_a_lane) {
    // Split backward's passes have no turns to say which collective this
    // is: they await every verdict.
    order_check_->await(
        takes_turns_ ? place_[slot] : CollectiveOrderCheck::kEveryCollective);
    awaits_order_check_ = takes_turns_;
  }
}

bool CollectiveSequence::is_turn_of(int32_t slot) const {
  const int32_t place = place_[slot];
  if (place == kNoSlot) {
    return true;
  }
  return place == next_ && (runs_in_lane(slot) || !lanes_->busy());
}

int32_t CollectiveSequence::unpark() {
  for (size_t i = 0; i < parked_.size(); ++i) {
    const int32_t slot = parked_[i];
    if (is_turn_of(slot)) {
      parked_.erase(parked_.begin() + static_cast<std::ptrdiff_t>(i));
      return slot; // one node has each place
    }
  }
  return kNoSlot;
}

void CollectiveSequence::check_none_left_parked() const {
  TORCH_INTERNAL_ASSERT(
      parked_.empty(),
      "torch_ext: ",
      parked_.size(),
      " collective node(s) never reached their turn in the collective sequence");
}

bool CollectiveSequence::runs_in_lane(int32_t index) const {
  const NodeSlot& slot = plan_.slots[index];
  // Only a node that runs whole leaves the engine thread, and only where no
  // accelerator stream runs it (Node::stream() is nullopt wherever no
  // accelerator is; BackwardCall::stream_of).
  return slot.runs_in_lane && slot.action == NodeAction::kRun &&
      slot.first_capture == kNoSlot &&
      !(has_accelerator_ && slot.fn->stream().has_value());
}

void CollectiveSequence::dispatch_to_lane(
    uintptr_t group,
    int32_t slot,
    torch::autograd::variable_list&& grads,
    LaneNode&& lane_node) {
  in_lane_[slot] = std::move(lane_node);
  lanes_->dispatch(
      group,
      slot,
      plan_.slots[slot].fn->getptr(),
      std::move(grads),
      CallerThreadState(),
      PlannedCollective{
          progress_of(slot) != nullptr ? progress_ : nullptr,
          order_check_,
          place_[slot]});
}

std::vector<CollectiveSequence::FinishedLaneNode> CollectiveSequence::
    take_finished(bool block) {
  // Ctrl-C while the engine waits for a lane (the collective releases the
  // GIL; the engine thread holds none).
  const std::function<void()> check_interrupt =
      host_callbacks().raise_if_interrupted;
  std::vector<FinishedLaneNode> taken;
  for (auto& finished : lanes_->take_finished(block, check_interrupt)) {
    auto entry = in_lane_.find(finished.slot);
    TORCH_INTERNAL_ASSERT(entry != in_lane_.end());
    taken.push_back(
        {finished.slot,
         std::move(finished.outputs),
         finished.error,
         std::move(entry->second)});
    in_lane_.erase(entry);
  }
  return taken;
}

c10::Stream CollectiveSequence::move_to_side_stream(
    const c10::Stream& node_stream,
    const torch::autograd::variable_list& inputs) {
  const c10::Device device = node_stream.device();
  const c10::impl::VirtualGuardImpl guard{device.type()};
  auto side = side_streams_.find(device);
  if (side == side_streams_.end()) {
    side = side_streams_.emplace(device, guard.getNewStream(device)).first;
  }
  const c10::Stream lane_stream = side->second;
  // The side stream starts after everything the node's own stream has
  // queued, its inputs included (wait_for_ready_inputs made that stream
  // wait for their producers).
  c10::Event inputs_ready{device.type()};
  inputs_ready.record(node_stream);
  lane_stream.wait(inputs_ready);
  // The inputs were allocated on other streams and are freed when the node
  // returns, while the side stream may still read them: the caching
  // allocator must not hand their memory out before it has. Through the
  // device guard, not Tensor::record_stream: torch registers
  // aten::record_stream for CUDA only, and the guard reaches any
  // accelerator's allocator (CUDA's guard calls its caching allocator).
  for (const auto& input : inputs) {
    if (input.defined() && input.device() == device) {
      guard.recordDataPtrOnStream(input.storage().data_ptr(), lane_stream);
    }
  }
  return lane_stream;
}

void CollectiveSequence::on_failure() noexcept {
  if (progress_ != nullptr) {
    // A lane waiting for its collective's turn gives up rather than issue it
    // (stop() below joins the lanes).
    progress_->abandoned();
  }
  if (lanes_.has_value()) {
    // Before anything else of the call's error path: a lane may still be
    // running a node of this call. Its queued nodes are dropped.
    lanes_->stop();
  }
  if (order_check_ != nullptr) {
    order_check_->complete_after_error();
  }
}

template <bool kTraced>
void BackwardCall::run_in_sequence() {
  auto unpark = [this] {
    const int32_t slot = sequence_.unpark();
    if (slot != kNoSlot) {
      ready_.push(ready_key(slot));
    }
  };
  while (true) {
    if (sequence_.lanes_busy()) {
      // Waits only when nothing else is ready to run.
      for (auto& finished : sequence_.take_finished(/*block=*/ready_.empty())) {
        finish_lane_node(std::move(finished));
      }
      if (!sequence_.lanes_busy()) {
        // A collective the engine issues itself may have waited for this.
        unpark();
      }
    }
    if (ready_.empty()) {
      if (sequence_.lanes_busy()) {
        continue;
      }
      break;
    }
    const int32_t slot = ready_.pop();
    if (!sequence_.is_turn_of(slot)) {
      sequence_.park(slot);
      continue;
    }
    if (sequence_.awaits_order_check()) {
      sequence_.await_order_check_before(slot);
    }
    try {
      if (sequence_.runs_in_lane(slot)) {
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
    if (sequence_.started(slot)) {
      unpark();
    }
  }
  sequence_.check_none_left_parked();
}

template void BackwardCall::run_in_sequence<false>();
template void BackwardCall::run_in_sequence<true>();

void BackwardCall::dispatch_to_lane(int32_t index) {
  NodeSlot& slot = plan_.slots[index];
  Node& fn = *slot.fn;
  // Asked first: a group the engine can see is unsafe raises here, before
  // any hook of the node has run.
  const uintptr_t group = host_callbacks().lane_group_key(fn);
  InputBuffer inputs = take_buffer(slot);
  CollectiveSequence::LaneNode lane_node;
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
  sequence_
      .dispatch_to_lane(group, index, std::move(grads), std::move(lane_node));
}

void BackwardCall::finish_lane_node(
    CollectiveSequence::FinishedLaneNode&& finished) {
  const int32_t index = finished.slot;
  Node& fn = *plan_.slots[index].fn;
  CollectiveSequence::LaneNode& lane_node = finished.lane_node;
  trace::EndOnExit end_trace_event(
      lane_node.trace_event == trace::kNoEvent ? nullptr : tracing_.recorder(),
      lane_node.trace_event);
  if (finished.error) {
    failed_node_ = &fn;
    std::rethrow_exception(
        host_callbacks().name_collective_node_in_error(
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

} // namespace torch_ext
