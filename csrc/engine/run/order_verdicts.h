#pragma once

// One call's collective order check (torch_ext.check_collective_order): the
// ranks compare the call's collective sequence (collective_turns.h) before
// any of it starts, and the call awaits their verdicts before each
// collective it starts and each hook it runs, and before it returns. Held by
// value by every call (BackwardCall::order_verdicts_); with the check off it
// holds nothing, and the run loops' per-node test is one of a bool.

#include "engine/host_interface.h"
#include "engine/plan/graph_plan.h"
#include "engine/run/call_feature.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace torch_ext {

class OrderVerdicts final : public CallFeature {
 public:
  // `plan` is the call's (a member that outlives this one), read once it is
  // made.
  explicit OrderVerdicts(const GraphPlan& plan) : plan_(plan) {}

  // Once the plan is made, before any node runs: decides whether the ranks
  // compare this call's collectives (the check is on and the plan has
  // collectives or lane nodes). Whether they do decides whether the call
  // takes turns (CollectiveTurns::plan).
  void plan();
  bool checks_order() const {
    return checks_order_;
  }
  // Registers this with `cleanups` when the ranks compare the collectives:
  // after the report and the lanes (BackwardCall::plan_collectives).
  void register_cleanup(FailureCleanups& cleanups) {
    if (checks_order_) {
      cleanups.add(*this);
    }
  }

  // Before the first node runs, inside the call's error handling, when the
  // ranks compare the collectives: begins the check on `in_order`, the
  // call's collective sequence (planned_collectives), before the first
  // collective starts. `beside_forward`: the backward handed over that the
  // call is (its context's), or null; the ranks compare it too.
  void begin(
      const std::vector<int32_t>& in_order,
      const CollectiveProgress* beside_forward);

  // Whether the run loops must call await_before (or await_before_turn)
  // before the next node: the check is on and this thread has not yet seen
  // every group agree.
  bool awaits() const {
    return awaits_order_check_;
  }
  // Awaits the order check's verdict if `slot` starts a collective on this
  // thread or has a hook, in a call whose collectives take no turns (run()'s
  // loop): split backward's passes have no turns to say which collective
  // this is, so they await every verdict.
  void await_before(int32_t slot) {
    await_verdict_before(
        slot,
        /*in_turns=*/false,
        kNoSlot,
        /*on_a_lane=*/false);
  }
  // The same, in a call that takes turns (BackwardCall::run_in_sequence):
  // `place` is `slot`'s place in the sequence (CollectiveTurns::place_of),
  // `on_a_lane` whether it runs on a lane (CallLanes::runs_in_lane).
  void await_before_turn(int32_t slot, int32_t place, bool on_a_lane) {
    await_verdict_before(slot, /*in_turns=*/true, place, on_a_lane);
  }
  // The call ends: a call that started no collective and ran no hook still
  // hears about a divergence before it returns.
  void await_every_verdict() {
    if (order_check_ != nullptr) {
      order_check_->await(CollectiveOrderCheck::kEveryCollective);
    }
  }

  // The check, or null, shared with a lane, which awaits its node's verdict
  // there (PlannedCollective).
  const std::shared_ptr<CollectiveOrderCheck>& shared() const {
    return order_check_;
  }

  // Every exchange of the order check completes all the same.
  void on_failure() noexcept override;

 private:
  void await_verdict_before(
      int32_t slot,
      bool in_turns,
      int32_t place,
      bool on_a_lane);

  const GraphPlan& plan_;
  // The order check, when it is on: begun before any node runs, awaited
  // before each collective starts (its group's verdict; on the lanes for
  // theirs), before the first hook runs and before the call returns (every
  // verdict). Shared with the lanes.
  std::shared_ptr<CollectiveOrderCheck> order_check_;
  bool checks_order_ = false;
  // order_check_ is set and this thread has not seen every group agree (the
  // engine thread asks no more after that).
  bool awaits_order_check_ = false;
};

} // namespace torch_ext
