// Deferred collective waits (deferred_waits.h): what defer_wait_to_first_use
// takes and when the call waits on it.

#include "engine/run/deferred_waits.h"
#include "engine/plan/schedule_replay.h"
#include "engine/run/backward_call.h"
#include "engine/run/running_node.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <utility>

namespace torch_ext {
namespace {

// Waits on a collective result the way its op's own formula would have:
// _c10d_functional::wait_tensor (blocks for gloo; on CUDA, makes the current
// stream wait for the collective's). Below autograd, so no node is recorded.
void wait_collective_result(const at::Tensor& result) {
  static const auto wait_tensor =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("_c10d_functional::wait_tensor", "")
          .typed<at::Tensor(const at::Tensor&)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  wait_tensor.call(result);
}

} // namespace

void DeferredWaits::wait_traced(
    const PendingWait& pending,
    int32_t consumer,
    const char* why) {
  trace::CallTrace* const trace = tracing_.recorder();
  if (trace == nullptr) {
    wait_collective_result(pending.result);
    return;
  }
  Node* reader = consumer == kNoSlot ? nullptr : plan_.slots[consumer].fn;
  const int32_t index = trace->begin(
      trace::Kind::kCollectiveWait,
      reader != nullptr ? reader->name() : std::string(why),
      reader != nullptr ? trace::traced_sequence_nr(reader->sequence_nr())
                        : -1);
  trace->event(index).wait_for = pending.launch_event;
  trace::EndOnExit end_wait(trace, index);
  wait_collective_result(pending.result);
}

bool defer_wait_to_first_use(const at::Tensor& result) {
  if (!result.defined()) {
    return false;
  }
  // A backward nested inside the node (stock's engine, reentrant
  // checkpoint) makes its own graph task current, and its nodes' outputs do
  // not go through this call's deliver(): only the node torch_ext runs right
  // now, under its host task, may defer.
  const RunningNode* running = running_node_under_host_task();
  if (running == nullptr) {
    return false;
  }
  // Fake and functional tensors (torch.compile tracing the formula) are not
  // in flight.
  constexpr c10::DispatchKeySet kTracing(
      {c10::DispatchKey::Python, c10::DispatchKey::Functionalize});
  if (result.key_set().has_any(kTracing)) {
    return false;
  }
  BackwardCall& call = *running->call;
  // The rule execution_order() predicts with (schedule_replay.h): the two
  // checks above are about where the formula runs, not about the node.
  if (!hands_result_in_flight(call.plan_, *running->node)) {
    return false;
  }
  if (call.deferred_waits_.defer(result)) {
    call.failure_cleanups_.add(call.deferred_waits_);
  }
  return true;
}

bool DeferredWaits::defer(const at::Tensor& result) {
  const int32_t launch_event = tracing_.running_node_event;
  trace::CallTrace* const trace = tracing_.recorder();
  if (trace != nullptr && launch_event != trace::kNoEvent) {
    trace->event(launch_event).collective = true;
  }
  pending_.push_back({result, kNoSlot, launch_event});
  return !std::exchange(took_one_, true);
}

void DeferredWaits::note_delivery(int32_t target, const at::Tensor& grad) {
  for (auto& pending : pending_) {
    if (pending.slot == kNoSlot && pending.result.is_same(grad)) {
      pending.slot = target;
      plan_.slots[target].has_pending_wait = true;
    }
  }
}

void DeferredWaits::wait_for(int32_t slot) {
  // Erase first, then wait: a failing wait must not be retried by the error
  // path.
  std::vector<PendingWait> ready;
  auto it = pending_.begin();
  while (it != pending_.end()) {
    if (slot == kNoSlot || it->slot == slot) {
      ready.push_back(std::move(*it));
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
  if (slot != kNoSlot) {
    plan_.slots[slot].has_pending_wait = false;
  }
  for (size_t i = 0; i < ready.size(); ++i) {
    try {
      wait_traced(ready[i], slot, "end of backward");
    } catch (...) {
      // The rest go back, for on_failure to complete.
      for (size_t rest = i + 1; rest < ready.size(); ++rest) {
        pending_.push_back(std::move(ready[rest]));
      }
      throw;
    }
  }
}

void DeferredWaits::on_failure() noexcept {
  while (!pending_.empty()) {
    const PendingWait pending = std::move(pending_.back());
    pending_.pop_back();
    try {
      wait_traced(pending, kNoSlot, "error");
    } catch (const std::exception& e) {
      TORCH_WARN(
          "torch_ext: waiting on a collective launched before a backward "
          "error failed: ",
          e.what());
    }
  }
}

} // namespace torch_ext
