#pragma once

// Split backward: the input-gradient pass (dI) now, the weight-gradient pass
// (dW) later, as zero-bubble pipeline schedules need.
//
// Take the graph from the roots (a stage's outputs). D is the set of nodes on
// a path to an input: the dI pass runs exactly those, like grad(inputs), and
// the host graph task's exec_info lists only D (and the inputs), so generated
// nodes such as MmBackward skip their weight gradients
// (task_should_compute_output). The weight subgraph W is every node not in D
// on a path to a weight. No node of W leads into D (it would be on a path to
// an input), so the dW pass is a DAG of its own, entered from:
//   - frontier nodes: nodes of D with a next edge into W. The dI pass keeps
//     them (saved variables included) and the gradients they received, after
//     their pre-hooks; the dW pass runs their apply() again, this time for the
//     edges into W only. A frontier node that already produced every
//     weight-side gradient in dI (a custom Function that ignores what it is
//     asked for) keeps those gradients instead and is released at once: the
//     dW pass delivers them without running it again;
//   - captured nodes of W (an input whose own node leads to a weight): every
//     edge into one comes from D, so the dI pass completes its gradients,
//     captures them after its tensor hooks and retains_grad hooks, runs its
//     pre-hooks and keeps them; the dW pass runs only its apply();
//   - roots whose edge leads into W directly.
// Nodes of D that are not frontier nodes are released when dI returns (unless
// the graph is retained); W is untouched until dW, which runs it inside its
// own host graph task with every weight's AccumulateGrad, so .grad,
// post-accumulate-grad hooks and DDP/FSDP hooks see what a full backward
// would have given them.
//
// The state between the passes holds C++ references only (nodes, tensors),
// never a Python object, so it cannot be part of a reference cycle.

#include "engine/call_context.h"
#include "engine/plan/graph_plan.h"

#include <memory>
#include <string>

namespace torch_ext {

// What backward_input leaves for backward_weight (split_backward.cpp).
struct SplitState;

struct InputPassResult {
  // The gradient of each input, undefined where none arrived.
  variable_list input_grads;
  std::shared_ptr<SplitState> state;
};

// The dI pass: backward from `roots` (seeded with `root_grads`) through the
// nodes on a path to `inputs` only, computing no weight gradient. `weights`
// are leaf tensors requiring grad, and `weight_edges` their AccumulateGrad
// edges; unless `allow_unused`, each input and weight must be reachable from
// the roots. With `keep_graph`, nothing is released. `context`: the pass's
// own (engine/call_context.h), of which a pass reads only beside_forward (its
// priorities are the plan's). The caller must not hold the GIL.
InputPassResult backward_input(
    const edge_list& roots,
    variable_list root_grads,
    const edge_list& inputs,
    const edge_list& weight_edges,
    const variable_list& weights,
    bool keep_graph,
    bool allow_unused,
    CallContext context = {});

// The dW pass: resumes from `state` and accumulates every weight's gradient
// into its .grad through its AccumulateGrad. Returns each weight's .grad
// afterwards. A state can be resumed once. `context` as for backward_input.
// The caller must not hold the GIL.
variable_list backward_weight(
    SplitState& state,
    bool keep_graph,
    CallContext context = {});

// For the state's repr: its frontier size, or that it was consumed.
std::string describe(const SplitState& state);

} // namespace torch_ext
