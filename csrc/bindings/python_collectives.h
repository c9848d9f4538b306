#pragma once

// The Python side of collectives (python_collectives.cpp): each node class's
// role, decided by torch_ext.collectives.roles' rules or a registration and
// cached per class; the questions the engine asks torch_ext.collectives.lanes
// and torch_ext.collectives.order_check; their torch_ext._C functions.

#include "engine/host_callbacks.h"

#include <Python.h>

namespace torch_ext {

// Sets the collective entries of `callbacks` to Python's answers.
void fill_collective_callbacks(HostCallbacks& callbacks);

// Adds set_collective_role, set_collective_role_decider, collective_role,
// set_collective_checker, set_lane_group_resolver and the other collective
// functions to torch_ext._C (torch_ext/collectives.py wraps them). False with
// a Python error set on failure.
bool init_collective_bindings(PyObject* module);

} // namespace torch_ext
