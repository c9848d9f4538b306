#pragma once

// One call's collective sequence: every node that issues a collective (a
// launch, in a lane or not), in the order the plan runs them, the same on
// every rank with the same graph and priorities. Held by value by every call
// (BackwardCall::sequence_); what it does depends on what is on:
// - the collective order check (torch_ext.check_collective_order): the ranks
//   compare the sequence before any of it starts;
// - the report to the next microbatch's forward (collective_progress.h),
//   when the call runs beside it: each collective waits for its turn and
//   says when it started;
// - turns (takes_turns), with lane nodes or the order check: each collective
//   starts only when every one before it has, and one the engine runs itself
//   also waits for the lanes to be idle, so no collective it knows of is
//   issued beside a lane's. Lane nodes' apply() runs on their process
//   group's lane (engine/run/collective_lane.h), or, on an accelerator, on
//   a side stream.
// With none of them on (an ordinary call) it holds nothing: no lane, no
// table, and the run loop's per-node test is one of a bool.
//
// The run loop of a call that takes turns (BackwardCall::run_in_sequence)
// and the lane nodes' hooks, which are the executor's steps, are in
// collective_sequence.cpp beside this class's own functions.

#include "engine/collective_progress.h"
#include "engine/host_callbacks.h"
#include "engine/plan/graph_plan.h"
#include "engine/planned_collective_start.h"
#include "engine/run/call_feature.h"
#include "engine/run/collective_lane.h"
#include "engine/trace.h"

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

namespace torch_ext {

class CollectiveSequence final : public CallFeature {
 public:
  // `plan` is the call's (a member that outlives this one), read once it is
  // made. Made on the caller's thread: takes the report target of the call
  // made on this thread (take_report_target), so a nested call has none.
  CollectiveSequence(const GraphPlan& plan, bool has_accelerator)
      : plan_(plan),
        has_accelerator_(has_accelerator),
        progress_(take_report_target()) {}

  // Once the plan is made, before any node runs: decides whether the call
  // takes turns (not split backward's passes, whose kept and resumed nodes
  // the sequence does not replay: `split_pass`), tells the report target how
  // many collectives the plan starts, and registers this with `cleanups`
  // when anything is on.
  void plan(bool split_pass, FailureCleanups& cleanups);

  // Whether each collective starts in its turn (BackwardCall::
  // run_in_sequence).
  bool takes_turns() const {
    return takes_turns_;
  }

  // Before the first node runs, inside the call's error handling: the turns
  // and the lanes, when the call takes turns, and the collective order
  // check, when it is on (the ranks compare the sequence before the first
  // collective starts).
  void begin();

  // Whether the run loops must call await_order_check_before before the next
  // node: the check is on and this thread has not yet seen every group
  // agree.
  bool awaits_order_check() const {
    return awaits_order_check_;
  }
  // Awaits the order check's verdict if `slot` starts a collective on this
  // thread or has a hook.
  void await_order_check_before(int32_t slot);
  // The call ends: a call that started no collective and ran no hook still
  // hears about a divergence before it returns.
  void await_every_verdict() {
    if (order_check_ != nullptr) {
      order_check_->await(CollectiveOrderCheck::kEveryCollective);
    }
  }

  // Whether the node in `slot` may start now (takes_turns): a node outside
  // the sequence always; one of it when every one before it has started
  // and, run by the engine itself, the lanes are idle.
  bool is_turn_of(int32_t slot) const;
  // `slot`, ready before its turn, waits for it.
  void park(int32_t slot) {
    parked_.push_back(slot);
  }
  // A parked node whose turn has come, taken out of the parked ones, or
  // kNoSlot.
  int32_t unpark();
  // The node in `slot` started (run, or handed to its lane). Returns whether
  // it was one of the sequence: the next one's turn has come, which may be
  // parked.
  bool started(int32_t slot) {
    if (place_[slot] == kNoSlot) {
      return false;
    }
    ++next_;
    return true;
  }
  // Every node of the sequence ran: nothing the plan runs is left parked.
  void check_none_left_parked() const;

  // The node in `slot`'s planned collective on the engine thread, reported
  // when the call reports (PlannedCollectiveStart's first constructor).
  CollectiveProgress* progress_of(int32_t slot) const {
    return plan_.slots[slot].collective ? progress_.get() : nullptr;
  }
  int32_t turn_of(int32_t slot) const {
    return takes_turns_ ? place_[slot] : kNoTurn;
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
  // `group`: apply() on `grads` there, as its planned collective's start.
  void dispatch_to_lane(
      uintptr_t group,
      int32_t slot,
      torch::autograd::variable_list&& grads,
      LaneNode&& lane_node);
  // Whether a lane node has not come back (take_finished).
  bool lanes_busy() const {
    return lanes_.has_value() && lanes_->busy();
  }
  // The lane nodes that returned since the last call, each with what
  // dispatch_to_lane kept of it. With `block`, waits for one (lanes_busy),
  // letting Ctrl-C through.
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
  // A lane waiting for its collective's turn gives up rather than issue it;
  // a lane still running a node of the call is joined, its queued nodes
  // dropped; every exchange of the order check completes all the same.
  void on_failure() noexcept override;

 private:
  // The nodes that issue a collective, in the order the plan runs them.
  std::vector<int32_t> planned_collectives() const;

  const GraphPlan& plan_;
  const bool has_accelerator_;
  // Where this call reports the collectives it starts, when it runs beside
  // the next microbatch's forward; shared with the lanes.
  std::shared_ptr<CollectiveProgress> progress_;
  // The order check, when it is on: begun before any node runs, awaited
  // before each collective starts (its group's verdict; on the lanes for
  // theirs), before the first hook runs and before the call returns (every
  // verdict). Shared with the lanes.
  std::shared_ptr<CollectiveOrderCheck> order_check_;
  bool checks_order_ = false;
  // order_check_ is set and this thread has not seen every group agree (the
  // engine thread asks no more after that).
  bool awaits_order_check_ = false;
  bool takes_turns_ = false;

  // While the call takes turns: per slot, its place in the sequence, or
  // kNoSlot; the place whose turn it is; the nodes of the sequence that
  // became ready before their turn.
  std::vector<int32_t> place_;
  int32_t next_ = 0;
  std::vector<int32_t> parked_;
  // The lanes: a thread per process group, joined when the call ends. Made
  // only for a call that takes turns.
  std::optional<CollectiveLanes> lanes_;
  std::unordered_map<int32_t, LaneNode> in_lane_;
  // Accelerator lane nodes' side stream, one per device (every lane node of
  // a device runs on it, so they stay in the sequence's order).
  std::unordered_map<c10::Device, c10::Stream> side_streams_;
};

} // namespace torch_ext
