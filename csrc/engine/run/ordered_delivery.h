#pragma once

// Bit-stable delivery: gradients added to an input buffer in stock's order.
//
// Where the plan orders an input (schedule_replay.h: more than one producer,
// and a call that may run them in another order than stock's), each gradient
// into it has its rank in stock's order. One that arrives ahead of its turn
// is held until every gradient before it has been added, so the sum has
// stock's bits whatever order the producers ran in. The executor
// (BackwardCall::deliver) hands every gradient of an ordered input here.

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace torch_ext {

class OrderedDelivery {
 public:
  // One entry per ordered input of the call's plan.
  void resize(size_t num_ordered_inputs) {
    inputs_.resize(num_ordered_inputs);
  }

  // `grad` (from `producer_stream`) for ordered input `ordered`, `rank`-th in
  // stock's order. If its turn has come, calls add(grad, producer_stream)
  // for it and then for each held gradient whose turn follows, in stock's
  // order; otherwise holds it. `last` says it was the input's last pending
  // gradient, so nothing may stay held.
  template <typename Add>
  void arrive(
      int32_t ordered,
      uint32_t rank,
      at::Tensor&& grad,
      const std::optional<c10::Stream>& producer_stream,
      bool last,
      Add&& add) {
    OrderedInput& order = inputs_[ordered];
    if (rank != order.next_rank) {
      // Ahead of its turn: an earlier gradient in stock's order is still to
      // come, so this one cannot be its node's input yet.
      TORCH_INTERNAL_ASSERT(rank > order.next_rank && !last);
      if (grad.defined()) {
        held_bytes_ += static_cast<int64_t>(grad.nbytes());
        peak_held_bytes_ = std::max(peak_held_bytes_, held_bytes_);
      }
      ++held_count_;
      order.held.push_back({rank, std::move(grad), producer_stream});
      return;
    }
    add(std::move(grad), producer_stream);
    ++order.next_rank;
    // Add the held gradients whose turn has come. A handful at most: a
    // linear search beats keeping them sorted.
    for (size_t i = 0; i < order.held.size();) {
      if (order.held[i].rank != order.next_rank) {
        ++i;
        continue;
      }
      HeldGradient held = std::move(order.held[i]);
      order.held[i] = std::move(order.held.back());
      order.held.pop_back();
      if (held.grad.defined()) {
        held_bytes_ -= static_cast<int64_t>(held.grad.nbytes());
      }
      add(std::move(held.grad), held.producer_stream);
      ++order.next_rank;
      i = 0;
    }
    TORCH_INTERNAL_ASSERT(!last || order.held.empty());
  }

  // Adds what this call held to held_gradient_stats; once per call whose
  // plan knew stock's order.
  void record_held_gradients() const;

 private:
  struct HeldGradient {
    uint32_t rank;
    at::Tensor grad;
    std::optional<c10::Stream> producer_stream;
  };
  // Per ordered input: the next place in stock's order to add, and the
  // gradients that arrived ahead of it.
  struct OrderedInput {
    uint32_t next_rank = 0;
    std::vector<HeldGradient> held;
  };
  std::vector<OrderedInput> inputs_;
  // Bytes of gradients held now and at most during this call.
  int64_t held_bytes_ = 0;
  int64_t peak_held_bytes_ = 0;
  int64_t held_count_ = 0;
};

// What bit-stable accumulation held, summed over every call since the last
// reset: gradients held back, and the largest number of bytes one call held
// at once.
struct HeldGradientStats {
  int64_t held_gradients = 0;
  int64_t peak_held_bytes = 0;
  int64_t ordered_calls = 0;
};
HeldGradientStats held_gradient_stats(bool reset);

} // namespace torch_ext
