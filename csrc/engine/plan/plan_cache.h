#pragma once

// Plan once, replay after (issue #14; the TorchScript interpreter's compile
// once, run many). A training loop builds a backward graph of the same
// structure every step, from new nodes. The first call of a structure
// discovers its plan (graph_discovery.cpp) and, for a call that may leave
// stock's order, replays stock's schedule for the delivery order
// (schedule_replay.h); once a structure has been seen twice, its plan is
// kept as a template. A later call walks the template's edges over its own
// nodes, checking that they have the same shape, and reuses everything
// derived from the structure: dependency counts, which nodes run and
// capture, priorities with their propagation, stock's delivery order.
//
// What makes a replay wrong forces a new plan, because it is checked on
// every call: another node type or edge count at any slot, an edge to
// another slot or input number, a node reached twice where the template has
// two, other pruning (topological_nr against the inputs), another collective
// role, another priority from the table or the call, another relative order
// of sequence numbers (stock's delivery order depends on it), another root,
// input or call kind (backward or grad, inputs= or not). Hooks, retain_graph,
// create_graph and anomaly mode are read from the nodes and the call while
// running, never from the plan, so they do not enter the key.

#include "engine/plan/graph_plan.h"

namespace torch_ext {

// Fills the empty `plan` for an ordinary call (not a split pass, not
// traced): replayed from this thread's cache when it holds the structure,
// else discovered (discover_graph), with stock's delivery order when
// priorities or collectives may reorder the call.
void plan_for_call(
    GraphPlan& plan,
    const edge_list& roots,
    const edge_list& inputs,
    bool accumulate_grad,
    const CallPriorities& priorities);

// Whether plan_for_call uses the cache (TORCH_EXT_PLAN_CACHE, on by
// default). Off, every call discovers its plan and templates are kept.
// The nodes a torch_ext backward from `roots` would run (grad() semantics
// with `inputs`, backward() without), in the order it would run them, with
// `priority_overrides` over the priority table: planned as a call plans
// (without the cache), then replayed (planned_run_order), nothing run.
std::vector<Node*> planned_execution_order(
    const edge_list& roots,
    const edge_list& inputs,
    std::vector<PriorityOverride> priority_overrides);

void set_plan_cache_enabled(bool enabled);
bool plan_cache_enabled();
// Drops this thread's templates.
void clear_plan_cache();

struct PlanCacheStats {
  // Calls replayed from a template, and calls that discovered their plan.
  int64_t hits = 0;
  int64_t misses = 0;
  // Templates kept now, and the bytes they hold.
  int64_t templates = 0;
  int64_t template_bytes = 0;
};
// This thread's counters since the last reset.
PlanCacheStats plan_cache_stats(bool reset);

} // namespace torch_ext
