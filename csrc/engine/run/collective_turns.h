#pragma once

// One call's collective sequence and its turns: every node that issues a
// collective (a launch, in a lane or not), in the order the plan runs them,
// the same on every rank with the same graph and priorities; with lane nodes
// or the collective order check (order_verdicts.h), each collective starts
// only when every one before it has, and one the engine runs itself also
// waits for the lanes to be idle (call_lanes.h), so no collective it knows of
// is issued beside a lane's. Held by value by every call
// (BackwardCall::turns_); a call that takes no turns holds nothing, and runs
// run()'s loop instead of BackwardCall::run_in_sequence. Not a CallFeature:
// its places and parked nodes are the engine thread's, and a failure leaves
// nothing of them to undo or complete.

#include "engine/plan/graph_plan.h"
#include "engine/planned_collective_start.h"

#include <cstdint>
#include <vector>

namespace torch_ext {

class CallLanes;

// The nodes that issue a collective, in the order `plan` runs them: the
// collective sequence, which the order check compares and whose length the
// report to the next microbatch's forward announces.
std::vector<int32_t> planned_collectives(const GraphPlan& plan);

class CollectiveTurns {
 public:
  // `plan` is the call's (a member that outlives this one), read once it is
  // made.
  explicit CollectiveTurns(const GraphPlan& plan) : plan_(plan) {}

  // Once the plan is made, before any node runs: decides whether the call
  // takes turns (not split backward's passes, whose kept and resumed nodes
  // the sequence does not replay: `split_pass`). `checks_order`: the ranks
  // compare the sequence (OrderVerdicts::plan).
  void plan(bool split_pass, bool checks_order);

  // Whether each collective starts in its turn (BackwardCall::
  // run_in_sequence).
  bool takes_turns() const {
    return takes_turns_;
  }

  // Before the first node runs, inside the call's error handling, when the
  // call takes turns: each slot's place in `in_order` (planned_collectives).
  void begin(const std::vector<int32_t>& in_order);

  // Whether the node in `slot` may start now (takes_turns): a node outside
  // the sequence always; one of it when every one before it has started
  // and, run by the engine itself (not on one of `lanes`), the lanes are
  // idle.
  bool is_turn_of(int32_t slot, const CallLanes& lanes) const;
  // `slot`, ready before its turn, waits for it.
  void park(int32_t slot) {
    parked_.push_back(slot);
  }
  // A parked node whose turn has come, taken out of the parked ones, or
  // kNoSlot.
  int32_t unpark(const CallLanes& lanes);
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

  // The node in `slot`'s place in the sequence, or kNoSlot (takes_turns).
  int32_t place_of(int32_t slot) const {
    return place_[slot];
  }
  // The turn the node in `slot`'s planned collective waits for beside the
  // next microbatch's forward (PlannedCollectiveStart), or kNoTurn.
  int32_t turn_of(int32_t slot) const {
    return takes_turns_ ? place_[slot] : kNoTurn;
  }

 private:
  const GraphPlan& plan_;
  bool takes_turns_ = false;
  // While the call takes turns: per slot, its place in the sequence, or
  // kNoSlot; the place whose turn it is; the nodes of the sequence that
  // became ready before their turn.
  std::vector<int32_t> place_;
  int32_t next_ = 0;
  std::vector<int32_t> parked_;
};

} // namespace torch_ext
