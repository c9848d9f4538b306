// The engine's entry: roots, root gradients and inputs -> BackwardRequest,
// with stock's checks in stock's order (THPEngine_run_backward), and the
// request run as one call inside its host task (run/run_call.h). See
// backward_request.h and engine_api.h.

#include "engine/backward_request.h"
#include "engine/run/run_call.h"

#include <ATen/LegacyBatchedTensorImpl.h>
#include <ATen/LegacyVmapMode.h>
#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/basic_ops.h>

namespace torch_ext {
namespace {

void check_not_batched(const at::Tensor& tensor, bool is_root, size_t i) {
  TORCH_CHECK(
      !at::isBatchedTensor(tensor),
      "torch.autograd.grad(outputs, inputs, grad_outputs) called inside ",
      "torch.vmap. We do not support the case where any ",
      is_root ? "outputs" : "inputs",
      " are vmapped tensors (",
      is_root ? "output " : "input ",
      i,
      " is being vmapped over). Please "
      "call autograd.grad() outside torch.vmap or file a bug report "
      "with your use case.");
}

} // namespace

RequestBuilder::RequestBuilder(
    size_t num_roots,
    size_t num_root_grads,
    CallOptions options,
    bool allow_unreachable) {
  TORCH_CHECK(
      num_roots == num_root_grads,
      "got ",
      num_roots,
      " tensors and ",
      num_root_grads,
      " gradients");
  // accumulate_grad: the user called backward() rather than grad().
  TORCH_CHECK(
      !options.accumulate_grad || at::impl::VmapMode::current_vmap_level() == 0,
      "backward() called inside torch.vmap. This is not supported, "
      "please call backward() outside torch.vmap or instead use "
      "torch.autograd.grad inside torch.vmap");
  request_.options = options;
  request_.allow_unreachable = allow_unreachable;
  request_.roots.reserve(num_roots);
  request_.root_grads.reserve(num_roots);
}

void RequestBuilder::add_root(const GraphEndpoint& root) {
  const size_t i = request_.roots.size();
  last_root_tensor_ = std::nullopt;
  if (const auto* tensor = std::get_if<at::Tensor>(&root)) {
    check_not_batched(*tensor, /*is_root=*/true, i);
    last_root_tensor_ = *tensor;
    request_.roots.push_back(torch::autograd::impl::gradient_edge(*tensor));
  } else {
    request_.roots.push_back(std::get<Edge>(root));
  }
  TORCH_CHECK(
      request_.roots.back().function,
      "element ",
      i,
      " of tensors does not require grad and does not have a grad_fn");
}

void RequestBuilder::add_root_grad(std::optional<at::Tensor> grad) {
  const size_t i = request_.root_grads.size();
  if (!grad.has_value()) {
    TORCH_CHECK(
        last_root_tensor_.has_value(),
        "element ",
        i,
        " of gradients tuple is None, but the corresponding output is a GradientEdge."
        "This is not supported.");
    TORCH_CHECK(
        !last_root_tensor_->requires_grad(),
        "element ",
        i,
        " of gradients tuple is None, but the corresponding Tensor requires grad");
  }
  request_.root_grads.push_back(grad.has_value() ? *grad : at::Tensor());
}

void RequestBuilder::expect_inputs(size_t count) {
  request_.has_inputs = true;
  request_.inputs.reserve(count);
}

void RequestBuilder::add_input(const GraphEndpoint& input) {
  if (const auto* tensor = std::get_if<at::Tensor>(&input)) {
    check_not_batched(*tensor, /*is_root=*/false, request_.inputs.size());
    request_.inputs.push_back(
        input_edge(*tensor, request_.options.accumulate_grad));
  } else {
    request_.inputs.push_back(std::get<Edge>(input));
  }
}

BackwardRequest RequestBuilder::finish(CallContext context) {
  request_.context = std::move(context);
  return std::move(request_);
}

BackwardRequest request_from_tensors(
    at::TensorList roots,
    const c10::List<std::optional<at::Tensor>>& root_grads,
    const std::optional<at::TensorList>& inputs,
    CallOptions options,
    bool allow_unreachable) {
  RequestBuilder builder(
      roots.size(),
      root_grads.size(),
      options,
      allow_unreachable);
  for (size_t i = 0; i < roots.size(); ++i) {
    builder.add_root(roots[i]);
    builder.add_root_grad(root_grads.get(i));
  }
  if (inputs.has_value()) {
    builder.expect_inputs(inputs->size());
    for (const auto& input : *inputs) {
      builder.add_input(input);
    }
  }
  return builder.finish({});
}

variable_list run(BackwardRequest request) {
  variable_list results;
  results = run_backward(
      request.roots,
      std::move(request.root_grads),
      request.inputs,
      request.options,
      std::move(request.context));
  if (!request.options.accumulate_grad && request.has_inputs) {
    for (size_t i = 0; i < results.size(); ++i) {
      TORCH_CHECK(
          request.allow_unreachable || results[i].defined(),
          "The differentiated Tensor at index ",
          i,
          " appears to not have been used in the graph. Set allow_unused=True "
          "if this is the desired behavior.");
    }
  }
  return results;
}

Edge input_edge(const at::Tensor& input, bool accumulate_grad) {
  auto grad_fn = input.grad_fn();
  if (!grad_fn) {
    grad_fn = torch::autograd::impl::try_get_grad_accumulator(input);
  }
  if (accumulate_grad) {
    input.retain_grad();
  }
  TORCH_CHECK(
      input.requires_grad(),
      "One of the differentiated Tensors does not require grad");
  if (!grad_fn) {
    // NOTE [ Autograd Unreachable Input ] (stock): an edge to a node of its
    // own, so that edges to nullptr in the graph (e.g. mul by a scalar) are
    // not taken for this input.
    return Edge(c10::make_intrusive<torch::autograd::Identity>(), 0);
  }
  return Edge(std::move(grad_fn), input.output_nr());
}

void prepare_roots(const edge_list& roots, variable_list& root_grads) {
  torch::autograd::validate_outputs(
      roots,
      root_grads,
      [](const std::string& msg) { return msg; });
  if (roots.size() != 1) {
    // Stock builds a GraphRoot node unless there is exactly one root, and it
    // takes a sequence number; forward ops recorded afterwards are numbered
    // as on stock.
    at::sequence_number::get_and_increment();
  }
}

variable_list run_backward(
    const edge_list& roots,
    variable_list root_grads,
    const edge_list& inputs,
    CallOptions options,
    CallContext context) {
  prepare_roots(roots, root_grads);
  TORCH_CHECK(
      options.accumulate_grad || !inputs.empty(),
      "grad requires non-empty inputs.");
  if (options.accumulate_grad && options.create_graph) {
    TORCH_WARN_ONCE(
        "Using backward() with create_graph=True will create a reference cycle "
        "between the parameter and its gradient which can cause a memory leak. "
        "We recommend using autograd.grad when creating the graph to avoid this. "
        "If you have to use this function, make sure to reset the .grad fields of "
        "your parameters to None after use to break the cycle and avoid the leak.");
  }

  return run_call(
      roots,
      std::move(root_grads),
      inputs,
      options,
      std::move(context));
}

} // namespace torch_ext
