// torch_ext._C's introspection of the engine: what bit-stable accumulation
// held. Added to the module by init_engine_info_bindings (python_bindings.cpp).

#include "python_engine_info.h"

#include "backward_call.h"

#include <torch/csrc/utils/pybind.h>

namespace torch_ext {
namespace {

PyObject* py_held_gradient_stats(PyObject* /*module*/, PyObject* reset) {
  const int do_reset = PyObject_IsTrue(reset);
  if (do_reset < 0) {
    return nullptr;
  }
  const HeldGradientStats stats = held_gradient_stats(do_reset != 0);
  return Py_BuildValue(
      "{s:L,s:L,s:L}",
      "ordered_calls",
      static_cast<long long>(stats.ordered_calls),
      "held_gradients",
      static_cast<long long>(stats.held_gradients),
      "peak_held_bytes",
      static_cast<long long>(stats.peak_held_bytes));
}

PyMethodDef engine_info_methods[] = {
    {"_held_gradient_stats",
     py_held_gradient_stats,
     METH_O,
     "_held_gradient_stats(reset) -> {ordered_calls, held_gradients, "
     "peak_held_bytes}: what bit-stable accumulation held back since the last "
     "reset (calls that knew stock's order, gradients held, the most bytes "
     "one call held at once)."},
    {nullptr, nullptr, 0, nullptr}};

} // namespace

bool init_engine_info_bindings(PyObject* module) {
  return PyModule_AddFunctions(module, engine_info_methods) == 0;
}

} // namespace torch_ext
