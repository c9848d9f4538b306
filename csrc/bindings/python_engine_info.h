#pragma once

// torch_ext._C's introspection of the engine (python_engine_info.cpp).

#include <Python.h>

namespace torch_ext {

// Adds the introspection functions to `module`. False, with a Python error
// set, on failure.
bool init_engine_info_bindings(PyObject* module);

} // namespace torch_ext
