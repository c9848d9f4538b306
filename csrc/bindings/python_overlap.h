#pragma once

// torch_ext._C's microbatch overlap (python_overlap.cpp): the calls into the
// window and its collective gate (overlap/), and the thread-state capture,
// that torch_ext/microbatch_overlap.py uses; the host's answers to the
// overlap's questions (a deferred Ctrl-C, the GIL released around its waits,
// the gate's error as torch_ext._C.ForwardStoppedByBackward, twin groups);
// torch_ext._C.HandedBackward, what a call's context holds of a hand-over.

#include "engine/collective_progress.h"

#include <Python.h>

#include <memory>

namespace torch_ext {

// The window's record of a backward handed over, from a
// torch_ext._C.HandedBackward (what _overlap_hand_over returned): a call's
// CallContext::beside_forward. Null for None (or no object); a TypeError for
// anything else.
std::shared_ptr<CollectiveProgress> handed_backward_from_python(
    PyObject* handed);

// Adds the overlap's functions to `module`. False, with a Python error set,
// on failure.
bool init_overlap_bindings(PyObject* module);

} // namespace torch_ext
