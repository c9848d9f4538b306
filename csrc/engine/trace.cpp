#include "engine/trace.h"

#include <c10/util/Exception.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <limits>
#include <mutex>

namespace torch_ext::trace {

namespace detail {
std::atomic<bool> tracing_on{false};
} // namespace detail

namespace {

// The recorder: guarded by its mutex, taken once per finished call.
std::mutex recorder_mutex;
bool session_active = false;
// Incremented by every start(), so a call that began in one session and
// finished in a later one is left out of both.
std::atomic<uint64_t> current_session{0};
std::vector<CallEvents> finished_calls;

std::atomic<uint64_t> next_backward_id{1};

// The kernel's thread id (threading.get_native_id() in Python), cached: the
// syscall costs ~0.3 us.
int64_t native_thread_id() {
  thread_local const int64_t tid = static_cast<int64_t>(::syscall(SYS_gettid));
  return tid;
}

} // namespace

int64_t clock_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t traced_sequence_nr(uint64_t sequence_nr) {
  return sequence_nr == std::numeric_limits<uint64_t>::max()
      ? -1
      : static_cast<int64_t>(sequence_nr);
}

CallTrace::CallTrace(const char* label)
    : session_(current_session.load(std::memory_order_acquire)) {
  call_.backward_id = next_backward_id.fetch_add(1, std::memory_order_relaxed);
  call_.thread = native_thread_id();
  begin(Kind::kBackward, label, -1);
}

int32_t CallTrace::begin(Kind kind, std::string name, int64_t sequence_nr) {
  Event& event = events_.emplace_back();
  event.kind = kind;
  event.name = std::move(name);
  event.sequence_nr = sequence_nr;
  event.start_ns = clock_ns();
  return static_cast<int32_t>(events_.size() - 1);
}

void CallTrace::finish() noexcept {
  end(0);
  std::lock_guard<std::mutex> lock(recorder_mutex);
  if (session_active && session_ == current_session.load()) {
    try {
      finished_calls.push_back(std::move(call_));
    } catch (const std::bad_alloc&) {
      // Out of memory: the trace loses this call, backward carries on.
    }
  }
}

void start() {
  std::lock_guard<std::mutex> lock(recorder_mutex);
  TORCH_CHECK(
      !session_active,
      "torch_ext.trace: a trace is already active; traces do not nest "
      "(one records every thread's backward calls)");
  session_active = true;
  finished_calls.clear();
  current_session.fetch_add(1);
  detail::tracing_on.store(true, std::memory_order_release);
}

void stop() {
  std::lock_guard<std::mutex> lock(recorder_mutex);
  detail::tracing_on.store(false, std::memory_order_relaxed);
  session_active = false;
}

std::vector<CallEvents> take() {
  std::lock_guard<std::mutex> lock(recorder_mutex);
  return std::exchange(finished_calls, {});
}

} // namespace torch_ext::trace
