// torch_ext._C's introspection of the engine: what bit-stable accumulation
// held, and which current-node path runs. Added to the module by
// init_engine_info_bindings (python_bindings.cpp).

#include "bindings/python_engine_info.h"
#include "engine/plan/plan_cache.h"
#include "engine/run/current_node.h"
#include "engine/run/ordered_delivery.h"

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

PyObject* py_current_node_state(PyObject* /*module*/, PyObject* /*unused*/) {
  switch (current_node_state()) {
    case CurrentNodeState::kAvailable:
      return PyUnicode_FromString("available");
    case CurrentNodeState::kUnavailable:
      return PyUnicode_FromString("unavailable");
    case CurrentNodeState::kUnknown:
      break;
  }
  return PyUnicode_FromString("unknown");
}

PyObject* py_set_current_node_forced_off(PyObject* /*module*/, PyObject* off) {
  const int forced_off = PyObject_IsTrue(off);
  if (forced_off < 0) {
    return nullptr;
  }
  set_current_node_forced_off(forced_off != 0);
  Py_RETURN_NONE;
}

PyObject* py_plan_cache_stats(PyObject* /*module*/, PyObject* reset) {
  const int do_reset = PyObject_IsTrue(reset);
  if (do_reset < 0) {
    return nullptr;
  }
  const PlanCacheStats stats = plan_cache_stats(do_reset != 0);
  return Py_BuildValue(
      "{s:L,s:L,s:L,s:L,s:O}",
      "hits",
      static_cast<long long>(stats.hits),
      "misses",
      static_cast<long long>(stats.misses),
      "templates",
      static_cast<long long>(stats.templates),
      "template_bytes",
      static_cast<long long>(stats.template_bytes),
      "enabled",
      plan_cache_enabled() ? Py_True : Py_False);
}

PyObject* py_set_plan_cache(PyObject* /*module*/, PyObject* enabled) {
  const int on = PyObject_IsTrue(enabled);
  if (on < 0) {
    return nullptr;
  }
  const bool was = plan_cache_enabled();
  set_plan_cache_enabled(on != 0);
  return PyBool_FromLong(was);
}

PyObject* py_clear_plan_cache(PyObject* /*module*/, PyObject* /*unused*/) {
  clear_plan_cache();
  Py_RETURN_NONE;
}

PyMethodDef engine_info_methods[] = {
    {"_current_node_state",
     py_current_node_state,
     METH_NOARGS,
     "_current_node_state() -> 'available' or 'unavailable': whether nodes "
     "are made the current autograd node while they run (current_node.cpp; "
     "settled by the process's first question, without a backward)."},
    {"_set_current_node_forced_off",
     py_set_current_node_forced_off,
     METH_O,
     "_set_current_node_forced_off(off): TORCH_EXT_CURRENT_NODE=off, as "
     "torch_ext/_loader.py parsed it; set before the first backward."},
    {"_held_gradient_stats",
     py_held_gradient_stats,
     METH_O,
     "_held_gradient_stats(reset) -> {ordered_calls, held_gradients, "
     "peak_held_bytes}: what bit-stable accumulation held back since the last "
     "reset (calls that knew stock's order, gradients held, the most bytes "
     "one call held at once)."},
    {"_plan_cache_stats",
     py_plan_cache_stats,
     METH_O,
     "_plan_cache_stats(reset) -> {hits, misses, templates, template_bytes, "
     "enabled}: this thread's plan cache (plan_cache.h) since the last reset."},
    {"_set_plan_cache",
     py_set_plan_cache,
     METH_O,
     "_set_plan_cache(enabled) -> bool: turns the plan cache on or off for "
     "every thread; returns the previous setting."},
    {"_clear_plan_cache",
     py_clear_plan_cache,
     METH_NOARGS,
     "_clear_plan_cache(): drops this thread's plan templates."},
    {nullptr, nullptr, 0, nullptr}};

} // namespace

bool init_engine_info_bindings(PyObject* module) {
  return PyModule_AddFunctions(module, engine_info_methods) == 0;
}

} // namespace torch_ext
