// The process-wide priority table and its per-call snapshot.

#include "engine/plan/priority_table.h"

#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

namespace torch_ext {
namespace {

using torch::autograd::Node;

struct TableEntry {
  // Weak: the table must not keep a graph alive. While the entry exists the
  // node's memory is not reused, so a new node never inherits a dead node's
  // priority; dead entries are swept as the table grows (set_node_priority).
  c10::weak_intrusive_ptr<Node> node;
  NodePriority priority;
};

std::mutex table_mutex;
std::unordered_map<Node*, TableEntry> table;
// Read without the lock on every backward call: empty means nothing to do.
std::atomic<size_t> table_size{0};

// Table size after the last sweep: entries of dead nodes are swept when the
// table has doubled since, so sweeping costs O(1) amortized per insertion.
size_t size_after_sweep = 0;

void sweep_dead_entries_locked() {
  for (auto it = table.begin(); it != table.end();) {
    it = it->second.node.expired() ? table.erase(it) : std::next(it);
  }
  size_after_sweep = table.size();
}

} // namespace

void set_node_priority(
    const c10::intrusive_ptr<Node>& node,
    NodePriority priority) {
  std::lock_guard<std::mutex> lock(table_mutex);
  table.insert_or_assign(
      node.get(),
      TableEntry{c10::weak_intrusive_ptr<Node>(node), priority});
  if (table.size() >= 2 * size_after_sweep + 64) {
    sweep_dead_entries_locked();
  }
  table_size.store(table.size(), std::memory_order_release);
}

bool clear_node_priority(Node* node) {
  std::lock_guard<std::mutex> lock(table_mutex);
  const bool erased = table.erase(node) > 0;
  table_size.store(table.size(), std::memory_order_release);
  return erased;
}

std::optional<NodePriority> node_priority(Node* node) {
  std::lock_guard<std::mutex> lock(table_mutex);
  auto it = table.find(node);
  if (it == table.end() || it->second.node.expired()) {
    return std::nullopt;
  }
  return it->second.priority;
}

CallPriorities::CallPriorities(std::vector<PriorityOverride> overrides) {
  if (table_size.load(std::memory_order_acquire) > 0) {
    std::lock_guard<std::mutex> lock(table_mutex);
    for (const auto& [node, entry] : table) {
      auto alive = entry.node.lock();
      if (alive) {
        by_node_[node] = entry.priority;
        keep_alive_.push_back(std::move(alive));
      }
    }
  }
  // In order, so later overrides of the same node win, as in a dict.
  for (auto& override_ : overrides) {
    by_node_[override_.node.get()] = override_.priority;
    overridden_.push_back(override_.node.get());
    keep_alive_.push_back(std::move(override_.node));
  }
}

std::optional<NodePriority> CallPriorities::lookup(Node* node) const {
  auto it = by_node_.find(node);
  if (it == by_node_.end()) {
    return std::nullopt;
  }
  return it->second;
}

bool CallPriorities::is_call_override(Node* node) const {
  return std::find(overridden_.begin(), overridden_.end(), node) !=
      overridden_.end();
}

} // namespace torch_ext
