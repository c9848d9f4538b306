#pragma once

// What the engine asks of the language that hosts it: the one interface
// through which engine/, and overlap/ above it, reach Python. The engine
// declares it here and includes no Python header. torch_ext's import makes
// one Python host (bindings/python_host.h) and installs it, explicitly and
// once (torch_ext/_host.py calls torch_ext._C.install_host), as stock's
// torch._C installs its PythonEngine (set_default_engine_stub,
// torch/csrc/autograd/python_engine.cpp). Until then, each question has the
// answer of a process without Python: no node is a collective, nothing is
// narrowed, no check.
//
// Those answers that need the GIL take it themselves.

#include "collectives/collective_role.h"

#include <c10/util/FunctionRef.h>
#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch_ext {

using torch::autograd::Node;
using torch::autograd::variable_list;

class CollectiveProgress;

// A collective of a call's sequence as the collective order check names it:
// the node, and when forward made it (its sequence_nr: every node of one
// graph was made on one thread, whose numbers only grow). The host derives
// which collective of its group it is, which ranks running the same program
// agree on whatever order they start them in.
struct CheckedCollective {
  const Node* fn;
  uint64_t created;
};

// One call's collective order check (torch_ext.check_collective_order),
// begun by the host when the call's plan is made: the members of each group
// the call's collectives use compare them, off the engine thread, one exchange
// per group. A thread about to start one of those collectives awaits the
// verdict of its group (and of the groups nested with it); one about to run a
// hook, or the call ending, awaits every verdict.
class CollectiveOrderCheck {
 public:
  // await()'s argument for every group's verdict.
  static constexpr int32_t kEveryCollective = -1;

  virtual ~CollectiveOrderCheck() = default;
  // Blocks until the verdict the collective at `collective` (its index in the
  // sequence the check was begun with) needs is in, and raises a mismatch,
  // the same on every rank of the group that disagrees. Safe from any thread
  // and from several at once, called without the GIL.
  virtual void await(int32_t collective) = 0;
  // After the call failed: completes every exchange all the same (every rank
  // of a disagreeing group takes part in naming the mismatch), raising
  // nothing.
  void complete_after_error() noexcept {
    try {
      await(kEveryCollective);
    } catch (...) {
    }
  }
};

class Host {
 public:
  virtual ~Host() = default;

  // What `fn`'s class is to the engine (collective_role.h): its role, and
  // whether it hands its result over in flight. Decided once per class and
  // cached: discovery asks for every node, without the GIL.
  virtual CollectiveKind collective_kind(const Node& fn) = 0;
  // The process group whose lane runs the lane node `fn`, as an opaque key.
  // Throws for a group the host can see is unsafe (DDP reducing on it).
  virtual uintptr_t lane_group_key(const Node& fn) = 0;
  // The collective order check (torch_ext.check_collective_order): whether
  // it is on, and one call's check begun with its collective sequence, in
  // the order the call starts them, and the backward handed over that the
  // call is (its CallContext's, or null), which the ranks compare too (null
  // if the check was switched off since).
  virtual bool collective_check_enabled() = 0;
  virtual std::shared_ptr<CollectiveOrderCheck> begin_collective_check(
      const std::vector<CheckedCollective>& sequence,
      const CollectiveProgress* beside_forward) = 0;
  // Throws if a signal handler raised (Ctrl-C): for the engine thread while
  // it waits for a lane, and for the microbatch overlap's forward thread
  // while it is parked (overlap/window.cpp).
  virtual void raise_if_interrupted() = 0;
  // After raise_if_interrupted threw `interrupt` where no error may leave
  // (a RecordFunction callback of the overlap's forward thread): makes the
  // host raise it again once it runs its own code.
  virtual void raise_interrupt_later(std::exception_ptr interrupt) = 0;
  // Runs `wait`, which blocks until another thread acts, with the GIL
  // released if this thread holds it: the other thread may need it to act.
  // The microbatch overlap's waits run under whatever called them (a
  // collective, the engine).
  virtual void wait_releasing_gil(c10::function_ref<void()> wait) = 0;
  // The error that stops the overlap's forward thread before a collective
  // because the backward beside it failed (overlap/collective_gate.cpp). The
  // host makes it, so that its code can tell it from other errors by type:
  // the gate raises it inside a dispatcher kernel, and torch turns any
  // c10::Error reaching Python from there into a RuntimeError.
  virtual std::exception_ptr forward_stopped_by_backward(
      std::string message) = 0;
  // The registered name of the twin of the process group registered as
  // `group_name`: a gloo group of the same ranks, on which a backward beside
  // the next microbatch's forward issues that group's collectives
  // (ForwardCollectives::kBesideBackwardCollectives). Throws for a group
  // that has none (not gloo).
  virtual std::string twin_group_name(const std::string& group_name) = 0;
  // Makes an error raised by the collective node `fn` name it and where it
  // ran (its lane, or the engine thread): a collective's error is often the
  // network's, which names no node of its own.
  virtual std::exception_ptr name_collective_node_in_error(
      std::exception_ptr error,
      const Node& fn,
      bool in_lane) = 0;
  // Split backward's passes narrow a custom Function's ctx.needs_input_grad
  // to the gradients the pass computes while its node runs
  // (GraphPlan::narrows_needs_input_grad, pytorch#174017). `narrow` returns
  // a token for `restore`, or null if nothing changed.
  virtual void* narrow_needs_input_grad(Node& fn) = 0;
  virtual void restore_needs_input_grad(Node& fn, void* token) = 0;
  // Anomaly mode: the failing node's forward stack, which lives in the host,
  // copied to the node the host task reports instead (its driver).
  virtual void copy_anomaly_metadata(Node& from, Node& to) = 0;
};

// Installs `host`, which lives as long as the process; once, at torch_ext's
// import, before any backward.
void install_host(Host& host);

namespace detail {
// The installed host; until then, the answers of a process without one
// (host_interface.cpp).
extern std::atomic<Host*> installed_host;
} // namespace detail

// Inline: discovery asks for every node.
inline Host& host() {
  return *detail::installed_host.load(std::memory_order_acquire);
}

} // namespace torch_ext
