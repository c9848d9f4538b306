#pragma once

// Accumulations a pass may hold back and run together. Split backward's
// weight pass hands its call one (split/batched_accumulation.h); the
// executor offers it every node it runs. The run layer knows only this
// interface, not what split backward does with it.

#include <torch/csrc/autograd/function.h>

namespace torch_ext {

class DeferredAccumulation {
 public:
  // Before `fn` runs: accumulates now whatever `fn` could observe being
  // held back (a hook of any kind may read any .grad).
  virtual void before_node(torch::autograd::Node& fn) = 0;
  // Takes over AccumulateGrad `fn`'s work on `grads` if it can; returns
  // whether it did (the node must then not run).
  virtual bool try_take(
      torch::autograd::Node& fn,
      const torch::autograd::variable_list& grads) = 0;
  // Accumulates everything held back. Also on the error path: what stock
  // would have accumulated before the error is accumulated.
  virtual void flush() = 0;

 protected:
  ~DeferredAccumulation() = default;
};

} // namespace torch_ext
