// The C++ half of torch_ext.overlap_microbatches (torch_ext/microbatches.py):
// the window in which one microbatch's backward runs on a backward thread
// while the thread that handed it over (the forward thread) runs the next
// microbatch's forward.
//
// The collective order rule, enforced here for every c10d collective through
// a kernel at the Autograd key of the c10d operators (the collective gate)
// and an observer of the forward thread's ops: on every process group, each
// rank issues all the collectives backward i's plan starts, then forward
// i+1's, then backward i+1's. The forward thread's collectives wait until
// backward i has started every collective its plan holds (engine/
// collective_progress.h; a lane node's counts as started once the gate has
// seen it issued), or until it has finished, when the microbatch saved the
// RNG state in forward (an activation checkpoint, whose recompute may issue
// collectives no plan holds). Asked to (forward_collectives=
// "in_turns_with_backward_collectives") and where the backward's
// collectives wait for their turns (a call that runs them in sequence), the
// two threads' collectives take turns instead, the backward's first (B0 F0
// B1 F1 ...), until one thread has none left, then the other's rest: the
// forward's k-th waits until backward i has started k, backward i's (k+1)-th
// until the forward has issued k (the observer counts them) or waits for
// backward i to end. Any other collective
// started while backward i runs (a hook's, a nested backward's, a lane
// node's second) is refused with an error on every rank alike, before it
// starts; a functional collective, which reaches c10d past the gate, through
// _overlap_refuse_unless_planned, called from Python.
//
// RNG: a checkpoint's recompute sets the global generator to forward's state
// and back. The backward thread does so only while the forward thread is
// parked in one of the window's waits (an RNG section), so the forward's
// draws never see the recompute's state.

#include "bindings/python_overlap.h"
#include "engine/caller_thread_state.h"
#include "engine/collective_progress.h"

#include <ATen/record_function.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/python_strings.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace torch_ext {
namespace {

// How often a parked forward thread looks for Ctrl-C.
constexpr auto kSignalPollInterval = std::chrono::milliseconds(50);

// When the forward thread's collectives may start, beside a backward
// (overlap_microbatches' forward_collectives; torch_ext/microbatches.py
// passes the value).
enum class ForwardRule : int {
  // Once the backward has started every collective its plan holds.
  kAfterPlannedCollectives = 0,
  // Once the whole backward has finished.
  kAfterBackward = 1,
  // In turns with the backward's planned collectives, where the backward's
  // take turns (in sequence); otherwise as kAfterPlannedCollectives.
  kInTurns = 2,
};

// One backward handed to the backward thread.
struct HandedBackward final : CollectiveProgress {
  HandedBackward(int64_t microbatch, ForwardRule rule)
      : microbatch(microbatch),
        forward_waits_for_all(rule == ForwardRule::kAfterBackward),
        forward_takes_turns(rule == ForwardRule::kInTurns) {}

  void planned(size_t count, bool in_turns) override;
  void may_start(size_t place) override;
  void started_one() override;
  void abandoned() override;

  // Whether the forward thread's next collective may start (under the
  // window's mutex): once every planned collective has started, or, in
  // turns, once the backward's has started one more than the forward has
  // issued.
  bool releases_forward() const {
    if (finished) {
      return true;
    }
    if (forward_waits_for_all || !planned_count.has_value()) {
      return false;
    }
    return started >= *planned_count ||
        (in_turns && !forward_done && started > forward_issued);
  }

  // Whether the backward's collective at `place` may be issued (under the
  // window's mutex): once the forward has issued as many, or has stopped
  // issuing them (it is waiting for this backward to finish; from then on
  // its collectives wait for all the backward's, releases_forward).
  bool backward_may_start(size_t place) const {
    return !in_turns || forward_waits_for_all || forward_done ||
        forward_issued >= place;
  }

  const int64_t microbatch;
  // The forward waits for the whole backward, not only its planned
  // collectives.
  const bool forward_waits_for_all;
  // The forward asked to take turns with the backward's collectives.
  const bool forward_takes_turns;
  std::optional<size_t> planned_count;
  // The two threads' collectives take turns: the forward asked to, and the
  // backward's wait for their turns (may_start).
  bool in_turns = false;
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
  // The forward thread's observer of every op it dispatches (see
  // on_forward_op), removed when the window closes.
  std::optional<at::CallbackHandle> forward_observer;
};

Window& window() {
  // Never destroyed: a gate may run during interpreter shutdown.
  static Window* instance = new Window();
  return *instance;
}

void HandedBackward::planned(size_t count, bool in_turns) {
  Window& w = window();
  std::lock_guard<std::mutex> lock(w.mutex);
  planned_count = count;
  this->in_turns = forward_takes_turns && in_turns;
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

void raise_if_interrupted() {
  pybind11::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) {
    throw python_error();
  }
}

// The c10d operators that are not collectives of a group (point-to-point
// sends and receives pair by peer and tag, not by order; check_for_nan is
// local).
bool is_gated(std::string_view name) {
  return name != "c10d::send" && name != "c10d::recv_" &&
      name != "c10d::recv_any_source_" && name != "c10d::check_for_nan";
}

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
        raise_if_interrupted();
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

// Releases the GIL for a scope if this thread holds it: a gate runs under
// whatever called the collective.
class ReleaseGilIfHeld {
 public:
  ReleaseGilIfHeld() {
    if (Py_IsInitialized() && PyGILState_Check() != 0) {
      release_.emplace();
    }
  }

 private:
  std::optional<pybind11::gil_scoped_release> release_;
};

void HandedBackward::may_start(size_t place) {
  Window& w = window();
  ReleaseGilIfHeld no_gil;
  std::unique_lock<std::mutex> lock(w.mutex);
  w.changed.wait(lock, [&] { return failed || backward_may_start(place); });
  TORCH_CHECK(
      !failed,
      "torch_ext: a collective of the backward of microbatch ",
      microbatch,
      " was not started: that backward failed first");
}

// The forward thread waits before its collective until the backward in
// flight releases it. Returns that backward (null if none).
std::shared_ptr<HandedBackward> forward_waits_its_turn(
    std::unique_lock<std::mutex>& lock) {
  Window& w = window();
  std::shared_ptr<HandedBackward> backward = w.current;
  if (backward != nullptr && !backward->releases_forward()) {
    lock.unlock();
    ReleaseGilIfHeld no_gil;
    lock.lock();
    park_forward_until(lock, [&] { return backward->releases_forward(); });
  }
  return backward;
}

// Whether `fn` is a gated c10d collective dispatched on the forward thread
// of an open window.
bool is_forward_collective(const at::RecordFunction& fn) {
  const char* name = fn.name();
  if (std::strncmp(name, "c10d::", 6) != 0 || !is_gated(name)) {
    return false;
  }
  const Window& w = window();
  return w.open.load(std::memory_order_acquire) &&
      std::this_thread::get_id() == w.forward_thread;
}

// RecordFunction's start callback on the forward thread, for every op it
// dispatches: a c10d collective reached with the Autograd key excluded (a
// functional collective's kernel calls c10d under autograd's fallback) skips
// the gate's kernel, so the forward thread waits here too. It cannot raise:
// Ctrl-C re-arms the interrupt for Python to raise once the op returns.
std::unique_ptr<at::ObserverContext> on_forward_op(
    const at::RecordFunction& fn) {
  if (!is_forward_collective(fn)) {
    return nullptr;
  }
  Window& w = window();
  try {
    std::unique_lock<std::mutex> lock(w.mutex);
    forward_waits_its_turn(lock);
  } catch (python_error&) {
    // Python's handler raised (KeyboardInterrupt): the collective goes on,
    // and Python raises it again once the op returns. Needs no GIL.
    PyErr_SetInterrupt();
  } catch (...) {
  }
  return nullptr;
}

// Its end callback: the collective has been issued (a c10d op returns once
// its work is queued on the group), which lets the backward's next one go
// (HandedBackward::backward_may_start). Counted here, where the gate's
// collectives and the functional ones both pass.
void on_forward_op_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (!is_forward_collective(fn)) {
    return;
  }
  Window& w = window();
  std::lock_guard<std::mutex> lock(w.mutex);
  if (w.current != nullptr && !w.current->finished) {
    ++w.current->forward_issued;
    w.changed.notify_all();
  }
}

// On a backward-side thread (the backward thread, its lanes): refuses the
// collective `name` unless the backward in flight planned it, before it is
// issued. The caller holds the window's mutex.
void refuse_unless_planned(
    const std::string& name,
    const HandedBackward& backward) {
  const IssuingLaneNode* lane_node = issuing_lane_node();
  TORCH_CHECK(
      lane_node == nullptr || lane_node->issued == 0,
      "torch_ext: ",
      name,
      " was not started: it is the second collective of a backward node "
      "declared with run_in_lane, whose backward must run one collective, in "
      "the backward of microbatch ",
      backward.microbatch,
      ", which runs beside the next microbatch's forward. The forward's "
      "collectives are issued right behind a lane node's first one, so a "
      "second could be ordered differently on each rank; it was refused on "
      "every rank. Declare only Functions whose backward runs one collective, "
      "or run that backward without the overlap.");
  if (backward.finished || backward.forward_waits_for_all ||
      starting_planned_collective()) {
    return;
  }
  TORCH_CHECK(
      false,
      "torch_ext: ",
      name,
      " was started during the backward of microbatch ",
      backward.microbatch,
      ", which runs beside the next microbatch's forward, by something the "
      "engine did not plan (a hook, or a backward nested in a node): it could "
      "race the forward's collectives on another rank, so it was refused on "
      "every rank. Run that backward without the overlap (DDP: only the last "
      "microbatch syncs, so run the others under no_sync()), or make the "
      "forward wait for the whole backward: "
      "overlap_microbatches(forward_collectives='after_backward')");
}

void before_collective(const c10::OperatorHandle& op) {
  Window& w = window();
  std::unique_lock<std::mutex> lock(w.mutex);
  if (w.current == nullptr) {
    return;
  }
  if (std::this_thread::get_id() == w.forward_thread) {
    const std::shared_ptr<HandedBackward> backward =
        forward_waits_its_turn(lock);
    TORCH_CHECK(
        backward->error.empty(),
        "torch_ext: ",
        op.schema().name(),
        " was not started: the backward of microbatch ",
        backward->microbatch,
        ", running beside this forward, failed (",
        backward->error,
        ")");
    return;
  }
  refuse_unless_planned(op.schema().name(), *w.current);
}

void collective_gate(
    const c10::OperatorHandle& op,
    c10::DispatchKeySet keys,
    torch::jit::Stack* stack) {
  const bool open = window().open.load(std::memory_order_acquire);
  if (open) {
    before_collective(op);
  }
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
  IssuingLaneNode* lane_node = issuing_lane_node();
  if (open && lane_node != nullptr && ++lane_node->issued == 1) {
    // Issued (queued on its group, in flight): the forward's next collective
    // is ordered behind it on every rank from here.
    lane_node->progress->started_one();
  }
}

void install_collective_gate() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Kept for the life of the process: the registrations last as long.
    auto* library = new torch::Library(
        torch::Library::IMPL,
        "c10d",
        c10::DispatchKey::Autograd,
        __FILE__,
        __LINE__);
    for (const c10::OperatorName& name :
         c10::Dispatcher::singleton().getAllOpNames()) {
      if (name.name.rfind("c10d::", 0) != 0 || !is_gated(name.name)) {
        continue;
      }
      // Kept alive by `names`: impl() takes the name as a C string.
      static std::deque<std::string> names;
      names.push_back(name.name.substr(6));
      library->impl(
          names.back().c_str(),
          torch::CppFunction::makeFromBoxedFunction<&collective_gate>());
    }
  });
}

void check_forward_thread(const char* api) {
  Window& w = window();
  TORCH_CHECK(
      w.open.load() && std::this_thread::get_id() == w.forward_thread,
      "torch_ext: ",
      api,
      " must be called on the thread that opened the microbatch overlap");
}

// _overlap_open(): this thread is the forward thread of a new window.
PyObject* py_overlap_open(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
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
  w.forward_observer = at::addThreadLocalCallback(
      at::RecordFunctionCallback(on_forward_op, on_forward_op_end)
          .scopes({at::RecordScope::FUNCTION}));
  w.open.store(true, std::memory_order_release);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// _overlap_close(): the last backward has finished (the caller waited).
PyObject* py_overlap_close(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
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
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// _overlap_hand_over(microbatch, rule): the backward of `microbatch` is
// about to start on the backward thread, the forward's collectives starting
// by `rule` (a ForwardRule's value); the previous one has finished.
PyObject* py_overlap_hand_over(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  long long microbatch = 0;
  int rule = 0;
  if (!PyArg_ParseTuple(args, "Li", &microbatch, &rule)) {
    return nullptr;
  }
  TORCH_CHECK(
      rule >= 0 && rule <= static_cast<int>(ForwardRule::kInTurns),
      "torch_ext: _overlap_hand_over: no forward rule ",
      rule);
  check_forward_thread("hand_over");
  Window& w = window();
  std::lock_guard<std::mutex> lock(w.mutex);
  TORCH_INTERNAL_ASSERT(w.current == nullptr || w.current->finished);
  w.current = std::make_shared<HandedBackward>(
      microbatch,
      static_cast<ForwardRule>(rule));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// _overlap_report_next_call(): on the backward thread, just before the
// handed backward's engine call.
PyObject* py_overlap_report_next_call(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  Window& w = window();
  std::lock_guard<std::mutex> lock(w.mutex);
  TORCH_INTERNAL_ASSERT(w.current != nullptr);
  report_next_call_to(w.current);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// _overlap_refuse_unless_planned(name): a functional collective `name` is
// about to be issued on this thread (torch_ext/microbatches.py wraps the
// call of torch.ops operators while the window is open: the op's kernel
// reaches c10d with the Autograd key excluded, past the gate). Refuses it as
// the gate refuses an unplanned c10d collective; nothing on the forward
// thread (the observer makes it wait) or outside a backward in flight.
PyObject* py_overlap_refuse_unless_planned(PyObject*, PyObject* name) {
  HANDLE_TH_ERRORS
  Window& w = window();
  if (!w.open.load(std::memory_order_acquire) ||
      std::this_thread::get_id() == w.forward_thread) {
    Py_RETURN_NONE;
  }
  const std::string op_name = THPUtils_unpackString(name);
  std::lock_guard<std::mutex> lock(w.mutex);
  if (w.current != nullptr) {
    refuse_unless_planned(op_name, *w.current);
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// _overlap_finish(error or None): on the backward thread, when the handed
// backward returned or raised.
PyObject* py_overlap_finish(PyObject*, PyObject* error) {
  HANDLE_TH_ERRORS
  // A call that never started (it raised before the engine) took no target.
  take_report_target();
  std::string message;
  if (error != Py_None) {
    message = THPUtils_unpackString(error);
  }
  Window& w = window();
  std::lock_guard<std::mutex> lock(w.mutex);
  if (w.current != nullptr) {
    w.current->finished = true;
    w.current->error = message.empty() && error != Py_None ? "error" : message;
  }
  if (w.rng_section == std::this_thread::get_id()) {
    w.rng_section.reset();
  }
  w.changed.notify_all();
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// _overlap_wait(): on the forward thread, parked until the handed backward
// has finished (Ctrl-C ends the wait).
PyObject* py_overlap_wait(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  check_forward_thread("wait");
  Window& w = window();
  pybind11::gil_scoped_release no_gil;
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
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// _overlap_enter_rng_section() -> bool: on a backward-side thread about to
// set the global RNG state; waits until the forward thread is parked. False
// (nothing to do) outside a window and on the forward thread.
PyObject* py_overlap_enter_rng_section(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  Window& w = window();
  if (!w.open.load() || std::this_thread::get_id() == w.forward_thread) {
    Py_RETURN_FALSE;
  }
  bool entered = false;
  {
    pybind11::gil_scoped_release no_gil;
    std::unique_lock<std::mutex> lock(w.mutex);
    if (w.rng_section != std::this_thread::get_id()) {
      w.changed.wait(lock, [&] {
        return !w.open.load() ||
            (w.forward_parked && !w.rng_section.has_value());
      });
      if (w.open.load()) {
        w.rng_section = std::this_thread::get_id();
        entered = true;
      }
    }
  }
  return PyBool_FromLong(entered ? 1 : 0);
  END_HANDLE_TH_ERRORS
}

// _overlap_leave_rng_section(): the section's thread restored the state.
PyObject* py_overlap_leave_rng_section(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  Window& w = window();
  std::lock_guard<std::mutex> lock(w.mutex);
  if (w.rng_section == std::this_thread::get_id()) {
    w.rng_section.reset();
    w.changed.notify_all();
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

void destroy_thread_state(PyObject* capsule) {
  delete static_cast<CallerThreadState*>(
      PyCapsule_GetPointer(capsule, "torch_ext.CallerThreadState"));
}

// _capture_thread_state() -> capsule: what a thread of torch_ext takes from
// this one (engine/caller_thread_state.h): PyTorch's thread-local state
// (grad mode, autocast, dispatch keys, saved-tensor hooks, modes), as
// stock's engine carries it to its device threads, and the numerics it does
// not carry (intra-op thread counts, the floating-point controls).
PyObject* py_capture_thread_state(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  auto state = std::make_unique<CallerThreadState>();
  PyObject* capsule = PyCapsule_New(
      state.get(),
      "torch_ext.CallerThreadState",
      destroy_thread_state);
  if (capsule != nullptr) {
    state.release();
  }
  return capsule;
  END_HANDLE_TH_ERRORS
}

// _run_in_thread_state(capsule, fn) -> fn(): under the captured state.
PyObject* py_run_in_thread_state(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* capsule = nullptr;
  PyObject* fn = nullptr;
  if (!PyArg_ParseTuple(args, "OO", &capsule, &fn)) {
    return nullptr;
  }
  auto* state = static_cast<CallerThreadState*>(
      PyCapsule_GetPointer(capsule, "torch_ext.CallerThreadState"));
  if (state == nullptr) {
    return nullptr;
  }
  const CallerThreadStateGuard guard(*state);
  return PyObject_CallNoArgs(fn);
  END_HANDLE_TH_ERRORS
}

PyMethodDef overlap_methods[] = {
    {"_overlap_open", py_overlap_open, METH_NOARGS, nullptr},
    {"_overlap_close", py_overlap_close, METH_NOARGS, nullptr},
    {"_overlap_hand_over", py_overlap_hand_over, METH_VARARGS, nullptr},
    {"_overlap_report_next_call",
     py_overlap_report_next_call,
     METH_NOARGS,
     nullptr},
    {"_overlap_finish", py_overlap_finish, METH_O, nullptr},
    {"_overlap_refuse_unless_planned",
     py_overlap_refuse_unless_planned,
     METH_O,
     nullptr},
    {"_overlap_wait", py_overlap_wait, METH_NOARGS, nullptr},
    {"_overlap_enter_rng_section",
     py_overlap_enter_rng_section,
     METH_NOARGS,
     nullptr},
    {"_overlap_leave_rng_section",
     py_overlap_leave_rng_section,
     METH_NOARGS,
     nullptr},
    {"_capture_thread_state", py_capture_thread_state, METH_NOARGS, nullptr},
    {"_run_in_thread_state", py_run_in_thread_state, METH_VARARGS, nullptr},
    {nullptr, nullptr, 0, nullptr}};

} // namespace

bool init_overlap_bindings(PyObject* module) {
  return PyModule_AddFunctions(module, overlap_methods) == 0;
}

} // namespace torch_ext
