#pragma once

// How the layers above run/ start a call: the engine's entry
// (engine/backward_request.cpp) and split backward's passes
// (split/split_backward.cpp). One function, which makes the call and runs it
// inside its host task, so that BackwardCall (backward_call.h) stays the run
// layer's own.

#include "engine/call_context.h"
#include "engine/call_options.h"
#include "engine/plan/graph_plan.h"

#include <c10/core/Stream.h>

#include <optional>
#include <vector>

namespace torch_ext {

class DeferredAccumulation;

// What a pass of split backward gives its call beside roots and options.
struct SplitPass {
  // Run in place of a plan discovered from the roots: a rewrite of a
  // discovered plan, whose root edges are the call's roots.
  GraphPlan plan;
  // Where the plan's kept indices point (NodeSlot::kept): what one pass keeps
  // for the next, and the next resumes. Outlives the call.
  std::vector<KeptNode>* kept = nullptr;
  // The weight pass's batch of unobserved accumulations, or null; flushed as
  // the host task's first final callback.
  DeferredAccumulation* batch = nullptr;
  // The streams the root gradients were produced on, when not the caller's
  // current ones now (a pass resuming gradients kept since an earlier one);
  // empty otherwise.
  std::vector<std::optional<c10::Stream>> root_streams;
  // What the call's span is called in a trace.
  const char* trace_label = nullptr;
  // The host task keeps the graph whatever options.keep_graph says.
  bool host_keeps_graph = false;
};

// Runs backward from `roots` (seeded with `root_grads`) as one call, inside
// one stock graph task, on the calling thread: every node that must run, for
// `inputs` (grad(), backward(inputs=)) or all of them, or, with `pass`, the
// nodes of its plan, with `context` (engine/call_context.h; a split pass's
// priorities are its plan's, and its context's are not read). Returns the
// captured gradient of each input for grad()
// (accumulate_grad false), undefined where none arrived. The caller must not
// hold the GIL.
variable_list run_call(
    edge_list roots,
    variable_list root_grads,
    edge_list inputs,
    CallOptions options,
    CallContext context,
    SplitPass* pass = nullptr);

// The stream `grad` was produced on (its device's current stream when it was
// made), or nullopt for an undefined one: a root gradient's, unless its call
// is told otherwise (SplitPass::root_streams).
std::optional<c10::Stream> producer_stream_of(const at::Tensor& grad);

} // namespace torch_ext
