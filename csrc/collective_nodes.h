#pragma once

// Which backward nodes are collectives, and what they do there.
//
// A *launch* node starts gradient communication: the engine drives to it
// first, propagating a high priority to every node on a path from the roots
// to it (like torch_ext.launch_first, but below it so an explicit
// launch_first still wins). A *wait* node blocks until a launch's result has
// arrived: the engine runs it as late as the nodes that read its result
// allow, so everything else ready runs while the bytes move. TorchRec's
// Req/Wait Functions make one of each (the forward Wait's node launches, the
// forward Req's node waits); a synchronous collective (torch_ext's ops,
// PyTorch's functional collectives, Megatron's _AllToAll) is a launch only.
//
// The role is decided once per node class and cached: discovery asks for
// every node, without the GIL, and pays one hash lookup.

#include <torch/csrc/autograd/function.h>

#include <cstdint>

// CPython's own spelling, so this header does not pull in Python.h.
typedef struct _object PyObject;

namespace torch_ext {

// Below LAUNCH_FIRST (INT64_MAX), above anything a user would pick by hand.
inline constexpr int64_t kCollectivePriority = int64_t{1} << 62;

enum class CollectiveRole : uint8_t { kNone = 0, kLaunch = 1, kWait = 2 };

// The role of `fn`'s class. Only nodes of Python autograd.Functions (PyNodes,
// which includes torch.library ops with a Python autograd formula) can have
// one: every collective library writes its collectives that way. A class
// seen for the first time is decided once, with the GIL, by its explicit
// registration (torch_ext.register_collective_backward) or else by
// torch_ext.collectives' built-in rules; later calls read the cache without
// the GIL. Safe to call on any thread, concurrently with registration.
CollectiveRole collective_role(const torch::autograd::Node& fn);

// A launch node: the engine prioritises it (collective_role == kLaunch).
inline bool is_collective_node(const torch::autograd::Node& fn) {
  return collective_role(fn) == CollectiveRole::kLaunch;
}

// Whether the collective node `fn` hands its result to the engine in flight
// (BackwardCall::defer_wait_to_first_use): torch_ext's own collective ops.
bool defers_its_wait(const torch::autograd::Node& fn);

// `example` is the node of a Python autograd.Function (a PyNode), whose type
// collective_role must recognise.
void remember_python_node_type(const torch::autograd::Node& example);

// Switch for the automatic priority (on by default).
void set_auto_collective_priority(bool enabled);
bool auto_collective_priority();

// Adds set_collective_role, set_collective_role_decider and collective_role
// to torch_ext._C (torch_ext/collectives.py wraps them). False with a Python
// error set on failure.
bool init_collective_bindings(PyObject* module);

} // namespace torch_ext
