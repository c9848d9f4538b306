// Collectives in sequence, and lane nodes (collective_sequence.h): the run
// loop of a call with lane nodes or the collective order check, where each
// collective starts only in its turn, the same on every rank; and the lane
// nodes, whose hooks run on the engine thread and whose apply() runs on their
// process group's lane (collectives/collective_lane.h), or, on an
// accelerator, on a side stream.

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

std::vector<int32_t> BackwardCall::planned_collectives() const {
  std::vector<int32_t> in_order;
  for (const int32_t s : planned_run_slots(plan_)) {
    if (plan_.slots[s].collective) {
      in_order.push_back(s);
    }
  }
  return in_order;
}

void BackwardCall::build_collective_sequence() {
  sequence_ = std::make_unique<CollectiveSequence>();
  sequence_->place.assign(plan_.slots.size(), kNoSlot);
  const std::vector<int32_t> in_order = planned_collectives();
  for (size_t i = 0; i < in_order.size(); ++i) {
    sequence_->place[in_order[i]] = static_cast<int32_t>(i);
  }
  begin_order_check(in_order);
}

void BackwardCall::begin_order_check(const std::vector<int32_t>& in_order) {
  if (!host_callbacks().collective_check_enabled()) {
    return;
  }
  std::vector<CheckedCollective> checked;
  checked.reserve(in_order.size());
  for (const int32_t s : in_order) {
    checked.push_back({plan_.slots[s].fn, plan_.slots[s].fn->sequence_nr()});
  }
  order_check_ = host_callbacks().begin_collective_check(checked);
}

void BackwardCall::await_order_check_before(int32_t slot) {
  const NodeSlot& node = plan_.slots[slot];
  // A hook may communicate (DDP's all_reduce, FSDP's reduce-scatter, a
  // user's), on any group: none runs before the ranks agree, or a divergence
  // would leave that group out of step on the ranks whose hook got there
  // first. A lane node's collective awaits the verdict on its lane instead
  // (dispatch_to_lane; its hooks run here), where there are lanes: split
  // backward's passes run it inline.
  const bool on_a_lane = sequence_ != nullptr && runs_in_lane(slot);
  if (has_any_hooks(*node.fn)) {
    order_check_->await(CollectiveOrderCheck::kEveryCollective);
    order_check_passed_ = true;
  } else if (node.collective && !on_a_lane) {
    // Split backward's passes have no sequence to say which collective this
    // is: they await every verdict.
    order_check_->await(
        sequence_ != nullptr ? sequence_->place[slot]
                             : CollectiveOrderCheck::kEveryCollective);
    order_check_passed_ = sequence_ == nullptr;
  }
}

bool BackwardCall::may_start(int32_t slot) const {
  const int32_t place = sequence_->place[slot];
  if (place == kNoSlot) {
    return true;
  }
  return place == sequence_->next &&
      (runs_in_lane(slot) || !sequence_->lanes.busy());
}

void BackwardCall::unpark() {
  for (size_t i = 0; i < sequence_->parked.size(); ++i) {
    if (may_start(sequence_->parked[i])) {
      ready_.push(ready_key(sequence_->parked[i]));
      sequence_->parked.erase(
          sequence_->parked.begin() + static_cast<std::ptrdiff_t>(i));
      return; // one node has each place
    }
  }
}

template <bool kTraced>
void BackwardCall::run_in_sequence() {
  build_collective_sequence();
  // Ctrl-C while the engine waits for a lane (the collective releases the
  // GIL; the engine thread holds none).
  const std::function<void()> check_interrupt =
      host_callbacks().raise_if_interrupted;
  while (true) {
    if (sequence_->lanes.busy()) {
      // Waits only when nothing else is ready to run.
      const bool block = ready_.empty();
      for (auto& finished :
           sequence_->lanes.take_finished(block, check_interrupt)) {
        finish_lane_node(
            finished.slot,
            std::move(finished.outputs),
            finished.error);
      }
      if (!sequence_->lanes.busy()) {
        // A collective the engine issues itself may have waited for this.
        unpark();
      }
    }
    if (ready_.empty()) {
      if (sequence_->lanes.busy()) {
        continue;
      }
      break;
    }
    const int32_t slot = ready_.pop();
    if (!may_start(slot)) {
      sequence_->parked.push_back(slot);
      continue;
    }
    if (order_check_ != nullptr && !order_check_passed_) {
      await_order_check_before(slot);
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
    if (sequence_->place[slot] != kNoSlot) {
      ++sequence_->next;
      unpark();
    }
  }
  // Every node of the sequence ran: nothing the plan runs is left parked.
  TORCH_INTERNAL_ASSERT(
      sequence_->parked.empty(),
      "torch_ext: ",
      sequence_->parked.size(),
      " collective node(s) never reached their turn in the collective sequence");
}

template void BackwardCall::run_in_sequence<false>();
template void BackwardCall::run_in_sequence<true>();

c10::Stream BackwardCall::move_to_side_stream(
    const c10::Stream& node_stream,
    const variable_list& inputs) {
  const c10::Device device = node_stream.device();
  auto side = sequence_->side_streams.find(device);
  if (side == sequence_->side_streams.end()) {
    const c10::impl::VirtualGuardImpl guard{device.type()};
    side = sequence_->side_streams.emplace(device, guard.getNewStream(device))
               .first;
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
  // allocator must not hand their memory out before it has.
  for (const auto& input : inputs) {
    if (input.defined() && input.device() == device) {
      input.record_stream(lane_stream);
    }
  }
  return lane_stream;
}

bool BackwardCall::runs_in_lane(int32_t index) const {
  const NodeSlot& slot = plan_.slots[index];
  // Only a node that runs whole (not captured, not split) leaves the engine
  // thread, and only on CPU: on an accelerator its collective is issued on a
  // stream and does not block the thread; the lane is a side stream there
  // (move_to_side_stream).
  return slot.runs_in_lane && slot.action == NodeAction::kRun &&
      slot.first_capture == kNoSlot && !stream_of(*slot.fn).has_value();
}

void BackwardCall::dispatch_to_lane(int32_t index) {
  NodeSlot& slot = plan_.slots[index];
  Node& fn = *slot.fn;
  // Asked first: a group the engine can see is unsafe raises here, before
  // any hook of the node has run.
  const uintptr_t group = host_callbacks().lane_group_key(fn);
  InputBuffer inputs = take_buffer(slot);
  CollectiveSequence::LaneNode& lane_node = sequence_->in_lane[index];
  if (trace_ != nullptr) {
    lane_node.trace_event = begin_node_event(*trace_, plan_, index);
  }
  // The hooks run here, on the engine thread, in execute_node's state; only
  // apply() moves to the lane.
  enter_task_state();
  if (slot.has_pending_wait) {
    wait_pending(index);
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
  // A reporting call's collective node reports when its collective is
  // issued (the gate sees it while this is the lane's issuing node), or once
  // apply() returned if the gate never saw it (a functional collective).
  std::shared_ptr<IssuingLaneNode> issuing;
  if (progress_ != nullptr && slot.collective) {
    issuing = std::make_shared<IssuingLaneNode>();
    issuing->progress = progress_;
  }
  std::function<void()> before_apply;
  if (order_check_ != nullptr || progress_ != nullptr) {
    const int32_t place = sequence_->place[index];
    before_apply =
        [check = order_check_, reports = progress_ != nullptr, issuing, place] {
          if (reports) {
            // The lane is this call's and runs its planned collectives only:
            // the collective gate lets all of them through
            // (collective_progress.h).
            start_only_planned_collectives_on_this_thread();
          }
          if (check != nullptr) {
            check->await(place);
          }
          if (issuing != nullptr) {
            // Here, on the lane: the engine thread runs the nodes that do not
            // wait for the forward thread meanwhile.
            issuing->progress->may_start(static_cast<size_t>(place));
          }
          // After the check's own exchange, which is not the node's collective.
          set_issuing_lane_node(issuing);
        };
  }
  std::function<void()> after_apply;
  if (issuing != nullptr) {
    after_apply = [issuing] {
      set_issuing_lane_node(nullptr);
      if (issuing->issued == 0) {
        issuing->progress->started_one();
      }
    };
  }
  sequence_->lanes.dispatch(
      group,
      index,
      fn.getptr(),
      std::move(grads),
      CallerThreadState(),
      std::move(before_apply),
      std::move(after_apply));
}

void BackwardCall::finish_lane_node(
    int32_t index,
    variable_list&& outputs,
    std::exception_ptr error) {
  Node& fn = *plan_.slots[index].fn;
  auto entry = sequence_->in_lane.find(index);
  TORCH_INTERNAL_ASSERT(entry != sequence_->in_lane.end());
  CollectiveSequence::LaneNode lane_node = std::move(entry->second);
  sequence_->in_lane.erase(entry);
  trace::EndOnExit end_trace_event(
      lane_node.trace_event == trace::kNoEvent ? nullptr : trace_.get(),
      lane_node.trace_event);
  if (error) {
    failed_node_ = &fn;
    std::rethrow_exception(
        host_callbacks().name_collective_node_in_error(
            std::move(error),
            fn,
            /*in_lane=*/true));
  }
  enter_task_state();
  variable_list delivered;
  try {
    CurrentNodeGuard current_node(current_node_slot_, fn);
    delivered = validate_and_post_hooks(
        fn,
        std::move(outputs),
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
