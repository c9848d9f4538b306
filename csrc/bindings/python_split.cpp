// torch_ext._C.backward_input / backward_weight and the opaque SplitState
// object that carries a graph from one to the other.
//
// SplitState is a plain CPython type holding a C++ shared_ptr
// (python_shared_object.h): dropping the last reference frees what the weight
// pass would have needed.

#include "bindings/python_split.h"
#include "bindings/python_host.h"
#include "bindings/python_overlap.h"
#include "bindings/python_request.h"
#include "bindings/python_shared_object.h"
#include "engine/split/batched_accumulation.h"
#include "engine/split/split_backward.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/python_numbers.h>
#include <torch/csrc/utils/python_strings.h>

namespace torch_ext {
namespace {

using PySplitState = PySharedObject<SplitState>;

PyTypeObject split_state_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* split_state_repr(PyObject* self) {
  HANDLE_TH_ERRORS
  const auto& state = PySplitState::of(self);
  const std::string repr = "<torch_ext SplitState: " + describe(*state) + ">";
  return PyUnicode_FromStringAndSize(
      repr.data(),
      static_cast<Py_ssize_t>(repr.size()));
  END_HANDLE_TH_ERRORS
}

// The host's narrow_needs_input_grad and restore_needs_input_grad: the
// narrowed tuple replaces the Function's own while
// its backward runs; the token is the original tuple (a strong reference).
//
// A custom Function's node is the one whose Python object is a THPFunction
// (PyNode's type info is not exported, so no dynamic_cast). Most C++ nodes
// have no Python object: those return before taking the GIL.
THPFunction* custom_function_of(Node& fn) {
  PyObject* obj = fn.pyobj_slot()->load_pyobj();
  return obj != nullptr && THPFunction_Check(obj)
      ? reinterpret_cast<THPFunction*>(obj)
      : nullptr;
}

} // namespace

void* PythonHost::narrow_needs_input_grad(Node& fn) {
  if (fn.pyobj_slot()->load_pyobj() == nullptr) {
    return nullptr;
  }
  pybind11::gil_scoped_acquire gil;
  THPFunction* function = custom_function_of(fn);
  if (function == nullptr || function->needs_input_grad == nullptr ||
      !PyTuple_Check(function->needs_input_grad)) {
    return nullptr;
  }
  PyObject* original = function->needs_input_grad;
  const Py_ssize_t num_args = PyTuple_GET_SIZE(original);
  THPObjectPtr narrowed{PyTuple_New(num_args)};
  if (!narrowed) {
    throw python_error();
  }
  // One next edge per tensor argument, in order.
  size_t edge = 0;
  bool changed = false;
  for (Py_ssize_t arg = 0; arg < num_args; ++arg) {
    PyObject* needs = PyTuple_GET_ITEM(original, arg);
    if (static_cast<size_t>(arg) < function->is_variable_input.size() &&
        function->is_variable_input[arg]) {
      if (needs == Py_True && edge < fn.num_outputs() &&
          !fn.task_should_compute_output(edge)) {
        needs = Py_False;
        changed = true;
      }
      ++edge;
    }
    Py_INCREF(needs);
    PyTuple_SET_ITEM(narrowed.get(), arg, needs);
  }
  if (!changed) {
    return nullptr;
  }
  function->needs_input_grad = narrowed.release();
  return original;
}

void PythonHost::restore_needs_input_grad(Node& fn, void* token) {
  pybind11::gil_scoped_acquire gil;
  THPFunction* function = custom_function_of(fn);
  if (function == nullptr) {
    // Unreachable (the node keeps its Function alive); runs in a destructor.
    Py_DECREF(static_cast<PyObject*>(token));
    return;
  }
  PyObject* narrowed = function->needs_input_grad;
  function->needs_input_grad = static_cast<PyObject*>(token);
  Py_XDECREF(narrowed);
}

PyObject* py_backward_input(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* outputs = nullptr;
  PyObject* grad_outputs = nullptr;
  PyObject* inputs = nullptr;
  PyObject* weights = nullptr;
  int keep_graph = 0;
  int allow_unused = 0;
  // The torch_ext._C.HandedBackward the pass runs as, or None.
  PyObject* handed = nullptr;
  if (!PyArg_ParseTuple(
          args,
          "OOOOpp|O",
          &outputs,
          &grad_outputs,
          &inputs,
          &weights,
          &keep_graph,
          &allow_unused,
          &handed)) {
    return nullptr;
  }
  // The request builder checks outputs, gradients and inputs as grad() does.
  BackwardRequest request = request_from_python(
      outputs,
      grad_outputs,
      inputs,
      {static_cast<bool>(keep_graph),
       /*create_graph=*/false,
       /*accumulate_grad=*/false},
      allow_unused != 0,
      /*priorities=*/nullptr,
      handed);
  TORCH_CHECK(
      !request.roots.empty(),
      "backward_input: outputs cannot be empty");
  TORCH_CHECK_TYPE(
      PyTuple_Check(weights),
      "backward_input: weights must be a tuple, but got ",
      THPUtils_typename(weights));
  variable_list weight_tensors;
  edge_list weight_edges;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(weights); ++i) {
    PyObject* weight = PyTuple_GET_ITEM(weights, i);
    TORCH_CHECK_TYPE(
        THPVariable_Check(weight),
        "backward_input: weights must be tensors, but element ",
        i,
        " is ",
        THPUtils_typename(weight));
    const at::Tensor& tensor = THPVariable_Unpack(weight);
    TORCH_CHECK(
        tensor.requires_grad(),
        "backward_input: weight ",
        i,
        " does not require grad");
    TORCH_CHECK(
        tensor.is_leaf(),
        "backward_input: weight ",
        i,
        " is not a leaf tensor; weights are the leaves whose .grad the "
        "weight pass accumulates");
    weight_tensors.push_back(tensor);
    weight_edges.push_back(input_edge(tensor, /*accumulate_grad=*/true));
  }

  InputPassResult result;
  {
    pybind11::gil_scoped_release no_gil;
    result = backward_input(
        request.roots,
        std::move(request.root_grads),
        request.inputs,
        weight_edges,
        weight_tensors,
        keep_graph != 0,
        allow_unused != 0,
        std::move(request.context));
  }
  THPObjectPtr input_grads{wrap_tensors(result.input_grads)};
  if (!input_grads) {
    return nullptr;
  }
  THPObjectPtr state{
      PySplitState::wrap(split_state_type, std::move(result.state))};
  if (!state) {
    return nullptr;
  }
  return PyTuple_Pack(2, input_grads.get(), state.get());
  END_HANDLE_TH_ERRORS
}

PyObject* py_backward_weight(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* state = nullptr;
  int keep_graph = 0;
  // The torch_ext._C.HandedBackward the pass runs as, or None.
  PyObject* handed = nullptr;
  if (!PyArg_ParseTuple(args, "Op|O", &state, &keep_graph, &handed)) {
    return nullptr;
  }
  TORCH_CHECK_TYPE(
      Py_TYPE(state) == &split_state_type,
      "backward_weight expects the state that torch_ext.backward_input "
      "returned, but got ",
      THPUtils_typename(state));
  // Keeps the state alive while the GIL is released.
  std::shared_ptr<SplitState> split_state = PySplitState::of(state);
  CallContext context{{}, handed_backward_from_python(handed)};
  variable_list grads;
  {
    pybind11::gil_scoped_release no_gil;
    grads = backward_weight(*split_state, keep_graph != 0, std::move(context));
  }
  return wrap_tensors(grads);
  END_HANDLE_TH_ERRORS
}

namespace {

constexpr std::pair<const char*, WeightAccumulationBatching> kBatchingModes[] =
    {
        {"off", WeightAccumulationBatching::kOff},
        {"accelerator", WeightAccumulationBatching::kAccelerator},
        {"always", WeightAccumulationBatching::kAlways},
};

} // namespace

PyObject* py_set_weight_accumulation_batching(
    PyObject* /*module*/,
    PyObject* mode) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(
      PyUnicode_Check(mode),
      "set_weight_accumulation_batching expects a str, got ",
      Py_TYPE(mode)->tp_name);
  const std::string name = THPUtils_unpackString(mode);
  for (const auto& [mode_name, value] : kBatchingModes) {
    if (name == mode_name) {
      set_weight_accumulation_batching(value);
      Py_RETURN_NONE;
    }
  }
  TORCH_CHECK_VALUE(
      false,
      "set_weight_accumulation_batching: mode must be 'off', 'accelerator' or "
      "'always', got '",
      name,
      "'");
  END_HANDLE_TH_ERRORS
}

PyObject* py_weight_accumulation_batching(
    PyObject* /*module*/,
    PyObject* /*unused*/) {
  HANDLE_TH_ERRORS
  const auto current = weight_accumulation_batching();
  for (const auto& [mode_name, value] : kBatchingModes) {
    if (value == current) {
      return PyUnicode_FromString(mode_name);
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unknown weight accumulation batching mode");
  END_HANDLE_TH_ERRORS
}

PyObject* py_set_max_batched_gradient_bytes(
    PyObject* /*module*/,
    PyObject* bytes) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(
      THPUtils_checkLong(bytes),
      "_set_max_batched_gradient_bytes expects an int, got ",
      Py_TYPE(bytes)->tp_name);
  const int64_t value = THPUtils_unpackLong(bytes);
  TORCH_CHECK_VALUE(
      value >= 0,
      "_set_max_batched_gradient_bytes: bytes must be >= 0");
  return THPUtils_packUInt64(
      set_max_batched_gradient_bytes(static_cast<size_t>(value)));
  END_HANDLE_TH_ERRORS
}

bool init_split_bindings(PyObject* module) {
  PySplitState::init_type(
      split_state_type,
      "torch_ext._C.SplitState",
      "What torch_ext.backward_input keeps for torch_ext.backward_weight: the "
      "frontier of the weight subgraph and the gradients that reached it.");
  split_state_type.tp_repr = split_state_repr;
  if (PyType_Ready(&split_state_type) < 0) {
    return false;
  }
  Py_INCREF(&split_state_type);
  if (PyModule_AddObject(
          module,
          "SplitState",
          reinterpret_cast<PyObject*>(&split_state_type)) < 0) {
    Py_DECREF(&split_state_type);
    return false;
  }
  return true;
}

} // namespace torch_ext
