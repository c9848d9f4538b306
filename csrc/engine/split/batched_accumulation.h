#pragma once

// Batched weight-gradient accumulation for split backward's weight pass.
//
// The weight pass ends in one AccumulateGrad per weight. When the weight
// already has a .grad and nothing observes the accumulation (no hook of any
// kind, grad mode off), AccumulateGrad does `.grad += grad` in place (its
// "case 2.3"). Done per node on a GPU that is one kernel launch per weight;
// the batch instead takes these over and runs them as one
// torch_ext::multi_tensor_accumulate_ (torch_ext.kernels: one Triton launch
// per dtype on CUDA, the torch reference elsewhere) when the pass ends, or
// earlier, before anything could observe a .grad it holds back (a hook, the
// host task's final callbacks).

#include "engine/run/deferred_accumulation.h"
#include "engine/run/node_steps.h"

#include <torch/csrc/autograd/function.h>

#include <vector>

namespace torch_ext {

enum class WeightAccumulationBatching {
  kOff,
  // Only weights on an accelerator, where launches are what it saves.
  kAccelerator,
  // Every eligible weight, CPU included (tests, and CPU users who want it).
  kAlways,
};

void set_weight_accumulation_batching(WeightAccumulationBatching mode);
WeightAccumulationBatching weight_accumulation_batching();

// Until it flushes, the batch keeps each weight's incoming gradient alive,
// which stock frees right after its AccumulateGrad; it flushes once the
// gradients it holds reach this many bytes, so the weight pass's peak exceeds
// stock's by less than this plus one gradient.
//
// 32 MiB: what batching saves is a launch per tensor, which counts for many
// small tensors (biases, norm weights: hundreds of them fit in a few MiB); a
// large gradient's add is bandwidth-bound and one launch for it costs little,
// so holding more buys little and 32 MiB is small next to a GPU's memory. Not
// measured on a GPU (this machine has none): to revisit with a CUDA benchmark.
inline constexpr size_t kDefaultMaxBatchedGradientBytes = size_t{32} << 20;
// For tests: sets the bound, returns the previous one.
size_t set_max_batched_gradient_bytes(size_t bytes);

class AccumulationBatch final : public DeferredAccumulation {
 public:
  // Whether batching can run at all: a mode other than kOff, and
  // torch_ext::multi_tensor_accumulate_ registered (torch_ext.kernels
  // imported).
  static bool available();

  // Takes over AccumulateGrad `fn`'s work on `grads` if it is an unobserved
  // in-place `.grad += grad`; returns whether it did (the node must then not
  // run).
  bool try_take(
      torch::autograd::Node& fn,
      const torch::autograd::variable_list& grads) override;

  // Flushes before a node that has a hook of any kind (has_any_hooks): a
  // hook may read any weight's .grad, which stock has accumulated as soon as
  // its gradient was ready. Such a node is never batched either.
  void before_node(torch::autograd::Node& fn) override {
    if (has_any_hooks(fn)) {
      flush();
    }
  }

  // Accumulates everything taken, one multi-tensor call per device, and
  // forgets it. Also on the error path: what stock would have accumulated
  // before the error is accumulated.
  void flush() override;

 private:
  std::vector<at::Tensor> dsts_;
  std::vector<at::Tensor> srcs_;
  // Bytes of srcs_.
  size_t held_bytes_ = 0;
};

} // namespace torch_ext
