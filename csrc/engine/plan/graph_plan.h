#pragma once

// The per-call view of the autograd graph that one torch_ext backward runs.
//
// Stock PyTorch keeps a GraphTask with three hash maps keyed by Node*
// (dependencies_, not_ready_, exec_info_) and looks a node up in each of them
// for every edge it routes a gradient along. torch_ext resolves every edge to a
// dense slot index once, during discovery, so the executor routes gradients by
// indexing vectors. (Most of what torch_ext saves per node is elsewhere: stock
// restores the whole thread-local state before every node, measured at ~38%
// of its instructions on a chain of tiny ops; see node_executor.cpp.)

#include "engine/plan/priority_table.h"
#include "engine/plan/scheduler.h"
#include "engine/trace.h"

#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/input_buffer.h>

#include <c10/util/flat_hash_map.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace torch_ext {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::InputBuffer;
using torch::autograd::Node;
using torch::autograd::variable_list;

// An edge whose target is not a node of this call (an invalid edge).
inline constexpr int32_t kNoSlot = -1;
// A delivery that is no edge of the plan (split backward's seeds); it is
// added on arrival.
inline constexpr int32_t kNoEdge = -1;

// What the executor does with a node when it becomes ready: the one node
// policy, as plan data. Discovery gives every node kRun or kCaptureOnly;
// split backward's passes (split_backward.cpp) rewrite the plan with the
// others. Only kRun exists in stock's engine (with kCaptureOnly its
// "captured but not needed" case).
enum class NodeAction : uint8_t {
  // Stock's call_function: tensor pre-hooks, retains_grad hooks, node
  // pre-hooks, apply, post hooks; then its saved variables are released
  // unless the graph is kept.
  kRun,
  // Not needed, only captured (grad()): its tensor pre-hooks and retains_grad
  // hooks run on its gradients, which are captured; apply() does not run.
  kCaptureOnly,
  // kCaptureOnly, then its node pre-hooks run and the gradients are kept
  // (KeptNode::inputs) for a later pass, which runs only its apply().
  kCaptureAndKeep,
  // Runs like kRun, but the gradients after its pre-hooks are kept and its
  // saved variables stay: a later pass runs apply() again for its edges
  // marked GraphPlan::later_pass_edge, whose gradients it does not deliver
  // now. If apply() already produced every one of them, those are kept
  // (KeptNode::outputs) instead, and the node is released now.
  kRunAndKeep,
  // Resumes what an earlier pass kept: delivers the kept outputs, or runs
  // apply() and the post hooks on the kept gradients (its pre-hooks ran in
  // that pass), then releases unless the graph is kept.
  kResumeKept,
};

// What a pass of split backward keeps of one node for the next pass: at most
// one of the two is set once the pass has run (or captured at) the node.
struct KeptNode {
  // Its gradients after the hooks that run before apply().
  std::optional<variable_list> inputs;
  // Or the outputs it already produced for the later pass's edges
  // (undefined at the other positions).
  std::optional<variable_list> outputs;
};

// Where a slot's gradients are while a call runs: an index into the call's
// input buffers (BackwardCall::buffers_), or kNoSlot. They are the call's,
// not the plan's: copying a plan (a template, plan_cache.h) copies no buffer.
// Kept out of the slot, an InputBuffer (four vectors and a stream) made a
// slot 168 bytes where it is now 48: a replayed call copies its template's
// slots, and the run loop reads them in no particular order.
struct SlotBuffer {
  int32_t index = kNoSlot;

  SlotBuffer() = default;
  SlotBuffer(const SlotBuffer& /*other*/) noexcept {}
  SlotBuffer& operator=(const SlotBuffer& /*other*/) noexcept {
    index = kNoSlot;
    return *this;
  }
  SlotBuffer(SlotBuffer&&) = default;
  SlotBuffer& operator=(SlotBuffer&&) = default;
  ~SlotBuffer() = default;

  bool has_value() const {
    return index != kNoSlot;
  }
};

// What a node's collective role makes of its slot
// (collectives/collective_role.h): the one rule, which discovery applies and
// the plan cache checks a replayed node against.
struct CollectiveFlags {
  bool collective = false;
  bool defers_wait = false;
  bool runs_in_lane = false;
  bool collective_wait = false;
  bool operator==(const CollectiveFlags&) const = default;
};
// Asks the host for `fn`'s role and, for a launch, whether it defers its wait
// (Host::collective_kind; graph_discovery.cpp).
CollectiveFlags collective_flags_of(const Node& fn);

// One node reachable from the roots.
struct NodeSlot {
  Node* fn = nullptr;
  // Edges into this node that have not delivered their gradient yet (stock's
  // dependencies_). The node becomes ready when this reaches zero.
  int32_t pending_edges = 0;
  // Offset of this node's next_edges() in GraphPlan::edge_targets; valid when
  // `expanded`. Nodes older than every input of grad() are not expanded: no
  // path leads from them to an input, so they never run.
  uint32_t first_edge = 0;
  bool expanded = false;
  // Whether apply() runs. Always true for backward() without inputs=; with
  // inputs= or grad() only nodes on a path to an input run (stock's
  // ExecInfo::needed_).
  bool needed = true;
  // The backward of a collective, prioritised automatically
  // (collectives/collective_role.h). These four are the node's
  // CollectiveFlags.
  bool collective = false;
  // A collective whose backward hands its result over in flight
  // (defer_wait_to_first_use, run/running_node.h): torch_ext's own ops.
  bool defers_wait = false;
  // A synchronous collective declared to run beside the rest: the call hands
  // its apply() to the lane of its process group (collective_lane.h).
  bool runs_in_lane = false;
  // The node waits for a collective's communication
  // (collectives/collective_role.h): it is queued behind every other ready node
  // of its priority.
  bool collective_wait = false;
  // A gradient delivered to this node is a collective's result still in
  // flight (defer_wait_to_first_use, run/running_node.h); wait before reading
  // it.
  bool has_pending_wait = false;
  // Index into GraphPlan::captures of the first capture on this node, or
  // kNoSlot. Captures of one node are contiguous.
  int32_t first_capture = kNoSlot;
  NodeAction action = NodeAction::kRun;

  CollectiveFlags collective_flags() const {
    return {collective, defers_wait, runs_in_lane, collective_wait};
  }
  void set_collective_flags(const CollectiveFlags& flags) {
    collective = flags.collective;
    defers_wait = flags.defers_wait;
    runs_in_lane = flags.runs_in_lane;
    collective_wait = flags.collective_wait;
  }
  // Index of what a split pass keeps of this node (SplitPassContext::kept),
  // or kNoSlot.
  int32_t kept = kNoSlot;
  // Left out of the host task's exec_info although it runs: its gradients
  // came complete from an earlier pass, and no node may recompute them
  // (task_should_compute_output); split backward's captured nodes of W.
  bool hidden_from_host = false;
  // Gradients delivered so far; created by the first delivery (stock's
  // not_ready_ entry).
  SlotBuffer inputs;

  // Whether it receives gradients (stock: an exec_info entry that is needed
  // or captures): BackwardCall::deliver, and the schedule replays.
  bool should_execute() const {
    return needed || first_capture != kNoSlot;
  }
  // Whether its apply() runs and its outputs are delivered along its edges:
  // every action but the two that only capture (BackwardCall::run_node_action,
  // and the schedule replays).
  bool delivers_outputs() const {
    return action != NodeAction::kCaptureOnly &&
        action != NodeAction::kCaptureAndKeep;
  }
};

// Where a slot's effective priority came from, for tracing: how it got it,
// and for a propagated priority the node it came from and how that node got
// its own.
struct PrioritySource {
  trace::PriorityFrom from = trace::PriorityFrom::kDefault;
  trace::PriorityFrom origin_from = trace::PriorityFrom::kDefault;
  Node* origin = nullptr;
};

// A gradient to hand back to the caller of grad(): input `input_nr` of the
// node it belongs to goes to result position `output_index`.
struct Capture {
  int32_t slot;
  uint32_t input_nr;
  uint32_t output_index;
};

struct GraphPlan {
  std::vector<NodeSlot> slots;
  // For slot s and its i-th next edge: slots[s].first_edge + i -> target slot.
  std::vector<int32_t> edge_targets;
  // Target slot and input of each root edge.
  std::vector<int32_t> root_targets;
  std::vector<uint32_t> root_input_nrs;
  std::vector<Capture> captures;
  // Whether only a subset of nodes runs (inputs= or grad()); stock's
  // "exec_info_ is not empty".
  bool filtered = false;
  // Each slot's effective priority (its own, or the highest propagated to it
  // from a node it leads to); empty when no priority applies to the call.
  std::vector<int64_t> priority;
  // Set before discovery while tracing: discovery then also fills
  // priority_sources (parallel to priority), which costs a second vector.
  bool record_priority_sources = false;
  std::vector<PrioritySource> priority_sources;
  // Whether any slot is `collective`; `runs_in_lane`.
  bool has_collectives = false;
  bool has_lanes = false;
  // Stock makes a single root the graph root itself (no incoming edge).
  bool single_root = false;

  // How the call starts (split backward's passes change it): deliver the
  // root gradients along the root edges, then make every node with a kept
  // index ready (a pass resuming an earlier one), in slot order.
  bool seeds_roots = true;
  bool resumes_kept_nodes = false;
  // Indexed by edge id (below): the edge's gradient is the later pass's
  // (a kRunAndKeep node keeps it, or its inputs to compute it again), not
  // delivered now. Empty when no edge is.
  std::vector<char> later_pass_edge;
  // Custom Python Functions run with ctx.needs_input_grad narrowed to the
  // gradients this pass computes (split_backward.h).
  bool narrows_needs_input_grad = false;

  // Bit-stable accumulation (docs/design.md, "Bits under any order"), filled by
  // order_deliveries_as_stock (schedule_replay.h) for a call that may run
  // producers out of stock's order. Indexed by edge id: slot s's i-th next
  // edge is slots[s].first_edge + i; root edge r is edge_targets.size() + r.
  // An input that receives two or more gradients has an index in
  // [0, num_ordered_inputs) (two-term sums commute in value, but the sum
  // takes the layout of the first term, so two are ordered too); each
  // delivery into it has its place in the order stock would deliver in.
  bool stock_order_known = false;
  uint32_t num_ordered_inputs = 0;
  std::vector<int32_t> ordered_input_of_edge;
  std::vector<uint32_t> stock_rank_of_edge;
  // Node -> slot, used while discovering. Open addressing: std::unordered_map
  // allocated once per node, a visible share of discovery in perf profiles of
  // a 10k-node chain.
  ska::flat_hash_map<Node*, int32_t> slot_of;

  int32_t target_of(int32_t slot, size_t edge_index) const {
    return edge_targets[slots[slot].first_edge + edge_index];
  }
  // How many edges of `slot` the plan has: its node's, if expanded.
  size_t num_edges(int32_t slot) const {
    const NodeSlot& node = slots[slot];
    return node.expanded ? node.fn->next_edges().size() : 0;
  }
};

// The one walk from nodes to what they lead to: calls visit(slot) once for
// every slot reachable from `starts` (slots), after every slot its edges lead
// to (the plan is a DAG). Used where a property flows from nodes to the nodes
// before them: which nodes are needed, effective priorities, what leads to a
// weight.
template <typename Starts, typename Visit>
void for_each_in_post_order(
    const GraphPlan& plan,
    const Starts& starts,
    Visit&& visit) {
  std::vector<char> visited(plan.slots.size(), 0);
  std::vector<std::pair<int32_t, size_t>> stack; // (slot, next edge)
  for (const int32_t start : starts) {
    if (visited[start]) {
      continue;
    }
    visited[start] = 1;
    stack.emplace_back(start, 0);
    while (!stack.empty()) {
      const int32_t slot = stack.back().first;
      const size_t edge = stack.back().second;
      if (edge < plan.num_edges(slot)) {
        ++stack.back().second;
        const int32_t child = plan.target_of(slot, edge);
        if (child != kNoSlot && !visited[child]) {
          visited[child] = 1;
          stack.emplace_back(child, 0);
        }
        continue;
      }
      visit(slot);
      stack.pop_back();
    }
  }
}

// The scheduling rule, in its one home: the key `slot` is queued with when it
// becomes ready. Its effective priority, then its sequence_nr, except that a
// node that would block on communication goes behind every other ready node
// of its priority, overlapping it: a node whose input is a collective's
// result in flight (`reads_result_in_flight`; a leaf's AccumulateGrad,
// sequence_nr UINT64_MAX, would otherwise run, and wait, at once), and a
// collective's wait node, which runs as late as its readers allow. The
// executor (BackwardCall::ready_key) and the replay of its order
// (planned_run_slots) both ask it.
inline ReadyNode ready_key(
    const GraphPlan& plan,
    int32_t slot,
    bool reads_result_in_flight) {
  const NodeSlot& node = plan.slots[slot];
  const int64_t priority = plan.priority.empty() ? 0 : plan.priority[slot];
  const uint64_t order = reads_result_in_flight || node.collective_wait
      ? 0
      : node.fn->sequence_nr();
  return {priority, order, slot};
}

// Stock's key: sequence_nr alone (its heap is over reentrant depth and
// sequence_nr, and a call runs at one depth).
inline ReadyNode stock_ready_key(const GraphPlan& plan, int32_t slot) {
  return {0, plan.slots[slot].fn->sequence_nr(), slot};
}

// The smallest topological_nr of `inputs`' nodes, or 0 for none: a node
// below it cannot lead to an input, and discovery does not expand it.
uint64_t min_topological_nr(const edge_list& inputs);

// Fills the empty `plan` for running backward from `roots`. With `inputs` empty
// every reachable node runs; otherwise only the nodes on a path from a root to
// an input run, and the gradient arriving at each input is captured at its
// result position (grad()), or, with `accumulate_grad`, the input's own node
// runs (backward(inputs=...)).
//
// `priorities` gives each slot its effective priority (GraphPlan::priority).
//
// `also_expand_to`, when given, lists edges besides `inputs` whose paths from
// the roots must be in the plan (split backward's weights): nodes older than
// every input are expanded all the same if they may lead to one of them.
void discover_graph(
    GraphPlan& plan,
    const edge_list& roots,
    const edge_list& inputs,
    bool accumulate_grad,
    const CallPriorities& priorities,
    const edge_list* also_expand_to = nullptr);

} // namespace torch_ext
