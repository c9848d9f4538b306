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
#include <mutex>
#include <vector>

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

// Makes an error raised by the collective node `fn` name it and where it ran
// (its lane, or the engine thread): a note on a Python exception (its type
// and message stay the node's own), context on a c10::Error. A collective
// node's error is often the network's (a peer gone, a timeout), which names
// no node of its own.
std::exception_ptr name_collective_node_in_error(
    std::exception_ptr error,
    const torch::autograd::Node& fn,
    bool in_lane);

// The collective order check (torch_ext.check_collective_order): whether it
// is on, and one call's check. The call's plan fixes, before any node runs,
// every collective it will start and their order (the collective sequence),
// so the ranks compare all of it in one exchange, made off the engine thread
// as soon as the plan is made. Whichever thread starts the call's first
// collective (the engine thread, or a lane that would block in the
// collective anyway) awaits the exchange's result first, and the call awaits
// it before it returns: a divergence raises on every rank before any of them
// issues a collective of the call, at the cost of one exchange per call.
bool collective_check_enabled();

// A collective of the sequence as the check names it: the node, and which of
// the call's collective nodes forward made it (its index among them in
// creation order: the ranks agree on it whatever order they start them in).
struct CheckedCollective {
  const torch::autograd::Node* fn;
  int32_t identity;
};

class CollectiveOrderCheck {
 public:
  // Starts the exchange of `sequence`'s fingerprints, in the order the call
  // starts them. With the GIL taken here; raises (python_error) if the
  // exchange cannot start.
  explicit CollectiveOrderCheck(const std::vector<CheckedCollective>& sequence);
  CollectiveOrderCheck(const CollectiveOrderCheck&) = delete;
  CollectiveOrderCheck& operator=(const CollectiveOrderCheck&) = delete;
  ~CollectiveOrderCheck();
  // Blocks until the exchange is done and raises its mismatch (python_error,
  // the same on every rank). Safe from any thread, called without the GIL;
  // only the first call waits, later ones rethrow its result.
  void await();
  // After the call failed: completes the exchange all the same (every rank
  // takes part in naming a mismatch), raising nothing.
  void complete_after_error() noexcept;

 private:
  std::mutex mutex_;
  bool done_ = false;
  std::exception_ptr mismatch_;
  // The checker and its pending exchange, released with the GIL.
  PyObject* checker_ = nullptr;
  PyObject* pending_ = nullptr;
};

// Switch for the automatic priority (on by default).
void set_auto_collective_priority(bool enabled);
bool auto_collective_priority();

// Adds set_collective_role, set_collective_role_decider and collective_role
// to torch_ext._C (torch_ext/collectives.py wraps them). False with a Python
// error set on failure.
bool init_collective_bindings(PyObject* module);

} // namespace torch_ext
