// Split backward (see split_backward.h) as two rewrites of a discovered
// plan: the dI plan runs D and keeps what the frontier needs (NodeAction
// kRunAndKeep, kCaptureAndKeep); the dW plan resumes it (kResumeKept) and
// runs the weight subgraph. The executor runs both like any plan.

#include "engine/split/split_backward.h"
#include "engine/backward_request.h"
#include "engine/plan/schedule_replay.h"
#include "engine/run/run_call.h"
#include "engine/split/batched_accumulation.h"

#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <sstream>
#include <unordered_set>

namespace torch_ext {

// A root gradient whose edge leads into W: the dW pass's root.
struct WeightSideRoot {
  // Its target's slot in SplitState::weight_plan.
  int32_t slot;
  uint32_t input_nr;
  at::Tensor grad;
  std::optional<c10::Stream> stream;
};

struct SplitState {
  // The dW pass's plan over the frontier nodes and W: dependency counts as
  // discovered by the dI pass, every node needed, edges out of W dropped.
  // Frontier nodes (a kept index) resume what the dI pass kept.
  GraphPlan weight_plan;
  // weight_plan holds raw pointers; these keep its nodes alive even once the
  // caller has dropped (or detached) the outputs. Parallel to its slots.
  std::vector<c10::intrusive_ptr<Node>> nodes;
  // What the dI pass keeps of each frontier node for the dW pass: a node of
  // D with a next edge into W, or a captured node of W (an input upstream of
  // a weight: every edge into it comes from D, so its gradients are complete
  // in dI). Indexed by NodeSlot::kept in both plans.
  std::vector<KeptNode> kept;
  std::vector<WeightSideRoot> weight_side_roots;
  variable_list weights;
  // Set by the first backward_weight. Atomic: two threads may resume one
  // state at once (the GIL is released), and exactly one may run.
  std::atomic<bool> consumed{false};

  // Everything the dW pass needed, dropped once it ran (or failed).
  void release() {
    weight_plan = GraphPlan();
    nodes.clear();
    kept.clear();
    weight_side_roots.clear();
  }
};

namespace {

// Whether each slot leads to one of `weight_slots` (a weight's slot included).
std::vector<char> leads_to_weight(
    const GraphPlan& plan,
    const std::vector<int32_t>& weight_slots) {
  const size_t num_slots = plan.slots.size();
  std::vector<char> leads(num_slots, 0);
  for (const int32_t slot : weight_slots) {
    leads[slot] = 1;
  }
  std::vector<int32_t> every_slot(num_slots);
  std::iota(every_slot.begin(), every_slot.end(), 0);
  for_each_in_post_order(plan, every_slot, [&](int32_t slot) {
    for (size_t i = 0; i < plan.num_edges(slot) && !leads[slot]; ++i) {
      const int32_t child = plan.target_of(slot, i);
      leads[slot] = child != kNoSlot && leads[child];
    }
  });
  return leads;
}

// Rewrites the plan discovered for the dI pass (grad(inputs), with every
// path to a weight expanded) into the dI plan, and builds the dW plan from
// it into the state.
class InputPassRewrite {
 public:
  InputPassRewrite(
      const edge_list& roots,
      const variable_list& root_grads,
      const edge_list& inputs,
      const edge_list& weights,
      bool allow_unused,
      SplitState& state)
      : roots_(roots),
        root_grads_(root_grads),
        inputs_(inputs),
        weights_(weights),
        allow_unused_(allow_unused),
        state_(state) {}

  void rewrite(GraphPlan& plan) {
    if (inputs_.empty()) {
      // No input needs a gradient (a pipeline's first stage): nothing runs
      // now, everything in the weight pass.
      plan.filtered = true;
      for (auto& slot : plan.slots) {
        slot.needed = false;
        slot.action = NodeAction::kCaptureOnly;
      }
    }
    check_reachable(plan);
    // The two passes together must sum every input buffer as one full
    // backward would, although the weight pass runs W's nodes after every
    // node of D (and the frontier nodes ready at once).
    order_deliveries_as_stock(plan, /*every_slot_runs=*/true);
    classify(plan);
    build_weight_plan(plan);
    plan.narrows_needs_input_grad = true;
    // A single root in W has nothing to run now; stock would still run its
    // tensor pre-hooks, which the weight pass does.
    plan.seeds_roots = !single_root_on_weight_side_;
  }

 private:
  void check_reachable(const GraphPlan& plan) const {
    if (allow_unused_) {
      return;
    }
    for (size_t i = 0; i < inputs_.size(); ++i) {
      TORCH_CHECK(
          plan.slot_of.count(inputs_[i].function.get()) != 0,
          "backward_input: input ",
          i,
          " is not used to compute the outputs. Pass allow_unused=True if "
          "this is expected.");
    }
    for (size_t i = 0; i < weights_.size(); ++i) {
      TORCH_CHECK(
          plan.slot_of.count(weights_[i].function.get()) != 0,
          "backward_input: weight ",
          i,
          " is not used to compute the outputs. Pass allow_unused=True if "
          "this is expected.");
    }
  }

  // D: the slots the plan runs (`needed`). W: the others that lead to a
  // weight. Frontier: slots of D with an edge into W (kRunAndKeep), and
  // slots of W that capture (kCaptureAndKeep). Edges from D into W that do
  // not end in a captured node carry the weight pass's gradients.
  void classify(GraphPlan& plan) {
    std::vector<int32_t> weight_slots;
    for (const auto& weight : weights_) {
      auto it = plan.slot_of.find(weight.function.get());
      if (it != plan.slot_of.end()) {
        weight_slots.push_back(it->second);
      }
    }
    const auto leads = leads_to_weight(plan, weight_slots);
    const size_t num_slots = plan.slots.size();
    weight_side_.assign(num_slots, 0);
    for (size_t s = 0; s < num_slots; ++s) {
      weight_side_[s] = !plan.slots[s].needed && leads[s];
    }
    plan.later_pass_edge.assign(
        plan.edge_targets.size() + plan.root_targets.size(),
        0);
    for (size_t s = 0; s < num_slots; ++s) {
      NodeSlot& node = plan.slots[s];
      if (is_captured_weight_side(plan, static_cast<int32_t>(s))) {
        node.action = NodeAction::kCaptureAndKeep;
        node.kept = static_cast<int32_t>(state_.kept.size());
        state_.kept.emplace_back();
        continue;
      }
      if (!node.needed || !node.expanded) {
        continue;
      }
      for (size_t i = 0; i < node.fn->next_edges().size(); ++i) {
        const int32_t target = plan.target_of(static_cast<int32_t>(s), i);
        if (target == kNoSlot || !weight_side_[target]) {
          continue;
        }
        if (node.kept == kNoSlot) {
          node.action = NodeAction::kRunAndKeep;
          node.kept = static_cast<int32_t>(state_.kept.size());
          state_.kept.emplace_back();
        }
        plan.later_pass_edge[node.first_edge + i] =
            !is_captured_weight_side(plan, target);
      }
    }
    // A captured root target receives its gradient in this pass.
    single_root_on_weight_side_ = roots_.size() == 1 &&
        weight_side_[plan.root_targets[0]] &&
        !is_captured_weight_side(plan, plan.root_targets[0]);
  }

  bool is_captured_weight_side(const GraphPlan& plan, int32_t slot) const {
    return weight_side_[slot] && plan.slots[slot].first_capture != kNoSlot;
  }

  // The weight pass's plan, taken now: running the input pass consumes the
  // dependency counts of W.
  void build_weight_plan(const GraphPlan& plan) {
    const size_t num_slots = plan.slots.size();
    GraphPlan& weight_plan = state_.weight_plan;
    std::vector<int32_t> weight_plan_slot(num_slots, kNoSlot);
    std::vector<int32_t> original_slot;
    for (size_t s = 0; s < num_slots; ++s) {
      const NodeSlot& node = plan.slots[s];
      const bool frontier = node.kept != kNoSlot;
      if (!weight_side_[s] && !frontier) {
        continue;
      }
      const auto slot = static_cast<int32_t>(weight_plan.slots.size());
      weight_plan_slot[s] = slot;
      original_slot.push_back(static_cast<int32_t>(s));
      weight_plan.slots.emplace_back();
      NodeSlot& copy = weight_plan.slots.back();
      copy.fn = node.fn;
      copy.expanded = node.expanded;
      copy.needed = true;
      // Every edge into W comes from a frontier node, a node of W or a root:
      // the count discovery made is the weight pass's. Frontier nodes are
      // made ready directly.
      copy.pending_edges = frontier ? 0 : node.pending_edges;
      if (frontier) {
        copy.action = NodeAction::kResumeKept;
        copy.kept = node.kept;
        // A captured node of W got its gradients in the input pass: no
        // frontier node of D may compute them again
        // (task_should_compute_output). It still runs; only
        // _will_engine_execute_node on it would tell otherwise, and its
        // tensor hooks (where multi-grad hooks ask) ran in the input pass.
        copy.hidden_from_host = node.action == NodeAction::kCaptureAndKeep;
      }
      state_.nodes.push_back(node.fn->getptr());
    }
    for (size_t slot = 0; slot < weight_plan.slots.size(); ++slot) {
      const int32_t s = original_slot[slot];
      NodeSlot& copy = weight_plan.slots[slot];
      copy.first_edge = static_cast<uint32_t>(weight_plan.edge_targets.size());
      const size_t num_edges = copy.expanded ? copy.fn->next_edges().size() : 0;
      for (size_t i = 0; i < num_edges; ++i) {
        const int32_t target = plan.target_of(s, i);
        const size_t edge = plan.slots[s].first_edge + i;
        weight_plan.ordered_input_of_edge.push_back(
            plan.ordered_input_of_edge[edge]);
        weight_plan.stock_rank_of_edge.push_back(plan.stock_rank_of_edge[edge]);
        weight_plan.edge_targets.push_back(
            target != kNoSlot && weight_side_[target] &&
                    !is_captured_weight_side(plan, target)
                ? weight_plan_slot[target]
                : kNoSlot);
      }
    }
    if (!plan.priority.empty()) {
      for (const int32_t s : original_slot) {
        weight_plan.priority.push_back(plan.priority[s]);
      }
    }
    if (!plan.priority_sources.empty()) {
      for (const int32_t s : original_slot) {
        weight_plan.priority_sources.push_back(plan.priority_sources[s]);
      }
    }
    weight_plan.filtered = true;
    weight_plan.stock_order_known = true;
    weight_plan.num_ordered_inputs = plan.num_ordered_inputs;
    weight_plan.resumes_kept_nodes = true;
    weight_plan.narrows_needs_input_grad = true;

    // Root edges into W are the weight pass's roots. Their edge ids follow
    // the weight plan's node edges (GraphPlan's root edge ids), with their
    // places in the full backward's order.
    const size_t first_root_edge = plan.edge_targets.size();
    for (size_t i = 0; i < roots_.size(); ++i) {
      const int32_t target = plan.root_targets[i];
      if (!weight_side_[target] || is_captured_weight_side(plan, target)) {
        continue;
      }
      if (single_root_on_weight_side_) {
        // Stock's single root has no incoming edge to count.
        weight_plan.slots[weight_plan_slot[target]].pending_edges += 1;
      }
      weight_plan.ordered_input_of_edge.push_back(
          plan.ordered_input_of_edge[first_root_edge + i]);
      weight_plan.stock_rank_of_edge.push_back(
          plan.stock_rank_of_edge[first_root_edge + i]);
      weight_plan.root_targets.push_back(weight_plan_slot[target]);
      weight_plan.root_input_nrs.push_back(roots_[i].input_nr);
      state_.weight_side_roots.push_back(
          {weight_plan_slot[target],
           roots_[i].input_nr,
           root_grads_[i],
           producer_stream_of(root_grads_[i])});
    }
  }

  const edge_list& roots_;
  const variable_list& root_grads_;
  const edge_list& inputs_;
  const edge_list& weights_;
  const bool allow_unused_;
  SplitState& state_;

  // Per slot of the input pass's plan.
  std::vector<char> weight_side_;
  bool single_root_on_weight_side_ = false;
};

// The caller may modify an input gradient in place (scale it, send it into a
// buffer) before the weight pass reads what the state keeps. An input
// gradient that shares memory with a kept one is cloned: a node that passes
// its gradient through (AddBackward at `x + bias`), or a captured node of W,
// whose kept gradients are the captured ones. Rare, and one copy of an input
// gradient when it happens; no other input gradient is copied.
void unshare_input_grads_from_state(
    variable_list& input_grads,
    const SplitState& state) {
  std::unordered_set<const c10::StorageImpl*> kept;
  auto keep = [&kept](const at::Tensor& grad) {
    if (grad.defined() && grad.has_storage()) {
      kept.insert(grad.storage().unsafeGetStorageImpl());
    }
  };
  for (const auto& kept_node : state.kept) {
    for (const auto* grads : {&kept_node.inputs, &kept_node.outputs}) {
      if (grads->has_value()) {
        std::for_each((*grads)->begin(), (*grads)->end(), keep);
      }
    }
  }
  for (const auto& root : state.weight_side_roots) {
    keep(root.grad);
  }
  if (kept.empty()) {
    return;
  }
  for (auto& grad : input_grads) {
    if (grad.defined() && grad.has_storage() &&
        kept.count(grad.storage().unsafeGetStorageImpl()) != 0) {
      grad = grad.clone();
    }
  }
}

} // namespace

InputPassResult backward_input(
    const edge_list& roots,
    variable_list root_grads,
    const edge_list& inputs,
    const edge_list& weight_edges,
    const variable_list& weights,
    bool keep_graph,
    bool allow_unused,
    CallContext context) {
  prepare_roots(roots, root_grads);

  auto state = std::make_shared<SplitState>();
  state->weights = weights;
  GraphPlan plan;
  // The weight pass copies its priorities, with their sources, from this
  // plan: record the sources even when this pass is not traced, so a traced
  // weight pass still says where its priorities came from.
  plan.record_priority_sources = true;
  discover_graph(
      plan,
      roots,
      inputs,
      /*accumulate_grad=*/false,
      CallPriorities({}),
      &weight_edges);
  InputPassRewrite(
      roots,
      root_grads,
      inputs,
      weight_edges,
      allow_unused,
      *state)
      .rewrite(plan);
  SplitPass pass;
  pass.plan = std::move(plan);
  pass.kept = &state->kept;
  pass.trace_label = "backward_input";
  // The host task retains the graph: frontier nodes keep their saved
  // variables whatever the caller asked, and nodes that read the host's
  // keep_graph (AOTAutograd's compiled backward frees saved tensors on use
  // without it) must not free what the weight pass needs.
  pass.host_keeps_graph = true;
  // Only the weight pass's root gradients are kept (in the state); no other
  // reference may stay, or input buffers would not accumulate in place.
  variable_list input_grads = run_call(
      roots,
      std::move(root_grads),
      inputs,
      {/*keep_graph=*/keep_graph,
       /*create_graph=*/false,
       /*accumulate_grad=*/false},
      std::move(context),
      &pass);
  unshare_input_grads_from_state(input_grads, *state);
  return {std::move(input_grads), std::move(state)};
}

variable_list backward_weight(
    SplitState& state,
    bool keep_graph,
    CallContext context) {
  TORCH_CHECK(
      !state.consumed.exchange(true),
      "backward_weight: this state was already resumed; each state that "
      "backward_input returns runs its weight pass once");
  struct ReleaseOnExit {
    SplitState& state;
    ~ReleaseOnExit() {
      state.release();
    }
  } release{state};

  if (!state.weight_plan.slots.empty()) {
    edge_list roots;
    variable_list root_grads;
    std::vector<std::optional<c10::Stream>> root_streams;
    for (auto& root : state.weight_side_roots) {
      roots.emplace_back(state.nodes[root.slot], root.input_nr);
      root_grads.push_back(std::move(root.grad));
      root_streams.push_back(root.stream);
    }
    AccumulationBatch batch;
    SplitPass pass;
    pass.plan = std::move(state.weight_plan);
    pass.kept = &state.kept;
    pass.root_streams = std::move(root_streams);
    pass.trace_label = "backward_weight";
    if (AccumulationBatch::available()) {
      pass.batch = &batch;
    }
    try {
      run_call(
          std::move(roots),
          std::move(root_grads),
          {},
          {/*keep_graph=*/keep_graph,
           /*create_graph=*/false,
           /*accumulate_grad=*/true},
          std::move(context),
          &pass);
    } catch (...) {
      // Stock would have accumulated these before the error.
      batch.flush();
      throw;
    }
  }
  variable_list grads;
  grads.reserve(state.weights.size());
  for (const auto& weight : state.weights) {
    grads.push_back(weight.grad());
  }
  return grads;
}

std::string describe(const SplitState& state) {
  std::ostringstream ss;
  if (state.consumed) {
    ss << "weight pass done";
  } else {
    ss << state.kept.size() << " frontier nodes, "
       << state.weight_plan.slots.size() - state.kept.size()
       << " weight-side nodes, " << state.weights.size() << " weights";
  }
  return std::move(ss).str();
}

} // namespace torch_ext
