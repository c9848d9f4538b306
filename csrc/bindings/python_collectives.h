#pragma once

// The Python side of collectives (python_collectives.cpp): the host's answers
// about node classes' roles, decided by torch_ext.collectives.roles' rules or
// a registration and cached per class, and its questions to
// torch_ext.collectives.lanes and torch_ext.collectives.order_check
// (PythonHost's methods, bindings/python_host.h); their torch_ext._C
// functions.

#include <Python.h>

namespace torch_ext {

// Adds set_collective_role, collective_role, set_collective_checker and the
// other collective functions to torch_ext._C (torch_ext/collectives/ wraps
// them). False with a Python error set on failure.
bool init_collective_bindings(PyObject* module);

} // namespace torch_ext
