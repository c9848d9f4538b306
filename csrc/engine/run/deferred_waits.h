#pragma once

// One call's collective results in flight: a collective's backward formula
// hands its result, still in flight, to the call running it
// (defer_wait_to_first_use, running_node.h); the call waits on it just
// before the first thing that reads it: the node it is delivered to
// (execute_node), an accumulation into the same input (add_to_input), or the
// end of the call. Everything scheduled in between overlaps the
// communication. Held by value by the call; with nothing in flight, the
// executor's tests of it are one of an empty vector and one of a slot's flag
// (NodeSlot::has_pending_wait).

#include "engine/plan/graph_plan.h"
#include "engine/run/call_feature.h"
#include "engine/trace.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace torch_ext {

class DeferredWaits final : public CallFeature {
 public:
  // `plan` and `tracing` are the call's, members that outlive this one.
  DeferredWaits(GraphPlan& plan, trace::CallTracing& tracing)
      : plan_(plan), tracing_(tracing) {}

  // Takes `result` in flight, launched by the node running now. Returns
  // whether it is the first the call took: the call then registers this for
  // its error path.
  bool defer(const at::Tensor& result);

  // Whether any result is in flight and not waited on.
  bool any() const {
    return !pending_.empty();
  }
  // Marks `target` as receiving a result in flight if `grad` is one.
  void note_delivery(int32_t target, const at::Tensor& grad);
  // Waits on the results in flight delivered to `slot` (or, with kNoSlot, on
  // every one) and forgets them.
  void wait_for(int32_t slot);
  // Waits on everything still in flight, warning of what fails: every
  // launched collective must still complete, or its output buffer and work
  // stay registered with c10d and the ranks fall out of step.
  void on_failure() noexcept override;

 private:
  // A result in flight, with the slot it was delivered to (kNoSlot until
  // delivered). A handful per call.
  struct PendingWait {
    at::Tensor result;
    int32_t slot = kNoSlot;
    // While tracing: the event of the node that launched it.
    int32_t launch_event = trace::kNoEvent;
  };
  // Waits on `pending`, recording the wait while tracing: `consumer` is the
  // slot that reads it, or kNoSlot (the end of the call, or `why`).
  void wait_traced(
      const PendingWait& pending,
      int32_t consumer,
      const char* why);

  GraphPlan& plan_;
  trace::CallTracing& tracing_;
  std::vector<PendingWait> pending_;
  bool took_one_ = false;
};

} // namespace torch_ext
