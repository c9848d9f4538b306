#include "engine/plan/schedule_replay.h"

#include "engine/plan/scheduler.h"

#include <torch/csrc/autograd/anomaly_mode.h>

namespace torch_ext {

namespace {

// Replays a run of `plan` from its roots: `key(slot)` is the ready key a slot
// is queued with, `on_delivery(edge, target, input_nr)` sees each delivery a
// receiving slot gets, `on_run(slot)` each slot popped. Dependency counts are
// taken from the plan's edges, so a plan that is running can be replayed.
template <class Key, class OnDelivery, class OnRun>
void replay_schedule(
    const GraphPlan& plan,
    bool every_slot_runs,
    Key key,
    OnDelivery on_delivery,
    OnRun on_run) {
  const size_t num_slots = plan.slots.size();
  const size_t num_node_edges = plan.edge_targets.size();
  std::vector<int32_t> pending(num_slots, 0);
  for (const int32_t target : plan.edge_targets) {
    if (target != kNoSlot) {
      ++pending[target];
    }
  }
  if (!plan.single_root) {
    for (const int32_t target : plan.root_targets) {
      ++pending[target];
    }
  }
  auto receives = [&](int32_t s) {
    return every_slot_runs || plan.slots[s].should_execute();
  };
  auto delivers = [&](int32_t s) {
    return every_slot_runs || plan.slots[s].delivers_outputs();
  };
  ReadyQueue ready;
  auto deliver = [&](size_t edge, int32_t target, uint32_t input_nr) {
    if (target == kNoSlot) {
      return;
    }
    const bool is_ready = --pending[target] == 0;
    if (!receives(target)) {
      return;
    }
    on_delivery(edge, target, input_nr);
    if (is_ready) {
      ready.push(key(target));
    }
  };
  // BackwardCall::seed_roots: a single root always runs; several are
  // delivered along their root edges, in order, before any node runs.
  if (plan.single_root) {
    const int32_t root = plan.root_targets[0];
    on_delivery(num_node_edges, root, plan.root_input_nrs[0]);
    ready.push(key(root));
  } else {
    for (size_t r = 0; r < plan.root_targets.size(); ++r) {
      deliver(num_node_edges + r, plan.root_targets[r], plan.root_input_nrs[r]);
    }
  }
  while (!ready.empty()) {
    const int32_t s = ready.pop();
    on_run(s);
    const NodeSlot& slot = plan.slots[s];
    if (!delivers(s) || !slot.expanded) {
      continue;
    }
    const auto& next_edges = slot.fn->next_edges();
    for (size_t i = 0; i < next_edges.size(); ++i) {
      deliver(
          slot.first_edge + i,
          plan.target_of(s, i),
          next_edges[i].input_nr);
    }
  }
}

} // namespace

void order_deliveries_as_stock(GraphPlan& plan, bool every_slot_runs) {
  const size_t num_slots = plan.slots.size();
  const size_t num_edges = plan.edge_targets.size() + plan.root_targets.size();
  // Input i of slot s is position position_base[s] + i.
  std::vector<uint32_t> position_base(num_slots + 1, 0);
  for (size_t s = 0; s < num_slots; ++s) {
    position_base[s + 1] = position_base[s] +
        static_cast<uint32_t>(plan.slots[s].fn->num_inputs());
  }
  std::vector<uint32_t> arrivals(position_base[num_slots], 0);
  std::vector<int32_t> position_of_edge(num_edges, kNoSlot);
  std::vector<uint32_t> rank(num_edges, 0);
  replay_schedule(
      plan,
      every_slot_runs,
      [&](int32_t s) { return stock_ready_key(plan, s); },
      [&](size_t edge, int32_t target, uint32_t input_nr) {
        const uint32_t position = position_base[target] + input_nr;
        position_of_edge[edge] = static_cast<int32_t>(position);
        rank[edge] = arrivals[position]++;
      },
      [](int32_t) {});

  std::vector<int32_t> ordered_index(arrivals.size(), kNoSlot);
  uint32_t num_ordered = 0;
  for (size_t p = 0; p < arrivals.size(); ++p) {
    if (arrivals[p] >= 2) {
      ordered_index[p] = static_cast<int32_t>(num_ordered++);
    }
  }
  plan.ordered_input_of_edge.assign(num_edges, kNoSlot);
  plan.stock_rank_of_edge = std::move(rank);
  for (size_t e = 0; e < num_edges; ++e) {
    if (position_of_edge[e] != kNoSlot) {
      plan.ordered_input_of_edge[e] = ordered_index[position_of_edge[e]];
    }
  }
  plan.num_ordered_inputs = num_ordered;
  plan.stock_order_known = true;
}

bool hands_result_in_flight(const GraphPlan& plan, const Node& fn) {
  using torch::autograd::AnomalyMode;
  return plan.stock_order_known && fn.post_hooks().empty() &&
      !(AnomalyMode::is_enabled() && AnomalyMode::should_check_nan());
}

std::vector<int32_t> planned_run_slots(const GraphPlan& plan) {
  // A delivery from a node that hands its result over in flight makes its
  // target read that result in flight (DeferredWaits::note_delivery).
  std::vector<char> receives_in_flight(plan.slots.size(), 0);
  for (size_t s = 0; s < plan.slots.size(); ++s) {
    const NodeSlot& slot = plan.slots[s];
    if (!slot.defers_wait || !slot.expanded ||
        !hands_result_in_flight(plan, *slot.fn)) {
      continue;
    }
    for (size_t i = 0; i < slot.fn->next_edges().size(); ++i) {
      const int32_t target = plan.target_of(static_cast<int32_t>(s), i);
      if (target != kNoSlot) {
        receives_in_flight[target] = 1;
      }
    }
  }
  std::vector<int32_t> order;
  replay_schedule(
      plan,
      /*every_slot_runs=*/false,
      [&](int32_t s) { return ready_key(plan, s, receives_in_flight[s] != 0); },
      [](size_t, int32_t, uint32_t) {},
      [&](int32_t s) { order.push_back(s); });
  return order;
}

std::vector<Node*> planned_run_order(const GraphPlan& plan) {
  std::vector<Node*> order;
  for (const int32_t s : planned_run_slots(plan)) {
    order.push_back(plan.slots[s].fn);
  }
  return order;
}

} // namespace torch_ext
