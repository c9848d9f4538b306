#pragma once

// Scheduler: which ready node runs next.
//
// Stock orders its ready queue by (reentrant depth, sequence_nr) in a
// std::priority_queue. One torch_ext call runs at a single depth (a nested
// backward is a separate call with its own queue), so depth drops out and the
// key is (priority, sequence_nr). With every priority equal the comparisons
// are exactly stock's, and since pushes and pops happen in the same order as
// stock's, the same libstdc++ heap breaks ties (AccumulateGrad nodes all have
// sequence_nr UINT64_MAX) the same way: the execution order is identical.

#include <cstdint>
#include <queue>
#include <vector>

namespace torch_ext {

struct ReadyNode {
  int64_t priority;
  uint64_t sequence_nr;
  int32_t slot;
};

struct RunsLater {
  bool operator()(const ReadyNode& a, const ReadyNode& b) const {
    if (a.priority != b.priority) {
      return a.priority < b.priority;
    }
    return a.sequence_nr < b.sequence_nr;
  }
};

class ReadyQueue {
 public:
  void push(const ReadyNode& node) {
    heap_.push(node);
  }

  bool empty() const {
    return heap_.empty();
  }

  // The next node to run.
  int32_t pop() {
    const int32_t slot = heap_.top().slot;
    heap_.pop();
    return slot;
  }

 private:
  std::priority_queue<ReadyNode, std::vector<ReadyNode>, RunsLater> heap_;
};

} // namespace torch_ext
