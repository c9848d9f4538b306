#include "engine/run/collective_lane.h"

#include <chrono>

namespace torch_ext {

CollectiveLanes::~CollectiveLanes() {
  stop();
}

void CollectiveLanes::dispatch(
    uintptr_t group,
    int32_t slot,
    c10::intrusive_ptr<torch::autograd::Node> fn,
    torch::autograd::variable_list&& inputs,
    CallerThreadState state,
    PlannedCollective planned) {
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->queues[group].push_back(
        Work{
            slot,
            std::move(fn),
            std::move(inputs),
            std::move(state),
            std::move(planned)});
  }
  ++in_flight_;
  if (lanes_.find(group) == lanes_.end()) {
    lanes_.emplace(
        group,
        std::thread(&CollectiveLanes::lane_main, shared_, group));
  } else {
    shared_->work_cv.notify_all();
  }
}

void CollectiveLanes::lane_main(
    std::shared_ptr<Shared> shared,
    uintptr_t group) {
  std::unique_lock<std::mutex> lock(shared->mutex);
  std::deque<Work>& queue = shared->queues[group];
  while (true) {
    shared->work_cv.wait(lock, [&] {
      return shared->stopping || !queue.empty();
    });
    if (shared->stopping) {
      return;
    }
    Work work = std::move(queue.front());
    queue.pop_front();
    lock.unlock();
    Finished finished{work.slot, {}, nullptr};
    try {
      PlannedCollectiveStart start(work.planned);
      const CallerThreadStateGuard state(work.state);
      finished.outputs = (*work.fn)(std::move(work.inputs));
      start.started();
    } catch (...) {
      finished.error = std::current_exception();
    }
    // Whatever apply() left of its inputs is freed here, on the lane, as
    // stock frees them when call_function returns.
    work.inputs.clear();
    lock.lock();
    shared->finished.push_back(std::move(finished));
    shared->finished_cv.notify_all();
  }
}

std::vector<CollectiveLanes::Finished> CollectiveLanes::take_finished(
    bool block,
    const std::function<void()>& check_interrupt) {
  std::vector<Finished> taken;
  {
    std::unique_lock<std::mutex> lock(shared_->mutex);
    while (block && shared_->finished.empty()) {
      TORCH_INTERNAL_ASSERT(
          in_flight_ > 0,
          "waiting on an idle collective lane");
      if (shared_->finished_cv.wait_for(
              lock,
              std::chrono::milliseconds(kInterruptPollMs),
              [&] { return !shared_->finished.empty(); })) {
        break;
      }
      lock.unlock();
      try {
        check_interrupt();
      } catch (...) {
        interrupted_ = true;
        throw;
      }
      lock.lock();
    }
    taken.swap(shared_->finished);
  }
  in_flight_ -= static_cast<int64_t>(taken.size());
  return taken;
}

void CollectiveLanes::stop() noexcept {
  if (lanes_.empty()) {
    return;
  }
  {
    std::unique_lock<std::mutex> lock(shared_->mutex);
    // Nodes not started yet are dropped; with the queues empty, a lane
    // returns as soon as its running node does.
    for (auto& [group, queue] : shared_->queues) {
      in_flight_ -= static_cast<int64_t>(queue.size());
      queue.clear();
    }
    shared_->stopping = true;
  }
  shared_->work_cv.notify_all();
  for (auto& [group, lane] : lanes_) {
    if (interrupted_) {
      lane.detach();
    } else {
      lane.join();
    }
  }
  lanes_.clear();
}

} // namespace torch_ext
