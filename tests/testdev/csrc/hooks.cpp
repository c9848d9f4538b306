// PrivateUse1HooksInterface (generators, device count, pinned memory) and the
// device's generators.
#include "allocator.h"
#include "common.h"
#include "streams.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/TensorBody.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>

#include <array>
#include <mutex>

namespace testdev {
namespace {

std::array<at::Generator, kDeviceCount>& generators() {
  // Leaked: random ops may still be queued at exit.
  static auto* gens = [] {
    auto* g = new std::array<at::Generator, kDeviceCount>();
    for (auto& gen : *g) {
      gen = at::detail::createCPUGenerator();
    }
    return g;
  }();
  return *gens;
}

struct Hooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }

  bool isAvailable() const override {
    return true;
  }

  bool hasPrimaryContext(c10::DeviceIndex /*device_index*/) const override {
    return true;
  }

  c10::DeviceIndex deviceCount() const override {
    return kDeviceCount;
  }

  void setCurrentDevice(c10::DeviceIndex device) const override {
    set_current_device(device);
  }

  c10::DeviceIndex getCurrentDevice() const override {
    return current_device();
  }

  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    auto previous = current_device();
    set_current_device(device);
    return previous;
  }

  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }

  const at::Generator& getDefaultGenerator(
      c10::DeviceIndex device_index) const override {
    return default_generator(device_index);
  }

  at::Generator getNewGenerator(
      c10::DeviceIndex /*device_index*/) const override {
    return at::detail::createCPUGenerator();
  }

  at::Device getDeviceFromPtr(void* data) const override {
    c10::DeviceIndex device = 0;
    TORCH_CHECK(
        device_of_ptr(data, &device),
        "testdev: pointer not allocated by testdev");
    return at::Device(c10::DeviceType::PrivateUse1, device);
  }

  bool isPinnedPtr(const void* data) const override {
    return is_pinned_ptr(data);
  }

  c10::Allocator* getPinnedMemoryAllocator() const override {
    return pinned_allocator();
  }

  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize)
      const override {
    resize_bytes(storage.unsafeGetStorageImpl(), newsize);
  }
};

// Registered at load time, before any Python code asks for the accelerator.
const bool registered = [] {
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

} // namespace

at::Generator& default_generator(c10::DeviceIndex device) {
  if (device < 0) {
    device = current_device();
  }
  check_device(device);
  return generators()[device];
}

at::Generator generator_for_op(
    const std::optional<at::Generator>& gen,
    c10::DeviceIndex device) {
  at::Generator source =
      gen.has_value() && gen->defined() ? *gen : default_generator(device);
  uint64_t seed = 0;
  {
    std::lock_guard<std::mutex> lock(source.mutex());
    seed = at::check_generator<at::CPUGeneratorImpl>(source)->random64();
  }
  return at::detail::createCPUGenerator(seed);
}

at::Tensor host_alias(const at::Tensor& t, HostStorages* storages) {
  const c10::Storage& storage = t.storage();
  auto make_host = [&] {
    return c10::Storage(
        c10::Storage::use_byte_size_t(),
        storage.nbytes(),
        c10::DataPtr(const_cast<void*>(storage.data()), c10::Device(c10::kCPU)),
        /*allocator=*/nullptr,
        /*resizable=*/false);
  };
  c10::Storage host;
  if (storages == nullptr) {
    host = make_host();
  } else {
    auto [it, fresh] =
        storages->try_emplace(storage.unsafeGetStorageImpl(), c10::Storage());
    if (fresh) {
      it->second = make_host();
    }
    host = it->second;
  }
  auto out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(host),
      c10::DispatchKeySet(c10::DispatchKey::CPU),
      t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(
      t.sizes(),
      t.strides(),
      t.storage_offset());
  // Lazy conjugation and negation are part of the value.
  out._set_conj(t.is_conj());
  out._set_neg(t.is_neg());
  return out;
}

c10::DeviceIndex device_of(const at::Tensor& tensor) {
  if (tensor.defined() && tensor.device().is_privateuseone()) {
    return tensor.device().index();
  }
  return current_device();
}

} // namespace testdev
