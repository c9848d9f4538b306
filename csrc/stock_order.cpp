#include "stock_order.h"

#include "scheduler.h"

namespace torch_ext {

void order_deliveries_as_stock(GraphPlan& plan, bool every_slot_runs) {
  const size_t num_slots = plan.slots.size();
  const size_t num_node_edges = plan.edge_targets.size();
  const size_t num_edges = num_node_edges + plan.root_targets.size();

  // Input i of slot s is position position_base[s] + i.
  std::vector<uint32_t> position_base(num_slots + 1, 0);
  for (size_t s = 0; s < num_slots; ++s) {
    position_base[s + 1] = position_base[s] +
        static_cast<uint32_t>(plan.slots[s].fn->num_inputs());
  }
  std::vector<uint32_t> arrivals(position_base[num_slots], 0);
  std::vector<int32_t> position_of_edge(num_edges, kNoSlot);
  std::vector<uint32_t> rank(num_edges, 0);
  std::vector<int32_t> pending(num_slots);
  for (size_t s = 0; s < num_slots; ++s) {
    pending[s] = plan.slots[s].pending_edges;
  }
  // What BackwardCall::deliver and execute_node do with a slot.
  auto receives = [&](int32_t s) {
    return every_slot_runs || plan.slots[s].should_execute();
  };
  auto delivers = [&](int32_t s) {
    return every_slot_runs || !plan.filtered || plan.slots[s].needed;
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
    const uint32_t position = position_base[target] + input_nr;
    position_of_edge[edge] = static_cast<int32_t>(position);
    rank[edge] = arrivals[position]++;
    if (is_ready) {
      ready.push({0, plan.slots[target].fn->sequence_nr(), target});
    }
  };

  // BackwardCall::seed_roots: a single root always runs.
  if (plan.single_root) {
    const int32_t root = plan.root_targets[0];
    const uint32_t position = position_base[root] + plan.root_input_nrs[0];
    position_of_edge[num_node_edges] = static_cast<int32_t>(position);
    rank[num_node_edges] = arrivals[position]++;
    pending[root] = 0;
    ready.push({0, plan.slots[root].fn->sequence_nr(), root});
  } else {
    // Several roots: stock's GraphRoot delivers along each root edge, in
    // order, before any node runs.
    for (size_t r = 0; r < plan.root_targets.size(); ++r) {
      deliver(num_node_edges + r, plan.root_targets[r], plan.root_input_nrs[r]);
    }
  }
  while (!ready.empty()) {
    const int32_t s = ready.pop();
    const NodeSlot& slot = plan.slots[s];
    if (!delivers(s) || !slot.expanded) {
      continue;
    }
    const auto& next_edges = slot.fn->next_edges();
    for (size_t i = 0; i < next_edges.size(); ++i) {
      deliver(
          slot.first_edge + i, plan.target_of(s, i), next_edges[i].input_nr);
    }
  }

  std::vector<int32_t> ordered_index(arrivals.size(), kNoSlot);
  uint32_t num_ordered = 0;
  for (size_t p = 0; p < arrivals.size(); ++p) {
    if (arrivals[p] >= 3) {
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

} // namespace torch_ext
