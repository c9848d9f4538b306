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
// Which role a node has is the host's answer (Host::collective_kind in
// engine/host_interface.h): decided once per node class and cached by the
// Python bindings (bindings/python_collectives.cpp). torch_ext._C exports
// these values (collective_roles, collective_priority); Python reads them
// there rather than restating them.

#include <atomic>
#include <cstdint>

namespace torch_ext {

// Below LAUNCH_FIRST (INT64_MAX), above anything a user would pick by hand.
inline constexpr int64_t kCollectivePriority = int64_t{1} << 62;

enum class CollectiveRole : uint8_t {
  kNone = 0,
  kLaunch = 1,
  kWait = 2,
  kLane = 3,
};

// What a node class is to the engine: its role and whether its node, when it
// launches, hands its result to the engine in flight
// (BackwardCall::defer_wait_to_first_use), as torch_ext's own collective ops
// do. Both are decided together, once per class.
struct CollectiveKind {
  CollectiveRole role = CollectiveRole::kNone;
  bool defers_wait = false;
  bool operator==(const CollectiveKind&) const = default;
};

// A node that issues a collective (kLaunch or kLane): the engine
// prioritises it.
inline bool is_launch(CollectiveRole role) {
  return role == CollectiveRole::kLaunch || role == CollectiveRole::kLane;
}

namespace detail {
inline std::atomic<bool> auto_collective_priority_on{true};
} // namespace detail

// Switch for the automatic priority (on by default).
inline void set_auto_collective_priority(bool enabled) {
  detail::auto_collective_priority_on.store(enabled, std::memory_order_relaxed);
}
inline bool auto_collective_priority() {
  return detail::auto_collective_priority_on.load(std::memory_order_relaxed);
}

} // namespace torch_ext
