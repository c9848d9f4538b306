// Plan once, replay after: see plan_cache.h.

#include "engine/plan/plan_cache.h"

#include "collectives/collective_role.h"
#include "engine/plan/schedule_replay.h"

#include <algorithm>
#include <atomic>
#include <numeric>
#include <typeinfo>

namespace torch_ext {
namespace {

std::atomic<bool> cache_enabled{true};

// What a call contributes to a structure's identity besides its nodes.
struct CallKey {
  size_t num_roots = 0;
  size_t num_inputs = 0;
  bool accumulate_grad = true;
  bool auto_collective = true;
  bool has_priorities = false;

  bool operator==(const CallKey& other) const {
    return num_roots == other.num_roots && num_inputs == other.num_inputs &&
        accumulate_grad == other.accumulate_grad &&
        auto_collective == other.auto_collective &&
        has_priorities == other.has_priorities;
  }
};

bool same_priority(
    const std::optional<NodePriority>& a,
    const std::optional<NodePriority>& b) {
  if (a.has_value() != b.has_value()) {
    return false;
  }
  return !a.has_value() ||
      (a->priority == b->priority && a->propagate == b->propagate);
}

// A structure's plan with its nodes taken out, and what a call must match
// to reuse it.
struct PlanTemplate {
  CallKey key;
  // Every slot's fn is null; slot_of is empty.
  GraphPlan plan;
  // Per slot: the node's dynamic type, and its number of next edges.
  std::vector<const std::type_info*> types;
  std::vector<uint32_t> num_edges;
  // Per node edge id: the input of its target the edge delivers to.
  std::vector<uint32_t> edge_input_nrs;
  // Per input of the call: its slot (kNoSlot if no root reaches it) and
  // input number.
  std::vector<int32_t> input_slots;
  std::vector<uint32_t> input_nrs;
  // The slots sorted by sequence_nr, and whether each has the same number as
  // the one before: stock's delivery order follows the numbers' relative
  // order, and distinct numbers are distinct nodes.
  std::vector<int32_t> by_sequence_nr;
  std::vector<char> same_sequence_nr_as_previous;
  // When the call had priorities: each slot's own, from the table or the
  // call.
  std::vector<std::optional<NodePriority>> own_priorities;
  size_t bytes = 0;
};

// A structure seen once, remembered by its size only: a one-off backward
// does not pay for a template.
struct SeenOnce {
  CallKey key;
  size_t num_slots;
  size_t num_edges;
};

// Templates kept per thread, least recently used dropped first. A training
// step has one backward structure (a pipeline stage a few: forward micro
// batches of two shapes, a loss stage); eight cover those with room, and a
// template costs about 75 bytes per node (plan_cache_stats: 78 on a
// 3,000-node chain, 73 on a 32-layer MLP).
constexpr size_t kMaxTemplates = 8;

struct ThreadCache {
  // Most recently used first.
  std::vector<PlanTemplate> templates;
  std::vector<SeenOnce> seen_once;
  PlanCacheStats stats;
  // Scratch, kept to reuse its capacity.
  std::vector<Node*> bound;
  // Nodes sorted by address: a run of equal sequence numbers, or every
  // bound node where an input must be out of reach.
  std::vector<Node*> sorted_nodes;
};

thread_local ThreadCache thread_cache;

size_t template_bytes(const PlanTemplate& t) {
  const GraphPlan& p = t.plan;
  return p.slots.capacity() * sizeof(NodeSlot) +
      p.edge_targets.capacity() * sizeof(int32_t) +
      p.ordered_input_of_edge.capacity() * sizeof(int32_t) +
      p.stock_rank_of_edge.capacity() * sizeof(uint32_t) +
      p.priority.capacity() * sizeof(int64_t) +
      p.captures.capacity() * sizeof(Capture) +
      t.types.capacity() * sizeof(void*) +
      t.num_edges.capacity() * sizeof(uint32_t) +
      t.edge_input_nrs.capacity() * sizeof(uint32_t) +
      t.by_sequence_nr.capacity() * sizeof(int32_t) +
      t.same_sequence_nr_as_previous.capacity() +
      t.own_priorities.capacity() * sizeof(std::optional<NodePriority>);
}

// Binds `fn` to `slot`, or checks that it is the node bound there already.
bool bind(std::vector<Node*>& bound, int32_t slot, Node* fn) {
  if (bound[slot] == nullptr) {
    bound[slot] = fn;
    return true;
  }
  return bound[slot] == fn;
}

// Walks the template's edges over the call's nodes: true, with `bound`
// holding each slot's node, if they have the template's structure.
bool rebind(
    const PlanTemplate& t,
    const edge_list& roots,
    const edge_list& inputs,
    const CallPriorities& priorities,
    std::vector<Node*>& bound,
    std::vector<Node*>& sorted_nodes) {
  const GraphPlan& plan = t.plan;
  const size_t num_slots = plan.slots.size();
  bound.assign(num_slots, nullptr);
  for (size_t r = 0; r < roots.size(); ++r) {
    if (roots[r].input_nr != plan.root_input_nrs[r] ||
        !bind(bound, plan.root_targets[r], roots[r].function.get())) {
      return false;
    }
  }
  const uint64_t min_topo_nr = min_topological_nr(inputs);
  // Slots were created in discovery as edges reached them, each from a slot
  // created before it: walking them in order binds every slot before its
  // own edges are walked.
  for (size_t s = 0; s < num_slots; ++s) {
    const NodeSlot& slot = plan.slots[s];
    Node* fn = bound[s];
    if (fn == nullptr || &typeid(*fn) != t.types[s] ||
        (fn->topological_nr() >= min_topo_nr) != slot.expanded) {
      return false;
    }
    if (collective_flags_of(*fn) != slot.collective_flags()) {
      return false;
    }
    if (t.key.has_priorities &&
        !same_priority(priorities.lookup(fn), t.own_priorities[s])) {
      return false;
    }
    if (!slot.expanded) {
      continue;
    }
    const auto& next_edges = fn->next_edges();
    if (next_edges.size() != t.num_edges[s]) {
      return false;
    }
    for (size_t i = 0; i < next_edges.size(); ++i) {
      const size_t edge = slot.first_edge + i;
      const int32_t target = plan.edge_targets[edge];
      Node* next = next_edges[i].function.get();
      if (target == kNoSlot) {
        if (next != nullptr) {
          return false;
        }
        continue;
      }
      if (next == nullptr || next_edges[i].input_nr != t.edge_input_nrs[edge] ||
          !bind(bound, target, next)) {
        return false;
      }
    }
  }
  // Every slot a distinct node (a graph that reuses one node where the
  // template had two passes every edge check above), with the sequence
  // numbers in the template's relative order. One pass over the slots in
  // the template's sequence_nr order: where the template's numbers rise the
  // call's must rise, which also makes those nodes distinct; only a run of
  // equal numbers (every AccumulateGrad has UINT64_MAX) is compared sorted.
  // Sorting every slot's node instead cost 2% of a 3,000-node chain's
  // backward (perf).
  const size_t num_ordered = t.by_sequence_nr.size();
  for (size_t k = 0; k < num_ordered;) {
    size_t run_end = k + 1;
    while (run_end < num_ordered && t.same_sequence_nr_as_previous[run_end]) {
      ++run_end;
    }
    const uint64_t number = bound[t.by_sequence_nr[k]]->sequence_nr();
    if (k > 0 && bound[t.by_sequence_nr[k - 1]]->sequence_nr() >= number) {
      return false;
    }
    if (run_end - k > 1) {
      sorted_nodes.clear();
      for (size_t j = k; j < run_end; ++j) {
        Node* fn = bound[t.by_sequence_nr[j]];
        if (fn->sequence_nr() != number) {
          return false;
        }
        sorted_nodes.push_back(fn);
      }
      std::sort(sorted_nodes.begin(), sorted_nodes.end());
      if (std::adjacent_find(sorted_nodes.begin(), sorted_nodes.end()) !=
          sorted_nodes.end()) {
        return false;
      }
    }
    k = run_end;
  }
  // An input no root reached must still be out of reach: looked up in the
  // bound nodes, sorted once for every such input of the call.
  bool bound_sorted = false;
  for (size_t j = 0; j < inputs.size(); ++j) {
    Node* input = inputs[j].function.get();
    const int32_t slot = t.input_slots[j];
    if (inputs[j].input_nr != t.input_nrs[j]) {
      return false;
    }
    if (slot != kNoSlot) {
      if (bound[slot] != input) {
        return false;
      }
      continue;
    }
    if (!bound_sorted) {
      sorted_nodes.assign(bound.begin(), bound.end());
      std::sort(sorted_nodes.begin(), sorted_nodes.end());
      bound_sorted = true;
    }
    if (std::binary_search(sorted_nodes.begin(), sorted_nodes.end(), input)) {
      return false;
    }
  }
  return true;
}

// The template of a plan discover_graph just made.
PlanTemplate make_template(
    GraphPlan& plan,
    const CallKey& key,
    const edge_list& inputs,
    const CallPriorities& priorities) {
  PlanTemplate t;
  t.key = key;
  for (const auto& input : inputs) {
    auto it = plan.slot_of.find(input.function.get());
    t.input_slots.push_back(it == plan.slot_of.end() ? kNoSlot : it->second);
    t.input_nrs.push_back(input.input_nr);
  }
  // Copy everything but the node lookup, which only discovery reads.
  ska::flat_hash_map<Node*, int32_t> slot_of;
  std::swap(slot_of, plan.slot_of);
  t.plan = plan;
  std::swap(slot_of, plan.slot_of);
  const size_t num_slots = plan.slots.size();
  t.types.resize(num_slots);
  t.num_edges.resize(num_slots);
  t.edge_input_nrs.resize(plan.edge_targets.size());
  if (key.has_priorities) {
    t.own_priorities.resize(num_slots);
  }
  for (size_t s = 0; s < num_slots; ++s) {
    NodeSlot& slot = t.plan.slots[s];
    Node* fn = slot.fn;
    t.types[s] = &typeid(*fn);
    t.num_edges[s] = static_cast<uint32_t>(fn->next_edges().size());
    if (slot.expanded) {
      for (size_t i = 0; i < fn->next_edges().size(); ++i) {
        t.edge_input_nrs[slot.first_edge + i] = fn->next_edge(i).input_nr;
      }
    }
    if (key.has_priorities) {
      t.own_priorities[s] = priorities.lookup(fn);
    }
    slot.fn = nullptr;
  }
  t.by_sequence_nr.resize(num_slots);
  std::iota(t.by_sequence_nr.begin(), t.by_sequence_nr.end(), 0);
  std::stable_sort(
      t.by_sequence_nr.begin(),
      t.by_sequence_nr.end(),
      [&](int32_t a, int32_t b) {
        return plan.slots[a].fn->sequence_nr() <
            plan.slots[b].fn->sequence_nr();
      });
  t.same_sequence_nr_as_previous.assign(num_slots, 0);
  for (size_t k = 1; k < num_slots; ++k) {
    t.same_sequence_nr_as_previous[k] =
        plan.slots[t.by_sequence_nr[k - 1]].fn->sequence_nr() ==
        plan.slots[t.by_sequence_nr[k]].fn->sequence_nr();
  }
  t.bytes = template_bytes(t);
  return t;
}

void discover(
    GraphPlan& plan,
    const edge_list& roots,
    const edge_list& inputs,
    bool accumulate_grad,
    const CallPriorities& priorities) {
  discover_graph(plan, roots, inputs, accumulate_grad, priorities);
  if (!plan.priority.empty() || plan.has_collectives) {
    // Priorities and deferred collective waits run nodes out of stock's
    // order; the sums must not notice.
    order_deliveries_as_stock(plan, /*every_slot_runs=*/false);
  }
}

} // namespace

void plan_for_call(
    GraphPlan& plan,
    const edge_list& roots,
    const edge_list& inputs,
    bool accumulate_grad,
    const CallPriorities& priorities) {
  // A traced call records where each priority came from, which the
  // template does not keep.
  if (!cache_enabled.load(std::memory_order_relaxed) ||
      plan.record_priority_sources) {
    discover(plan, roots, inputs, accumulate_grad, priorities);
    return;
  }
  ThreadCache& cache = thread_cache;
  const CallKey key{
      roots.size(),
      inputs.size(),
      accumulate_grad,
      auto_collective_priority(),
      !priorities.empty()};
  for (size_t i = 0; i < cache.templates.size(); ++i) {
    const PlanTemplate& t = cache.templates[i];
    if (!(t.key == key) ||
        !rebind(
            t,
            roots,
            inputs,
            priorities,
            cache.bound,
            cache.sorted_nodes)) {
      continue;
    }
    plan = t.plan;
    for (size_t s = 0; s < plan.slots.size(); ++s) {
      plan.slots[s].fn = cache.bound[s];
    }
    if (i != 0) {
      std::rotate(
          cache.templates.begin(),
          cache.templates.begin() + i,
          cache.templates.begin() + i + 1);
    }
    ++cache.stats.hits;
    return;
  }
  ++cache.stats.misses;
  discover(plan, roots, inputs, accumulate_grad, priorities);
  // Kept once the structure comes back: the second call with its size.
  const SeenOnce seen{key, plan.slots.size(), plan.edge_targets.size()};
  auto it = std::find_if(
      cache.seen_once.begin(),
      cache.seen_once.end(),
      [&](const SeenOnce& s) {
        return s.key == seen.key && s.num_slots == seen.num_slots &&
            s.num_edges == seen.num_edges;
      });
  if (it == cache.seen_once.end()) {
    if (cache.seen_once.size() == kMaxTemplates) {
      cache.seen_once.pop_back();
    }
    cache.seen_once.insert(cache.seen_once.begin(), seen);
    return;
  }
  cache.seen_once.erase(it);
  if (cache.templates.size() == kMaxTemplates) {
    cache.templates.pop_back();
  }
  cache.templates.insert(
      cache.templates.begin(),
      make_template(plan, key, inputs, priorities));
}

std::vector<Node*> planned_execution_order(
    const edge_list& roots,
    const edge_list& inputs,
    std::vector<PriorityOverride> priority_overrides) {
  GraphPlan plan;
  // As a call plans: stock's delivery order known where the call would know
  // it, which decides whether a collective hands its result over in flight
  // (hands_result_in_flight).
  discover(
      plan,
      roots,
      inputs,
      /*accumulate_grad=*/false,
      CallPriorities(std::move(priority_overrides)));
  return planned_run_order(plan);
}

void set_plan_cache_enabled(bool enabled) {
  cache_enabled.store(enabled, std::memory_order_relaxed);
}

void clear_plan_cache() {
  thread_cache.templates.clear();
  thread_cache.seen_once.clear();
}

bool plan_cache_enabled() {
  return cache_enabled.load(std::memory_order_relaxed);
}

PlanCacheStats plan_cache_stats(bool reset) {
  PlanCacheStats stats = thread_cache.stats;
  stats.templates = static_cast<int64_t>(thread_cache.templates.size());
  for (const auto& t : thread_cache.templates) {
    stats.template_bytes += static_cast<int64_t>(t.bytes);
  }
  if (reset) {
    thread_cache.stats = PlanCacheStats{};
  }
  return stats;
}

} // namespace torch_ext
