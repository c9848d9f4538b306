// torch_ext._C.install_host: torch_ext's one host made from the Python
// functions torch_ext/_host.py hands it, and installed for the engine
// (engine/host_interface.h).

#include "bindings/python_host.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <utility>

namespace torch_ext {
namespace {

PyObject* forget_dead_class(PyObject* /*self*/, PyObject* weakref) {
  // Called by a dying class's weak reference, which only the installed host
  // makes.
  python_host().forget_dead_class(weakref);
  Py_RETURN_NONE;
}

PyMethodDef forget_dead_class_def = {
    "_forget_dead_node_class",
    forget_dead_class,
    METH_O,
    "Weak reference callback: a node class the collective role cache holds is dying."};

THPObjectPtr checked_callable(PyObject* obj, const char* what) {
  TORCH_CHECK_TYPE(
      PyCallable_Check(obj),
      "torch_ext._C.install_host: ",
      what,
      " must be callable");
  return THPObjectPtr(Py_NewRef(obj));
}

// install_host(*, node_class_kind, lane_group, twin_group_name, python_node)
PyObject* py_install_host(PyObject* module, PyObject* args, PyObject* kwargs) {
  HANDLE_TH_ERRORS
  PyObject* node_class_kind = nullptr;
  PyObject* lane_group = nullptr;
  PyObject* twin_group_name = nullptr;
  PyObject* python_node = nullptr;
  constexpr const char* accepted_kwargs[] = {
      "node_class_kind",
      "lane_group",
      "twin_group_name",
      "python_node",
      nullptr};
  if (!PyArg_ParseTupleAndKeywords(
          args,
          kwargs,
          "$OOOO",
          const_cast<char**>(accepted_kwargs),
          &node_class_kind,
          &lane_group,
          &twin_group_name,
          &python_node)) {
    return nullptr;
  }
  TORCH_CHECK(
      dynamic_cast<PythonHost*>(&host()) == nullptr,
      "torch_ext._C.install_host: torch_ext's host is installed once, when torch_ext is imported");
  TORCH_CHECK_TYPE(
      THPFunction_Check(python_node) &&
          reinterpret_cast<THPFunction*>(python_node)->cdata,
      "torch_ext._C.install_host: python_node must be the live node of a Python autograd.Function");
  PythonHost::Answers answers{
      checked_callable(node_class_kind, "node_class_kind"),
      checked_callable(lane_group, "lane_group"),
      checked_callable(twin_group_name, "twin_group_name"),
      THPObjectPtr(PyObject_GetAttrString(module, "ForwardStoppedByBackward"))};
  if (!answers.forward_stopped_by_backward_type) {
    return nullptr;
  }
  // typeid of the node behind a THPFunction: its dynamic type, PyNode.
  const std::type_info& python_node_type =
      typeid(*reinterpret_cast<THPFunction*>(python_node)->cdata);
  // Never destroyed, as stock's engine is not: weak reference callbacks, and
  // discovery on other threads, may ask it during interpreter shutdown.
  auto* made = new PythonHost(std::move(answers), python_node_type);
  install_host(*made);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef host_methods[] = {
    {"install_host",
     reinterpret_cast<PyCFunction>(
         reinterpret_cast<void (*)()>(py_install_host)),
     METH_VARARGS | METH_KEYWORDS,
     "install_host(*, node_class_kind, lane_group, twin_group_name, "
     "python_node): makes torch_ext's host from Python's answers to the "
     "engine's questions and installs it; once, when torch_ext is imported "
     "(torch_ext/_host.py)."},
    {nullptr, nullptr, 0, nullptr}};

} // namespace

PythonHost::PythonHost(Answers answers, const std::type_info& python_node)
    : python_node_(python_node),
      answers_(std::move(answers)),
      forget_callback_(PyCFunction_New(&forget_dead_class_def, nullptr)) {
  if (!forget_callback_) {
    throw python_error();
  }
}

PythonHost& python_host() {
  auto* installed = dynamic_cast<PythonHost*>(&host());
  TORCH_CHECK(
      installed != nullptr,
      "torch_ext's host is not installed yet: torch_ext's import installs it (torch_ext/_host.py)");
  return *installed;
}

// Python runs signal handlers on the main thread only, so elsewhere this
// does nothing.
void PythonHost::raise_if_interrupted() {
  pybind11::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) {
    throw python_error();
  }
}

bool init_host_bindings(PyObject* module) {
  return PyModule_AddFunctions(module, host_methods) == 0;
}

} // namespace torch_ext
