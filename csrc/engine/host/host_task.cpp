// Host task: runs a torch_ext backward inside one stock graph task.
//
// Other parts of PyTorch read the *current graph task* while backward runs
// (Engine::queue_callback for DDP/FSDP, _current_graph_task_id for
// checkpoint and multi-grad hooks, task_should_compute_output for pruning).
// An extension cannot create or install a GraphTask, so torch_ext asks the
// stock engine to run one: its only root is BackwardDriver, whose apply()
// runs torch_ext's discovery, scheduler and executor over the real graph on
// the same thread, while that task is current. See docs/design.md, "The
// host-task pattern".

#include "engine/host/host_task.h"
#include "engine/host_interface.h"

#include <ATen/EmptyTensor.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/headeronly/version.h>

#include <limits>

namespace torch_ext {
namespace {

using torch::autograd::AnomalyMode;
using torch::autograd::GraphTask;

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
  explicit BackwardDriver(HostedRun& call)
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
    HostedRun* call = std::exchange(call_, nullptr);
    try {
      call->run(this);
    } catch (...) {
      Node* failed = call->failed_node();
      if (AnomalyMode::is_enabled() && failed != nullptr) {
        failed_node_name_ = failed->name();
        host().copy_anomaly_metadata(*failed, *this);
      }
      throw;
    }
    return {};
  }

 private:
  HostedRun* call_;
  std::string failed_node_name_;
};

} // namespace

void publish_plan_to_host_task(const GraphPlan& plan) {
  // GraphTask's fields are not API: exec_info_ and nodes_in_graph_ are
  // written here as torch 2.13's engine.cpp and graph_task.h use them. Check
  // both (and task_should_compute_output, _will_engine_execute_node) before
  // moving to another version.
  static_assert(
      TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 13,
      "publish_plan_to_host_task writes GraphTask internals as torch 2.13 "
      "lays them out");
  // Every node with an incoming edge, as stock's compute_dependencies
  // records it; a single root has none. This is safe because every node
  // runs on this thread. Reserving first avoids rehashing a node-based set
  // ~log2(n) times while it grows.
  auto* nodes_in_graph = const_cast<std::unordered_set<Node*>*>(
      torch::autograd::get_current_graph_task_nodes_in_graph());
  TORCH_INTERNAL_ASSERT(
      nodes_in_graph != nullptr,
      "torch_ext's engine ran outside its host graph task");
  const int32_t single_root = plan.single_root ? plan.root_targets[0] : kNoSlot;
  nodes_in_graph->reserve(nodes_in_graph->size() + plan.slots.size());
  for (size_t i = 0; i < plan.slots.size(); ++i) {
    if (static_cast<int32_t>(i) != single_root) {
      nodes_in_graph->insert(plan.slots[i].fn);
    }
  }
  if (!plan.filtered) {
    return;
  }
  // The host task was given one output (the driver) so that its exec_info is
  // not empty; generated nodes consult it through task_should_compute_output
  // to skip gradients nobody asked for (MmBackward computing dW in grad(x)).
  // Every node that runs or captures must be in it, or its gradient is
  // silently dropped.
  auto* exec_info = const_cast<std::unordered_map<Node*, GraphTask::ExecInfo>*>(
      torch::autograd::get_current_graph_task_exec_info());
  TORCH_INTERNAL_ASSERT(exec_info != nullptr && !exec_info->empty());
  for (size_t i = 0; i < plan.slots.size(); ++i) {
    const NodeSlot& slot = plan.slots[i];
    if (!slot.should_execute() || slot.hidden_from_host) {
      continue;
    }
    auto& info = (*exec_info)[slot.fn];
    info.needed_ = slot.needed;
    if (slot.first_capture != kNoSlot) {
      info.captures_ =
          std::make_unique<std::vector<GraphTask::ExecInfo::Capture>>();
      for (size_t c = slot.first_capture; c < plan.captures.size() &&
           plan.captures[c].slot == static_cast<int32_t>(i);
           ++c) {
        info.captures_->emplace_back(
            plan.captures[c].input_nr,
            plan.captures[c].output_index);
      }
    }
  }
}

void run_in_host_task(HostedRun& call, bool keep_graph, bool filtered) {
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
