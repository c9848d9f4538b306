#include "overlap/window.h"
#include "engine/host_interface.h"
#include "overlap/collective_gate.h"

#include <c10/util/Exception.h>

#include <chrono>

namespace torch_ext {
namespace {

// How often a parked forward thread looks for Ctrl-C.
constexpr auto kSignalPollInterval = std::chrono::milliseconds(50);

// Blocks the forward thread, parked, until `done()`, polling Ctrl-C; returns
// with no RNG section running. The caller holds `lock` and not the GIL.
void park_forward_until(
    std::unique_lock<std::mutex>& lock,
    const std::function<bool()>& done) {
  Window& w = window();
  w.forward_parked = true;
  w.changed.notify_all();
  try {
    while (!done() || w.rng_section.has_value()) {
      if (w.changed.wait_for(lock, kSignalPollInterval) ==
          std::cv_status::timeout) {
        lock.unlock();
        host().raise_if_interrupted();
        lock.lock();
      }
    }
  } catch (...) {
    if (!lock.owns_lock()) {
      lock.lock();
    }
    w.forward_parked = false;
    throw;
  }
  w.forward_parked = false;
}

void check_forward_thread(const char* api) {
  Window& w = window();
  TORCH_CHECK(
      w.open.load() && std::this_thread::get_id() == w.forward_thread,
      "torch_ext: ",
      api,
      " must be called on the thread that opened the microbatch overlap");
}

} // namespace

Window& window() {
  // Never destroyed: a gate may run during interpreter shutdown.
  static Window* instance = new Window();
  return *instance;
}

void HandedBackward::planned(size_t count, bool in_turns) {
  Window& w = window();
  std::lock_guard<std::mutex> lock(w.mutex);
  planned_count = count;
  backward_takes_turns = in_turns;
  w.changed.notify_all();
}

void HandedBackward::abandoned() {
  Window& w = window();
  std::lock_guard<std::mutex> lock(w.mutex);
  failed = true;
  w.changed.notify_all();
}

void HandedBackward::started_one() {
  Window& w = window();
  std::lock_guard<std::mutex> lock(w.mutex);
  ++started;
  w.changed.notify_all();
}

void HandedBackward::may_start(size_t place) {
  Window& w = window();
  bool backward_failed = false;
  // Called on the engine thread or a lane, which may hold the GIL.
  host().wait_releasing_gil([&] {
    std::unique_lock<std::mutex> lock(w.mutex);
    w.changed.wait(lock, [&] { return failed || backward_may_start(place); });
    backward_failed = failed;
  });
  TORCH_CHECK(
      !backward_failed,
      "torch_ext: a collective of the backward of microbatch ",
      microbatch,
      " was not started: that backward failed first");
}

std::shared_ptr<HandedBackward> forward_waits_its_turn(
    std::unique_lock<std::mutex>& lock) {
  Window& w = window();
  std::shared_ptr<HandedBackward> backward = w.current;
  if (backward != nullptr && !backward->releases_forward()) {
    // A gate runs under whatever called the collective, which may hold the
    // GIL. The mutex is let go before the GIL is taken back: a thread that
    // holds the GIL may be waiting for the mutex.
    lock.unlock();
    host().wait_releasing_gil([&] {
      std::unique_lock<std::mutex> parked(w.mutex);
      park_forward_until(parked, [&] { return backward->releases_forward(); });
    });
    lock.lock();
  }
  return backward;
}

void open_window() {
  install_collective_gate();
  Window& w = window();
  std::lock_guard<std::mutex> lock(w.mutex);
  TORCH_CHECK(
      !w.open.load(),
      "torch_ext: a microbatch overlap is already open in this process; "
      "close it (leave its with block, or call close()) before opening "
      "another");
  w.forward_thread = std::this_thread::get_id();
  w.current = nullptr;
  w.forward_parked = false;
  w.rng_section.reset();
  w.twin_names.clear();
  w.forward_observer = observe_forward_thread_ops();
  w.open.store(true, std::memory_order_release);
}

void close_window() {
  Window& w = window();
  std::lock_guard<std::mutex> lock(w.mutex);
  TORCH_INTERNAL_ASSERT(w.current == nullptr || w.current->finished);
  if (w.forward_observer.has_value()) {
    // Thread-local: removed on the forward thread, which closes the window.
    at::removeCallback(*w.forward_observer);
    w.forward_observer.reset();
  }
  w.open.store(false, std::memory_order_release);
  w.current = nullptr;
  w.changed.notify_all();
}

std::shared_ptr<HandedBackward> hand_over(
    int64_t microbatch,
    ForwardCollectives rule) {
  check_forward_thread("hand_over");
  Window& w = window();
  std::lock_guard<std::mutex> lock(w.mutex);
  TORCH_INTERNAL_ASSERT(w.current == nullptr || w.current->finished);
  w.current = std::make_shared<HandedBackward>(microbatch, rule);
  return w.current;
}

void finish_handed_backward(const std::optional<std::string>& error) {
  Window& w = window();
  std::lock_guard<std::mutex> lock(w.mutex);
  if (w.current != nullptr) {
    w.current->finished = true;
    if (error.has_value()) {
      w.current->error = error->empty() ? "error" : *error;
    }
  }
  if (w.rng_section == std::this_thread::get_id()) {
    w.rng_section.reset();
  }
  w.changed.notify_all();
}

void wait_for_handed_backward() {
  check_forward_thread("wait");
  Window& w = window();
  host().wait_releasing_gil([&] {
    std::unique_lock<std::mutex> lock(w.mutex);
    const std::shared_ptr<HandedBackward> backward = w.current;
    if (backward != nullptr && !backward->finished) {
      // No collective of the forward's comes before this backward ends: the
      // backward's wait for none (HandedBackward::backward_may_start).
      backward->forward_done = true;
      w.changed.notify_all();
    }
    park_forward_until(lock, [&] {
      return backward == nullptr || backward->finished;
    });
  });
}

bool enter_rng_section() {
  Window& w = window();
  if (!w.open.load() || std::this_thread::get_id() == w.forward_thread) {
    return false;
  }
  bool entered = false;
  host().wait_releasing_gil([&] {
    std::unique_lock<std::mutex> lock(w.mutex);
    if (w.rng_section == std::this_thread::get_id()) {
      return;
    }
    w.changed.wait(lock, [&] {
      return !w.open.load() || (w.forward_parked && !w.rng_section.has_value());
    });
    if (w.open.load()) {
      w.rng_section = std::this_thread::get_id();
      entered = true;
    }
  });
  return entered;
}

void leave_rng_section() {
  Window& w = window();
  std::lock_guard<std::mutex> lock(w.mutex);
  if (w.rng_section == std::this_thread::get_id()) {
    w.rng_section.reset();
    w.changed.notify_all();
  }
}

} // namespace torch_ext
