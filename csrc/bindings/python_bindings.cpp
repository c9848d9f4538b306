// torch_ext._C: the Python entry points the schema language cannot express.
//
// run_backward takes exactly the arguments of torch._C._EngineBase.run_backward
// (roots may be GradientEdges, whose node is a Python object), so
// torch_ext.Engine can stand in for torch.autograd's execution engine; the
// request builder (backward_request.h) checks them as stock does.

#include "bindings/python_collectives.h"
#include "bindings/python_engine_info.h"
#include "bindings/python_host.h"
#include "bindings/python_overlap.h"
#include "bindings/python_request.h"
#include "bindings/python_split.h"
#include "engine/plan/plan_cache.h"
#include "engine/plan/schedule_replay.h"
#include "engine/run/running_node.h"
#include "engine/trace.h"

#include <ATen/ThreadLocalPythonObjects.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/python_anomaly_mode.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/python_strings.h>

namespace torch_ext {
namespace {

PyObject* nodes_to_list(const std::vector<Node*>& nodes) {
  THPObjectPtr list{PyList_New(static_cast<Py_ssize_t>(nodes.size()))};
  if (!list) {
    throw python_error();
  }
  for (size_t i = 0; i < nodes.size(); ++i) {
    PyObject* node = torch::autograd::functionToPyObject(nodes[i]->getptr());
    if (node == nullptr) {
      throw python_error();
    }
    PyList_SET_ITEM(list.get(), static_cast<Py_ssize_t>(i), node);
  }
  return list.release();
}

// execution_order(roots, inputs, priorities) -> [Node]: roots and inputs are
// tuples of GradientEdges (torch_ext/order.py resolves tensors).
PyObject* py_execution_order(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* roots = nullptr;
  PyObject* inputs = nullptr;
  PyObject* priorities = nullptr;
  if (!PyArg_ParseTuple(
          args,
          "O!O!O",
          &PyTuple_Type,
          &roots,
          &PyTuple_Type,
          &inputs,
          &priorities)) {
    return nullptr;
  }
  const edge_list root_edges = gradient_edges_from_python(roots);
  const edge_list input_edges = gradient_edges_from_python(inputs);
  auto overrides = parse_priority_overrides(priorities);
  std::vector<Node*> order;
  {
    pybind11::gil_scoped_release no_gil;
    order =
        planned_execution_order(root_edges, input_edges, std::move(overrides));
  }
  return nodes_to_list(order);
  END_HANDLE_TH_ERRORS
}

// _current_execution_order() -> [Node] or None: the order of the torch_ext
// call whose node runs on this thread, with stock's check of
// get_current_graph_task_execution_order.
PyObject* py_current_execution_order(
    PyObject* /*module*/,
    PyObject* /*unused*/) {
  HANDLE_TH_ERRORS
  std::optional<std::vector<Node*>> order = running_call_planned_order();
  if (!order.has_value()) {
    Py_RETURN_NONE;
  }
  TORCH_CHECK(
      !c10::AutogradState::get_tls_state().get_multithreading_enabled(),
      "get_current_graph_task_execution_order expects the current backward to be "
      "executed with multithreading disabled, e.g. by running:\n\n"
      ">>> with torch.autograd.set_multithreading_enabled(False):\n"
      "...     torch.autograd.grad(...)\n");
  return nodes_to_list(*order);
  END_HANDLE_TH_ERRORS
}

PyObject* py_run_backward(
    PyObject* /*module*/,
    PyObject* args,
    PyObject* kwargs) {
  HANDLE_TH_ERRORS
  PyObject* tensors = nullptr;
  PyObject* grad_tensors = nullptr;
  unsigned char keep_graph = 0;
  unsigned char create_graph = 0;
  PyObject* inputs = nullptr;
  unsigned char allow_unreachable = 0;
  unsigned char accumulate_grad = 0;
  PyObject* priorities = nullptr;
  PyObject* handed = nullptr;
  constexpr const char* accepted_kwargs[] = {
      "tensors",
      "grad_tensors",
      "keep_graph",
      "create_graph",
      "inputs",
      "allow_unreachable",
      "accumulate_grad",
      "priorities",
      "handed",
      nullptr};
  if (!PyArg_ParseTupleAndKeywords(
          args,
          kwargs,
          "OObb|ObbOO",
          const_cast<char**>(accepted_kwargs),
          &tensors,
          &grad_tensors,
          &keep_graph,
          &create_graph,
          &inputs,
          &allow_unreachable,
          &accumulate_grad,
          &priorities,
          &handed)) {
    return nullptr;
  }
  const bool grad_api_called = !accumulate_grad && inputs != nullptr;
  auto results = run_releasing_gil(request_from_python(
      tensors,
      grad_tensors,
      inputs,
      {static_cast<bool>(keep_graph),
       static_cast<bool>(create_graph),
       static_cast<bool>(accumulate_grad)},
      allow_unreachable,
      priorities,
      handed));
  if (grad_api_called) {
    return wrap_tensors(results);
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// Stock's _engine_run_backward stashes the caller's contextvars under
// "context" for the duration of its engine call (so that a node run on
// another thread sees e.g. the compiler's configuration) and erases it after,
// rather than restoring an outer one.
class StashedContext {
 public:
  StashedContext() {
    PyObject* context = PyContext_CopyCurrent();
    if (context == nullptr) {
      throw python_error();
    }
    // SafePyObject takes over the new reference.
    at::impl::ThreadLocalPythonObjects::set(
        kKey,
        std::make_shared<c10::SafePyObject>(context, getPyInterpreter()));
  }
  ~StashedContext() {
    at::impl::ThreadLocalPythonObjects::erase(kKey);
  }
  StashedContext(const StashedContext&) = delete;
  StashedContext& operator=(const StashedContext&) = delete;

 private:
  static constexpr const char* kKey = "context";
};

// The plain call of torch_ext.backward()/grad() (engine.py): one tensor
// output and no gradient for it, stock's Python checked to do nothing but
// forward. Does here what that Python would (_make_grads' implicit gradient,
// _engine_run_backward's context stash) and runs the call: a small backward's
// fixed cost is mostly interpreter work. Returns NotImplemented, having done
// nothing, where stock's Python would do something else with the output (it
// does not require grad, is nested, or is not a floating scalar), so that
// the caller takes stock's path with its errors.
//   run_backward_implicit(output, keep_graph, create_graph, inputs,
//                         allow_unreachable, accumulate_grad, priorities)
PyObject* py_run_backward_implicit(
    PyObject* /*module*/,
    PyObject* const* args,
    Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(
      nargs == 7,
      "run_backward_implicit takes 7 positional arguments, got ",
      nargs);
  PyObject* output = args[0];
  TORCH_CHECK_TYPE(
      THPVariable_CheckExact(output),
      "run_backward_implicit: the output must be a plain torch.Tensor, got ",
      THPUtils_typename(output));
  const at::Tensor& tensor = THPVariable_Unpack(output);
  if (!tensor.requires_grad() || tensor.is_nested() || tensor.numel() != 1 ||
      !at::isFloatingType(tensor.scalar_type())) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  const bool accumulate_grad = PyObject_IsTrue(args[5]) == 1;
  THPObjectPtr outputs{PyTuple_Pack(1, output)};
  THPObjectPtr gradients{PyTuple_New(1)};
  if (!outputs || !gradients) {
    throw python_error();
  }
  PyTuple_SET_ITEM(
      gradients.get(),
      0,
      THPVariable_Wrap(at::ones_like(tensor, at::MemoryFormat::Preserve)));
  StashedContext stashed_context;
  auto results = run_releasing_gil(request_from_python(
      outputs.get(),
      gradients.get(),
      args[3],
      {PyObject_IsTrue(args[1]) == 1,
       PyObject_IsTrue(args[2]) == 1,
       accumulate_grad},
      PyObject_IsTrue(args[4]) == 1,
      args[6],
      /*handed=*/nullptr));
  if (!accumulate_grad) {
    return wrap_tensors(results);
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* py_set_priority(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* node = nullptr;
  long long priority = 0;
  int propagate = 1;
  if (!PyArg_ParseTuple(args, "OLp", &node, &priority, &propagate)) {
    return nullptr;
  }
  set_node_priority(
      checked_node_of(node),
      {static_cast<int64_t>(priority), static_cast<bool>(propagate)});
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* py_clear_priority(PyObject* /*module*/, PyObject* node) {
  HANDLE_TH_ERRORS
  return PyBool_FromLong(clear_node_priority(checked_node_of(node).get()));
  END_HANDLE_TH_ERRORS
}

PyObject* py_get_priority(PyObject* /*module*/, PyObject* node) {
  HANDLE_TH_ERRORS
  const auto priority = node_priority(checked_node_of(node).get());
  if (!priority.has_value()) {
    Py_RETURN_NONE;
  }
  return Py_BuildValue(
      "(LO)",
      static_cast<long long>(priority->priority),
      priority->propagate ? Py_True : Py_False);
  END_HANDLE_TH_ERRORS
}

PyObject* py_trace_start(PyObject* /*module*/, PyObject* /*unused*/) {
  HANDLE_TH_ERRORS
  trace::start();
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* py_trace_stop(PyObject* /*module*/, PyObject* /*unused*/) {
  HANDLE_TH_ERRORS
  trace::stop();
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// One event as a tuple (torch_ext/tracing.py names the fields).
PyObject* traced_event_tuple(const trace::Event& event) {
  return Py_BuildValue(
      "(iNLLiiNLLLOi)",
      static_cast<int>(event.kind),
      THPUtils_packString(event.name),
      static_cast<long long>(event.sequence_nr),
      static_cast<long long>(event.priority),
      static_cast<int>(event.priority_from),
      static_cast<int>(event.origin_from),
      THPUtils_packString(event.origin_name),
      static_cast<long long>(event.origin_sequence_nr),
      static_cast<long long>(event.start_ns),
      static_cast<long long>(event.end_ns),
      event.collective ? Py_True : Py_False,
      static_cast<int>(event.wait_for));
}

PyObject* py_trace_take(PyObject* /*module*/, PyObject* /*unused*/) {
  HANDLE_TH_ERRORS
  const std::vector<trace::CallEvents> calls = trace::take();
  THPObjectPtr result{PyList_New(static_cast<Py_ssize_t>(calls.size()))};
  if (!result) {
    throw python_error();
  }
  for (size_t c = 0; c < calls.size(); ++c) {
    const auto& call = calls[c];
    THPObjectPtr events{
        PyList_New(static_cast<Py_ssize_t>(call.events.size()))};
    if (!events) {
      throw python_error();
    }
    for (size_t e = 0; e < call.events.size(); ++e) {
      PyObject* event = traced_event_tuple(call.events[e]);
      if (event == nullptr) {
        throw python_error();
      }
      PyList_SET_ITEM(events.get(), static_cast<Py_ssize_t>(e), event);
    }
    PyObject* item = Py_BuildValue(
        "(KLN)",
        static_cast<unsigned long long>(call.backward_id),
        static_cast<long long>(call.thread),
        events.release());
    if (item == nullptr) {
      throw python_error();
    }
    PyList_SET_ITEM(result.get(), static_cast<Py_ssize_t>(c), item);
  }
  return result.release();
  END_HANDLE_TH_ERRORS
}

PyObject* py_trace_clock_ns(PyObject* /*module*/, PyObject* /*unused*/) {
  HANDLE_TH_ERRORS
  return PyLong_FromLongLong(trace::clock_ns());
  END_HANDLE_TH_ERRORS
}

PyObject* py_defer_wait(PyObject* /*module*/, PyObject* tensor) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(
      THPVariable_Check(tensor),
      "defer_wait expects a Tensor, got ",
      Py_TYPE(tensor)->tp_name);
  return PyBool_FromLong(defer_wait_to_first_use(THPVariable_Unpack(tensor)));
  END_HANDLE_TH_ERRORS
}

} // namespace

// Copies a node's forward stack (and parent chain) for anomaly mode's report.
void PythonHost::copy_anomaly_metadata(Node& from, Node& to) {
  pybind11::gil_scoped_acquire gil;
  auto* source =
      static_cast<torch::autograd::PyAnomalyMetadata*>(from.metadata());
  auto* target =
      static_cast<torch::autograd::PyAnomalyMetadata*>(to.metadata());
  PyDict_Clear(target->dict());
  if (PyDict_Update(target->dict(), source->dict()) < 0) {
    PyErr_Clear();
  }
}

namespace {

PyMethodDef methods[] = {
    {"run_backward",
     reinterpret_cast<PyCFunction>(
         reinterpret_cast<void (*)()>(py_run_backward)),
     METH_VARARGS | METH_KEYWORDS,
     "run_backward(tensors, grad_tensors, keep_graph, create_graph, inputs=None, "
     "allow_unreachable=False, accumulate_grad=False, priorities=None, "
     "handed=None): torch._C._EngineBase.run_backward on torch_ext's engine, "
     "with the call's context: priorities, [(node, priority, propagate)] for "
     "this call; handed, the torch_ext._C.HandedBackward it runs as."},
    {"run_backward_implicit",
     reinterpret_cast<PyCFunction>(
         reinterpret_cast<void (*)()>(py_run_backward_implicit)),
     METH_FASTCALL,
     "run_backward_implicit(output, keep_graph, create_graph, inputs, "
     "allow_unreachable, accumulate_grad, priorities): the plain call of "
     "torch_ext.backward/grad with stock's implicit gradient and context "
     "stash, or NotImplemented where stock's Python would do more."},
    {"set_priority",
     py_set_priority,
     METH_VARARGS,
     "set_priority(node, priority, propagate): record a node's priority."},
    {"clear_priority",
     py_clear_priority,
     METH_O,
     "clear_priority(node) -> bool: forget a node's priority."},
    {"get_priority",
     py_get_priority,
     METH_O,
     "get_priority(node) -> (priority, propagate) or None."},
    {"trace_start",
     py_trace_start,
     METH_NOARGS,
     "trace_start(): start recording every backward call (raises if a trace "
     "is already active)."},
    {"trace_stop", py_trace_stop, METH_NOARGS, "trace_stop(): stop recording."},
    {"trace_take",
     py_trace_take,
     METH_NOARGS,
     "trace_take() -> [(backward_id, thread, [event tuple, ...]), ...]: the "
     "calls recorded in the last trace (see torch_ext/tracing.py)."},
    {"trace_clock_ns",
     py_trace_clock_ns,
     METH_NOARGS,
     "trace_clock_ns() -> int: the trace's clock (CLOCK_MONOTONIC), in ns."},
    {"defer_wait",
     py_defer_wait,
     METH_O,
     "defer_wait(result) -> bool: from a collective's backward formula, hand "
     "its in-flight result to the engine to wait on at first use; False when "
     "not running as a torch_ext node (the caller must wait)."},
    {"backward_input",
     py_backward_input,
     METH_VARARGS,
     "backward_input(outputs, grad_outputs, inputs, weights, keep_graph, "
     "allow_unused, handed=None) -> (input gradients, SplitState): split "
     "backward's dI pass; handed as for run_backward."},
    {"set_weight_accumulation_batching",
     py_set_weight_accumulation_batching,
     METH_O,
     "set_weight_accumulation_batching(mode): 'off', 'accelerator' or 'always'."},
    {"weight_accumulation_batching",
     py_weight_accumulation_batching,
     METH_NOARGS,
     "weight_accumulation_batching() -> mode."},
    {"_set_max_batched_gradient_bytes",
     py_set_max_batched_gradient_bytes,
     METH_O,
     "_set_max_batched_gradient_bytes(n) -> previous n: for tests, the bytes "
     "of gradients batched accumulation holds before it flushes."},
    {"backward_weight",
     py_backward_weight,
     METH_VARARGS,
     "backward_weight(state, keep_graph, handed=None) -> weight gradients: "
     "split backward's dW pass; handed as for run_backward."},
    {"execution_order",
     py_execution_order,
     METH_VARARGS,
     "execution_order(roots, inputs, priorities) -> [Node]: the nodes a "
     "torch_ext backward would run, in its order (torch_ext.debug.execution_order)."},
    {"_current_execution_order",
     py_current_execution_order,
     METH_NOARGS,
     "_current_execution_order() -> [Node] or None: the run order of the "
     "torch_ext backward whose node runs on this thread."},
    {nullptr, nullptr, 0, nullptr}};

// The names of trace::Kind and trace::PriorityFrom, indexed by their values,
// which torch_ext/tracing.py reads rather than restating them.
bool add_trace_names(PyObject* module) {
  static_assert(
      static_cast<int>(trace::Kind::kBackward) == 0 &&
      static_cast<int>(trace::Kind::kNode) == 1 &&
      static_cast<int>(trace::Kind::kCollectiveWait) == 2);
  static_assert(
      static_cast<int>(trace::PriorityFrom::kDefault) == 0 &&
      static_cast<int>(trace::PriorityFrom::kSetPriority) == 1 &&
      static_cast<int>(trace::PriorityFrom::kCallOverride) == 2 &&
      static_cast<int>(trace::PriorityFrom::kAutoCollective) == 3 &&
      static_cast<int>(trace::PriorityFrom::kPropagated) == 4);
  THPObjectPtr kinds(
      Py_BuildValue("(sss)", "backward", "node", "collective_wait"));
  THPObjectPtr sources(Py_BuildValue(
      "(Ossss)",
      Py_None,
      "set_priority",
      "priorities",
      "collective",
      "propagated"));
  return kinds && sources &&
      PyModule_AddObjectRef(module, "trace_kinds", kinds.get()) == 0 &&
      PyModule_AddObjectRef(module, "trace_priority_sources", sources.get()) ==
      0;
}

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "torch_ext._C",
    "torch_ext's C++ autograd engine.",
    -1,
    methods};

} // namespace
} // namespace torch_ext

PyMODINIT_FUNC PyInit__C() {
  // The host, Python's answers to the engine's questions, is not made here:
  // torch_ext's import installs it (install_host, torch_ext/_host.py).
  PyObject* module = PyModule_Create(&torch_ext::module_def);
  if (module != nullptr &&
      (!torch_ext::init_host_bindings(module) ||
       !torch_ext::init_split_bindings(module) ||
       !torch_ext::init_engine_info_bindings(module) ||
       !torch_ext::init_collective_bindings(module) ||
       !torch_ext::init_overlap_bindings(module) ||
       !torch_ext::add_trace_names(module))) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
