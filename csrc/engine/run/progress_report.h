#pragma once

// One call's report to the next microbatch's forward (collective_progress.h),
// when the call runs beside it (its CallContext says so,
// engine/call_context.h): how many collectives its plan starts, and, for
// each, its wait for its turn and when it started. Held by value by every
// call (BackwardCall::progress_report_); a call that does not run beside a
// forward holds a null pointer, which the executor tests per collective.

#include "engine/collective_progress.h"
#include "engine/plan/graph_plan.h"
#include "engine/run/call_feature.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

namespace torch_ext {

class ProgressReport final : public CallFeature {
 public:
  // `plan` is the call's (a member that outlives this one), read once it is
  // made. `beside_forward` is the call context's (CallContext::
  // beside_forward): where the call reports, or null.
  ProgressReport(
      const GraphPlan& plan,
      std::shared_ptr<CollectiveProgress> beside_forward)
      : plan_(plan), progress_(std::move(beside_forward)) {}

  // Whether the call runs beside the next microbatch's forward.
  bool reports() const {
    return progress_ != nullptr;
  }
  // The backward handed over that the call is, or null: what the
  // collective order check compares beside the collectives.
  const CollectiveProgress* beside_forward() const {
    return progress_.get();
  }

  // Once the plan is made, before any node runs, when the call reports
  // (BackwardCall::plan_collectives): tells the report target that the plan
  // starts `count` collectives, and registers this with `cleanups`. In turns
  // (`in_turns`), each planned collective waits for its turn (may_start): the
  // forward's collectives may then take turns with them.
  void plan(size_t count, bool in_turns, FailureCleanups& cleanups) {
    progress_->planned(count, in_turns);
    cleanups.add(*this);
  }

  // The node in `slot`'s planned collective on the engine thread, reported
  // when the call reports (PlannedCollectiveStart's first constructor).
  CollectiveProgress* progress_of(int32_t slot) const {
    return plan_.slots[slot].collective ? progress_.get() : nullptr;
  }
  // The same for a lane node's, shared with its lane (PlannedCollective).
  std::shared_ptr<CollectiveProgress> shared_progress_of(int32_t slot) const {
    return progress_of(slot) != nullptr ? progress_ : nullptr;
  }

  // A lane waiting for its collective's turn gives up rather than issue it
  // (CallLanes::on_failure, run after this one, joins the lanes).
  void on_failure() noexcept override {
    if (progress_ != nullptr) {
      progress_->abandoned();
    }
  }

 private:
  const GraphPlan& plan_;
  // Where this call reports the collectives it starts, when it runs beside
  // the next microbatch's forward; shared with the lanes.
  std::shared_ptr<CollectiveProgress> progress_;
};

} // namespace torch_ext
