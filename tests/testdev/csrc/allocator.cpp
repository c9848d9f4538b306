#include "allocator.h"

#include "streams.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace testdev {
namespace {

constexpr size_t kAlignment = 64;
constexpr size_t kRound = 512;

struct Block {
  void* ptr = nullptr;
  size_t size = 0;
  c10::DeviceIndex device = 0;
  // The stream it was allocated on: once freed, only that stream may take it
  // again at once (its later work is ordered after all earlier uses there).
  c10::StreamId stream = 0;
  // Other streams recordStream named: the block waits for them on free.
  std::vector<c10::StreamId> used_on;
};

struct Pending {
  Block* block;
  std::vector<void*> events;
};

using FreeList = std::multimap<size_t, Block*>;

struct DeviceState {
  std::array<FreeList, kPoolSize + 1> free_lists;
  AllocatorStats stats;
};

void free_block(void* ctx);

class Allocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DeviceIndex device = current_device();
    c10::Device dev(c10::DeviceType::PrivateUse1, device);
    if (nbytes == 0) {
      return c10::DataPtr(nullptr, dev);
    }
    c10::Stream stream = current_stream(device);
    size_t size = (nbytes + kRound - 1) / kRound * kRound;
    std::lock_guard<std::mutex> lock(mu_);
    process_pending();
    DeviceState& state = devices_[device];
    FreeList& list = state.free_lists[stream.id()];
    Block* block = nullptr;
    // Best fit, but never a block over twice the size: blocks are not split.
    auto it = list.lower_bound(size);
    if (it != list.end() && it->first <= 2 * size) {
      block = it->second;
      list.erase(it);
      ++state.stats.num_reuses;
    } else {
      void* ptr = std::aligned_alloc(kAlignment, size);
      TORCH_CHECK(ptr, "testdev: out of host memory allocating ", size);
      block = new Block();
      block->ptr = ptr;
      block->size = size;
      block->device = device;
      block->stream = stream.id();
      state.stats.reserved_bytes += static_cast<int64_t>(size);
      by_address_.emplace(reinterpret_cast<uintptr_t>(ptr), block);
    }
    block->used_on.clear();
    ++state.stats.num_allocs;
    state.stats.allocated_bytes += static_cast<int64_t>(block->size);
    state.stats.peak_allocated_bytes =
        std::max(state.stats.peak_allocated_bytes, state.stats.allocated_bytes);
    return c10::DataPtr(block->ptr, block, &free_block, dev);
  }

  void copy_data(void* dest, const void* src, std::size_t count)
      const override {
    std::memcpy(dest, src, count);
  }

  bool initialized() override {
    return true;
  }

  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {
    empty_cache_impl();
  }

  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    if (ptr.get_deleter() != &free_block) {
      return; // not ours (e.g. from_blob): nothing to keep alive
    }
    auto* block = static_cast<Block*>(ptr.get_context());
    std::lock_guard<std::mutex> lock(mu_);
    if (stream.device_index() != block->device ||
        stream.id() == block->stream) {
      return;
    }
    auto& used = block->used_on;
    if (std::find(used.begin(), used.end(), stream.id()) == used.end()) {
      used.push_back(stream.id());
    }
  }

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(
      c10::DeviceIndex device) override {
    AllocatorStats s = stats(device);
    c10::CachingDeviceAllocator::DeviceStats out;
    auto& all = out.allocated_bytes[0];
    all.current = s.allocated_bytes;
    all.peak = s.peak_allocated_bytes;
    out.reserved_bytes[0].current = s.reserved_bytes;
    out.allocation[0].allocated = s.num_allocs;
    out.allocation[0].freed = s.num_frees;
    return out;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_device(device);
    std::lock_guard<std::mutex> lock(mu_);
    auto& s = devices_[device].stats;
    s.num_allocs = s.num_reuses = s.num_frees = 0;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check_device(device);
    std::lock_guard<std::mutex> lock(mu_);
    auto& s = devices_[device].stats;
    s.peak_allocated_bytes = s.allocated_bytes;
  }

  void free(Block* block) {
    std::lock_guard<std::mutex> lock(mu_);
    DeviceState& state = devices_[block->device];
    state.stats.allocated_bytes -= static_cast<int64_t>(block->size);
    ++state.stats.num_frees;
    if (block->used_on.empty()) {
      state.free_lists[block->stream].emplace(block->size, block);
      return;
    }
    // CUDA's rule: the other streams may still use the block; it is reusable
    // once the work they have been given so far has run.
    Pending pending{block, {}};
    for (c10::StreamId id : block->used_on) {
      void* event = event_create(false);
      event_record(
          event,
          c10::Stream(
              c10::Stream::UNSAFE,
              c10::Device(c10::DeviceType::PrivateUse1, block->device),
              id));
      pending.events.push_back(event);
    }
    pending_.push_back(std::move(pending));
  }

  AllocatorStats stats(c10::DeviceIndex device) {
    check_device(device);
    std::lock_guard<std::mutex> lock(mu_);
    process_pending();
    AllocatorStats s = devices_[device].stats;
    s.num_pending = 0;
    for (const auto& p : pending_) {
      s.num_pending += p.block->device == device ? 1 : 0;
    }
    return s;
  }

  bool device_of(const void* ptr, c10::DeviceIndex* device) {
    auto address = reinterpret_cast<uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_address_.upper_bound(address);
    if (it == by_address_.begin()) {
      return false;
    }
    --it;
    if (address >= it->first + it->second->size) {
      return false;
    }
    *device = it->second->device;
    return true;
  }

  void empty_cache_impl() {
    synchronize_device(-1);
    std::lock_guard<std::mutex> lock(mu_);
    process_pending();
    for (auto& state : devices_) {
      for (auto& list : state.free_lists) {
        for (auto& entry : list) {
          Block* block = entry.second;
          state.stats.reserved_bytes -= static_cast<int64_t>(block->size);
          by_address_.erase(reinterpret_cast<uintptr_t>(block->ptr));
          std::free(block->ptr);
          delete block;
        }
        list.clear();
      }
    }
  }

 private:
  // Moves blocks whose recorded streams have caught up to their free lists.
  void process_pending() {
    auto done = [](const Pending& p) {
      return std::all_of(p.events.begin(), p.events.end(), event_query);
    };
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (!done(*it)) {
        ++it;
        continue;
      }
      for (void* event : it->events) {
        event_destroy(event);
      }
      Block* block = it->block;
      devices_[block->device].free_lists[block->stream].emplace(
          block->size,
          block);
      it = pending_.erase(it);
    }
  }

  std::mutex mu_;
  std::array<DeviceState, kDeviceCount> devices_;
  std::vector<Pending> pending_;
  std::map<uintptr_t, Block*> by_address_;
};

// Leaked: tensors may be freed by static destructors after this one's.
Allocator* the_allocator = new Allocator();

void free_block(void* ctx) {
  the_allocator->free(static_cast<Block*>(ctx));
}

// Pinned host memory: plain memory, tracked so isPinnedPtr can answer.
std::mutex pinned_mu;
std::map<uintptr_t, size_t> pinned_ranges;

void free_pinned(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(pinned_mu);
    pinned_ranges.erase(reinterpret_cast<uintptr_t>(ptr));
  }
  std::free(ptr);
}

class PinnedAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    c10::Device cpu(c10::DeviceType::CPU);
    if (nbytes == 0) {
      return c10::DataPtr(nullptr, cpu);
    }
    size_t size = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
    void* ptr = std::aligned_alloc(kAlignment, size);
    TORCH_CHECK(ptr, "testdev: out of host memory allocating ", size);
    {
      std::lock_guard<std::mutex> lock(pinned_mu);
      pinned_ranges[reinterpret_cast<uintptr_t>(ptr)] = size;
    }
    return c10::DataPtr(ptr, ptr, &free_pinned, cpu);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &free_pinned;
  }

  void copy_data(void* dest, const void* src, std::size_t count)
      const override {
    std::memcpy(dest, src, count);
  }
};

PinnedAllocator* the_pinned_allocator = new PinnedAllocator();

} // namespace

c10::DeviceAllocator* device_allocator() {
  return the_allocator;
}

c10::Allocator* pinned_allocator() {
  return the_pinned_allocator;
}

bool is_pinned_ptr(const void* ptr) {
  auto address = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(pinned_mu);
  auto it = pinned_ranges.upper_bound(address);
  if (it == pinned_ranges.begin()) {
    return false;
  }
  --it;
  return address < it->first + it->second;
}

bool device_of_ptr(const void* ptr, c10::DeviceIndex* device) {
  return the_allocator->device_of(ptr, device);
}

AllocatorStats allocator_stats(c10::DeviceIndex device) {
  return the_allocator->stats(device);
}

void reset_peak(c10::DeviceIndex device) {
  the_allocator->resetPeakStats(device);
}

void empty_cache() {
  the_allocator->empty_cache_impl();
}

// The allocator of PrivateUse1 tensors; c10::getDeviceAllocator finds it.
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, the_allocator)

} // namespace testdev
