// Discovery: roots -> the dense GraphPlan the executor runs.
//
// Mirrors stock Engine::compute_dependencies (dependency counts, duplicate
// edges counted, min_topo_nr pruning) and GraphTask::init_to_execute (which
// nodes must run for grad() / backward(inputs=)), over slot indices instead of
// Node* hash maps.

#include "engine/host_interface.h"
#include "engine/plan/graph_plan.h"

#include <algorithm>
#include <array>
#include <limits>

namespace torch_ext {

uint64_t min_topological_nr(const edge_list& inputs) {
  if (inputs.empty()) {
    return 0;
  }
  uint64_t min_topo_nr = std::numeric_limits<uint64_t>::max();
  for (const auto& edge : inputs) {
    min_topo_nr = std::min(min_topo_nr, edge.function->topological_nr());
  }
  return min_topo_nr;
}

namespace {

class PlanBuilder {
 public:
  explicit PlanBuilder(GraphPlan& plan) : plan_(plan) {}

  // Slot of `fn`, created on first sight. Every call is one edge into `fn`.
  int32_t add_edge_to(Node* fn) {
    auto [it, inserted] =
        plan_.slot_of.emplace(fn, static_cast<int32_t>(plan_.slots.size()));
    if (inserted) {
      plan_.slots.emplace_back();
      plan_.slots.back().fn = fn;
      expand_stack_.push_back(it->second);
    }
    plan_.slots[it->second].pending_edges += 1;
    return it->second;
  }

  // The single-root case: stock makes the root node the graph root itself, so
  // it has no incoming edge.
  int32_t add_single_root(Node* fn) {
    const auto slot = static_cast<int32_t>(plan_.slots.size());
    plan_.slot_of.emplace(fn, slot);
    plan_.slots.emplace_back();
    plan_.slots.back().fn = fn;
    expand_stack_.push_back(slot);
    return slot;
  }

  void expand_all(uint64_t min_topo_nr) {
    // Depth-first, like stock: the order is not observable, only the counts.
    while (!expand_stack_.empty()) {
      const int32_t slot = expand_stack_.back();
      expand_stack_.pop_back();
      Node* fn = plan_.slots[slot].fn;
      if (fn->topological_nr() < min_topo_nr) {
        // Created before every input: no path to one, so it never runs and
        // its edges are never followed.
        continue;
      }
      const auto& next_edges = fn->next_edges();
      plan_.slots[slot].first_edge =
          static_cast<uint32_t>(plan_.edge_targets.size());
      plan_.slots[slot].expanded = true;
      // Recognised whether or not they get the automatic priority: a call
      // with collectives may defer their waits or run their wait nodes late,
      // and so must know stock's delivery order (schedule_replay.h).
      const CollectiveFlags flags = collective_flags_of(*fn);
      plan_.slots[slot].set_collective_flags(flags);
      plan_.has_collectives =
          plan_.has_collectives || flags.collective || flags.collective_wait;
      plan_.has_lanes = plan_.has_lanes || flags.runs_in_lane;
      plan_.edge_targets.resize(plan_.edge_targets.size() + next_edges.size());
      for (size_t i = 0; i < next_edges.size(); ++i) {
        Node* next = next_edges[i].function.get();
        // add_edge_to may grow slots; read first_edge again after it.
        const int32_t target = next ? add_edge_to(next) : kNoSlot;
        plan_.edge_targets[plan_.slots[slot].first_edge + i] = target;
      }
    }
  }

  int32_t slot_of(Node* fn) const {
    auto it = plan_.slot_of.find(fn);
    return it == plan_.slot_of.end() ? kNoSlot : it->second;
  }

 private:
  GraphPlan& plan_;
  std::vector<int32_t> expand_stack_;
};

// Stock GraphTask::init_to_execute over slots: a node is needed when one of
// its edges leads to a node that runs or captures. `single_root` is the
// single root's slot, or kNoSlot when the root edges are the walk's starts.
// Nodes older than every input are not expanded, so they lead nowhere.
void mark_needed(GraphPlan& plan, int32_t single_root) {
  auto mark = [&](int32_t slot) {
    NodeSlot& node = plan.slots[slot];
    for (size_t i = 0; i < plan.num_edges(slot) && !node.needed; ++i) {
      const int32_t child = plan.target_of(slot, i);
      node.needed = child != kNoSlot && plan.slots[child].should_execute();
    }
  };
  if (single_root != kNoSlot) {
    for_each_in_post_order(plan, std::array<int32_t, 1>{single_root}, mark);
  } else {
    for_each_in_post_order(plan, plan.root_targets, mark);
  }
}

// Effective priorities: a node runs with its own priority (default 0) or, if
// higher, the highest propagating priority of any node it leads to, so every
// node on a path from the roots to a prioritised node runs at least at that
// node's priority. One post-order pass: children before parents.
void assign_priorities(
    GraphPlan& plan,
    const CallPriorities& priorities,
    bool auto_collective) {
  const size_t num_slots = plan.slots.size();
  std::vector<std::optional<NodePriority>> own(num_slots);
  bool any = false;
  for (size_t i = 0; i < num_slots; ++i) {
    own[i] = priorities.lookup(plan.slots[i].fn);
    if (!own[i].has_value() && auto_collective && plan.slots[i].collective) {
      // An explicit priority on a collective's node wins over the automatic
      // one.
      own[i] = NodePriority{kCollectivePriority, /*propagate=*/true};
    }
    any = any || own[i].has_value();
  }
  if (!any) {
    return;
  }
  constexpr int64_t kNothing = std::numeric_limits<int64_t>::min();
  // below[s]: the highest propagating priority among the nodes s leads to.
  std::vector<int64_t> below(num_slots, kNothing);
  // Tracing only: the node below[s] came from, and how it got its own.
  const bool record_sources = plan.record_priority_sources;
  auto own_source = [&](int32_t slot) {
    if (!own[slot].has_value()) {
      return trace::PriorityFrom::kDefault;
    }
    Node* fn = plan.slots[slot].fn;
    if (priorities.is_call_override(fn)) {
      return trace::PriorityFrom::kCallOverride;
    }
    return priorities.lookup(fn).has_value()
        ? trace::PriorityFrom::kSetPriority
        : trace::PriorityFrom::kAutoCollective;
  };
  std::vector<PrioritySource> below_source(record_sources ? num_slots : 0);
  auto propagated_from = [&](int32_t slot) {
    const auto& mine = own[slot];
    const int64_t from_self =
        mine.has_value() && mine->propagate ? mine->priority : kNothing;
    return std::max(from_self, below[slot]);
  };
  // Where propagated_from(slot) comes from.
  auto propagated_source = [&](int32_t slot) {
    const auto& mine = own[slot];
    if (mine.has_value() && mine->propagate && mine->priority >= below[slot]) {
      return PrioritySource{
          trace::PriorityFrom::kPropagated,
          own_source(slot),
          plan.slots[slot].fn};
    }
    return below_source[slot];
  };
  // Children before parents: below[child] is final when its parents read it.
  for_each_in_post_order(plan, plan.root_targets, [&](int32_t slot) {
    for (size_t i = 0; i < plan.num_edges(slot); ++i) {
      const int32_t child = plan.target_of(slot, i);
      if (child == kNoSlot) {
        continue;
      }
      const int64_t from_child = propagated_from(child);
      if (record_sources && from_child > below[slot]) {
        below_source[slot] = propagated_source(child);
      }
      below[slot] = std::max(below[slot], from_child);
    }
  });

  plan.priority.resize(num_slots);
  for (size_t i = 0; i < num_slots; ++i) {
    const int64_t base = own[i].has_value() ? own[i]->priority : 0;
    plan.priority[i] = std::max(base, below[i]);
  }
  if (record_sources) {
    plan.priority_sources.resize(num_slots);
    for (size_t i = 0; i < num_slots; ++i) {
      const int64_t base = own[i].has_value() ? own[i]->priority : 0;
      if (below[i] > base) {
        plan.priority_sources[i] = below_source[i];
      } else {
        plan.priority_sources[i].from = own_source(static_cast<int32_t>(i));
      }
    }
  }
}

} // namespace

CollectiveFlags collective_flags_of(const Node& fn) {
  const CollectiveKind kind = host().collective_kind(fn);
  CollectiveFlags flags;
  flags.collective = is_launch(kind.role);
  flags.defers_wait = flags.collective && kind.defers_wait;
  flags.runs_in_lane = kind.role == CollectiveRole::kLane;
  flags.collective_wait = kind.role == CollectiveRole::kWait;
  return flags;
}

void discover_graph(
    GraphPlan& plan,
    const edge_list& roots,
    const edge_list& inputs,
    bool accumulate_grad,
    const CallPriorities& priorities,
    const edge_list* also_expand_to) {
  TORCH_INTERNAL_ASSERT(
      plan.slots.empty(),
      "discover_graph needs an empty plan");
  PlanBuilder builder(plan);
  const bool single_root = roots.size() == 1;
  plan.single_root = single_root;
  for (const auto& root : roots) {
    plan.root_input_nrs.push_back(root.input_nr);
  }
  if (single_root) {
    plan.root_targets.push_back(
        builder.add_single_root(roots[0].function.get()));
  } else {
    for (const auto& root : roots) {
      plan.root_targets.push_back(builder.add_edge_to(root.function.get()));
    }
  }
  uint64_t min_topo_nr = min_topological_nr(inputs);
  if (also_expand_to != nullptr && !also_expand_to->empty()) {
    // min_topological_nr of no edges is 0 (prune nothing), not a minimum.
    const uint64_t also = min_topological_nr(*also_expand_to);
    min_topo_nr = inputs.empty() ? also : std::min(min_topo_nr, also);
  }
  builder.expand_all(min_topo_nr);
  const bool auto_collective =
      plan.has_collectives && auto_collective_priority();
  if (!priorities.empty() || auto_collective) {
    assign_priorities(plan, priorities, auto_collective);
  }
  if (inputs.empty()) {
    return;
  }

  plan.filtered = true;
  for (auto& slot : plan.slots) {
    slot.needed = false;
  }
  std::vector<Capture> captures;
  uint32_t output_index = 0;
  for (const auto& input : inputs) {
    const int32_t slot = builder.slot_of(input.function.get());
    if (slot == kNoSlot) {
      // Not reachable from the roots: its gradient stays undefined.
      if (!accumulate_grad) {
        ++output_index;
      }
      continue;
    }
    if (accumulate_grad) {
      plan.slots[slot].needed = true;
    } else {
      captures.push_back({slot, input.input_nr, output_index++});
    }
  }
  // The executor visits a node's captures as one contiguous run, in the order
  // they were requested (stock runs a node's capture hooks in that order).
  std::stable_sort(
      captures.begin(),
      captures.end(),
      [](const Capture& a, const Capture& b) { return a.slot < b.slot; });
  for (int32_t i = static_cast<int32_t>(captures.size()) - 1; i >= 0; --i) {
    plan.slots[captures[i].slot].first_capture = i;
  }
  plan.captures = std::move(captures);

  mark_needed(plan, single_root ? plan.root_targets[0] : kNoSlot);
  for (auto& slot : plan.slots) {
    slot.action = slot.needed ? NodeAction::kRun : NodeAction::kCaptureOnly;
  }
}

} // namespace torch_ext
