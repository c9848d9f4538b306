#pragma once

// What one backward call was asked to do, beside its graph: the flags every
// entry point passes (engine_api.h, backward_request.h) and the call reads.

namespace torch_ext {

struct CallOptions {
  bool keep_graph = false;
  bool create_graph = false;
  // backward() (true) writes .grad through AccumulateGrad; grad() (false)
  // captures the gradients of `inputs` and returns them.
  bool accumulate_grad = true;
};

} // namespace torch_ext
