#include "collectives/role_cache.h"

#include <c10/util/Exception.h>

namespace torch_ext {
namespace {

constexpr uintptr_t kRoleBits = 0x3;
constexpr uintptr_t kDefersWaitBit = 0x4;
constexpr uintptr_t kAddressBits = ~uintptr_t{0x7};
constexpr uintptr_t kEmpty = 0;
// A removed entry: no class has address 0 (so no entry is this, whatever its
// low bits), and probing goes on past it.
constexpr uintptr_t kRemoved = 0x4;
// 256 words: room for 128 classes before the first copy.
constexpr size_t kInitialCapacity = 256;

uintptr_t entry_of(uintptr_t key, CollectiveKind kind) {
  return key | static_cast<uintptr_t>(kind.role) |
      (kind.defers_wait ? kDefersWaitBit : 0);
}

CollectiveKind kind_of(uintptr_t entry) {
  return {
      static_cast<CollectiveRole>(entry & kRoleBits),
      (entry & kDefersWaitBit) != 0};
}

} // namespace

// One table: open addressing over atomic words.
class RoleTable {
 public:
  explicit RoleTable(size_t capacity)
      : mask_(capacity - 1), slots_(new std::atomic<uintptr_t>[capacity]) {
    TORCH_INTERNAL_ASSERT(
        (capacity & mask_) == 0,
        "capacity must be a power of two");
    for (size_t i = 0; i < capacity; ++i) {
      slots_[i].store(kEmpty, std::memory_order_relaxed);
    }
  }

  size_t capacity() const {
    return mask_ + 1;
  }

  std::optional<CollectiveKind> find(uintptr_t key) const {
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      const uintptr_t entry = slots_[i].load(std::memory_order_acquire);
      if (entry == kEmpty) {
        return std::nullopt;
      }
      if ((entry & kAddressBits) == key) {
        return kind_of(entry);
      }
    }
  }

  // Writers only. The word holding `key`, or null.
  std::atomic<uintptr_t>* slot_of(uintptr_t key) {
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      const uintptr_t entry = slots_[i].load(std::memory_order_relaxed);
      if (entry == kEmpty) {
        return nullptr;
      }
      if ((entry & kAddressBits) == key) {
        return &slots_[i];
      }
    }
  }

  // Writers only; `key` is absent. Returns whether it took an empty word
  // (rather than a removed entry's).
  bool insert(uintptr_t key, CollectiveKind kind) {
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      const uintptr_t entry = slots_[i].load(std::memory_order_relaxed);
      if (entry == kEmpty || entry == kRemoved) {
        slots_[i].store(entry_of(key, kind), std::memory_order_release);
        return entry == kEmpty;
      }
    }
  }

  template <typename Visit>
  void for_each_entry(Visit&& visit) const {
    for (size_t i = 0; i <= mask_; ++i) {
      const uintptr_t entry = slots_[i].load(std::memory_order_relaxed);
      if (entry != kEmpty && entry != kRemoved) {
        visit(entry & kAddressBits, kind_of(entry));
      }
    }
  }

 private:
  size_t home(uintptr_t key) const {
    // Fibonacci hashing; the low 4 bits of an allocation carry nothing.
    return static_cast<size_t>(((key >> 4) * 0x9E3779B97F4A7C15ull) >> 32) &
        mask_;
  }

  size_t mask_;
  std::unique_ptr<std::atomic<uintptr_t>[]> slots_;
};

namespace {

uintptr_t key_of(const void* node_class) {
  const auto key = reinterpret_cast<uintptr_t>(node_class);
  TORCH_INTERNAL_ASSERT(
      (key & ~kAddressBits) == 0,
      "a node class is not 8-byte aligned");
  return key;
}

} // namespace

RoleCache::RoleCache() {
  tables_.push_back(std::make_unique<RoleTable>(kInitialCapacity));
  current_.store(tables_.back().get(), std::memory_order_release);
}

RoleCache::~RoleCache() = default;

std::optional<CollectiveKind> RoleCache::find(const void* node_class) const {
  return current_.load(std::memory_order_acquire)->find(key_of(node_class));
}

RoleCache::Stored RoleCache::store(
    const void* node_class,
    CollectiveKind kind,
    bool overwrite,
    const void* death_token) {
  const uintptr_t key = key_of(node_class);
  std::lock_guard<std::mutex> lock(writer_mutex_);
  RoleTable* table = current_.load(std::memory_order_relaxed);
  if (std::atomic<uintptr_t>* slot = table->slot_of(key)) {
    if (!overwrite) {
      return {kind_of(slot->load(std::memory_order_relaxed)), false};
    }
    slot->store(entry_of(key, kind), std::memory_order_release);
    return {kind, false};
  }
  // At most half full, counting removed entries: probes stay short.
  if ((used_words_ + 1) * 2 > table->capacity()) {
    table = grow();
  }
  if (table->insert(key, kind)) {
    used_words_ += 1;
  }
  key_of_token_.emplace(death_token, key);
  return {kind, true};
}

bool RoleCache::remove(const void* death_token) {
  std::lock_guard<std::mutex> lock(writer_mutex_);
  auto it = key_of_token_.find(death_token);
  if (it == key_of_token_.end()) {
    return false;
  }
  RoleTable* table = current_.load(std::memory_order_relaxed);
  if (std::atomic<uintptr_t>* slot = table->slot_of(it->second)) {
    slot->store(kRemoved, std::memory_order_release);
  }
  key_of_token_.erase(it);
  return true;
}

size_t RoleCache::size() const {
  std::lock_guard<std::mutex> lock(writer_mutex_);
  return key_of_token_.size();
}

RoleTable* RoleCache::grow() {
  RoleTable* old_table = current_.load(std::memory_order_relaxed);
  const size_t live = key_of_token_.size();
  size_t capacity = old_table->capacity();
  while ((live + 1) * 4 > capacity) {
    capacity *= 2;
  }
  auto table = std::make_unique<RoleTable>(capacity);
  old_table->for_each_entry(
      [&](uintptr_t key, CollectiveKind kind) { table->insert(key, kind); });
  used_words_ = live;
  tables_.push_back(std::move(table));
  current_.store(tables_.back().get(), std::memory_order_release);
  return tables_.back().get();
}

} // namespace torch_ext
