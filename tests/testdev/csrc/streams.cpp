#include "streams.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>

namespace testdev {
namespace {

using Clock = std::chrono::steady_clock;

// One stream: a queue of work items and the thread that runs them in order.
struct Worker {
  std::mutex mu;
  std::condition_variable has_work;
  std::condition_variable progress;
  std::deque<std::function<void()>> queue;
  uint64_t enqueued = 0;
  uint64_t completed = 0;
  // The first exception of an item since the last synchronize: kept rather
  // than lost on a thread nobody joins, and rethrown to the host like CUDA's
  // asynchronous errors.
  std::exception_ptr error;

  void loop() {
    for (;;) {
      std::function<void()> work;
      {
        std::unique_lock<std::mutex> lock(mu);
        has_work.wait(lock, [&] { return !queue.empty(); });
        work = std::move(queue.front());
        queue.pop_front();
      }
      std::exception_ptr failure;
      try {
        work();
      } catch (...) {
        failure = std::current_exception();
      }
      // Destroy the closure (and what it holds) before counting it done, so
      // a synchronize sees its captures released.
      work = nullptr;
      {
        std::lock_guard<std::mutex> lock(mu);
        ++completed;
        if (failure && !error) {
          error = failure;
        }
      }
      progress.notify_all();
    }
  }
};

thread_local Worker* this_worker = nullptr;

// Kernels run on the workers warn there, where no Python handler turns the
// warning into a (deduplicated) Python warning: print each message once.
class OnceWarningHandler final : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (seen_.insert(warning.msg()).second) {
      c10::WarningHandler::process(warning);
    }
  }

 private:
  std::mutex mu_;
  std::unordered_set<std::string> seen_;
};

std::mutex create_mu;
std::array<std::array<std::atomic<Worker*>, kPoolSize + 1>, kDeviceCount>
    workers{};
std::array<std::atomic<uint32_t>, kDeviceCount> pool_next{};

thread_local c10::DeviceIndex thread_device = 0;
thread_local std::array<c10::StreamId, kDeviceCount> thread_streams{};

Worker* existing_worker(c10::DeviceIndex device, c10::StreamId id) {
  return workers[device][id].load(std::memory_order_acquire);
}

void check_stream(const c10::Stream& stream) {
  TORCH_CHECK(
      stream.device_type() == c10::DeviceType::PrivateUse1,
      "testdev: not a testdev stream: ",
      stream);
  check_device(stream.device_index());
  TORCH_CHECK(
      stream.id() >= 0 && stream.id() <= kPoolSize,
      "testdev: unknown stream id ",
      stream.id());
}

// Threads start on a stream's first use. They are leaked on purpose: joining
// them from static destructors at exit can deadlock on work still queued.
Worker* worker(const c10::Stream& stream) {
  check_stream(stream);
  auto device = stream.device_index();
  auto id = stream.id();
  if (Worker* w = existing_worker(device, id)) {
    return w;
  }
  std::lock_guard<std::mutex> lock(create_mu);
  if (Worker* w = existing_worker(device, id)) {
    return w;
  }
  auto* w = new Worker();
  std::thread([w] {
    static auto* handler = new OnceWarningHandler();
    c10::WarningUtils::set_warning_handler(handler);
    this_worker = w;
    w->loop();
  }).detach();
  workers[device][id].store(w, std::memory_order_release);
  return w;
}

void wait_done(Worker* w, uint64_t target) {
  TORCH_CHECK(
      w != this_worker,
      "testdev: a stream cannot synchronize with itself");
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(w->mu);
    w->progress.wait(lock, [&] { return w->completed >= target; });
    std::swap(error, w->error);
  }
  if (error) {
    std::rethrow_exception(error);
  }
}

void sync_worker(Worker* w) {
  uint64_t target = 0;
  {
    std::lock_guard<std::mutex> lock(w->mu);
    target = w->enqueued;
  }
  wait_done(w, target);
}

// One recorded version of an event.
struct Marker {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Clock::time_point time;

  void fire() {
    {
      std::lock_guard<std::mutex> lock(mu);
      time = Clock::now();
      done = true;
    }
    cv.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
  }
  bool is_done() {
    std::lock_guard<std::mutex> lock(mu);
    return done;
  }
};

struct Event {
  std::mutex mu;
  std::shared_ptr<Marker> last;
  bool timing = false;

  std::shared_ptr<Marker> latest() {
    std::lock_guard<std::mutex> lock(mu);
    return last;
  }
};

std::shared_ptr<Marker> record_marker(const c10::Stream& stream) {
  auto marker = std::make_shared<Marker>();
  enqueue(stream, [marker] { marker->fire(); });
  return marker;
}

void wait_marker(const c10::Stream& stream, std::shared_ptr<Marker> marker) {
  if (marker->is_done()) {
    return;
  }
  enqueue(stream, [marker] { marker->wait(); });
}

} // namespace

void enqueue(c10::Stream stream, std::function<void()> work) {
  Worker* w = worker(stream);
  {
    std::lock_guard<std::mutex> lock(w->mu);
    w->queue.push_back(std::move(work));
    ++w->enqueued;
  }
  w->has_work.notify_one();
}

void check_device(c10::DeviceIndex device) {
  TORCH_CHECK(
      device >= 0 && device < kDeviceCount,
      "testdev: invalid device index ",
      static_cast<int>(device),
      " (there are ",
      static_cast<int>(kDeviceCount),
      " devices)");
}

c10::DeviceIndex current_device() {
  return thread_device;
}

void set_current_device(c10::DeviceIndex device) {
  check_device(device);
  thread_device = device;
}

c10::Stream default_stream(c10::DeviceIndex device) {
  if (device < 0) {
    device = thread_device;
  }
  check_device(device);
  return c10::Stream(
      c10::Stream::UNSAFE,
      c10::Device(c10::DeviceType::PrivateUse1, device),
      0);
}

c10::Stream current_stream(c10::DeviceIndex device) {
  if (device < 0) {
    device = thread_device;
  }
  check_device(device);
  return c10::Stream(
      c10::Stream::UNSAFE,
      c10::Device(c10::DeviceType::PrivateUse1, device),
      thread_streams[device]);
}

c10::Stream exchange_stream(c10::Stream stream) {
  check_stream(stream);
  auto previous = current_stream(stream.device_index());
  thread_streams[stream.device_index()] = stream.id();
  return previous;
}

c10::Stream stream_from_pool(c10::DeviceIndex device) {
  if (device < 0) {
    device = thread_device;
  }
  check_device(device);
  auto id = 1 + pool_next[device].fetch_add(1) % kPoolSize;
  return c10::Stream(
      c10::Stream::UNSAFE,
      c10::Device(c10::DeviceType::PrivateUse1, device),
      static_cast<c10::StreamId>(id));
}

void synchronize_stream(c10::Stream stream) {
  check_stream(stream);
  if (Worker* w = existing_worker(stream.device_index(), stream.id())) {
    sync_worker(w);
  }
}

bool query_stream(c10::Stream stream) {
  check_stream(stream);
  Worker* w = existing_worker(stream.device_index(), stream.id());
  if (w == nullptr) {
    return true;
  }
  std::lock_guard<std::mutex> lock(w->mu);
  return w->completed == w->enqueued;
}

void synchronize_device(c10::DeviceIndex device) {
  std::exception_ptr error;
  for (c10::DeviceIndex d = 0; d < kDeviceCount; ++d) {
    if (device >= 0 && d != device) {
      continue;
    }
    for (auto& slot : workers[d]) {
      Worker* w = slot.load(std::memory_order_acquire);
      if (w == nullptr) {
        continue;
      }
      // Every stream is drained before the first error is reported.
      try {
        sync_worker(w);
      } catch (...) {
        if (!error) {
          error = std::current_exception();
        }
      }
    }
  }
  if (error) {
    std::rethrow_exception(error);
  }
}

void hold(c10::Stream stream, double ms) {
  auto duration = std::chrono::duration<double, std::milli>(ms);
  enqueue(stream, [duration] { std::this_thread::sleep_for(duration); });
}

void* event_create(bool enable_timing) {
  auto* event = new Event();
  event->timing = enable_timing;
  return event;
}

void event_destroy(void* event) {
  // Markers are shared with the closures that fire or wait for them, so an
  // event may go before its work has run.
  delete static_cast<Event*>(event);
}

void event_record(void* event, c10::Stream stream) {
  auto* e = static_cast<Event*>(event);
  auto marker = record_marker(stream);
  std::lock_guard<std::mutex> lock(e->mu);
  e->last = std::move(marker);
}

void event_block(void* event, c10::Stream stream) {
  // The marker is read now: a record made after this call is not waited for.
  auto marker = static_cast<Event*>(event)->latest();
  if (marker) {
    wait_marker(stream, std::move(marker));
  }
}

bool event_query(void* event) {
  auto marker = static_cast<Event*>(event)->latest();
  return !marker || marker->is_done();
}

void event_synchronize(void* event) {
  auto marker = static_cast<Event*>(event)->latest();
  if (marker) {
    marker->wait();
  }
}

double event_elapsed_ms(void* start, void* end) {
  auto* s = static_cast<Event*>(start);
  auto* e = static_cast<Event*>(end);
  TORCH_CHECK(
      s->timing && e->timing,
      "testdev: both events must be created with enable_timing=True");
  auto sm = s->latest();
  auto em = e->latest();
  TORCH_CHECK(sm && em, "testdev: both events must be recorded first");
  TORCH_CHECK(
      sm->is_done() && em->is_done(),
      "testdev: both events must have completed (synchronize them first)");
  return std::chrono::duration<double, std::milli>(em->time - sm->time).count();
}

void stream_wait_stream(c10::Stream waiter, c10::Stream waitee) {
  if (waiter == waitee) {
    return;
  }
  wait_marker(waiter, record_marker(waitee));
}

} // namespace testdev
