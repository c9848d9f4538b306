#pragma once

// The state of a call that runs its collectives in sequence
// (BackwardCall::runs_collective_sequence, run_in_sequence in
// collective_sequence.cpp): the collective lanes, the nodes on them, and each
// collective's turn. Made only for such a call, so an ordinary call carries
// none of it.

#include "collectives/collective_lane.h"
#include "engine/trace.h"

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace torch_ext {

struct CollectiveSequence {
  // The lanes: a thread per process group, joined when the call ends.
  CollectiveLanes lanes;
  // A node whose apply() is on a lane: what its post hooks will need.
  struct LaneNode {
    torch::autograd::variable_list inputs;
    bool had_post_hooks = false;
    int32_t trace_event = trace::kNoEvent;
  };
  std::unordered_map<int32_t, LaneNode> in_lane;
  // Accelerator lane nodes' side stream, one per device (every lane node of
  // a device runs on it, so they stay in the collective sequence's order).
  std::unordered_map<c10::Device, c10::Stream> side_streams;
  // Per slot, its place in the collective sequence, or kNoSlot.
  std::vector<int32_t> place;
  int32_t next = 0;
  // Nodes of the sequence that became ready before their turn.
  std::vector<int32_t> parked;
};

} // namespace torch_ext
