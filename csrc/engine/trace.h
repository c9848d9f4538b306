#pragma once

// Tracing: what torch_ext's engine ran, when, at which priority and why
// (torch_ext.trace() in Python).
//
// Off by default. Each backward call checks once, when it starts, whether
// tracing is on (one relaxed atomic load); when it is off the call's
// CallTracing holds no CallTrace and every hook in the executor is a
// null-pointer test. When on,
// the call records into its own CallTrace, touched only by the thread running
// the call (every node of a call runs on one thread, see docs/design.md,
// "The host-task pattern"), so
// recording an event takes no lock; the call hands its events to the global
// recorder once, when it finishes. A call is in the trace if tracing was on
// when it started and still on, in the same session, when it finished.
//
// Times come from std::chrono::steady_clock, which on Linux is
// CLOCK_MONOTONIC, the clock of Python's time.perf_counter_ns().

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace torch_ext::trace {

enum class Kind : uint8_t {
  // One backward call: its whole run (discovery, nodes, final waits).
  kBackward = 0,
  // One node: hooks, apply and routing of its outputs.
  kNode = 1,
  // The engine blocked on a collective's in-flight result.
  kCollectiveWait = 2,
};

// Why a node ran at its effective priority.
enum class PriorityFrom : uint8_t {
  // The default, 0: nothing set a priority on or below it.
  kDefault = 0,
  // torch_ext.set_priority / launch_first on the node itself.
  kSetPriority = 1,
  // The call's own priorities= argument.
  kCallOverride = 2,
  // The automatic priority of a collective's node.
  kAutoCollective = 3,
  // Propagated from a node it leads to (the event's origin).
  kPropagated = 4,
};

// Within one call, an event is named by its index in the call's events.
inline constexpr int32_t kNoEvent = -1;

struct Event {
  Kind kind = Kind::kNode;
  // A node that launched a collective and left its result in flight.
  bool collective = false;
  PriorityFrom priority_from = PriorityFrom::kDefault;
  // kPropagated: how the origin node got its own priority.
  PriorityFrom origin_from = PriorityFrom::kDefault;
  // Node: its name(). Wait: the node that blocked (the result's first
  // reader), or what the call was doing ("end of backward", "error").
  std::string name;
  // -1 where there is none (backward spans, AccumulateGrad's UINT64_MAX).
  int64_t sequence_nr = -1;
  int64_t priority = 0;
  // kPropagated: the node the priority was propagated from.
  std::string origin_name;
  int64_t origin_sequence_nr = -1;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  // Wait: the event of the node that launched the collective.
  int32_t wait_for = kNoEvent;
};

// The events of one finished call, in the order they started.
struct CallEvents {
  uint64_t backward_id = 0;
  int64_t thread = 0;
  std::vector<Event> events;
};

namespace detail {
extern std::atomic<bool> tracing_on;
} // namespace detail

inline bool enabled() {
  // Acquire, paired with start()'s release: a call that sees tracing on also
  // sees the session it belongs to (free on x86).
  return detail::tracing_on.load(std::memory_order_acquire);
}

// CLOCK_MONOTONIC in nanoseconds (steady_clock).
int64_t clock_ns();

// The recorder of one backward call. Created only while tracing is on;
// event 0 is the call's own span.
class CallTrace {
 public:
  explicit CallTrace(const char* label);
  CallTrace(const CallTrace&) = delete;
  CallTrace& operator=(const CallTrace&) = delete;

  // Starts an event now and returns its index; fill it through event().
  int32_t begin(Kind kind, std::string name, int64_t sequence_nr);
  void end(int32_t index) {
    events_[index].end_ns = clock_ns();
  }
  Event& event(int32_t index) {
    return events_[index];
  }

  // Ends the call's span and hands every event to the recorder.
  void finish() noexcept;

 private:
  uint64_t session_;
  CallEvents call_;
  std::vector<Event>& events_ = call_.events;
};

// Ends a span when it goes out of scope, on error paths too.
class EndOnExit {
 public:
  EndOnExit(CallTrace* trace, int32_t index) : trace_(trace), index_(index) {}
  ~EndOnExit() {
    if (trace_ != nullptr) {
      trace_->end(index_);
    }
  }
  EndOnExit(const EndOnExit&) = delete;
  EndOnExit& operator=(const EndOnExit&) = delete;

 private:
  CallTrace* trace_;
  int32_t index_;
};

// What one call holds of tracing, by value: its recorder, made when the call
// starts if tracing is on then, and the event of the node it runs now.
class CallTracing {
 public:
  // Ends the call's span and hands its events to the recorder when it goes
  // out of scope, on error paths too.
  class Span {
   public:
    explicit Span(CallTrace* trace) : trace_(trace) {}
    ~Span() {
      if (trace_ != nullptr) {
        trace_->finish();
      }
    }
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;

   private:
    CallTrace* trace_;
  };

  // What the call's span is called, in place of start()'s default (split
  // backward's passes name theirs).
  void set_label(const char* label) {
    label_ = label;
  }
  // Starts recording the call if tracing is on now; the span lasts as long
  // as what this returns.
  [[nodiscard]] Span start(const char* default_label) {
    if (enabled()) {
      recorder_ = std::make_unique<CallTrace>(
          label_ != nullptr ? label_ : default_label);
    }
    return Span(recorder_.get());
  }
  // The call's recorder, or null: the call is not traced.
  CallTrace* recorder() const {
    return recorder_.get();
  }

  // While tracing: the event of the node running now (a collective it
  // launches marks it; deferred_waits.cpp).
  int32_t running_node_event = kNoEvent;

 private:
  const char* label_ = nullptr;
  std::unique_ptr<CallTrace> recorder_;
};

// A node's sequence_nr as traced: -1 for "none" (UINT64_MAX).
int64_t traced_sequence_nr(uint64_t sequence_nr);

// Starts a session. Raises if one is already active: sessions do not nest.
void start();
// Stops the session; calls still running are left out of it.
void stop();
// The events of every call that finished during the last session, taken out
// of the recorder.
std::vector<CallEvents> take();

} // namespace torch_ext::trace
