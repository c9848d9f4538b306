// The testdev caching allocator: host memory handed out with CUDA's
// stream-ordered reuse rules, so a missing recordStream shows up as one
// stream reading memory another stream has already been given.
#pragma once

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstdint>

namespace testdev {

c10::DeviceAllocator* device_allocator();
// The allocator for pin_memory(): plain host memory whose ranges are tracked
// so that is_pinned() answers true for them.
c10::Allocator* pinned_allocator();
bool is_pinned_ptr(const void* ptr);
// The device of a pointer the device allocator handed out (inside a block).
bool device_of_ptr(const void* ptr, c10::DeviceIndex* device);

struct AllocatorStats {
  int64_t allocated_bytes = 0;
  int64_t peak_allocated_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t num_allocs = 0;
  // Allocations served from a cached block.
  int64_t num_reuses = 0;
  int64_t num_frees = 0;
  // Blocks freed while recorded on other streams, waiting for them.
  int64_t num_pending = 0;
};
AllocatorStats allocator_stats(c10::DeviceIndex device);
void reset_peak(c10::DeviceIndex device);
// Synchronizes every device, then returns all cached blocks to the OS.
void empty_cache();

} // namespace testdev
