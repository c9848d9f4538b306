#pragma once

// torch_ext._C's microbatch overlap (python_overlap.cpp): the calls into the
// window and its collective gate (overlap/), and the thread-state capture,
// that torch_ext/microbatch_overlap.py uses; the host's answers to the
// overlap's questions (a deferred Ctrl-C, the GIL released around its waits,
// the gate's error as torch_ext._C.ForwardStoppedByBackward, twin groups).

#include <Python.h>

namespace torch_ext {

// Adds the overlap's functions to `module`. False, with a Python error set,
// on failure.
bool init_overlap_bindings(PyObject* module);

} // namespace torch_ext
