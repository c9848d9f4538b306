#pragma once

// Collective lanes: where a synchronous collective's node runs beside the
// rest of one backward call (docs/design.md, "Collectives other libraries
// wrote").
//
// Megatron-core's and DeepSpeed's _AllToAll run the gradient's all_to_all
// inside their backward node and return once the bytes have arrived. Run
// inline, the engine thread waits for the network there. A lane is a thread
// of the call, one per process group: the engine hands it the node's apply()
// (its hooks stay on the engine thread) and goes on with every other ready
// node; when apply() returns, the engine delivers its outputs like any other
// node's. The collective releases the GIL while it waits, and the dense nodes
// are C++, so both proceed on CPU. On an accelerator the node's collective
// does not block the thread but the stream it is issued on: there the lane
// is a side stream instead (CallLanes::move_to_side_stream), and no
// thread is involved.
//
// A lane runs its group's nodes one at a time, in the order they were handed
// to it. Which order that is, across the lanes and the collectives the engine
// issues itself, is the run loop's business (engine/run/collective_turns.h):
// the same on every rank.
//
// Lanes live as long as their call: they start on the first node handed to
// them and are joined when the call ends, however it ends.

#include "engine/caller_thread_state.h"
#include "engine/planned_collective_start.h"

#include <torch/csrc/autograd/function.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace torch_ext {

class CollectiveLanes {
 public:
  // A node whose apply() returned on its lane, or raised.
  struct Finished {
    int32_t slot;
    torch::autograd::variable_list outputs;
    std::exception_ptr error;
  };

  CollectiveLanes() = default;
  CollectiveLanes(const CollectiveLanes&) = delete;
  CollectiveLanes& operator=(const CollectiveLanes&) = delete;
  // Joins every lane (stop()).
  ~CollectiveLanes();

  // Runs `fn`'s apply() on `inputs` on the lane of `group` (started on first
  // use), after the nodes handed to that lane before it, under the engine
  // thread's state `state` (grad mode, dispatch keys, profiler; the intra-op
  // thread counts and the floating-point controls), as the start of
  // `planned` (engine/planned_collective_start.h): the collective order
  // check's mismatch and the overlap's refusal of its turn are the node's
  // error, raised on the lane, where it would block in the collective anyway,
  // not on the engine thread.
  void dispatch(
      uintptr_t group,
      int32_t slot,
      c10::intrusive_ptr<torch::autograd::Node> fn,
      torch::autograd::variable_list&& inputs,
      CallerThreadState state,
      PlannedCollective planned);

  // Whether any node handed over has not been taken back by take_finished.
  bool busy() const {
    return in_flight_ != 0;
  }

  // The nodes that finished since the last call, in the order they did.
  // With `block`, waits until there is at least one (busy() must hold),
  // calling `check_interrupt` every kInterruptPollMs while it waits; what
  // that throws propagates, and marks the lanes interrupted.
  std::vector<Finished> take_finished(
      bool block,
      const std::function<void()>& check_interrupt);

  // Drops the nodes not started yet and waits for the running ones to return
  // (bounded by their process group's timeout), then joins the lanes. After
  // an interrupt it does not wait: a lane still inside its collective is
  // detached and ends when the collective does, holding what it needs.
  void stop() noexcept;

 private:
  struct Work {
    int32_t slot;
    c10::intrusive_ptr<torch::autograd::Node> fn;
    torch::autograd::variable_list inputs;
    CallerThreadState state;
    PlannedCollective planned;
  };
  // What the engine thread and the lanes share. Held by shared_ptr, so a lane
  // detached after an interrupt outlives the call safely.
  struct Shared {
    std::mutex mutex;
    // Signalled when a node finished (engine waits) or work arrived or
    // stopping (lanes wait).
    std::condition_variable finished_cv;
    std::condition_variable work_cv;
    std::unordered_map<uintptr_t, std::deque<Work>> queues;
    std::vector<Finished> finished;
    bool stopping = false;
  };
  static void lane_main(std::shared_ptr<Shared> shared, uintptr_t group);

  // How often a blocked engine thread lets Python run signal handlers: Ctrl-C
  // ends the call within this long. A GIL round trip each time, ~20 per second.
  static constexpr int kInterruptPollMs = 50;

  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
  std::unordered_map<uintptr_t, std::thread> lanes_;
  // Nodes handed over and not yet taken back; engine thread only.
  int64_t in_flight_ = 0;
  bool interrupted_ = false;
};

} // namespace torch_ext
