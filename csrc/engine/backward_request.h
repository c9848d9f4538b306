#pragma once

// One request builder for every entry point into torch_ext's engine:
// torch_ext._C.run_backward (torch.autograd's engine call), the ops
// torch.ops.torch_ext.backward/grad and split backward's input pass. Each
// turns its roots, root gradients, inputs and flags into a BackwardRequest
// through RequestBuilder, so the checks and messages are stock's, made in
// stock's order (THPEngine_run_backward in torch/csrc/autograd/
// python_engine.cpp), in one place. The Python entry points unpack their
// arguments in bindings/python_request.cpp and build the request here.

#include "engine/engine_api.h"

#include <ATen/core/List.h>

#include <optional>
#include <variant>

namespace torch_ext {

// What the engine runs: validated edges, the call's options and its context.
struct BackwardRequest {
  edge_list roots;
  variable_list root_grads; // undefined for a root that needs none
  edge_list inputs;
  // The call named inputs, even none: grad() returns one gradient each.
  bool has_inputs = false;
  CallOptions options;
  // grad(allow_unused=True): an input no gradient reached is not an error.
  bool allow_unreachable = false;
  CallContext context;
};

// A root or an input as a call names it: a tensor, or the edge of a
// torch.autograd.graph.GradientEdge.
using GraphEndpoint = std::variant<at::Tensor, Edge>;

// Adds roots, each followed by its gradient, then inputs, checking each as
// stock does at the same point.
class RequestBuilder {
 public:
  RequestBuilder(
      size_t num_roots,
      size_t num_root_grads,
      CallOptions options,
      bool allow_unreachable);

  void add_root(const GraphEndpoint& root);
  // The gradient of the root added last; nullopt for None.
  void add_root_grad(std::optional<at::Tensor> grad);
  void expect_inputs(size_t count);
  void add_input(const GraphEndpoint& input);
  // The request, with the context the entry point built for the call.
  BackwardRequest finish(CallContext context);

 private:
  BackwardRequest request_;
  std::optional<at::Tensor> last_root_tensor_;
};

// The request from tensors (the ops' schemas): every root and input a Tensor.
BackwardRequest request_from_tensors(
    at::TensorList roots,
    const c10::List<std::optional<at::Tensor>>& root_grads,
    const std::optional<at::TensorList>& inputs,
    CallOptions options,
    bool allow_unreachable);

// Runs `request` on torch_ext's engine; the caller must not hold the GIL
// (bindings/python_request.h releases it). For grad() (inputs named,
// accumulate_grad false): the gradient of each input, with stock's error for
// an unreachable one unless allowed.
variable_list run(BackwardRequest request);

// The edge whose gradient grad()/backward(inputs=) is asked for, as stock's
// run_backward resolves a tensor input: its grad_fn, or its AccumulateGrad if
// it is a leaf, or an edge to a fresh node when it has neither (unreachable).
// backward(inputs=) also retains the gradient of a non-leaf input.
Edge input_edge(const at::Tensor& input, bool accumulate_grad);

// What every call does with its roots before it runs, as stock's
// Engine::execute does: checks each root gradient against its root's
// metadata, and takes a sequence number for the GraphRoot node stock builds
// unless there is exactly one root, so that forward ops recorded afterwards
// are numbered as on stock. run_backward and split backward's input pass.
void prepare_roots(const edge_list& roots, variable_list& root_grads);

} // namespace torch_ext
