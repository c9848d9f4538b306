// The Python module torch_ext_testdev: what tests/testdev/__init__.py wraps.
// Loading it registers the device (guard, allocator, hooks, kernels) through
// the static registrations in the other files.
#include "allocator.h"
#include "common.h"
#include "process_group.h"
#include "streams.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

namespace py = pybind11;

namespace testdev {
namespace {

c10::DeviceIndex resolve(int device) {
  auto d =
      static_cast<c10::DeviceIndex>(device < 0 ? current_device() : device);
  check_device(d);
  return d;
}

// Random ops draw their seeds at issue, but the host still waits for queued
// work first so a state read or written here is in order with it.
at::Generator& synced_generator(int device) {
  auto d = resolve(device);
  synchronize_device(d);
  return default_generator(d);
}

// A host-opened barrier on a stream: deterministic where a timed hold only
// makes a race likely. A gate never opened lets its stream go after
// `timeout_ms`, so a broken test fails instead of hanging.
class Gate : public std::enable_shared_from_this<Gate> {
 public:
  void block(double timeout_ms) {
    auto self = shared_from_this();
    auto timeout = std::chrono::duration<double, std::milli>(timeout_ms);
    enqueue(current_stream(-1), [self, timeout] {
      std::unique_lock<std::mutex> lock(self->mu_);
      self->cv_.wait_for(lock, timeout, [&] { return self->open_; });
    });
  }

  void open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }

  bool is_open() {
    std::lock_guard<std::mutex> lock(mu_);
    return open_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

} // namespace
} // namespace testdev

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace testdev;
  m.def("device_count", [] { return static_cast<int>(kDeviceCount); });
  m.def("current_device", [] { return static_cast<int>(current_device()); });
  m.def("set_device", [](int device) {
    set_current_device(static_cast<c10::DeviceIndex>(device));
  });
  m.def(
      "hold",
      [](double ms, int device) { hold(current_stream(resolve(device)), ms); },
      py::arg("ms"),
      py::arg("device") = -1,
      "Keeps the current stream of the device busy for ms milliseconds.");
  m.def(
      "synchronize",
      [](int device) {
        py::gil_scoped_release no_gil;
        synchronize_device(device < 0 ? -1 : resolve(device));
      },
      py::arg("device") = -1);
  py::class_<Gate, std::shared_ptr<Gate>>(m, "Gate")
      .def(py::init<>())
      .def(
          "block",
          &Gate::block,
          py::arg("timeout_ms") = 10000.0,
          "Holds the current stream of the current device until open().")
      .def("open", &Gate::open)
      .def_property_readonly("is_open", &Gate::is_open);
  m.def("manual_seed", [](int device, uint64_t seed) {
    auto& gen = synced_generator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed);
  });
  m.def("seed", [](int device) {
    auto& gen = synced_generator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    return gen.seed();
  });
  m.def("initial_seed", [](int device) {
    auto& gen = default_generator(resolve(device));
    std::lock_guard<std::mutex> lock(gen.mutex());
    return gen.current_seed();
  });
  m.def("get_rng_state", [](int device) {
    auto& gen = synced_generator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    at::Tensor state = gen.get_state();
    return py::bytes(
        reinterpret_cast<const char*>(state.const_data_ptr()),
        state.nbytes());
  });
  m.def("set_rng_state", [](int device, const std::string& bytes) {
    auto& gen = synced_generator(device);
    at::Tensor state =
        at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::memcpy(state.mutable_data_ptr(), bytes.data(), bytes.size());
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  });
  m.def("memory_stats", [](int device) {
    AllocatorStats s = allocator_stats(resolve(device));
    py::dict out;
    out["allocated_bytes"] = s.allocated_bytes;
    out["peak_allocated_bytes"] = s.peak_allocated_bytes;
    out["reserved_bytes"] = s.reserved_bytes;
    out["num_allocs"] = s.num_allocs;
    out["num_reuses"] = s.num_reuses;
    out["num_frees"] = s.num_frees;
    out["num_pending"] = s.num_pending;
    return out;
  });
  m.def("reset_peak_memory_stats", [](int device) {
    reset_peak(resolve(device));
  });
  m.def("empty_cache", [] {
    py::gil_scoped_release no_gil;
    empty_cache();
  });
  // The process-group backend's Python bindings (process_group.cpp).
  register_process_group(m);
}
