#pragma once

// What each node class is to the engine (collective_role.h's CollectiveKind:
// its role, and whether it defers its wait), cached per class and read
// without a lock.
//
// Read by discovery for every node without the GIL, written (rarely) by
// registration, by the first sight of a class and by a class's death. Readers
// take no lock: the table is open addressing over atomic words, each holding
// a class's address with its kind in the low bits (classes are at least
// 8-byte aligned), so a reader sees an entry whole or not at all. A full
// table is replaced by a larger copy; readers may still be probing the old
// one, so old tables are kept (their sizes double, so all of them together
// are at most twice the current one). A reader that misses an entry only
// just added takes the host's slow path, which looks again after it has
// serialized with the writers.
//
// Entries are keyed by address, and a class's address can be reused by a new
// class once it is freed. So every entry comes with a *death token* from the
// host (the Python bindings give a weak reference to the class), and the
// host calls remove(token) while the class dies, before its memory can be
// reused. A node holds its class alive, so a class a reader looks up for a
// live node is never removed under it. The cache never dereferences a token.

#include "collectives/collective_role.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace torch_ext {

class RoleTable;

class RoleCache {
 public:
  RoleCache();
  ~RoleCache();
  RoleCache(const RoleCache&) = delete;
  RoleCache& operator=(const RoleCache&) = delete;

  // The kind of the class at `node_class`, if it has one here. Lock-free.
  std::optional<CollectiveKind> find(const void* node_class) const;

  struct Stored {
    // The class's kind now.
    CollectiveKind kind;
    // Whether the cache keeps `death_token` (for a new entry). If not, the
    // caller still owns it, and drops it.
    bool token_kept;
  };

  // Sets `node_class`'s kind; with `overwrite` false an existing entry wins
  // and its kind is returned.
  Stored store(
      const void* node_class,
      CollectiveKind kind,
      bool overwrite,
      const void* death_token);

  // The class whose entry `death_token` came with is dying: forget it.
  // Returns whether the token was one of the cache's (which the caller then
  // drops).
  bool remove(const void* death_token);

  // Classes held.
  size_t size() const;

 private:
  RoleTable* grow();

  mutable std::mutex writer_mutex_;
  std::atomic<RoleTable*> current_{nullptr};
  // Every table ever made: readers may still probe an old one.
  std::vector<std::unique_ptr<RoleTable>> tables_;
  // Words of the current table that are not empty (entries and removed ones).
  size_t used_words_ = 0;
  // Each class's death token -> the class's key.
  std::unordered_map<const void*, uintptr_t> key_of_token_;
};

} // namespace torch_ext
