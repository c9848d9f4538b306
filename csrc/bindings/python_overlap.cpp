// torch_ext._C's half of torch_ext.overlap_microbatches (torch_ext/
// microbatch_overlap.py): its calls turned into the window's (overlap/window.h;
// the rule lives there and in overlap/collective_gate.h, which the window
// installs and Python never calls), the host's answers to the
// questions the overlap asks (PythonHost's methods), the forward rules' names,
// the handed backward's type (what a call's context holds of the overlap)
// and the gate's error type for Python, and the caller's thread-local state
// carried to the backward thread.

#include "bindings/python_overlap.h"
#include "bindings/python_host.h"
#include "bindings/python_shared_object.h"
#include "engine/caller_thread_state.h"
#include "overlap/window.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/object_ptr.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/python_strings.h>

#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace torch_ext {
namespace {

// The error the gate raises in a dispatcher kernel, below whatever called
// the collective from Python: torch's handlers there (HANDLE_TH_ERRORS around
// torch.ops, its pybind11 translator around ProcessGroup's methods) make any
// c10::Error, subclass or not, a RuntimeError, and a torch::PyTorchError the
// Python type it names. So the error is one, and needs no GIL until a
// handler sets it.
struct ForwardStoppedByBackward final : torch::PyTorchError {
  ForwardStoppedByBackward(std::string message, PyObject* type)
      : torch::PyTorchError(std::move(message)), type_(type) {}
  PyObject* python_type() override {
    return type_;
  }

 private:
  // torch_ext._C.ForwardStoppedByBackward, which the host holds.
  PyObject* type_;
};

// _overlap_open(): this thread is the forward thread of a new window.
PyObject* py_overlap_open(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  open_window();
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// _overlap_close(): the last backward has finished (the caller waited).
PyObject* py_overlap_close(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  close_window();
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// torch_ext._C.HandedBackward: the window's record of one backward handed
// over (overlap/window.h), which Python passes to that backward's engine call
// (handed=) to become its CallContext::beside_forward.
using PyHandedBackward = PySharedObject<HandedBackward>;

PyTypeObject handed_backward_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

const HandedBackward& handed_of(PyObject* self) {
  return *PyHandedBackward::of(self);
}

PyObject* handed_backward_microbatch(PyObject* self, void*) {
  return PyLong_FromLongLong(handed_of(self).microbatch);
}

PyObject* handed_backward_forward_collectives(PyObject* self, void*) {
  const std::string_view name = name_of(handed_of(self).rule);
  return PyUnicode_FromStringAndSize(
      name.data(),
      static_cast<Py_ssize_t>(name.size()));
}

PyGetSetDef handed_backward_getset[] = {
    {"microbatch",
     handed_backward_microbatch,
     nullptr,
     "The microbatch whose backward this is.",
     nullptr},
    {"forward_collectives",
     handed_backward_forward_collectives,
     nullptr,
     "When the next forward's collectives may start beside it: a "
     "forward_collectives name.",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

// _overlap_hand_over(microbatch, rule) -> HandedBackward: the backward of
// `microbatch` is about to start on the backward thread, the forward's
// collectives starting by `rule` (one of _overlap_forward_rules, parsed here
// into the rule the window and the call hold); the previous one has
// finished.
PyObject* py_overlap_hand_over(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  long long microbatch = 0;
  const char* name = nullptr;
  if (!PyArg_ParseTuple(args, "Ls", &microbatch, &name)) {
    return nullptr;
  }
  const std::optional<ForwardCollectives> rule =
      forward_collectives_named(name);
  TORCH_CHECK_VALUE(
      rule.has_value(),
      "torch_ext: _overlap_hand_over: no forward rule named '",
      name,
      "'");
  // Made before the hand-over, which a failure to make it must not leave
  // behind with no backward to run.
  THPObjectPtr handed(PyHandedBackward::wrap(handed_backward_type, nullptr));
  if (!handed) {
    return nullptr;
  }
  PyHandedBackward::of(handed.get()) = hand_over(microbatch, *rule);
  return handed.release();
  END_HANDLE_TH_ERRORS
}

// _overlap_finish(error or None): on the backward thread, when the handed
// backward returned or raised.
PyObject* py_overlap_finish(PyObject*, PyObject* error) {
  HANDLE_TH_ERRORS
  std::optional<std::string> message;
  if (error != Py_None) {
    message = THPUtils_unpackString(error);
  }
  finish_handed_backward(message);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// _overlap_wait(): on the forward thread, parked until the handed backward
// has finished (Ctrl-C ends the wait).
PyObject* py_overlap_wait(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  wait_for_handed_backward();
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// _overlap_enter_rng_section() -> bool: enter_rng_section.
PyObject* py_overlap_enter_rng_section(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  return PyBool_FromLong(enter_rng_section() ? 1 : 0);
  END_HANDLE_TH_ERRORS
}

// _overlap_leave_rng_section(): the section's thread restored the state.
PyObject* py_overlap_leave_rng_section(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  leave_rng_section();
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
    {"_overlap_finish", py_overlap_finish, METH_O, nullptr},
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

std::shared_ptr<CollectiveProgress> handed_backward_from_python(
    PyObject* handed) {
  if (handed == nullptr || handed == Py_None) {
    return nullptr;
  }
  TORCH_CHECK_TYPE(
      Py_TYPE(handed) == &handed_backward_type,
      "handed must be a torch_ext._C.HandedBackward or None, but got ",
      Py_TYPE(handed)->tp_name);
  return PyHandedBackward::of(handed);
}

std::exception_ptr PythonHost::forward_stopped_by_backward(
    std::string message) {
  return std::make_exception_ptr(ForwardStoppedByBackward(
      std::move(message),
      answers_.forward_stopped_by_backward_type.get()));
}

// Python's handler raised (KeyboardInterrupt) in raise_if_interrupted;
// Python raises it again once the op returns. Needs no GIL.
void PythonHost::raise_interrupt_later(std::exception_ptr interrupt) {
  try {
    std::rethrow_exception(std::move(interrupt));
  } catch (python_error&) {
    PyErr_SetInterrupt();
  } catch (...) {
  }
}

// torch_ext.collectives.twin_groups makes the twin (or refuses a group that
// can have none), with the GIL.
std::string PythonHost::twin_group_name(const std::string& group_name) {
  pybind11::gil_scoped_acquire gil;
  THPObjectPtr twin_name(PyObject_CallFunction(
      answers_.twin_group_name.get(),
      "s",
      group_name.c_str()));
  const char* name = twin_name ? PyUnicode_AsUTF8(twin_name.get()) : nullptr;
  if (name == nullptr) {
    throw python_error();
  }
  return name;
}

void PythonHost::wait_releasing_gil(c10::function_ref<void()> wait) {
  if (Py_IsInitialized() && PyGILState_Check() != 0) {
    pybind11::gil_scoped_release no_gil;
    wait();
    return;
  }
  wait();
}

bool init_overlap_bindings(PyObject* module) {
  if (PyModule_AddFunctions(module, overlap_methods) != 0) {
    return false;
  }
  PyHandedBackward::init_type(
      handed_backward_type,
      "torch_ext._C.HandedBackward",
      "One backward handed to torch_ext.overlap_microbatches' backward "
      "thread, for its engine call's context.");
  handed_backward_type.tp_getset = handed_backward_getset;
  if (PyType_Ready(&handed_backward_type) < 0) {
    return false;
  }
  // The name of each ForwardCollectives, in order, which
  // torch_ext/microbatch_overlap.py reads rather than restating them.
  THPObjectPtr rules(
      PyTuple_New(static_cast<Py_ssize_t>(kForwardCollectivesNames.size())));
  if (!rules) {
    return false;
  }
  for (size_t value = 0; value < kForwardCollectivesNames.size(); ++value) {
    const std::string_view name = kForwardCollectivesNames[value];
    PyObject* key = PyUnicode_FromStringAndSize(
        name.data(),
        static_cast<Py_ssize_t>(name.size()));
    if (key == nullptr) {
      return false;
    }
    PyTuple_SET_ITEM(rules.get(), static_cast<Py_ssize_t>(value), key);
  }
  // A RuntimeError, so that code catching the gate's errors as before still
  // does; torch_ext/microbatch_overlap.py tells it from the others by type.
  // The module holds it, and the host takes it from there (install_host).
  THPObjectPtr forward_stopped_by_backward(PyErr_NewExceptionWithDoc(
      "torch_ext._C.ForwardStoppedByBackward",
      "A collective of the forward thread of torch_ext.overlap_microbatches "
      "was not started: the backward beside it had failed.",
      PyExc_RuntimeError,
      nullptr));
  return forward_stopped_by_backward &&
      PyModule_AddObjectRef(module, "_overlap_forward_rules", rules.get()) ==
      0 &&
      PyModule_AddObjectRef(
          module,
          "HandedBackward",
          reinterpret_cast<PyObject*>(&handed_backward_type)) == 0 &&
      PyModule_AddObjectRef(
          module,
          "ForwardStoppedByBackward",
          forward_stopped_by_backward.get()) == 0;
}

} // namespace torch_ext
