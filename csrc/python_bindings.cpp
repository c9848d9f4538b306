// torch_ext._C: the Python entry points the schema language cannot express.
//
// run_backward takes exactly the arguments of torch._C._EngineBase.run_backward
// (roots may be GradientEdges, whose node is a Python object), so
// torch_ext.Engine can stand in for torch.autograd's execution engine. Its
// argument checks and messages are stock's (THPEngine_run_backward).

#include "collective_nodes.h"
#include "engine_api.h"
#include "python_engine_info.h"
#include "schedule_replay.h"
#include "python_split.h"
#include "trace.h"

#include <ATen/LegacyBatchedTensorImpl.h>
#include <ATen/LegacyVmapMode.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_anomaly_mode.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/python_strings.h>

namespace torch_ext {
namespace {

// The C++ node behind a torch.autograd.graph.Node, or null if `obj` is none.
c10::intrusive_ptr<Node> node_of(PyObject* obj) {
  if (THPFunction_Check(obj)) {
    return reinterpret_cast<THPFunction*>(obj)->cdata;
  }
  if (torch::autograd::THPCppFunction_Check(obj)) {
    return reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata;
  }
  return {};
}

Edge parse_gradient_edge(PyObject* obj) {
  PyObject* grad_fn = PyTuple_GetItem(obj, 0);
  const auto output_nr = THPUtils_unpackLong(PyTuple_GetItem(obj, 1));
  auto node = node_of(grad_fn);
  TORCH_CHECK(
      node,
      "GradientEdge's first object must be an autograd.graph.Node but got ",
      THPUtils_typename(grad_fn));
  return Edge(std::move(node), static_cast<uint32_t>(output_nr));
}

c10::intrusive_ptr<Node> checked_node_of(PyObject* obj) {
  auto node = node_of(obj);
  TORCH_CHECK_TYPE(
      node,
      "expected a torch.autograd.graph.Node, but got ",
      THPUtils_typename(obj));
  return node;
}

// [(node, priority, propagate), ...] as built by torch_ext.priority.
std::vector<PriorityOverride> parse_priority_overrides(PyObject* overrides) {
  std::vector<PriorityOverride> parsed;
  if (overrides == nullptr || overrides == Py_None) {
    return parsed;
  }
  THPObjectPtr items{PySequence_Fast(overrides, "priorities must be a sequence")};
  if (!items) {
    throw python_error();
  }
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(items.get());
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(items.get(), i);
    TORCH_CHECK_TYPE(
        PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 3,
        "priorities must hold (node, priority, propagate) tuples");
    NodePriority priority;
    priority.priority = THPUtils_unpackLong(PyTuple_GET_ITEM(item, 1));
    priority.propagate = PyObject_IsTrue(PyTuple_GET_ITEM(item, 2)) == 1;
    parsed.push_back({checked_node_of(PyTuple_GET_ITEM(item, 0)), priority});
  }
  return parsed;
}

void check_not_batched(const at::Tensor& tensor, const char* what, size_t i) {
  TORCH_CHECK(
      !at::isBatchedTensor(tensor),
      "torch.autograd.grad(outputs, inputs, grad_outputs) called inside ",
      "torch.vmap. We do not support the case where any ",
      what,
      " are vmapped tensors (",
      what == std::string("outputs") ? "output " : "input ",
      i,
      " is being vmapped over). Please "
      "call autograd.grad() outside torch.vmap or file a bug report "
      "with your use case.");
}

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
  if (!PyArg_ParseTuple(args, "O!O!O", &PyTuple_Type, &roots, &PyTuple_Type, &inputs, &priorities)) {
    return nullptr;
  }
  auto parse_edges = [](PyObject* tuple) {
    edge_list edges;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); ++i) {
      edges.push_back(parse_gradient_edge(PyTuple_GET_ITEM(tuple, i)));
    }
    return edges;
  };
  const edge_list root_edges = parse_edges(roots);
  const edge_list input_edges = parse_edges(inputs);
  auto overrides = parse_priority_overrides(priorities);
  std::vector<Node*> order;
  {
    pybind11::gil_scoped_release no_gil;
    order = planned_execution_order(root_edges, input_edges, std::move(overrides));
  }
  return nodes_to_list(order);
  END_HANDLE_TH_ERRORS
}

// _current_execution_order() -> [Node] or None: the order of the torch_ext
// call whose node runs on this thread, with stock's check of
// get_current_graph_task_execution_order.
PyObject* py_current_execution_order(PyObject* /*module*/, PyObject* /*unused*/) {
  HANDLE_TH_ERRORS
  const BackwardCall* call = BackwardCall::running_call();
  if (call == nullptr) {
    Py_RETURN_NONE;
  }
  TORCH_CHECK(
      !c10::AutogradState::get_tls_state().get_multithreading_enabled(),
      "get_current_graph_task_execution_order expects the current backward to be "
      "executed with multithreading disabled, e.g. by running:\n\n"
      ">>> with torch.autograd.set_multithreading_enabled(False):\n"
      "...     torch.autograd.grad(...)\n");
  return nodes_to_list(call->planned_order());
  END_HANDLE_TH_ERRORS
}

PyObject* py_run_backward(PyObject* /*module*/, PyObject* args, PyObject* kwargs) {
  HANDLE_TH_ERRORS
  PyObject* tensors = nullptr;
  PyObject* grad_tensors = nullptr;
  unsigned char keep_graph = 0;
  unsigned char create_graph = 0;
  PyObject* inputs = nullptr;
  unsigned char allow_unreachable = 0;
  unsigned char accumulate_grad = 0;
  PyObject* priorities = nullptr;
  constexpr const char* accepted_kwargs[] = {
      "tensors",
      "grad_tensors",
      "keep_graph",
      "create_graph",
      "inputs",
      "allow_unreachable",
      "accumulate_grad",
      "priorities",
      nullptr};
  if (!PyArg_ParseTupleAndKeywords(
          args,
          kwargs,
          "OObb|ObbO",
          const_cast<char**>(accepted_kwargs),
          &tensors,
          &grad_tensors,
          &keep_graph,
          &create_graph,
          &inputs,
          &allow_unreachable,
          &accumulate_grad,
          &priorities)) {
    return nullptr;
  }
  TORCH_CHECK(
      PyTuple_Check(tensors),
      "tensors argument is expected to be a tuple, but got ",
      THPUtils_typename(tensors));
  TORCH_CHECK(
      PyTuple_Check(grad_tensors),
      "grad_tensors argument is expected to be a tuple, but got ",
      THPUtils_typename(grad_tensors));
  const Py_ssize_t num_tensors = PyTuple_GET_SIZE(tensors);
  const Py_ssize_t num_gradients = PyTuple_GET_SIZE(grad_tensors);
  TORCH_CHECK(
      num_tensors == num_gradients,
      "got ",
      num_tensors,
      " tensors and ",
      num_gradients,
      " gradients");
  const bool backward_api_called = accumulate_grad;
  TORCH_CHECK(
      !backward_api_called || at::impl::VmapMode::current_vmap_level() == 0,
      "backward() called inside torch.vmap. This is not supported, "
      "please call backward() outside torch.vmap or instead use "
      "torch.autograd.grad inside torch.vmap");

  edge_list roots;
  roots.reserve(num_tensors);
  variable_list grads;
  grads.reserve(num_tensors);
  for (Py_ssize_t i = 0; i < num_tensors; ++i) {
    PyObject* root = PyTuple_GET_ITEM(tensors, i);
    std::optional<at::Tensor> root_tensor;
    if (THPVariable_Check(root)) {
      root_tensor = THPVariable_Unpack(root);
      check_not_batched(*root_tensor, "outputs", i);
      roots.push_back(root_edge(*root_tensor, i));
    } else if (PyObject_IsInstance(root, THPGradientEdgeClass)) {
      roots.push_back(parse_gradient_edge(root));
      TORCH_CHECK(
          roots.back().function,
          "element ",
          i,
          " of tensors does not require grad and does not have a grad_fn");
    } else {
      TORCH_CHECK(
          false,
          "element ",
          i,
          " of tensors tuple is neither a Tensor nor a GradientEdge");
    }

    PyObject* grad = PyTuple_GET_ITEM(grad_tensors, i);
    if (THPVariable_Check(grad)) {
      grads.push_back(THPVariable_Unpack(grad));
    } else {
      TORCH_CHECK(
          grad == Py_None,
          "element ",
          i,
          " of gradients tuple is not a Tensor or None");
      TORCH_CHECK(
          root_tensor.has_value(),
          "element ",
          i,
          " of gradients tuple is None, but the corresponding output is a GradientEdge."
          "This is not supported.");
      TORCH_CHECK(
          !root_tensor->requires_grad(),
          "element ",
          i,
          " of gradients tuple is None, but the corresponding Tensor requires grad");
      grads.emplace_back();
    }
  }

  edge_list input_edges;
  if (inputs != nullptr) {
    TORCH_CHECK(
        PyTuple_CheckExact(inputs), "inputs to run_backward must be a tuple");
    const Py_ssize_t num_inputs = PyTuple_GET_SIZE(inputs);
    input_edges.reserve(num_inputs);
    for (Py_ssize_t i = 0; i < num_inputs; ++i) {
      PyObject* input = PyTuple_GET_ITEM(inputs, i);
      if (THPVariable_Check(input)) {
        const auto& tensor = THPVariable_Unpack(input);
        check_not_batched(tensor, "inputs", i);
        input_edges.push_back(input_edge(tensor, accumulate_grad));
      } else if (PyObject_IsInstance(input, THPGradientEdgeClass)) {
        input_edges.push_back(parse_gradient_edge(input));
      } else {
        TORCH_CHECK(
            false,
            "all inputs have to be Tensors or GradientEdges, but got ",
            THPUtils_typename(input));
      }
    }
  }

  auto priority_overrides = parse_priority_overrides(priorities);

  variable_list results;
  {
    pybind11::gil_scoped_release no_gil;
    results = run_backward(
        roots,
        std::move(grads),
        input_edges,
        {static_cast<bool>(keep_graph),
         static_cast<bool>(create_graph),
         static_cast<bool>(accumulate_grad)},
        std::move(priority_overrides));
  }

  if (!backward_api_called && inputs != nullptr) {
    const Py_ssize_t num_inputs = PyTuple_GET_SIZE(inputs);
    THPObjectPtr py_results{PyTuple_New(num_inputs)};
    if (!py_results) {
      return nullptr;
    }
    for (Py_ssize_t i = 0; i < num_inputs; ++i) {
      TORCH_CHECK(
          allow_unreachable || results[i].defined(),
          "The differentiated Tensor at index ",
          i,
          " appears to not have been used "
          "in the graph. Set allow_unused=True if this is the desired behavior.");
      PyTuple_SET_ITEM(py_results.get(), i, THPVariable_Wrap(results[i]));
    }
    return py_results.release();
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
  return PyBool_FromLong(
      BackwardCall::defer_wait_to_first_use(THPVariable_Unpack(tensor)));
  END_HANDLE_TH_ERRORS
}

PyObject* py_set_auto_collective_priority(PyObject* /*module*/, PyObject* enabled) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(
      PyBool_Check(enabled),
      "set_auto_collective_priority expects a bool, got ",
      Py_TYPE(enabled)->tp_name);
  set_auto_collective_priority(enabled == Py_True);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* py_auto_collective_priority(PyObject* /*module*/, PyObject* /*unused*/) {
  return PyBool_FromLong(auto_collective_priority());
}

PyObject* py_is_collective_node(PyObject* /*module*/, PyObject* node) {
  HANDLE_TH_ERRORS
  return PyBool_FromLong(is_collective_node(*checked_node_of(node)));
  END_HANDLE_TH_ERRORS
}

PyObject* py_remember_python_node_type(PyObject* /*module*/, PyObject* node) {
  HANDLE_TH_ERRORS
  remember_python_node_type(*checked_node_of(node));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// Copies a node's forward stack (and parent chain) for anomaly mode's report.
void copy_anomaly_metadata(Node& from, Node& to) {
  pybind11::gil_scoped_acquire gil;
  auto* source = static_cast<torch::autograd::PyAnomalyMetadata*>(from.metadata());
  auto* target = static_cast<torch::autograd::PyAnomalyMetadata*>(to.metadata());
  PyDict_Clear(target->dict());
  if (PyDict_Update(target->dict(), source->dict()) < 0) {
    PyErr_Clear();
  }
}

PyMethodDef methods[] = {
    {"run_backward",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_run_backward)),
     METH_VARARGS | METH_KEYWORDS,
     "run_backward(tensors, grad_tensors, keep_graph, create_graph, inputs=None, "
     "allow_unreachable=False, accumulate_grad=False, priorities=None): "
     "torch._C._EngineBase.run_backward on torch_ext's engine; priorities: "
     "[(node, priority, propagate)] for this call."},
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
    {"set_auto_collective_priority",
     py_set_auto_collective_priority,
     METH_O,
     "set_auto_collective_priority(enabled): switch collectives' automatic "
     "priority."},
    {"auto_collective_priority",
     py_auto_collective_priority,
     METH_NOARGS,
     "auto_collective_priority() -> bool."},
    {"remember_python_node_type",
     py_remember_python_node_type,
     METH_O,
     "remember_python_node_type(node): the grad_fn of a Python "
     "autograd.Function, so the engine can recognise collectives' nodes."},
    {"is_collective_node",
     py_is_collective_node,
     METH_O,
     "is_collective_node(node) -> bool: whether the engine prioritises the "
     "node as a collective."},
    {"backward_input",
     py_backward_input,
     METH_VARARGS,
     "backward_input(outputs, grad_outputs, inputs, weights, keep_graph, "
     "allow_unused) -> (input gradients, SplitState): split backward's dI pass."},
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
     "backward_weight(state, keep_graph) -> weight gradients: split backward's "
     "dW pass."},
    {"execution_order",
     py_execution_order,
     METH_VARARGS,
     "execution_order(roots, inputs, priorities) -> [Node]: the nodes a "
     "torch_ext backward would run, in its order (torch_ext.execution_order)."},
    {"_current_execution_order",
     py_current_execution_order,
     METH_NOARGS,
     "_current_execution_order() -> [Node] or None: the run order of the "
     "torch_ext backward whose node runs on this thread."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "torch_ext._C",
    "torch_ext's C++ autograd engine.",
    -1,
    methods};

} // namespace
} // namespace torch_ext

PyMODINIT_FUNC PyInit__C() {
  torch_ext::set_anomaly_metadata_copier(torch_ext::copy_anomaly_metadata);
  PyObject* module = PyModule_Create(&torch_ext::module_def);
  if (module != nullptr &&
      (!torch_ext::init_split_bindings(module) ||
       !torch_ext::init_engine_info_bindings(module))) {
    Py_DECREF(module);
    return nullptr;
  }
  if (module != nullptr && !torch_ext::init_collective_bindings(module)) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
