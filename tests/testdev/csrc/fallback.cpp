// The boxed fallback: every aten op without a native testdev kernel. Output
// shapes come from the op's Meta kernel, outputs are allocated at issue on
// the calling thread, and the op's CPU kernel runs later on the current
// stream's worker, on CPU tensors viewing the device's host memory.
#include "common.h"
#include "streams.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

namespace testdev {
namespace {

using c10::IValue;
using torch::jit::Stack;

constexpr auto kMeta = c10::DispatchKeySet(c10::DispatchKey::Meta);
constexpr auto kCPU = c10::DispatchKeySet(c10::DispatchKey::CPU);

// Applies f to every tensor in an argument (a tensor, a list of tensors, a
// list of optional tensors); other values are returned as they are.
template <typename F>
IValue map_tensors(const IValue& value, const F& f) {
  if (value.isTensor()) {
    return f(value.toTensor());
  }
  if (value.isTensorList()) {
    auto list = value.toTensorList();
    c10::List<at::Tensor> out;
    out.reserve(list.size());
    for (size_t i = 0; i < list.size(); ++i) {
      out.push_back(f(list.get(i)));
    }
    return out;
  }
  if (value.isList()) {
    auto list = value.toList();
    bool has_tensor = false;
    for (size_t i = 0; i < list.size(); ++i) {
      has_tensor = has_tensor || list.get(i).isTensor();
    }
    if (!has_tensor) {
      return value;
    }
    c10::impl::GenericList out(list.elementType());
    out.reserve(list.size());
    for (size_t i = 0; i < list.size(); ++i) {
      IValue item = list.get(i);
      out.push_back(item.isTensor() ? f(item.toTensor()) : item);
    }
    return out;
  }
  return value;
}

template <typename F>
void for_each_tensor(const IValue& value, const F& f) {
  map_tensors(value, [&](const at::Tensor& t) {
    f(t);
    return t;
  });
}

// TESTDEV_DEBUG=1 names the ops that run synchronously, and why; 2 names
// every op the fallback takes.
int debug_level() {
  static const int level = [] {
    const char* v = std::getenv("TESTDEV_DEBUG");
    return v == nullptr ? 0 : std::atoi(v);
  }();
  return level;
}

bool debug() {
  return debug_level() > 0;
}

bool is_generator(const c10::Argument& arg) {
  c10::TypePtr type = arg.type();
  if (auto optional = type->cast<c10::OptionalType>()) {
    type = optional->getElementType();
  }
  return type->kind() == c10::TypeKind::GeneratorType;
}

bool is_write(const c10::Argument& arg) {
  return arg.alias_info() != nullptr && arg.alias_info()->isWrite();
}

// The argument a returned alias refers to (same alias set), or -1.
int aliased_argument(
    const c10::FunctionSchema& schema,
    const c10::AliasInfo& alias) {
  const auto& args = schema.arguments();
  for (size_t j = 0; j < args.size(); ++j) {
    const c10::AliasInfo* info = args[j].alias_info();
    if (info == nullptr) {
      continue;
    }
    for (const auto& set : info->beforeSets()) {
      if (alias.beforeSets().count(set) != 0) {
        return static_cast<int>(j);
      }
    }
  }
  return -1;
}

at::Tensor to_meta(const at::Tensor& t) {
  if (!t.defined() || !t.is_privateuseone()) {
    return t;
  }
  // Same sizes, strides and offset over a storage of the same size, so views
  // and resizes the Meta kernel makes read back as they would on the device.
  auto numel = static_cast<int64_t>(t.storage().nbytes() / t.itemsize());
  auto base = at::empty({numel}, t.options().device(c10::kMeta));
  auto meta = base.as_strided(t.sizes(), t.strides(), t.storage_offset());
  meta._set_conj(t.is_conj());
  meta._set_neg(t.is_neg());
  return meta;
}

// A host tensor argument, copied at issue. A Python scalar's wrapped-number
// flag survives: it takes part in type promotion.
at::Tensor host_copy(const at::Tensor& t) {
  at::Tensor copy = t.clone();
  copy.unsafeGetTensorImpl()->set_wrapped_number(
      t.unsafeGetTensorImpl()->is_wrapped_number());
  return copy;
}

IValue device_to(const IValue& value, c10::DeviceType type) {
  if (value.isDevice() && value.toDevice().is_privateuseone()) {
    return c10::Device(type);
  }
  return value;
}

// The arguments of the CPU kernel: device tensors become host aliases, host
// tensors are copied now (read at issue, like a CUDA kernel's arguments), and
// a random op gets a generator seeded from the device's at issue.
Stack cpu_arguments(
    const c10::FunctionSchema& schema,
    const std::vector<IValue>& args,
    c10::DeviceIndex device,
    HostStorages* storages) {
  Stack out;
  out.reserve(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    if (is_generator(schema.arguments()[i])) {
      out.emplace_back(
          generator_for_op(args[i].toOptional<at::Generator>(), device));
      continue;
    }
    out.push_back(map_tensors(
        device_to(args[i], c10::kCPU),
        [storages](const at::Tensor& t) -> at::Tensor {
          if (!t.defined()) {
            return t;
          }
          return t.is_privateuseone() ? host_alias(t, storages) : host_copy(t);
        }));
  }
  return out;
}

void check_cpu_kernel(const c10::OperatorHandle& op) {
  TORCH_CHECK_NOT_IMPLEMENTED(
      op.hasComputedKernelForDispatchKey(c10::DispatchKey::CPU),
      "testdev: ",
      op.schema().operator_name(),
      " has no CPU kernel to run on the device");
}

// Layout of a fresh output: the Meta kernel's strides when they describe a
// dense tensor, else contiguous.
at::Tensor allocate_like(const at::Tensor& like, c10::DeviceIndex device) {
  auto options = like.options().device(c10::DeviceType::PrivateUse1, device);
  if (like.is_non_overlapping_and_dense()) {
    return at::empty_strided(like.sizes(), like.strides(), options);
  }
  return at::empty(like.sizes(), options);
}

// A view of `input`'s storage laid out as `like` (the Meta kernel's or the
// CPU kernel's view, over a storage of the same bytes), made on the calling
// thread. Built directly: view_as_real and view.dtype change the dtype.
at::Tensor alias_view(const at::Tensor& input, const at::Tensor& like) {
  auto keys = input.key_set()
                  .remove(c10::DispatchKey::Conjugate)
                  .remove(c10::DispatchKey::Negative);
  auto view = at::detail::make_tensor<c10::TensorImpl>(
      c10::TensorImpl::VIEW,
      c10::Storage(input.storage()),
      keys,
      like.dtype());
  view.unsafeGetTensorImpl()->set_sizes_and_strides(
      like.sizes(),
      like.strides(),
      like.storage_offset());
  view._set_conj(like.is_conj());
  view._set_neg(like.is_neg());
  return view;
}

// Runs the op on the calling thread, after the current stream has caught up.
// Used where the Meta kernel cannot say what the outputs are (data-dependent
// sizes: nonzero, masked_select, unique; no Meta kernel) or the op returns
// non-tensors (equal, is_nonzero): their results reach the host at once, as
// on CUDA where such ops synchronize.
void run_synchronously(
    const c10::OperatorHandle& op,
    const std::vector<IValue>& args,
    c10::DeviceIndex device,
    Stack* stack) {
  check_cpu_kernel(op);
  const auto& schema = op.schema();
  synchronize_stream(current_stream(device));
  HostStorages storages;
  Stack cpu_stack = cpu_arguments(schema, args, device, &storages);
  op.redispatchBoxed(kCPU, &cpu_stack);
  const auto& returns = schema.returns();
  // The stream is idle, so fresh outputs are filled here on the host.
  auto to_device = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || t.is_privateuseone()) {
      return t;
    }
    at::Tensor out = allocate_like(t, device);
    host_alias(out).copy_(t);
    return out;
  };
  for (size_t r = 0; r < returns.size(); ++r) {
    const IValue& result = cpu_stack[r];
    const c10::AliasInfo* alias = returns[r].alias_info();
    if (alias == nullptr) {
      stack->push_back(map_tensors(result, to_device));
      continue;
    }
    int j = aliased_argument(schema, *alias);
    TORCH_CHECK_NOT_IMPLEMENTED(
        j >= 0 && args[j].isTensor() && result.isTensor(),
        "testdev: cannot return the alias of ",
        schema.operator_name());
    const at::Tensor& input = args[j].toTensor();
    if (alias->isWrite()) {
      stack->push_back(input);
    } else {
      // A view: the CPU result views the host alias of the input's storage.
      stack->push_back(alias_view(input, result.toTensor()));
    }
  }
}

bool tensors_only(const IValue& value) {
  return value.isTensor() || value.isTensorList() || value.isNone();
}

// An output allocated at issue; the worker copies the CPU kernel's result
// into its host alias.
struct FreshOutput {
  at::Tensor alias;
  size_t ret;
  int64_t index; // in a returned list, else -1
};

void fallback(
    const c10::OperatorHandle& op,
    c10::DispatchKeySet /*keys*/,
    Stack* stack) {
  const auto& schema = op.schema();
  if (debug_level() > 1) {
    std::cerr << "testdev: fallback " << schema.operator_name() << std::endl;
  }
  const auto& arguments = schema.arguments();
  const size_t num_args = arguments.size();
  std::vector<IValue> args(stack->end() - num_args, stack->end());
  torch::jit::drop(*stack, num_args);

  std::optional<c10::Device> device;
  for (const auto& arg : args) {
    for_each_tensor(arg, [&](const at::Tensor& t) {
      if (!t.defined() || !t.is_privateuseone()) {
        return;
      }
      TORCH_CHECK(
          !device.has_value() || *device == t.device(),
          "Expected all tensors to be on the same device, but found at "
          "least two devices, ",
          *device,
          " and ",
          t.device(),
          "! (",
          schema.operator_name(),
          ")");
      device = t.device();
    });
  }
  for (const auto& arg : args) {
    if (!device.has_value() && arg.isDevice() &&
        arg.toDevice().is_privateuseone()) {
      device = arg.toDevice();
    }
  }
  // Allocations and the stream are the op's device's, as a CUDA kernel's
  // device guard makes them.
  c10::DeviceGuard guard(device.value_or(c10::Device(c10::kPrivateUse1)));
  c10::DeviceIndex index = current_device();

  // 1. The Meta kernel: output sizes and strides, resizes of out= arguments.
  Stack meta_stack;
  std::vector<at::Tensor> meta_written(num_args);
  for (size_t i = 0; i < num_args; ++i) {
    IValue meta = map_tensors(device_to(args[i], c10::kMeta), to_meta);
    if (is_write(arguments[i]) && meta.isTensor()) {
      meta_written[i] = meta.toTensor();
    }
    meta_stack.push_back(std::move(meta));
  }
  bool meta_ok = true;
  try {
    op.redispatchBoxed(kMeta, &meta_stack);
  } catch (const std::exception& e) {
    meta_ok = false;
    if (debug()) {
      std::cerr << "testdev: " << schema.operator_name()
                << " runs synchronously, its Meta kernel failed: " << e.what()
                << std::endl;
    }
  }
  const auto& returns = schema.returns();
  for (size_t r = 0; meta_ok && r < returns.size(); ++r) {
    meta_ok = tensors_only(meta_stack[r]);
    const c10::AliasInfo* alias = returns[r].alias_info();
    if (meta_ok && alias != nullptr) {
      int j = aliased_argument(schema, *alias);
      meta_ok = j >= 0 && args[j].isTensor() && meta_stack[r].isTensor();
    }
  }
  if (!meta_ok) {
    if (debug()) {
      std::cerr << "testdev: " << schema.operator_name()
                << " runs synchronously" << std::endl;
    }
    run_synchronously(op, args, index, stack);
    return;
  }
  check_cpu_kernel(op);

  // 2. Outputs, at issue: written arguments take the Meta kernel's shape;
  // views alias their input now; fresh outputs are allocated.
  for (size_t i = 0; i < num_args; ++i) {
    const at::Tensor& meta = meta_written[i];
    if (!meta.defined()) {
      continue;
    }
    const at::Tensor& t = args[i].toTensor();
    if (meta.sizes() != t.sizes() || meta.strides() != t.strides()) {
      restride(t, meta.sizes(), meta.strides());
    }
  }
  std::vector<IValue> results;
  std::vector<FreshOutput> fresh;
  HostStorages storages;
  for (size_t r = 0; r < returns.size(); ++r) {
    const IValue& meta = meta_stack[r];
    const c10::AliasInfo* alias = returns[r].alias_info();
    if (alias != nullptr) {
      const at::Tensor& input =
          args[aliased_argument(schema, *alias)].toTensor();
      if (alias->isWrite()) {
        results.emplace_back(input);
      } else {
        results.emplace_back(alias_view(input, meta.toTensor()));
      }
      continue;
    }
    if (meta.isTensor()) {
      const at::Tensor& m = meta.toTensor();
      if (!m.defined()) {
        results.emplace_back(m);
        continue;
      }
      at::Tensor out = allocate_like(m, index);
      fresh.push_back({host_alias(out, &storages), r, -1});
      results.emplace_back(std::move(out));
    } else if (meta.isTensorList()) {
      auto metas = meta.toTensorList();
      c10::List<at::Tensor> outs;
      for (size_t k = 0; k < metas.size(); ++k) {
        at::Tensor out = allocate_like(metas.get(k), index);
        fresh.push_back(
            {host_alias(out, &storages), r, static_cast<int64_t>(k)});
        outs.push_back(std::move(out));
      }
      results.emplace_back(std::move(outs));
    } else {
      results.emplace_back(meta);
    }
  }

  // 3. The CPU kernel, later, on the current stream. The closure holds host
  // aliases only, never the device storages: Python may free a tensor right
  // after this returns and the allocator hand its block to the next op on
  // this stream, which is what makes a missing recordStream visible.
  Stack cpu_stack = cpu_arguments(schema, args, index, &storages);
  // The kernel runs with the issuing thread's intra-op thread count (a
  // stream thread keeps the count it started with), so reductions split work
  // as they would on CPU and results stay bitwise equal.
  int threads = at::get_num_threads();
  enqueue(
      current_stream(index),
      [op,
       threads,
       cpu_stack = std::move(cpu_stack),
       fresh = std::move(fresh)]() mutable {
        if (at::get_num_threads() != threads) {
          at::set_num_threads(threads);
        }
        op.redispatchBoxed(kCPU, &cpu_stack);
        for (const auto& out : fresh) {
          const IValue& result = cpu_stack[out.ret];
          if (out.index < 0) {
            out.alias.copy_(result.toTensor());
          } else {
            out.alias.copy_(result.toTensorList().get(out.index));
          }
        }
      });
  for (auto& result : results) {
    stack->push_back(std::move(result));
  }
}

// _fused_sdp_choice returns an int: through the fallback it would run
// synchronously, and the CPU kernel would pick a CPU-only backend. The math
// backend keeps scaled_dot_product_attention asynchronous.
void sdp_choice_math(
    const c10::OperatorHandle& op,
    c10::DispatchKeySet /*keys*/,
    Stack* stack) {
  torch::jit::drop(*stack, op.schema().arguments().size());
  stack->emplace_back(static_cast<int64_t>(0)); // sdp::SDPBackend::math
}

} // namespace

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  // These have a CPU kernel, but a composite kernel would serve PrivateUse1
  // (a decomposition with other rounding): the CPU kernel, through the
  // fallback, keeps results bitwise equal to CPU's.
  for (const char* name : {
           "native_layer_norm",
           "native_group_norm",
           "silu_backward",
           "mish_backward",
       }) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
  m.impl(
      "_fused_sdp_choice",
      torch::CppFunction::makeFromBoxedFunction<&sdp_choice_math>());
}

} // namespace testdev
