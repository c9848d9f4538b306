// One call's lanes (call_lanes.h): lane nodes handed to their process
// group's lane (engine/run/collective_lane.h) and taken back, and, on an
// accelerator, the side stream each runs on instead.

#include "engine/run/call_lanes.h"
#include "engine/host_interface.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <functional>

namespace torch_ext {

bool CallLanes::runs_in_lane(int32_t index) const {
  const NodeSlot& slot = plan_.slots[index];
  // Only a node that runs whole leaves the engine thread, and only where no
  // accelerator stream runs it (Node::stream() is nullopt wherever no
  // accelerator is; BackwardCall::stream_of).
  return slot.runs_in_lane && slot.action == NodeAction::kRun &&
      slot.first_capture == kNoSlot &&
      !(has_accelerator_ && slot.fn->stream().has_value());
}

void CallLanes::dispatch_to_lane(
    uintptr_t group,
    int32_t slot,
    torch::autograd::variable_list&& grads,
    LaneNode&& lane_node,
    PlannedCollective&& planned) {
  in_lane_[slot] = std::move(lane_node);
  lanes_->dispatch(
      group,
      slot,
      plan_.slots[slot].fn->getptr(),
      std::move(grads),
      CallerThreadState(),
      std::move(planned));
}

std::vector<CallLanes::FinishedLaneNode> CallLanes::take_finished(bool block) {
  // Ctrl-C while the engine waits for a lane (the collective releases the
  // GIL; the engine thread holds none).
  const std::function<void()> check_interrupt = [] {
    host().raise_if_interrupted();
  };
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

c10::Stream CallLanes::move_to_side_stream(
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

void CallLanes::on_failure() noexcept {
  if (lanes_.has_value()) {
    // Before anything else of the call's error path but the report's
    // abandonment (ProgressReport::on_failure): a lane may still be running
    // a node of this call. Its queued nodes are dropped.
    lanes_->stop();
  }
}

} // namespace torch_ext
