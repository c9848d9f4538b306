#pragma once

// One call's lanes, when its collectives take turns (collective_turns.h):
// lane nodes' apply() runs on their process group's lane
// (engine/run/collective_lane.h), or, on an accelerator, on a side stream,
// while their hooks run on the engine thread (BackwardCall::dispatch_to_lane
// and finish_lane_node, run_loop.cpp). Held by value by every call
// (BackwardCall::lanes_); a call that takes no turns makes no lane, and the
// run loop does not ask it.

#include "engine/plan/graph_plan.h"
#include "engine/planned_collective_start.h"
#include "engine/run/call_feature.h"
#include "engine/run/collective_lane.h"
#include "engine/trace.h"

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <unordered_map>
#include <vector>

namespace torch_ext {

class CallLanes final : public CallFeature {
 public:
  // `plan` is the call's (a member that outlives this one), read once it is
  // made.
  CallLanes(const GraphPlan& plan, bool has_accelerator)
      : plan_(plan), has_accelerator_(has_accelerator) {}

  // Once the plan is made, before any node runs: registers this with
  // `cleanups` when the call takes turns (`takes_turns`), whose lanes begin()
  // makes; after the report (BackwardCall::plan_collectives).
  void plan(bool takes_turns, FailureCleanups& cleanups) {
    if (takes_turns) {
      cleanups.add(*this);
    }
  }
  // Before the first node runs, inside the call's error handling, when the
  // call takes turns.
  void begin() {
    lanes_.emplace();
  }

  // Whether the node in `slot` runs on a lane (takes_turns): a lane node
  // that runs whole (not captured, not split), on CPU. On an accelerator its
  // collective is issued on a stream and does not block the thread; the lane
  // is a side stream there (move_to_side_stream).
  bool runs_in_lane(int32_t slot) const;

  // A lane node handed to its lane: what its post hooks will need when it
  // returns.
  struct LaneNode {
    torch::autograd::variable_list inputs;
    bool had_post_hooks = false;
    int32_t trace_event = trace::kNoEvent;
  };
  // Hands the node in `slot`, whose hooks before apply() ran, to the lane of
  // `group`: apply() on `grads` there, as the start of `planned`, its
  // planned collective.
  void dispatch_to_lane(
      uintptr_t group,
      int32_t slot,
      torch::autograd::variable_list&& grads,
      LaneNode&& lane_node,
      PlannedCollective&& planned);
  // Whether a lane node has not come back (take_finished).
  bool busy() const {
    return lanes_.has_value() && lanes_->busy();
  }
  // The lane nodes that returned since the last call, each with what
  // dispatch_to_lane kept of it. With `block`, waits for one (busy), letting
  // Ctrl-C through.
  struct FinishedLaneNode {
    int32_t slot;
    torch::autograd::variable_list outputs;
    std::exception_ptr error;
    LaneNode lane_node;
  };
  std::vector<FinishedLaneNode> take_finished(bool block);

  // A lane node on an accelerator (the executor): the side stream of
  // `node_stream`'s device that it runs on instead, made to wait for what
  // that stream has queued; `inputs` are recorded as used on it.
  c10::Stream move_to_side_stream(
      const c10::Stream& node_stream,
      const torch::autograd::variable_list& inputs);

  // The call succeeded: joins the lanes.
  void finish() {
    if (lanes_.has_value()) {
      lanes_->stop();
    }
  }
  // A lane still running a node of the call is joined, its queued nodes
  // dropped.
  void on_failure() noexcept override;

 private:
  const GraphPlan& plan_;
  const bool has_accelerator_;
  // The lanes: a thread per process group, joined when the call ends. Made
  // only for a call that takes turns.
  std::optional<CollectiveLanes> lanes_;
  std::unordered_map<int32_t, LaneNode> in_lane_;
  // Accelerator lane nodes' side stream, one per device (every lane node of
  // a device runs on it, so they stay in the sequence's order).
  std::unordered_map<c10::Device, c10::Stream> side_streams_;
};

} // namespace torch_ext
