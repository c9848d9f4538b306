#pragma once

// The window of torch_ext.overlap_microbatches
// (torch_ext/microbatch_overlap.py): one microbatch's backward runs on a
// backward thread while the thread that handed it over (the forward thread)
// runs the next microbatch's forward. Here: the hand-over, what the backward in
// flight tells the forward thread (HandedBackward: when the forward's
// collectives may start, by its rule, ForwardCollectives), where the forward
// thread parks, and the RNG sections. The collective gate (collective_gate.h)
// holds every collective to that order (docs/design.md, "The collective order
// rule").
//
// RNG: a checkpoint's recompute sets the global generator to forward's state
// and back. The backward thread does so only while the forward thread is
// parked in one of the window's waits (an RNG section), so the forward's
// draws never see the recompute's state.
//
// No Python here: Ctrl-C and the GIL are reached through the Host
// (engine/host_interface.h); bindings/python_overlap.cpp turns Python's
// calls into these functions.

#include "engine/collective_progress.h"

#include <ATen/record_function.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>

namespace torch_ext {

// One backward handed to the backward thread: the call it starts (its
// CallContext::beside_forward) reports here. Its microbatch and rule are
// CollectiveProgress's.
struct HandedBackward final : CollectiveProgress {
  using CollectiveProgress::CollectiveProgress;

  void planned(size_t count, bool in_turns) override;
  void may_start(size_t place) override;
  void started_one() override;
  void abandoned() override;

  // Whether the forward thread's next collective may start (under the
  // window's mutex): once every planned collective has started, or, in
  // turns, once the backward's has started one more than the forward has
  // issued.
  bool releases_forward() const {
    if (finished || rule == ForwardCollectives::kBesideBackwardCollectives) {
      return true;
    }
    if (rule == ForwardCollectives::kAfterBackward ||
        !planned_count.has_value()) {
      return false;
    }
    return started >= *planned_count ||
        (in_turns() && !forward_done && started > forward_issued);
  }

  // Whether the backward's collective at `place` may be issued (under the
  // window's mutex): once the forward has issued as many, or has stopped
  // issuing them (it is waiting for this backward to finish; from then on
  // its collectives wait for all the backward's, releases_forward).
  bool backward_may_start(size_t place) const {
    return !in_turns() || forward_done || forward_issued >= place;
  }

  // The two threads' collectives take turns: the rule asks for it, and the
  // backward's wait for their turns (may_start).
  bool in_turns() const {
    return rule == ForwardCollectives::kInTurnsWithBackwardCollectives &&
        backward_takes_turns;
  }

  std::optional<size_t> planned_count;
  // The backward's collectives wait for their turns (planned()'s in_turns):
  // the call holds them to its plan's order.
  bool backward_takes_turns = false;
  size_t started = 0;
  // The collectives the forward thread has issued since the hand-over.
  size_t forward_issued = 0;
  // The forward thread waited for this backward to finish.
  bool forward_done = false;
  // The engine call failed (abandoned()).
  bool failed = false;
  bool finished = false;
  // Why it failed; empty if it did not.
  std::string error;
};

struct Window {
  std::mutex mutex;
  std::condition_variable changed;
  // Read without the mutex by every collective's gate.
  std::atomic<bool> open{false};
  std::thread::id forward_thread;
  std::shared_ptr<HandedBackward> current;
  // The forward thread is blocked in one of the window's waits.
  bool forward_parked = false;
  // The backward-side thread inside an RNG section, if any.
  std::optional<std::thread::id> rng_section;
  // The forward thread's observer of every op it dispatches
  // (collective_gate.h), removed when the window closes.
  std::optional<at::CallbackHandle> forward_observer;
  // Under kBesideBackwardCollectives, the registered name of each group's
  // twin, by the group's (Host::twin_group_name, asked once per group and
  // window: a window lives in one world, whose names do not change).
  std::unordered_map<std::string, std::string> twin_names;
};

// The one window of the process.
Window& window();

// The forward thread waits before its collective until the backward in
// flight releases it. `lock` holds the window's mutex, and holds it again
// on return; it is released while the thread is parked. Returns that
// backward (null if none).
std::shared_ptr<HandedBackward> forward_waits_its_turn(
    std::unique_lock<std::mutex>& lock);

// What torch_ext/microbatch_overlap.py calls, through
// bindings/python_overlap.cpp.

// This thread becomes the forward thread of a new window, the collective
// gate on.
void open_window();
// The last backward has finished (the caller waited).
void close_window();
// The backward of `microbatch` is about to start on the backward thread,
// the forward's collectives starting by `rule`; the previous one has
// finished. Returns the window's record of it, which the backward's engine
// call is given in its CallContext (engine/call_context.h) and reports to.
std::shared_ptr<HandedBackward> hand_over(
    int64_t microbatch,
    ForwardCollectives rule);
// On the backward thread, when the handed backward returned (`error`
// nullopt) or raised (`error` says what).
void finish_handed_backward(const std::optional<std::string>& error);
// On the forward thread, parked until the handed backward has finished
// (Ctrl-C ends the wait).
void wait_for_handed_backward();
// On a backward-side thread about to set the global RNG state: waits until
// the forward thread is parked. False (nothing to do) outside a window and
// on the forward thread.
bool enter_rng_section();
// The section's thread restored the state.
void leave_rng_section();

} // namespace torch_ext
