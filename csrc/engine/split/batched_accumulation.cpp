#include "engine/split/batched_accumulation.h"

#include <ATen/DeviceAccelerator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <atomic>

namespace torch_ext {
namespace {

std::atomic<WeightAccumulationBatching> batching_mode{
    WeightAccumulationBatching::kAccelerator};

std::atomic<size_t> max_batched_gradient_bytes{kDefaultMaxBatchedGradientBytes};

constexpr const char* kAccumulateOp = "torch_ext::multi_tensor_accumulate_";

bool is_batchable_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
}

// A plain dense tensor: no subclass, functorch wrapper, functionalization or
// lazy negation, for which AccumulateGrad takes other paths.
bool is_plain_dense(const at::Tensor& t) {
  constexpr c10::DispatchKeySet kWrapped({
      c10::DispatchKey::Python,
      c10::DispatchKey::Functionalize,
      c10::DispatchKey::FuncTorchBatched,
      c10::DispatchKey::Batched,
      c10::DispatchKey::FuncTorchGradWrapper,
  });
  return t.layout() == at::kStrided && !t.key_set().has_any(kWrapped) &&
      !t.is_neg() && !t.is_conj() && t.is_contiguous();
}

} // namespace

void set_weight_accumulation_batching(WeightAccumulationBatching mode) {
  batching_mode.store(mode, std::memory_order_relaxed);
}

WeightAccumulationBatching weight_accumulation_batching() {
  return batching_mode.load(std::memory_order_relaxed);
}

size_t set_max_batched_gradient_bytes(size_t bytes) {
  return max_batched_gradient_bytes.exchange(bytes, std::memory_order_relaxed);
}

bool AccumulationBatch::available() {
  return weight_accumulation_batching() != WeightAccumulationBatching::kOff &&
      c10::Dispatcher::singleton()
          .findSchema(c10::OperatorName(kAccumulateOp, ""))
          .has_value();
}

bool AccumulationBatch::try_take(
    torch::autograd::Node& fn,
    const torch::autograd::variable_list& grads) {
  auto* accumulate = dynamic_cast<torch::autograd::AccumulateGrad*>(&fn);
  if (accumulate == nullptr || grads.size() != 1 ||
      at::GradMode::is_enabled()) {
    return false;
  }
  // Any hook observes the accumulation (or its timing): leave it to the node.
  if (has_any_hooks(fn)) {
    return false;
  }
  const at::Tensor& variable = accumulate->variable;
  const at::Tensor& grad = grads[0];
  // AccumulateGrad does nothing for a variable that stopped requiring grad
  // (frozen between the passes) and raises for one moved into the graph.
  if (!variable.defined() || !grad.defined() || !variable.requires_grad() ||
      variable.grad_fn()) {
    return false;
  }
  // Without a .grad, AccumulateGrad steals or clones the incoming gradient:
  // nothing to batch.
  at::Tensor variable_grad = variable.grad();
  if (!variable_grad.defined()) {
    return false;
  }
  if (weight_accumulation_batching() ==
          WeightAccumulationBatching::kAccelerator &&
      !at::accelerator::isAccelerator(variable_grad.device().type())) {
    return false;
  }
  if (variable_grad.scalar_type() != grad.scalar_type() ||
      !is_batchable_dtype(grad.scalar_type()) ||
      variable_grad.device() != grad.device() ||
      !variable_grad.sizes().equals(grad.sizes()) ||
      !is_plain_dense(variable_grad) || !is_plain_dense(grad)) {
    return false;
  }
  dsts_.push_back(std::move(variable_grad));
  srcs_.push_back(grad);
  held_bytes_ += grad.nbytes();
  if (held_bytes_ >=
      max_batched_gradient_bytes.load(std::memory_order_relaxed)) {
    flush();
  }
  return true;
}

void AccumulationBatch::flush() {
  if (dsts_.empty()) {
    return;
  }
  std::vector<at::Tensor> dsts = std::move(dsts_);
  std::vector<at::Tensor> srcs = std::move(srcs_);
  dsts_.clear();
  srcs_.clear();
  held_bytes_ = 0;
  static const auto accumulate =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow(kAccumulateOp, "")
          .typed<void(at::TensorList, at::TensorList, double)>();
  at::NoGradGuard no_grad;
  // One call per device, in the order the nodes ran.
  std::vector<bool> done(dsts.size(), false);
  for (size_t first = 0; first < dsts.size(); ++first) {
    if (done[first]) {
      continue;
    }
    std::vector<at::Tensor> device_dsts;
    std::vector<at::Tensor> device_srcs;
    for (size_t i = first; i < dsts.size(); ++i) {
      if (!done[i] && dsts[i].device() == dsts[first].device()) {
        done[i] = true;
        device_dsts.push_back(dsts[i]);
        device_srcs.push_back(srcs[i]);
      }
    }
    accumulate.call(device_dsts, device_srcs, 1.0);
  }
}

} // namespace torch_ext
