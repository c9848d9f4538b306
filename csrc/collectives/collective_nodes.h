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
// PyTorch's functional collectives) is a launch only. A *lane* node is a
// launch whose node blocks until its bytes have arrived (Megatron's and
// DeepSpeed's _AllToAll) and that the user declared may run beside the rest
// (torch_ext.run_in_lane): the engine hands its apply() to the lane of its
// process group (collective_lane.h) and goes on with the other ready nodes.
//
// The role is decided once per node class and cached: discovery asks for
// every node, without the GIL, and pays one hash lookup.

#include <torch/csrc/autograd/function.h>

#include <cstdint>
#include <exception>

// CPython's own spelling, so this header does not pull in Python.h.
typedef struct _object PyObject;

namespace torch_ext {

// Below LAUNCH_FIRST (INT64_MAX), above anything a user would pick by hand.
inline constexpr int64_t kCollectivePriority = int64_t{1} << 62;

enum class CollectiveRole : uint8_t {
  kNone = 0,
  kLaunch = 1,
  kWait = 2,
  kLane = 3,
};

// The role of `fn`'s class. Only nodes of Python autograd.Functions (PyNodes,
// which includes torch.library ops with a Python autograd formula) can have
// one: every collective library writes its collectives that way. A class
// seen for the first time is decided once, with the GIL, by its explicit
// registration (torch_ext.register_collective_backward) or else by
// torch_ext.collectives' built-in rules; later calls read the cache without
// the GIL. Safe to call on any thread, concurrently with registration.
CollectiveRole collective_role(const torch::autograd::Node& fn);

// A node that issues a collective (kLaunch or kLane): the engine
// prioritises it.
inline bool is_launch(CollectiveRole role) {
  return role == CollectiveRole::kLaunch || role == CollectiveRole::kLane;
}
inline bool is_collective_node(const torch::autograd::Node& fn) {
  return is_launch(collective_role(fn));
}

// Whether the collective node `fn` hands its result to the engine in flight
// (BackwardCall::defer_wait_to_first_use): torch_ext's own collective ops.
bool defers_its_wait(const torch::autograd::Node& fn);

// `example` is the node of a Python autograd.Function (a PyNode), whose type
// collective_role must recognise.
void remember_python_node_type(const torch::autograd::Node& example);

// The process group whose lane runs the lane node `fn`, as an opaque key
// (the group object's address; the Python registry keeps it alive). Asks
// torch_ext.lanes with the GIL, which also refuses a group the engine can see
// is unsafe (DDP reducing on it): a python_error then.
uintptr_t lane_group_key(const torch::autograd::Node& fn);

// Raises (python_error) if a signal handler raised, such as Ctrl-C's
// KeyboardInterrupt; takes the GIL. Python runs handlers on the main thread
// only, so elsewhere this does nothing.
void raise_if_interrupted();

// Makes an error raised by the lane node `fn` name it: a note on a Python
// exception (its type and message stay the node's own), context on a
// c10::Error.
std::exception_ptr name_lane_node_in_error(
    std::exception_ptr error,
    const torch::autograd::Node& fn);

// The collective order check (torch_ext.check_collective_order): whether it
// is on, and its two questions, each asked with the GIL. `check_collective`
// before the node `fn` that issues a collective starts, as the call's
// `position`-th one and the `identity`-th the graph's forward made (its
// index among the call's collective nodes in creation order), with `inputs`
// the gradients it was given;
// `check_end_of_collectives` when a call issued `count` and no more. Both
// compare with the other ranks and raise (python_error) on a mismatch.
bool collective_check_enabled();
void check_collective(
    const torch::autograd::Node& fn,
    int32_t position,
    int32_t identity,
    const torch::autograd::variable_list& inputs);
void check_end_of_collectives(int32_t count);

// Switch for the automatic priority (on by default).
void set_auto_collective_priority(bool enabled);
bool auto_collective_priority();

// Adds set_collective_role, set_collective_role_decider and collective_role
// to torch_ext._C (torch_ext/collectives.py wraps them). False with a Python
// error set on failure.
bool init_collective_bindings(PyObject* module);

} // namespace torch_ext
