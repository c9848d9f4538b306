#pragma once

// Starting a collective that a call planned, on the thread that issues it:
// the engine thread for the nodes it runs (run/node_executor.cpp), a lane
// for a lane node (engine/run/collective_lane.cpp). What that takes is
// written once, here: the collective order check's verdict, the turn beside
// the next microbatch's forward (collective_progress.h), this thread marked
// as starting a planned collective (the collective gate lets it through),
// and the report that it started.

#include "engine/collective_progress.h"
#include "engine/host_interface.h"

#include <cstdint>
#include <memory>
#include <optional>

namespace torch_ext {

// PlannedCollective::place for a collective that takes no turn: its call
// does not hold its collectives to the plan's order (split backward's
// passes), so it waits for no turn beside the forward either.
inline constexpr int32_t kNoTurn = -1;

// What a lane needs of the planned collective its node starts, carried with
// the node: shared, since a lane detached after Ctrl-C outlives the call.
struct PlannedCollective {
  // Where the call reports its collectives, or null.
  std::shared_ptr<CollectiveProgress> progress;
  // The call's collective order check, or null.
  std::shared_ptr<CollectiveOrderCheck> order_check;
  // Its place in the plan's order of collectives (0 first), or kNoTurn.
  int32_t place = kNoTurn;
};

// One planned collective being started, for the scope of the apply() that
// issues it: constructed before apply(), started() once it returned. What
// apply() raises leaves it unreported (the call fails, and abandons the
// rest).
class PlannedCollectiveStart {
 public:
  // On the engine thread, which awaited the order check before the node's
  // hooks ran (a hook may communicate; OrderVerdicts::await_before): waits
  // for the turn at `place` (kNoTurn: none) and reports to `progress`, if
  // any. The collective started once apply() returned: an asynchronous one
  // is then in flight.
  PlannedCollectiveStart(CollectiveProgress* progress, int32_t place)
      : progress_(progress) {
    take_turn(place);
  }

  // On a lane, whose node runs one collective (run_in_lane's contract):
  // awaits the order check's verdict for it here, where the lane would block
  // in the collective anyway, then waits for its turn. The collective gate
  // reports it started as soon as it is issued (IssuingLaneNode), so the
  // forward's next collective is issued right behind it; started() reports
  // it only if the gate never saw it (a functional collective).
  explicit PlannedCollectiveStart(const PlannedCollective& planned)
      : progress_(planned.progress.get()) {
    if (planned.order_check != nullptr) {
      planned.order_check->await(planned.place);
    }
    take_turn(planned.place);
    if (progress_ != nullptr) {
      issuing_ = std::make_shared<IssuingLaneNode>();
      issuing_->progress = planned.progress;
      // After the check's own exchange, which is not the node's collective.
      set_issuing_lane_node(issuing_);
    }
  }

  ~PlannedCollectiveStart() {
    if (issuing_ != nullptr) {
      set_issuing_lane_node(nullptr);
    }
  }
  PlannedCollectiveStart(const PlannedCollectiveStart&) = delete;
  PlannedCollectiveStart& operator=(const PlannedCollectiveStart&) = delete;

  // apply() returned without error.
  void started() {
    if (progress_ == nullptr) {
      return;
    }
    if (issuing_ == nullptr || issuing_->issued == 0) {
      progress_->started_one();
    }
  }

 private:
  void take_turn(int32_t place) {
    if (progress_ == nullptr) {
      return;
    }
    if (place != kNoTurn) {
      progress_->may_start(static_cast<size_t>(place));
    }
    starting_.emplace();
  }

  CollectiveProgress* progress_;
  // While it starts, this thread is marked as starting a planned collective.
  std::optional<StartingPlannedCollective> starting_;
  // On a lane: the node the collective gate counts the collectives of.
  std::shared_ptr<IssuingLaneNode> issuing_;
};

} // namespace torch_ext
