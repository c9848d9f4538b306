#pragma once

// torch_ext._C's split-backward entry points (python_split.cpp), listed in
// the module's method table in python_bindings.cpp.

#include <Python.h>

namespace torch_ext {

// backward_input(outputs, grad_outputs, inputs, weights, keep_graph,
// allow_unused) -> (input gradients, SplitState)
PyObject* py_backward_input(PyObject* module, PyObject* args);
// backward_weight(state, keep_graph) -> weight gradients
PyObject* py_backward_weight(PyObject* module, PyObject* args);
PyObject* py_set_weight_accumulation_batching(PyObject* module, PyObject* mode);
PyObject* py_weight_accumulation_batching(PyObject* module, PyObject* unused);
// _set_max_batched_gradient_bytes(n) -> previous n (for tests)
PyObject* py_set_max_batched_gradient_bytes(PyObject* module, PyObject* bytes);

// Adds the SplitState type to `module`. False, with a Python error set, on
// failure.
bool init_split_bindings(PyObject* module);

} // namespace torch_ext
