#pragma once

// What a call that runs one pass of split backward (split/split_backward.cpp)
// holds of it, by value: where the nodes the plan keeps or resumes live, and
// the weight pass's batch of unobserved accumulations. A call that is no
// pass holds the default, whose per-node test is one of a null pointer.

#include "engine/plan/graph_plan.h"
#include "engine/run/deferred_accumulation.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>

#include <vector>

namespace torch_ext {

class SplitPassContext {
 public:
  // No pass: an ordinary call.
  SplitPassContext() = default;
  // A pass: `kept` is where the plan's kept indices point (NodeSlot::kept),
  // what one pass keeps for the next, and the next resumes; it outlives the
  // call. `batch`, or null, takes the weight pass's unobserved
  // accumulations.
  SplitPassContext(std::vector<KeptNode>* kept, DeferredAccumulation* batch)
      : is_pass_(true), kept_(kept), batch_(batch) {}

  bool is_pass() const {
    return is_pass_;
  }

  // What the node whose slot has `kept` index keeps or resumes.
  KeptNode& kept(int32_t index) {
    TORCH_INTERNAL_ASSERT(kept_ != nullptr);
    return (*kept_)[index];
  }

  // Before any node runs, once the plan is made: the batch is flushed as the
  // host task's first final callback, ahead of any a hook queues during the
  // pass. After an error, when final callbacks do not run, the caller
  // flushes.
  void flush_batch_when_the_pass_ends() {
    if (batch_ != nullptr) {
      torch::autograd::Engine::get_default_engine().queue_callback(
          [batch = batch_] { batch->flush(); });
    }
  }

  // Before `fn` runs: a hook may read a weight's .grad that the batch holds
  // back.
  void before_node(Node& fn) {
    if (batch_ != nullptr) {
      batch_->before_node(fn);
    }
  }

  // Whether the batch took over AccumulateGrad `fn`'s work on `grads` (the
  // node must then not run).
  bool takes_accumulation(Node& fn, const variable_list& grads) {
    return batch_ != nullptr && batch_->try_take(fn, grads);
  }

 private:
  bool is_pass_ = false;
  std::vector<KeptNode>* kept_ = nullptr;
  DeferredAccumulation* batch_ = nullptr;
};

} // namespace torch_ext
