#pragma once

// torch_ext._C's microbatch overlap (python_overlap.cpp): the window, its
// collective gate and the thread-state capture torch_ext/microbatches.py uses.

#include <Python.h>

namespace torch_ext {

// Adds the overlap's functions to `module`. False, with a Python error set,
// on failure.
bool init_overlap_bindings(PyObject* module);

} // namespace torch_ext
