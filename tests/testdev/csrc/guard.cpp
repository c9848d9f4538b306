// The PrivateUse1 DeviceGuardImplInterface: what c10::Stream, c10::Event,
// the device guards, torch.accelerator and the autograd engine's stream
// handling call.
#include "allocator.h"
#include "streams.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace testdev {
namespace {

using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;

struct GuardImpl final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override {
    return DeviceType::PrivateUse1;
  }

  Device exchangeDevice(Device device) const override {
    Device previous = getDevice();
    if (device.index() != previous.index()) {
      set_current_device(device.index());
    }
    return previous;
  }

  Device getDevice() const override {
    return Device(DeviceType::PrivateUse1, current_device());
  }

  void setDevice(Device device) const override {
    TORCH_CHECK(device.is_privateuseone(), "testdev: not a testdev device");
    set_current_device(device.index());
  }

  void uncheckedSetDevice(Device device) const noexcept override {
    if (device.index() >= 0 && device.index() < kDeviceCount) {
      set_current_device(device.index());
    }
  }

  Stream getStream(Device device) const override {
    return current_stream(device.index());
  }

  Stream getDefaultStream(Device device) const override {
    return default_stream(device.index());
  }

  Stream getStreamFromGlobalPool(Device device, bool /*isHighPriority*/)
      const override {
    return stream_from_pool(device.index());
  }

  Stream getNewStream(Device device, int /*priority*/) const override {
    return stream_from_pool(device.index());
  }

  Stream exchangeStream(Stream stream) const override {
    return exchange_stream(stream);
  }

  DeviceIndex deviceCount() const noexcept override {
    return kDeviceCount;
  }

  void destroyEvent(void* event, const DeviceIndex /*device_index*/)
      const noexcept override {
    if (event != nullptr) {
      event_destroy(event);
    }
  }

  void record(
      void** event,
      const Stream& stream,
      const DeviceIndex device_index,
      const c10::EventFlag flag) const override {
    TORCH_CHECK(
        device_index == -1 || device_index == stream.device_index(),
        "testdev: event device ",
        static_cast<int>(device_index),
        " does not match the stream's device ",
        static_cast<int>(stream.device_index()));
    if (*event == nullptr) {
      *event = event_create(flag == c10::EventFlag::BACKEND_DEFAULT);
    }
    event_record(*event, stream);
  }

  void block(void* event, const Stream& stream) const override {
    if (event != nullptr) {
      event_block(event, stream);
    }
  }

  bool queryEvent(void* event) const override {
    return event == nullptr || event_query(event);
  }

  void synchronizeEvent(void* event) const override {
    if (event != nullptr) {
      event_synchronize(event);
    }
  }

  double elapsedTime(void* start, void* end, const DeviceIndex /*device*/)
      const override {
    TORCH_CHECK(
        start != nullptr && end != nullptr,
        "testdev: both events must be recorded before elapsed_time");
    return event_elapsed_ms(start, end);
  }

  bool queryStream(const Stream& stream) const override {
    return query_stream(stream);
  }

  void synchronizeStream(const Stream& stream) const override {
    synchronize_stream(stream);
  }

  void synchronizeDevice(const DeviceIndex device_index) const override {
    synchronize_device(device_index);
  }

  void recordDataPtrOnStream(const c10::DataPtr& data_ptr, const Stream& stream)
      const override {
    device_allocator()->recordStream(data_ptr, stream);
  }
};

} // namespace

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl)

} // namespace testdev
