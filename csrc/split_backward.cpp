// Split backward (see split_backward.h): the dI pass classifies the graph,
// runs D and keeps the frontier; the dW pass runs the weight subgraph from it.

#include "split_backward.h"
#include "schedule_replay.h"

#include "batched_accumulation.h"
#include "engine_api.h"

#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/input_metadata.h>

#include <algorithm>
#include <atomic>
#include <sstream>
#include <unordered_set>

namespace torch_ext {

using torch::autograd::GraphTask;

// A node the dW pass starts from, as the dI pass left it: a node of D with a
// next edge into W, or a node of W that the dI pass captured at (an input
// upstream of a weight). Exactly one of `inputs` and `outputs` is set once the
// dI pass has run (or captured at) it.
struct FrontierNode {
  // Its slot in SplitState::weight_plan.
  int32_t slot = kNoSlot;
  // A captured node of W: every edge into it comes from D (a node leading to
  // it leads to an input), so its gradients were complete in dI and its edges
  // in are cut from the weight plan. Its hooks before apply() ran in dI.
  bool captured_in_weight_subgraph = false;
  // The gradients it received, after its pre-hooks: the dW pass runs its
  // apply() on them (again, for a node of D: for the edges into W).
  std::optional<variable_list> inputs;
  // Or the gradients it already produced for its edges into W (undefined at
  // the other positions): the dW pass delivers them without running it.
  std::optional<variable_list> outputs;
};

// A root gradient whose edge leads into W: delivered by the dW pass.
struct WeightSideRoot {
  int32_t slot;
  uint32_t input_nr;
  at::Tensor grad;
  std::optional<c10::Stream> stream;
  // Its edge id in the weight plan (bit-stable accumulation).
  int32_t edge;
};

struct SplitState {
  // The dW pass's plan over the frontier nodes and W: dependency counts as
  // discovered by the dI pass, every node needed, edges out of W dropped.
  GraphPlan weight_plan;
  // weight_plan holds raw pointers; these keep its nodes alive even once the
  // caller has dropped (or detached) the outputs.
  std::vector<c10::intrusive_ptr<Node>> nodes;
  // For each slot of weight_plan, its index in `frontier`, or kNoSlot.
  std::vector<int32_t> frontier_of_slot;
  std::vector<FrontierNode> frontier;
  std::vector<WeightSideRoot> weight_side_roots;
  variable_list weights;
  // Set by the first backward_weight. Atomic: two threads may resume one
  // state at once (the GIL is released), and exactly one may run.
  std::atomic<bool> consumed{false};

  // Everything the dW pass needed, dropped once it ran (or failed).
  void release() {
    weight_plan = GraphPlan();
    nodes.clear();
    frontier_of_slot.clear();
    frontier.clear();
    weight_side_roots.clear();
  }
};

namespace {

NeedsInputGradHooks needs_input_grad_hooks;

// ctx.needs_input_grad of a custom Python Function, narrowed for the pass
// while the node runs.
class NarrowedNeedsInputGrad {
 public:
  explicit NarrowedNeedsInputGrad(Node& fn)
      : fn_(fn),
        token_(
            needs_input_grad_hooks.narrow != nullptr
                ? needs_input_grad_hooks.narrow(fn)
                : nullptr) {}
  ~NarrowedNeedsInputGrad() {
    if (token_ != nullptr) {
      needs_input_grad_hooks.restore(fn_, token_);
    }
  }
  NarrowedNeedsInputGrad(const NarrowedNeedsInputGrad&) = delete;
  NarrowedNeedsInputGrad& operator=(const NarrowedNeedsInputGrad&) = delete;

 private:
  Node& fn_;
  void* token_;
};

// Stock's call_pre_hooks: the node pre-hooks, which run after the tensor
// pre-hooks and retains_grad hooks (NOTE [Hooks ordering]).
variable_list call_node_pre_hooks(Node& fn, variable_list inputs) {
  for (const auto& hook : fn.pre_hooks()) {
    inputs = (*hook)(inputs);
  }
  return inputs;
}

// Hooks -> apply -> hooks, then releases the saved variables unless the
// graph is kept: a node run in one pass only.
variable_list run_whole_node(
    Node& fn,
    variable_list&& buffered,
    bool keep_graph) {
  NarrowedNeedsInputGrad narrowed(fn);
  auto outputs = apply_and_post_hooks(
      fn, call_hooks_before_apply(fn, std::move(buffered)), keep_graph);
  if (!keep_graph) {
    fn.release_variables();
  }
  return outputs;
}

std::optional<c10::Stream> producer_stream_of(const at::Tensor& grad) {
  if (!grad.defined()) {
    return std::nullopt;
  }
  return torch::autograd::InputMetadata(grad).stream();
}

// Whether each slot leads to one of `weight_slots` (a weight's slot included).
std::vector<char> leads_to_weight(
    const GraphPlan& plan,
    const std::vector<int32_t>& weight_slots) {
  const size_t num_slots = plan.slots.size();
  std::vector<char> leads(num_slots, 0);
  for (const int32_t slot : weight_slots) {
    leads[slot] = 1;
  }
  auto num_edges = [&](int32_t slot) -> size_t {
    const NodeSlot& node = plan.slots[slot];
    return node.expanded ? node.fn->next_edges().size() : 0;
  };
  // Post-order, children before parents; the plan is a DAG.
  std::vector<char> visited(num_slots, 0);
  std::vector<std::pair<int32_t, size_t>> stack; // (slot, next edge)
  for (size_t start = 0; start < num_slots; ++start) {
    if (visited[start]) {
      continue;
    }
    visited[start] = 1;
    stack.emplace_back(static_cast<int32_t>(start), 0);
    while (!stack.empty()) {
      const int32_t slot = stack.back().first;
      const size_t edge = stack.back().second;
      if (edge < num_edges(slot)) {
        ++stack.back().second;
        const int32_t child = plan.target_of(slot, edge);
        if (child != kNoSlot && !visited[child]) {
          visited[child] = 1;
          stack.emplace_back(child, 0);
        }
        continue;
      }
      for (size_t i = 0; i < num_edges(slot) && !leads[slot]; ++i) {
        const int32_t child = plan.target_of(slot, i);
        leads[slot] = child != kNoSlot && leads[child];
      }
      stack.pop_back();
    }
  }
  return leads;
}

class InputPass final : public SplitPass {
 public:
  InputPass(
      const edge_list& roots,
      variable_list root_grads,
      const edge_list& inputs,
      const edge_list& weights,
      bool keep_graph,
      bool allow_unused,
      SplitState& state)
      : roots_(roots),
        root_grads_(std::move(root_grads)),
        inputs_(inputs),
        weights_(weights),
        keep_graph_(keep_graph),
        allow_unused_(allow_unused),
        priorities_({}),
        state_(state) {}

  void build_plan(GraphPlan& plan, std::unordered_set<Node*>* nodes_in_graph)
      override {
    // The weight pass copies its priorities, with their sources, from this
    // plan: record the sources even when this pass is not traced, so a
    // traced weight pass still says where its priorities came from.
    plan.record_priority_sources = true;
    discover_graph(
        plan,
        roots_,
        inputs_,
        /*accumulate_grad=*/false,
        priorities_,
        nodes_in_graph,
        &weights_);
    if (inputs_.empty()) {
      // No input needs a gradient (a pipeline's first stage): nothing runs
      // now, everything in the weight pass.
      plan.filtered = true;
      for (auto& slot : plan.slots) {
        slot.needed = false;
      }
    }
    check_reachable(plan);
    // The two passes together must sum every input buffer as one full
    // backward would, although the weight pass runs W's nodes after every
    // node of D (and the frontier nodes ready at once).
    order_deliveries_as_stock(plan, /*every_slot_runs=*/true);
    plan_ = &plan;
    classify(plan);
    build_weight_plan(plan);
    // Only the weight pass's root gradients are kept (in the state); an extra
    // reference would stop input buffers from accumulating in place.
    root_grads_.clear();
  }

  void seed(BackwardCall& call) override {
    // A single root in W has nothing to run now; stock would still run its
    // tensor pre-hooks, which the weight pass does.
    if (!single_root_on_weight_side_) {
      call.seed_all_roots();
    }
  }

  variable_list run_node(int32_t slot, Node& fn, variable_list&& buffered)
      override {
    const int32_t frontier_index = frontier_index_[slot];
    if (frontier_index == kNoSlot) {
      return run_whole_node(fn, std::move(buffered), keep_graph_);
    }
    // A frontier node: its pre-hooks run once, here; the weight pass may run
    // apply() again on the same inputs, so its saved variables stay.
    auto inputs = call_hooks_before_apply(fn, std::move(buffered));
    variable_list inputs_for_weight_pass = inputs;
    variable_list outputs;
    {
      NarrowedNeedsInputGrad narrowed(fn);
      outputs =
          apply_and_post_hooks(fn, std::move(inputs), /*keep_graph=*/true);
    }
    FrontierNode& frontier = state_.frontier[frontier_index];
    bool weight_side_complete = true;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (is_weight_side_edge(slot, i) && !outputs[i].defined()) {
        weight_side_complete = false;
      }
    }
    if (weight_side_complete) {
      // It computed its weight gradients already (pytorch#174017): keep them,
      // and the weight pass will not run it again.
      variable_list kept(outputs.size());
      for (size_t i = 0; i < outputs.size(); ++i) {
        // An edge into a captured node of W delivers now (see FrontierNode).
        if (is_weight_side_edge(slot, i) &&
            !plan_->slots[plan_->target_of(slot, i)].should_execute()) {
          kept[i] = std::move(outputs[i]);
        }
      }
      frontier.outputs = std::move(kept);
      if (!keep_graph_) {
        fn.release_variables();
      }
    } else {
      frontier.inputs = std::move(inputs_for_weight_pass);
      for (size_t i = 0; i < outputs.size(); ++i) {
        if (is_weight_side_edge(slot, i) &&
            !plan_->slots[plan_->target_of(slot, i)].should_execute()) {
          // Partial: the weight pass recomputes every weight-side gradient.
          outputs[i] = at::Tensor();
        }
      }
    }
    return outputs;
  }

  void on_captured_only(int32_t slot, variable_list&& hooked) override {
    const int32_t frontier_index = frontier_index_[slot];
    if (frontier_index == kNoSlot) {
      return;
    }
    // A captured node of W: its tensor pre-hooks and retains_grad hooks ran
    // on these gradients, for the capture; its node pre-hooks run now, like
    // a frontier node's, and the weight pass runs only its apply(), so every
    // hook runs once across the passes.
    state_.frontier[frontier_index].inputs =
        call_node_pre_hooks(*plan_->slots[slot].fn, std::move(hooked));
  }

 private:
  bool is_weight_side_edge(int32_t slot, size_t edge) const {
    const int32_t target = plan_->target_of(slot, edge);
    return target != kNoSlot && weight_side_[target];
  }

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
  // weight. Frontier: slots of D with an edge into W, and slots of W that
  // capture (FrontierNode::captured_in_weight_subgraph).
  void classify(const GraphPlan& plan) {
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
    frontier_index_.assign(num_slots, kNoSlot);
    for (size_t s = 0; s < num_slots; ++s) {
      const NodeSlot& node = plan.slots[s];
      if (is_captured_weight_side(plan, static_cast<int32_t>(s))) {
        frontier_index_[s] = static_cast<int32_t>(state_.frontier.size());
        state_.frontier.emplace_back().captured_in_weight_subgraph = true;
        continue;
      }
      if (!node.needed || !node.expanded) {
        continue;
      }
      for (size_t i = 0; i < node.fn->next_edges().size(); ++i) {
        if (is_weight_side_edge_of(plan, static_cast<int32_t>(s), i)) {
          frontier_index_[s] = static_cast<int32_t>(state_.frontier.size());
          state_.frontier.emplace_back();
          break;
        }
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

  bool is_weight_side_edge_of(const GraphPlan& plan, int32_t slot, size_t edge)
      const {
    const int32_t target = plan.target_of(slot, edge);
    return target != kNoSlot && weight_side_[target];
  }

  // The weight pass's plan, taken now: running the input pass consumes the
  // dependency counts of W.
  void build_weight_plan(const GraphPlan& plan) {
    const size_t num_slots = plan.slots.size();
    GraphPlan& weight_plan = state_.weight_plan;
    std::vector<int32_t> weight_plan_slot(num_slots, kNoSlot);
    std::vector<int32_t> original_slot;
    for (size_t s = 0; s < num_slots; ++s) {
      const bool frontier = frontier_index_[s] != kNoSlot;
      if (!weight_side_[s] && !frontier) {
        continue;
      }
      const NodeSlot& node = plan.slots[s];
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
      state_.nodes.push_back(node.fn->getptr());
      state_.frontier_of_slot.push_back(frontier_index_[s]);
      if (frontier) {
        state_.frontier[frontier_index_[s]].slot = slot;
      }
    }
    for (size_t slot = 0; slot < weight_plan.slots.size(); ++slot) {
      const int32_t s = original_slot[slot];
      NodeSlot& copy = weight_plan.slots[slot];
      copy.first_edge = static_cast<uint32_t>(weight_plan.edge_targets.size());
      const size_t num_edges =
          copy.expanded ? copy.fn->next_edges().size() : 0;
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

    // Root edges into W follow the weight plan's node edges (GraphPlan's
    // edge ids), with their places in the full backward's order.
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
      const auto weight_edge =
          static_cast<int32_t>(weight_plan.ordered_input_of_edge.size());
      weight_plan.ordered_input_of_edge.push_back(
          plan.ordered_input_of_edge[first_root_edge + i]);
      weight_plan.stock_rank_of_edge.push_back(
          plan.stock_rank_of_edge[first_root_edge + i]);
      state_.weight_side_roots.push_back(
          {weight_plan_slot[target],
           roots_[i].input_nr,
           root_grads_[i],
           producer_stream_of(root_grads_[i]),
           weight_edge});
    }
  }

  const edge_list& roots_;
  // The caller's root gradients, until the plan is built.
  variable_list root_grads_;
  const edge_list& inputs_;
  const edge_list& weights_;
  const bool keep_graph_;
  const bool allow_unused_;
  CallPriorities priorities_;
  SplitState& state_;

  const GraphPlan* plan_ = nullptr;
  // Per slot of the input pass's plan.
  std::vector<char> weight_side_;
  std::vector<int32_t> frontier_index_;
  bool single_root_on_weight_side_ = false;
};

class WeightPass final : public SplitPass {
 public:
  WeightPass(SplitState& state, bool keep_graph)
      : state_(state),
        keep_graph_(keep_graph),
        batch_accumulation_(AccumulationBatch::available()) {}

  // Accumulates what the batch took over (batched_accumulation.h). Also
  // runs as the host task's first final callback, ahead of any a hook
  // queues during the pass; after an error, when final callbacks do not run,
  // backward_weight calls it.
  void flush_accumulation() {
    batch_.flush();
  }

  void build_plan(GraphPlan& plan, std::unordered_set<Node*>* nodes_in_graph)
      override {
    plan = std::move(state_.weight_plan);
    nodes_in_graph->reserve(nodes_in_graph->size() + plan.slots.size());
    for (const auto& slot : plan.slots) {
      nodes_in_graph->insert(slot.fn);
    }
  }

  void seed(BackwardCall& call) override {
    // Frontier nodes recompute only the gradients the weight plan delivers:
    // a captured node of W got its gradients in the input pass, so it leaves
    // the host's exec_info (task_should_compute_output) now that the plan is
    // published. It still runs; only _will_engine_execute_node on it would
    // tell otherwise, and its tensor hooks (where multi-grad hooks ask) ran
    // in the input pass.
    auto* exec_info =
        const_cast<std::unordered_map<Node*, GraphTask::ExecInfo>*>(
            torch::autograd::get_current_graph_task_exec_info());
    for (const auto& frontier : state_.frontier) {
      if (frontier.captured_in_weight_subgraph) {
        exec_info->erase(state_.nodes[frontier.slot].get());
      }
    }
    if (batch_accumulation_) {
      torch::autograd::Engine::get_default_engine().queue_callback(
          [this] { flush_accumulation(); });
    }
    // Root gradients first, as a full backward delivers them before any node
    // runs; then the frontier nodes become ready and run in the scheduler's
    // order (sequence_nr), which is their order in a full backward, so every
    // input buffer of W sums its gradients in the same order.
    for (auto& root : state_.weight_side_roots) {
      call.seed_gradient(
          root.slot, root.input_nr, std::move(root.grad), root.stream, root.edge);
    }
    for (auto& frontier : state_.frontier) {
      if (frontier.inputs.has_value()) {
        call.seed_ready(
            frontier.slot, InputBuffer(std::move(*frontier.inputs)));
        frontier.inputs.reset();
      } else {
        TORCH_INTERNAL_ASSERT(frontier.outputs.has_value());
        call.seed_ready(frontier.slot, InputBuffer(variable_list()));
      }
    }
  }

  variable_list run_node(int32_t slot, Node& fn, variable_list&& buffered)
      override {
    if (batch_accumulation_ && AccumulationBatch::has_hooks(fn)) {
      // A hook may read a weight's .grad that the batch holds back.
      batch_.flush();
    }
    const int32_t frontier_index = state_.frontier_of_slot[slot];
    if (frontier_index == kNoSlot) {
      if (batch_accumulation_ && batch_.try_take(fn, buffered)) {
        return {}; // what an AccumulateGrad returns
      }
      return run_whole_node(fn, std::move(buffered), keep_graph_);
    }
    FrontierNode& frontier = state_.frontier[frontier_index];
    if (frontier.outputs.has_value()) {
      auto outputs = std::move(*frontier.outputs);
      frontier.outputs.reset();
      return outputs;
    }
    // Its pre-hooks ran in the input pass, on these same gradients.
    NarrowedNeedsInputGrad narrowed(fn);
    auto outputs = apply_and_post_hooks(fn, std::move(buffered), keep_graph_);
    if (!keep_graph_) {
      fn.release_variables();
    }
    return outputs;
  }

 private:
  SplitState& state_;
  const bool keep_graph_;
  const bool batch_accumulation_;
  AccumulationBatch batch_;
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
  for (const auto& frontier : state.frontier) {
    for (const auto* grads : {&frontier.inputs, &frontier.outputs}) {
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

Edge weight_edge(const at::Tensor& weight, size_t index) {
  TORCH_CHECK(
      weight.defined() && weight.requires_grad(),
      "backward_input: weight ",
      index,
      " does not require grad");
  TORCH_CHECK(
      weight.is_leaf(),
      "backward_input: weight ",
      index,
      " is not a leaf tensor; weights are the leaves whose .grad the weight "
      "pass accumulates");
  return input_edge(weight, /*accumulate_grad=*/true);
}

} // namespace

InputPassResult backward_input(
    const edge_list& roots,
    variable_list root_grads,
    const edge_list& inputs,
    const variable_list& weights,
    bool keep_graph,
    bool allow_unused) {
  torch::autograd::validate_outputs(
      roots, root_grads, [](const std::string& msg) { return msg; });
  edge_list weight_edges;
  weight_edges.reserve(weights.size());
  for (size_t i = 0; i < weights.size(); ++i) {
    weight_edges.push_back(weight_edge(weights[i], i));
  }
  if (roots.size() != 1) {
    // Stock's GraphRoot takes a sequence number (see run_backward).
    at::sequence_number::get_and_increment();
  }

  auto state = std::make_shared<SplitState>();
  state->weights = weights;
  InputPass pass(
      roots,
      root_grads,
      inputs,
      weight_edges,
      keep_graph,
      allow_unused,
      *state);
  BackwardCall call(
      roots,
      std::move(root_grads),
      inputs,
      {/*keep_graph=*/keep_graph,
       /*create_graph=*/false,
       /*accumulate_grad=*/false},
      {});
  call.set_split_pass(&pass, "backward_input");
  // The host task retains the graph: frontier nodes keep their saved
  // variables whatever the caller asked, and nodes that read the host's
  // keep_graph (AOTAutograd's compiled backward frees saved tensors on use
  // without it) must not free what the weight pass needs.
  run_in_host_task(call, /*keep_graph=*/true, /*filtered=*/true);
  variable_list input_grads = call.take_captured();
  unshare_input_grads_from_state(input_grads, *state);
  return {std::move(input_grads), std::move(state)};
}

variable_list backward_weight(SplitState& state, bool keep_graph) {
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
    WeightPass pass(state, keep_graph);
    BackwardCall call(
        {},
        {},
        {},
        {/*keep_graph=*/keep_graph,
         /*create_graph=*/false,
         /*accumulate_grad=*/true},
        {});
    call.set_split_pass(&pass, "backward_weight");
    try {
      run_in_host_task(call, keep_graph, /*filtered=*/true);
    } catch (...) {
      // Stock would have accumulated these before the error.
      pass.flush_accumulation();
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
    ss << state.frontier.size() << " frontier nodes, "
       << state.weight_plan.slots.size() - state.frontier.size()
       << " weight-side nodes, " << state.weights.size() << " weights";
  }
  return std::move(ss).str();
}

void set_needs_input_grad_hooks(NeedsInputGradHooks hooks) {
  needs_input_grad_hooks = hooks;
}

} // namespace torch_ext
