// Kernels registered natively for PrivateUse1: allocation, views (metadata
// only, on the calling thread), resizing, copies and reading a scalar.
// Everything else goes through the boxed fallback in fallback.cpp.
#include "allocator.h"
#include "common.h"
#include "streams.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_local_scalar_dense.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/bernoulli.h>
#include <ATen/ops/clone.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cstring>

namespace testdev {

void resize_bytes(c10::StorageImpl* storage, size_t nbytes) {
  TORCH_CHECK(storage->resizable(), "testdev: storage is not resizable");
  c10::DeviceIndex device = storage->device().index();
  c10::DeviceGuard guard(c10::Device(c10::DeviceType::PrivateUse1, device));
  c10::DataPtr fresh = device_allocator()->allocate(nbytes);
  size_t n = std::min(storage->nbytes(), nbytes);
  if (n > 0) {
    void* dst = fresh.get();
    const void* src = storage->data();
    enqueue(current_stream(device), [dst, src, n] {
      std::memcpy(dst, src, n);
    });
  }
  // The old block goes back to the allocator now: stream order keeps the
  // copy ahead of its reuse by this stream, as on CUDA.
  storage->set_data_ptr_noswap(std::move(fresh));
  storage->set_nbytes(nbytes);
}

void restride(
    const at::Tensor& tensor,
    c10::IntArrayRef sizes,
    c10::IntArrayRef strides) {
  auto* impl = tensor.unsafeGetTensorImpl();
  size_t needed = at::detail::computeStorageNbytes(
      sizes,
      strides,
      tensor.itemsize(),
      tensor.storage_offset());
  if (needed > tensor.storage().nbytes()) {
    resize_bytes(tensor.storage().unsafeGetStorageImpl(), needed);
  }
  impl->set_sizes_and_strides(sizes, strides);
}

namespace {

constexpr auto kKeys = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);

c10::Device target_device(std::optional<c10::Device> device) {
  auto d = device.value_or(c10::Device(c10::DeviceType::PrivateUse1));
  TORCH_CHECK(d.is_privateuseone(), "testdev: not a testdev device: ", d);
  return d;
}

at::Tensor empty_memory_format(
    c10::IntArrayRef size,
    std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> /*layout*/,
    std::optional<c10::Device> device,
    std::optional<bool> /*pin_memory*/,
    std::optional<c10::MemoryFormat> memory_format) {
  // The allocator takes the current device and stream.
  c10::DeviceGuard guard(target_device(device));
  return at::detail::empty_generic(
      size,
      device_allocator(),
      kKeys,
      c10::dtype_or_default(dtype),
      memory_format);
}

at::Tensor empty_strided(
    c10::IntArrayRef size,
    c10::IntArrayRef stride,
    std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> /*layout*/,
    std::optional<c10::Device> device,
    std::optional<bool> /*pin_memory*/) {
  c10::DeviceGuard guard(target_device(device));
  return at::detail::empty_strided_generic(
      size,
      stride,
      device_allocator(),
      kKeys,
      c10::dtype_or_default(dtype));
}

const at::Tensor& resize_(
    const at::Tensor& self,
    c10::IntArrayRef size,
    std::optional<c10::MemoryFormat> memory_format) {
  auto* impl = self.unsafeGetTensorImpl();
  auto format = memory_format.value_or(c10::MemoryFormat::Contiguous);
  TORCH_CHECK(
      format != c10::MemoryFormat::Preserve,
      "testdev: resize_ does not take memory_format=torch.preserve_format");
  if (self.sizes() == size && !memory_format.has_value()) {
    return self;
  }
  impl->set_sizes_contiguous(size);
  impl->empty_tensor_restride(format);
  restride(self, impl->sizes(), impl->strides());
  return self;
}

at::Tensor& set_storage_offset(
    at::Tensor& self,
    c10::Storage source,
    int64_t storage_offset,
    c10::IntArrayRef size,
    c10::IntArrayRef stride) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_storage_offset(storage_offset);
  if (stride.empty()) {
    impl->set_sizes_contiguous(size);
    restride(self, impl->sizes(), impl->strides());
  } else {
    restride(self, size, stride);
  }
  return self;
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source) {
  int64_t numel = static_cast<int64_t>(source.nbytes() / self.itemsize());
  return set_storage_offset(self, std::move(source), 0, {numel}, {});
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  if (self.is_same(source)) {
    return self;
  }
  return set_storage_offset(
      self,
      source.storage(),
      source.storage_offset(),
      source.sizes(),
      source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::DeviceGuard guard(self.device());
  c10::Storage empty(
      c10::Storage::use_byte_size_t(),
      0,
      device_allocator(),
      /*resizable=*/true);
  return set_storage_offset(self, std::move(empty), 0, {0}, {});
}

at::Tensor copy_from(
    const at::Tensor& src,
    const at::Tensor& dst,
    bool /*non_blocking*/) {
  if (dst.numel() == 0 || src.numel() == 0) {
    return dst;
  }
  // CPU copy_ does the dtype conversion and broadcasting in every case.
  if (src.is_privateuseone() && dst.is_privateuseone()) {
    auto src_stream = current_stream(src.device().index());
    auto dst_stream = current_stream(dst.device().index());
    HostStorages storages; // an overlapping copy is seen as one by copy_
    at::Tensor from = host_alias(src, &storages);
    at::Tensor to = host_alias(dst, &storages);
    // As CUDA does across devices: the copy runs on the source device's
    // current stream, after the work queued so far on the destination's, and
    // the destination's current stream waits for it.
    bool cross = src_stream.device_index() != dst_stream.device_index();
    if (cross) {
      stream_wait_stream(src_stream, dst_stream);
    }
    enqueue(src_stream, [from, to] { to.copy_(from); });
    if (cross) {
      stream_wait_stream(dst_stream, src_stream);
    }
  } else if (dst.is_privateuseone()) {
    // Host to device: the host data is read now (as a pageable cudaMemcpy
    // does), written on the stream in order.
    at::Tensor snapshot = src.clone();
    at::Tensor to = host_alias(dst);
    enqueue(current_stream(dst.device().index()), [snapshot, to] {
      to.copy_(snapshot);
    });
  } else {
    // Device to host: the host waits for the work queued on the source
    // device's current stream, then reads.
    synchronize_stream(current_stream(src.device().index()));
    dst.copy_(host_alias(src));
  }
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) {
    dst.resize_(self.sizes());
  }
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  synchronize_stream(current_stream(self.device().index()));
  return at::_local_scalar_dense(host_alias(self));
}

void record_stream(at::Tensor& self, c10::Stream stream) {
  device_allocator()->recordStream(self.storage().data_ptr(), stream);
}

// native_dropout has no Generator argument: its CPU kernel would draw from
// the global CPU generator. The same steps as that kernel, with bernoulli_
// going through the fallback, which gives it the device's generator.
std::tuple<at::Tensor, at::Tensor> native_dropout(
    const at::Tensor& input,
    double p,
    std::optional<bool> train) {
  if (input.numel() == 0) {
    return {input, at::empty_like(input)};
  }
  if (train.has_value() && !*train) {
    return {
        input.clone(),
        at::ones_like(input, input.options().dtype(at::kBool))};
  }
  double keep = 1. - p;
  double scale = keep == 0 ? 0. : 1. / keep;
  at::Tensor mask =
      at::empty_like(input, at::MemoryFormat::Contiguous).bernoulli_(keep);
  at::Tensor output = input.mul(mask).mul_(scale);
  return {output, mask};
}

at::Tensor as_strided(
    const at::Tensor& self,
    c10::IntArrayRef size,
    c10::IntArrayRef stride,
    std::optional<int64_t> storage_offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, storage_offset);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) {
  return at::native::view(self, size);
}

at::Tensor reshape_alias(
    const at::Tensor& self,
    c10::IntArrayRef size,
    c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

} // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage_storage_offset", set_storage_offset);
  m.impl("set_.source_Storage", set_storage);
  m.impl("set_.source_Tensor", set_tensor);
  m.impl("set_", set_empty);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("record_stream", record_stream);
  m.impl("native_dropout", native_dropout);
}

// torch.autocast("testdev") runs, without casting: PyTorch registers no
// AutocastPrivateUse1 kernels or fallthrough, so without this every op under
// an enabled autocast fails to dispatch.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

// The lazy conjugate/negative fallbacks would materialize a conjugated
// source with clone(), which copies through _copy_from again, forever (CPU
// and CUDA copy through copy_, which they let through). The copy kernels
// take conjugated and negated tensors as they are: host aliases keep the
// bits and CPU's copy_ resolves them.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

} // namespace testdev
