// The collective sequence's turns (collective_turns.h): which node of it may
// start, and the ones that became ready before their turn.

#include "engine/run/collective_turns.h"
#include "engine/plan/schedule_replay.h"
#include "engine/run/call_lanes.h"

namespace torch_ext {

std::vector<int32_t> planned_collectives(const GraphPlan& plan) {
  std::vector<int32_t> in_order;
  for (const int32_t s : planned_run_slots(plan)) {
    if (plan.slots[s].collective) {
      in_order.push_back(s);
    }
  }
  return in_order;
}

void CollectiveTurns::plan(bool split_pass, bool checks_order) {
  // Lane nodes need turns; so does the order check, whose verdict each
  // collective awaits by its place. Not split backward's passes, whose kept
  // and resumed nodes the sequence does not replay: there the ranks still
  // compare the collectives the plan will start, before the first starts.
  takes_turns_ = (plan_.has_lanes || (plan_.has_collectives && checks_order)) &&
      plan_.seeds_roots && !plan_.resumes_kept_nodes && !split_pass;
}

void CollectiveTurns::begin(const std::vector<int32_t>& in_order) {
  place_.assign(plan_.slots.size(), kNoSlot);
  for (size_t i = 0; i < in_order.size(); ++i) {
    place_[in_order[i]] = static_cast<int32_t>(i);
  }
}

bool CollectiveTurns::is_turn_of(int32_t slot, const CallLanes& lanes) const {
  const int32_t place = place_[slot];
  if (place == kNoSlot) {
    return true;
  }
  return place == next_ && (lanes.runs_in_lane(slot) || !lanes.busy());
}

int32_t CollectiveTurns::unpark(const CallLanes& lanes) {
  for (size_t i = 0; i < parked_.size(); ++i) {
    const int32_t slot = parked_[i];
    if (is_turn_of(slot, lanes)) {
      parked_.erase(parked_.begin() + static_cast<std::ptrdiff_t>(i));
      return slot; // one node has each place
    }
  }
  return kNoSlot;
}

void CollectiveTurns::check_none_left_parked() const {
  TORCH_INTERNAL_ASSERT(
      parked_.empty(),
      "torch_ext: ",
      parked_.size(),
      " collective node(s) never reached their turn in the collective sequence");
}

} // namespace torch_ext
