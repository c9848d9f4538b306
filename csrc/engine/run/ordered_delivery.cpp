// Bit-stable delivery's process-wide counters (ordered_delivery.h); the
// delivery itself is inlined into the executor's.

#include "engine/run/ordered_delivery.h"

#include <mutex>

namespace torch_ext {
namespace {
std::mutex held_stats_mutex;
HeldGradientStats held_stats;
} // namespace

void OrderedDelivery::record_held_gradients() const {
  std::lock_guard<std::mutex> lock(held_stats_mutex);
  held_stats.ordered_calls += 1;
  held_stats.held_gradients += held_count_;
  held_stats.peak_held_bytes =
      std::max(held_stats.peak_held_bytes, peak_held_bytes_);
}

HeldGradientStats held_gradient_stats(bool reset) {
  std::lock_guard<std::mutex> lock(held_stats_mutex);
  const HeldGradientStats stats = held_stats;
  if (reset) {
    held_stats = HeldGradientStats{};
  }
  return stats;
}

} // namespace torch_ext
