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

class AccumulationBatch {
 public:
  // Whether batching can run at all: a mode other than kOff, and
  // torch_ext::multi_tensor_accumulate_ registered (torch_ext.kernels
  // imported).
  static bool available();

  // Whether running `fn` runs a hook of any kind. A hook may read any
  // weight's .grad, which stock has accumulated as soon as its gradient was
  // ready: the pass flushes the batch before such a node, and never batches
  // it.
  static bool has_hooks(torch::autograd::Node& fn);

  // Takes over AccumulateGrad `fn`'s work on `grads` if it is an unobserved
  // in-place `.grad += grad`; returns whether it did (the node must then not
  // run).
  bool try_take(torch::autograd::Node& fn, const torch::autograd::variable_list& grads);

  // Accumulates everything taken, one multi-tensor call per device, and
  // forgets it. Also on the error path: what stock would have accumulated
  // before the error is accumulated.
  void flush();

 private:
  std::vector<at::Tensor> dsts_;
  std::vector<at::Tensor> srcs_;
};

} // namespace torch_ext
