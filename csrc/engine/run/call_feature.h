#pragma once

// What a call's features do when the call fails, in one list: each feature
// that holds something the failure must undo or complete (a lane still
// running a node, a collective in flight, an exchange other ranks take part
// in) registers itself while it is active, and the call's error path runs the
// list, in the order the features registered. An ordinary call registers
// nothing, and pays nothing for the list while it runs.

#include <c10/util/Exception.h>

#include <array>
#include <cstddef>

namespace torch_ext {

class CallFeature {
 public:
  // The call failed, on the engine thread: nothing it planned and has not
  // started will start. Raises nothing: the call's error is what propagates.
  virtual void on_failure() noexcept = 0;

 protected:
  ~CallFeature() = default;
};

class FailureCleanups {
 public:
  // `feature` outlives the call's error path (a member of the call).
  void add(CallFeature& feature) {
    TORCH_INTERNAL_ASSERT(count_ < features_.size());
    features_[count_++] = &feature;
  }

  void run() noexcept {
    for (size_t i = 0; i < count_; ++i) {
      features_[i]->on_failure();
    }
  }

 private:
  // As many as there are features with something to clean up: the report to
  // the next microbatch's forward, the lanes, the collective order check and
  // the deferred waits.
  std::array<CallFeature*, 4> features_{};
  size_t count_ = 0;
};

} // namespace torch_ext
