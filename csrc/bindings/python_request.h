#pragma once

// The Python entry points' arguments -> the engine's requests
// (engine/backward_request.h): torch._C._EngineBase.run_backward's tuples,
// GradientEdges, torch_ext's priorities, and the GIL released around a call.

#include "engine/backward_request.h"

#include <Python.h>

namespace torch_ext {

// torch._C._EngineBase.run_backward's arguments (tensors, grad_tensors,
// inputs, flags) and the call's context (engine/call_context.h) as Python
// gives it: `priorities`, [(node, priority, propagate)], and `handed`, the
// torch_ext._C.HandedBackward the call runs as (torch_ext/engine.py's
// CallContext); `inputs`, `priorities` and `handed` are null (or None) when
// not given.
BackwardRequest request_from_python(
    PyObject* tensors,
    PyObject* grad_tensors,
    PyObject* inputs,
    CallOptions options,
    bool allow_unreachable,
    PyObject* priorities,
    PyObject* handed);

// [(node, priority, propagate), ...] as built by torch_ext.priority.
std::vector<PriorityOverride> parse_priority_overrides(PyObject* overrides);

// The edges of a tuple of torch.autograd.graph.GradientEdges.
edge_list gradient_edges_from_python(PyObject* tuple);

// A tuple of the tensors (None for an undefined one).
PyObject* wrap_tensors(const variable_list& tensors);

// The C++ node behind a torch.autograd.graph.Node, or a TypeError.
c10::intrusive_ptr<Node> checked_node_of(PyObject* obj);

// PythonEngine::execute refuses to run while the GIL is held (nodes written
// in Python take it themselves). Python entry points hold it; the dispatcher
// may call the ops with or without it.
class ReleaseGilIfHeld {
 public:
  ReleaseGilIfHeld()
      : saved_(
            Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread()
                                                     : nullptr) {}
  ~ReleaseGilIfHeld() {
    if (saved_ != nullptr) {
      PyEval_RestoreThread(saved_);
    }
  }
  ReleaseGilIfHeld(const ReleaseGilIfHeld&) = delete;
  ReleaseGilIfHeld& operator=(const ReleaseGilIfHeld&) = delete;

 private:
  PyThreadState* saved_;
};

// Runs `request` (engine/backward_request.h), releasing the GIL if the
// caller holds it.
inline variable_list run_releasing_gil(BackwardRequest request) {
  ReleaseGilIfHeld no_gil;
  return run(std::move(request));
}

} // namespace torch_ext
