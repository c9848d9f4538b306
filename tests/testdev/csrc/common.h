// Helpers the testdev kernels, hooks and Python module share.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/StorageImpl.h>

#include <unordered_map>

namespace testdev {

// The device's default generator: a CPU generator the device owns.
// torch.testdev.manual_seed seeds it.
at::Generator& default_generator(c10::DeviceIndex device);

// A generator for one queued random op: seeded from `gen` (or the device's
// default generator) at issue time, on the calling thread. The draw happens
// in issue order, as CUDA's Philox offsets are taken at launch, so results do
// not depend on when or on which stream's thread the op runs.
at::Generator generator_for_op(
    const std::optional<at::Generator>& gen,
    c10::DeviceIndex device);

// A CPU tensor viewing the host memory of a testdev tensor (same sizes,
// strides, offset), holding no reference to the testdev storage: closures
// queued on a stream capture these, never the storage, so Python may free
// the tensor right after issuing work, as on CUDA.
//
// Aliases made with the same `storages` map share one host storage per
// device storage, so CPU kernels see overlapping arguments as overlapping.
using HostStorages = std::unordered_map<const c10::StorageImpl*, c10::Storage>;
at::Tensor host_alias(
    const at::Tensor& device_tensor,
    HostStorages* storages = nullptr);

// Grows a testdev storage to `nbytes`: new memory, the old bytes copied on
// the current stream (after the queued work that writes them).
void resize_bytes(c10::StorageImpl* storage, size_t nbytes);

// Gives a testdev tensor these sizes and strides (keeping its offset),
// growing its storage when they need more.
void restride(
    const at::Tensor& tensor,
    c10::IntArrayRef sizes,
    c10::IntArrayRef strides);

// The device of a testdev tensor, or the current device when undefined.
c10::DeviceIndex device_of(const at::Tensor& tensor);

} // namespace testdev
