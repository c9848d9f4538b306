// The collective order check's verdicts for one call (order_verdicts.h):
// begun on the call's collective sequence, awaited before each collective and
// hook.

#include "engine/run/order_verdicts.h"
#include "engine/run/node_steps.h"

namespace torch_ext {

void OrderVerdicts::plan() {
  checks_order_ = (plan_.has_lanes || plan_.has_collectives) &&
      host().collective_check_enabled();
}

void OrderVerdicts::begin(
    const std::vector<int32_t>& in_order,
    const CollectiveProgress* beside_forward) {
  std::vector<CheckedCollective> checked;
  checked.reserve(in_order.size());
  for (const int32_t s : in_order) {
    checked.push_back({plan_.slots[s].fn, plan_.slots[s].fn->sequence_nr()});
  }
  order_check_ = host().begin_collective_check(checked, beside_forward);
  awaits_order_check_ = order_check_ != nullptr;
}

void OrderVerdicts::await_verdict_before(
    int32_t slot,
    bool in_turns,
    int32_t place,
    bool on_a_lane) {
  const NodeSlot& node = plan_.slots[slot];
  // A hook may communicate (DDP's all_reduce, FSDP's reduce-scatter, a
  // user's), on any group: none runs before the ranks agree, or a divergence
  // would leave that group out of step on the ranks whose hook got there
  // first. A lane node's collective awaits the verdict on its lane instead
  // (PlannedCollectiveStart; its hooks run here), where there are lanes:
  // split backward's passes run it inline.
  if (has_any_hooks(*node.fn)) {
    order_check_->await(CollectiveOrderCheck::kEveryCollective);
    awaits_order_check_ = false;
  } else if (node.collective && !on_a_lane) {
    // Split backward's passes have no turns to say which collective this
    // is: they await every verdict.
    order_check_->await(
        in_turns ? place : CollectiveOrderCheck::kEveryCollective);
    awaits_order_check_ = in_turns;
  }
}

void OrderVerdicts::on_failure() noexcept {
  if (order_check_ != nullptr) {
    order_check_->complete_after_error();
  }
}

} // namespace torch_ext
