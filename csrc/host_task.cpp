// Host task: runs a torch_ext backward inside one stock graph task.
//
// Other parts of PyTorch read the *current graph task* while backward runs
// (Engine::queue_callback for DDP/FSDP, _current_graph_task_id for
// checkpoint and multi-grad hooks, task_should_compute_output for pruning).
// An extension cannot create or install a GraphTask, so torch_ext asks the
// stock engine to run one: its only root is BackwardDriver, whose apply()
// runs torch_ext's discovery, scheduler and executor over the real graph on
// the same thread, while that task is current. See DESIGN.md, "The host-task
// pattern".

#include "engine_api.h"
#include "schedule_replay.h"

#include <ATen/DeviceAccelerator.h>
#include <ATen/EmptyTensor.h>
#include <ATen/SequenceNumber.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/input_metadata.h>

#include <limits>
#include <mutex>

namespace torch_ext {
namespace {

using torch::autograd::AnomalyMode;
using torch::autograd::GraphTask;

AnomalyMetadataCopier anomaly_metadata_copier = nullptr;

// The gradient fed to the driver. The host task checks it against the
// driver's input metadata and hands it over; nothing reads its value. Shared
// by all calls and never freed (it must outlive every thread's last backward).
// Allocated directly, not through the dispatcher: a TorchDispatchMode active
// during the first backward must neither see nor replace it.
const at::Tensor& driver_dummy_grad() {
  static const at::Tensor* dummy =
      new at::Tensor(at::detail::empty_cpu({}, at::TensorOptions()));
  return *dummy;
}

class BackwardDriver final : public torch::autograd::Node {
 public:
  explicit BackwardDriver(BackwardCall& call)
      // An explicit sequence_nr: the driver must not consume one of the
      // numbers forward ops are given.
      : Node(/*sequence_nr=*/std::numeric_limits<uint64_t>::max()),
        call_(&call) {
    add_input_metadata(driver_dummy_grad());
  }

  std::string name() const override {
    // In anomaly mode the host task reports the node that raised as its own
    // failure: it prints the name and forward stack of the failing node, as
    // stock would, rather than the driver's.
    return failed_node_name_.empty() ? "torch_ext::BackwardDriver"
                                     : failed_node_name_;
  }

  variable_list apply(variable_list&& /*dummy_grad*/) override {
    TORCH_INTERNAL_ASSERT(call_ != nullptr, "BackwardDriver ran twice");
    BackwardCall* call = std::exchange(call_, nullptr);
    try {
      call->run(this);
    } catch (...) {
      Node* failed = call->failed_node();
      if (AnomalyMode::is_enabled() && failed != nullptr) {
        failed_node_name_ = failed->name();
        if (anomaly_metadata_copier != nullptr) {
          anomaly_metadata_copier(*failed, *this);
        }
      }
      throw;
    }
    return {};
  }

 private:
  BackwardCall* call_;
  std::string failed_node_name_;
};

// Stock GraphTask::stash_current_streams: the caller's current stream on
// every device that already has a context.
std::vector<c10::Stream> current_accelerator_streams() {
  std::vector<c10::Stream> streams;
  const auto accelerator = at::accelerator::getAccelerator(/*checked=*/false);
  if (!accelerator.has_value()) {
    return streams;
  }
  const c10::impl::VirtualGuardImpl guard{*accelerator};
  const auto num_devices = guard.deviceCount();
  for (c10::DeviceIndex index = 0; index < num_devices; ++index) {
    if (at::globalContext().getAcceleratorHooksInterface().hasPrimaryContext(
            index)) {
      streams.push_back(guard.getStream({*accelerator, index}));
    }
  }
  return streams;
}

std::optional<c10::Stream> producer_stream_of(const at::Tensor& grad) {
  if (!grad.defined()) {
    return std::nullopt;
  }
  return torch::autograd::InputMetadata(grad).stream();
}

} // namespace

void set_anomaly_metadata_copier(AnomalyMetadataCopier copier) {
  anomaly_metadata_copier = copier;
}

BackwardCall::BackwardCall(
    edge_list roots,
    variable_list root_grads,
    edge_list inputs,
    CallOptions options,
    std::vector<PriorityOverride> priority_overrides)
    : roots_(std::move(roots)),
      root_grads_(std::move(root_grads)),
      inputs_(std::move(inputs)),
      options_(options),
      priorities_(std::move(priority_overrides)),
      // Read here, on the caller's thread: past stock's reentrant depth
      // limit the host task runs the driver on a pool thread, whose current
      // streams are not the caller's.
      caller_streams_(current_accelerator_streams()) {
  if (!options_.accumulate_grad) {
    captured_.resize(inputs_.size());
  }
  root_streams_.reserve(root_grads_.size());
  for (const auto& grad : root_grads_) {
    root_streams_.push_back(producer_stream_of(grad));
  }
}

void BackwardCall::publish_plan_to_host_task() {
  if (!plan_.filtered) {
    return;
  }
  // The host task was given one output (the driver) so that its exec_info is
  // not empty; generated nodes consult it through task_should_compute_output
  // to skip gradients nobody asked for (MmBackward computing dW in grad(x)).
  // Every node that runs or captures must be in it, or its gradient is
  // silently dropped. This is safe because every node runs on this thread.
  auto* exec_info =
      const_cast<std::unordered_map<Node*, GraphTask::ExecInfo>*>(
          torch::autograd::get_current_graph_task_exec_info());
  TORCH_INTERNAL_ASSERT(exec_info != nullptr && !exec_info->empty());
  for (size_t i = 0; i < plan_.slots.size(); ++i) {
    const NodeSlot& slot = plan_.slots[i];
    if (!slot.should_execute()) {
      continue;
    }
    auto& info = (*exec_info)[slot.fn];
    info.needed_ = slot.needed;
    if (slot.first_capture != kNoSlot) {
      info.captures_ =
          std::make_unique<std::vector<GraphTask::ExecInfo::Capture>>();
      for (size_t c = slot.first_capture; c < plan_.captures.size() &&
           plan_.captures[c].slot == static_cast<int32_t>(i);
           ++c) {
        info.captures_->emplace_back(
            plan_.captures[c].input_nr, plan_.captures[c].output_index);
      }
    }
  }
}

void BackwardCall::seed_roots() {
  if (roots_.size() == 1) {
    // Stock makes a single root the graph root and runs it whether or not
    // grad()/inputs= needs it (it then runs only its tensor pre-hooks).
    NodeSlot& root = plan_.slots[plan_.root_targets[0]];
    root.pending_edges = 1;
    root.inputs.emplace(make_input_buffer(*root.fn));
  }
  // Several roots: stock's GraphRoot delivers each gradient along its root
  // edge, in order, like any node's outputs.
  const auto first_root_edge = static_cast<int32_t>(plan_.edge_targets.size());
  for (size_t i = 0; i < roots_.size(); ++i) {
    deliver(
        plan_.root_targets[i],
        roots_[i].input_nr,
        std::move(root_grads_[i]),
        root_streams_[i],
        first_root_edge + static_cast<int32_t>(i));
  }
}

void BackwardCall::seed_ready(int32_t slot, InputBuffer&& inputs) {
  plan_.slots[slot].inputs.emplace(std::move(inputs));
  ready_.push(ready_key(slot));
}

void BackwardCall::run(Node* host_node) {
  if (trace::enabled()) {
    const char* label = trace_label_ != nullptr ? trace_label_
        : options_.accumulate_grad              ? "backward"
                                                : "grad";
    trace_ = std::make_unique<trace::CallTrace>(label);
    plan_.record_priority_sources = true;
  }
  // The call's span ends, and its events go to the recorder, however run()
  // exits.
  struct FinishTrace {
    trace::CallTrace* trace;
    ~FinishTrace() {
      if (trace != nullptr) {
        trace->finish();
      }
    }
  } finish_trace{trace_.get()};
  current_node_slot_ = current_node_slot(host_node);
  auto* host_nodes_in_graph = const_cast<std::unordered_set<Node*>*>(
      torch::autograd::get_current_graph_task_nodes_in_graph());
  TORCH_INTERNAL_ASSERT(
      host_nodes_in_graph != nullptr,
      "torch_ext's engine ran outside its host graph task");
  host_nodes_in_graph_ = host_nodes_in_graph;
  // Filling the host's nodes_in_graph makes _will_engine_execute_node and
  // register_multi_grad_hook(mode="all") see the real graph.
  if (split_ != nullptr) {
    split_->build_plan(plan_, host_nodes_in_graph);
  } else {
    discover_graph(
        plan_,
        roots_,
        inputs_,
        options_.accumulate_grad,
        priorities_,
        host_nodes_in_graph);
  }
  if (!plan_.stock_order_known &&
      (!plan_.priority.empty() || plan_.has_collectives)) {
    // Priorities and deferred collective waits run nodes out of stock's
    // order; the sums must not notice.
    order_deliveries_as_stock(plan_, /*every_slot_runs=*/false);
  }
  ordered_inputs_.resize(plan_.num_ordered_inputs);
  publish_plan_to_host_task();
  // Gradients are accumulated (InputBuffer) and nodes run with grad mode
  // equal to create_graph, as under stock's per-task thread-local state.
  c10::GradMode::set_enabled(options_.create_graph);
  task_autograd_state_ = c10::AutogradState::get_tls_state();
  task_dispatch_keys_ = c10::impl::tls_local_dispatch_key_set();

  int32_t running = kNoSlot;
  try {
    if (split_ != nullptr) {
      split_->seed(*this);
    } else {
      seed_roots();
    }
    // One loop for both: with a loop per variant GCC stopped inlining the
    // queue's pop (callgrind: +10 instructions per node untraced).
    const bool traced = trace_ != nullptr;
    while (!ready_.empty()) {
      running = ready_.pop();
      if (traced) {
        execute_node</*kTraced=*/true>(running);
      } else {
        execute_node</*kTraced=*/false>(running);
      }
    }
    // Collective results no node read (dropped, or delivered to nodes that
    // do not run) still complete before backward returns. A failure here is
    // no node's.
    running = kNoSlot;
    wait_pending(kNoSlot);
  } catch (...) {
    if (running != kNoSlot) {
      failed_node_ = plan_.slots[running].fn;
    }
    wait_pending_after_error();
    record_held_gradients();
    throw;
  }
  record_held_gradients();
  sync_leaf_streams_with_caller();
}

namespace {
std::mutex held_stats_mutex;
HeldGradientStats held_stats;
} // namespace

void BackwardCall::record_held_gradients() const {
  if (!plan_.stock_order_known) {
    return;
  }
  std::lock_guard<std::mutex> lock(held_stats_mutex);
  held_stats.ordered_calls += 1;
  held_stats.held_gradients += held_count_;
  held_stats.peak_held_bytes =
      std::max(held_stats.peak_held_bytes, peak_held_bytes_);
}

HeldGradientStats held_gradient_stats(bool reset) {
  std::lock_guard<std::mutex> lock(held_stats_mutex);
  const HeldGradientStats stats = held_stats;
  if (reset) {
    held_stats = HeldGradientStats{};
  }
  return stats;
}

void BackwardCall::sync_leaf_streams_with_caller() {
  // Stock GraphTask::exec_post_processing: the caller may read .grad and the
  // returned gradients on its own streams as soon as backward returns.
  for (const auto& leaf_stream : leaf_streams_) {
    for (const auto& caller_stream : caller_streams_) {
      if (caller_stream.device() != leaf_stream.device() ||
          caller_stream == leaf_stream) {
        continue;
      }
      c10::Event event{leaf_stream.device_type()};
      event.record(leaf_stream);
      caller_stream.wait(event);
    }
  }
}

variable_list run_backward(
    const edge_list& roots,
    variable_list root_grads,
    const edge_list& inputs,
    CallOptions options,
    std::vector<PriorityOverride> priority_overrides) {
  torch::autograd::validate_outputs(
      roots, root_grads, [](const std::string& msg) { return msg; });
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
  if (roots.size() != 1) {
    // Stock builds a GraphRoot node unless there is exactly one root, and it
    // takes a sequence number; forward ops recorded afterwards are numbered
    // as on stock.
    at::sequence_number::get_and_increment();
  }

  BackwardCall call(
      roots,
      std::move(root_grads),
      inputs,
      options,
      std::move(priority_overrides));
  run_in_host_task(call, options.keep_graph, /*filtered=*/!inputs.empty());
  return call.take_captured();
}

void run_in_host_task(BackwardCall& call, bool keep_graph, bool filtered) {
  auto driver = c10::make_intrusive<BackwardDriver>(call);
  // Plain backward(): no host outputs, so the host's exec_info stays empty;
  // a non-empty exec_info makes can_checkpoint() false and reentrant
  // checkpoint raises. grad()/inputs=: the driver is the host's one output,
  // making its exec_info non-empty so nodes prune unneeded gradients.
  edge_list host_outputs;
  if (filtered) {
    host_outputs.emplace_back(driver, 0);
  }
  // create_graph is applied inside the driver (grad mode on while nodes
  // run); telling the host would make it warn about a reference cycle
  // between a parameter and its gradient that is not there.
  torch::autograd::Engine::get_default_engine().execute(
      {Edge(driver, 0)},
      {driver_dummy_grad()},
      keep_graph,
      /*create_graph=*/false,
      /*accumulate_grad=*/true,
      host_outputs);
}

} // namespace torch_ext
