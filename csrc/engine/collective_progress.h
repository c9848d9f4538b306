#pragma once

// What a backward run beside the next microbatch's forward tells the thread
// that handed it over (torch_ext.overlap_microbatches, overlap/window.h),
// and where it waits for that thread: how many collectives its plan starts,
// when each may start and when each has. The order this serves is the
// collective order rule (docs/design.md, "The collective order rule").
//
// The call learns that it runs beside a forward from its CallContext
// (engine/call_context.h), built where the call was asked for. What stays
// per thread here is what a thread is doing now, which the collective gate
// (overlap/collective_gate.h) reads inside the dispatcher, where no argument
// of the call reaches: whether this thread is starting a collective such a
// call planned (the gate lets that one through and refuses the others), and
// the lane node it is running.

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <utility>

namespace torch_ext {

// When the forward thread's collectives may start, beside a backward
// (overlap_microbatches' forward_collectives, named as there).
enum class ForwardCollectives : uint8_t {
  // Once the backward has started every collective its plan holds.
  kAfterBackwardCollectives = 0,
  // Once the whole backward has finished.
  kAfterBackward = 1,
  // In turns with the backward's planned collectives, where the backward's
  // take turns (in sequence); otherwise as kAfterBackwardCollectives.
  kInTurnsWithBackwardCollectives = 2,
  // At once: the backward's collectives go to a twin of their group, which
  // the forward's never use (gloo groups only).
  kBesideBackwardCollectives = 3,
};

// Each rule's name in overlap_microbatches' forward_collectives, indexed by
// its value: the one list of them, which torch_ext/microbatch_overlap.py
// reads (torch_ext._C._overlap_forward_rules).
inline constexpr std::array<std::string_view, 4> kForwardCollectivesNames = {
    "after_backward_collectives",
    "after_backward",
    "in_turns_with_backward_collectives",
    "beside_backward_collectives"};
static_assert(
    kForwardCollectivesNames.size() ==
    static_cast<size_t>(ForwardCollectives::kBesideBackwardCollectives) + 1);

inline std::string_view name_of(ForwardCollectives rule) {
  return kForwardCollectivesNames[static_cast<size_t>(rule)];
}

// The rule named `name`, or nullopt for none.
inline std::optional<ForwardCollectives> forward_collectives_named(
    std::string_view name) {
  for (size_t value = 0; value < kForwardCollectivesNames.size(); ++value) {
    if (kForwardCollectivesNames[value] == name) {
      return static_cast<ForwardCollectives>(value);
    }
  }
  return std::nullopt;
}

// One backward handed over to run beside the next microbatch's forward, as
// the call sees it (overlap/window.h's HandedBackward implements it): which
// it is, and what it reports.
class CollectiveProgress {
 public:
  CollectiveProgress(int64_t microbatch, ForwardCollectives rule)
      : microbatch(microbatch), rule(rule) {}
  virtual ~CollectiveProgress() = default;
  CollectiveProgress(const CollectiveProgress&) = delete;
  CollectiveProgress& operator=(const CollectiveProgress&) = delete;

  // The microbatch whose backward this is, and when the next forward's
  // collectives may start beside it: what the ranks also compare when they
  // check the collective order (Host::begin_collective_check).
  const int64_t microbatch;
  const ForwardCollectives rule;

  // The call's plan is made: it starts `count` collectives. `in_turns`:
  // each asks for its turn (may_start) before it is issued, in the plan's
  // order, so the forward's may go between them; otherwise the forward's
  // wait for all of them.
  virtual void planned(size_t count, bool in_turns) = 0;
  // Blocks until the collective at `place` in the plan's order (0 first)
  // may be issued: when the threads take turns, once the forward thread has
  // issued `place` collectives of its own, or has none left to issue before
  // this backward ends; at once otherwise.
  // Throws once the call has failed (abandoned): a collective that waited
  // must not be issued after the ranks' sequences have parted.
  virtual void may_start(size_t place) = 0;
  // One of them was started: its collective has been issued (a lane
  // node's, see IssuingLaneNode), or its apply() returned (on the engine
  // thread, an asynchronous collective is then in flight; a lane node whose
  // collective the gate did not see has finished it).
  virtual void started_one() = 0;
  // The call failed: nothing it planned and has not started will start.
  virtual void abandoned() = 0;
};

// The lane node of a reporting call that a lane thread is running. Its
// backward runs one collective (run_in_lane's contract), so the collective
// gate reports it started as soon as that collective has been issued: the
// forward thread's next collective is then issued right behind it, not after
// it has finished, and the two are in flight at once. A second collective
// from the same node is refused before it is issued: the forward thread's
// may already be queued ahead of it on some ranks and not on others.
struct IssuingLaneNode {
  std::shared_ptr<CollectiveProgress> progress;
  // How many collectives the node has issued so far.
  int issued = 0;
};

namespace detail {
// Thread state, not a call's: what this thread is doing now, set for the
// scope of a planned collective's start (PlannedCollectiveStart) and of the
// order check's exchange, and read by the collective gate below the
// dispatcher, on the same thread, within that scope.
inline thread_local int starting_planned_collective = 0;
inline thread_local std::shared_ptr<IssuingLaneNode> issuing_lane_node;
} // namespace detail

// The lane node this thread is running for a reporting call, if any.
inline IssuingLaneNode* issuing_lane_node() {
  return detail::issuing_lane_node.get();
}

// Marks `node` as the lane node this thread runs (null: none), for the scope
// of its start (PlannedCollectiveStart, engine/planned_collective_start.h).
inline void set_issuing_lane_node(std::shared_ptr<IssuingLaneNode> node) {
  detail::issuing_lane_node = std::move(node);
}

// Whether this thread is starting a collective that a reporting call planned
// (or its collective order check's exchange, which precedes them all).
inline bool starting_planned_collective() {
  return detail::starting_planned_collective > 0;
}

// Marks this thread as starting a planned collective for a scope: the
// collective order check's exchange, and each planned collective's start
// (PlannedCollectiveStart).
class StartingPlannedCollective {
 public:
  explicit StartingPlannedCollective(bool active = true) : active_(active) {
    if (active_) {
      ++detail::starting_planned_collective;
    }
  }
  ~StartingPlannedCollective() {
    if (active_) {
      --detail::starting_planned_collective;
    }
  }
  StartingPlannedCollective(const StartingPlannedCollective&) = delete;
  StartingPlannedCollective& operator=(const StartingPlannedCollective&) =
      delete;

 private:
  bool active_;
};

} // namespace torch_ext
