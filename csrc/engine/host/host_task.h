#pragma once

// The host task (host_task.cpp): the stock graph task each torch_ext call
// runs inside, and the one place torch_ext writes its internals. The lowest
// layer of a call: it runs whatever it is given (HostedRun) and knows nothing
// of the run loop above it, which publishes its plan here.

#include "engine/plan/graph_plan.h"

namespace torch_ext {

// What runs inside the host task: one call's run loop (BackwardCall).
class HostedRun {
 public:
  // Runs the call on this thread, from inside the host task's node
  // `host_node`, while the host graph task is current.
  virtual void run(Node* host_node) = 0;
  // The node whose error is propagating out of run(), if any; the host task
  // reports it in anomaly mode in place of its own node.
  virtual Node* failed_node() const = 0;

 protected:
  ~HostedRun() = default;
};

// Runs `call` inside one stock graph task (host_task.cpp). `filtered`: only a
// subset of nodes runs (the host's exec_info must be non-empty).
void run_in_host_task(HostedRun& call, bool keep_graph, bool filtered);

// Registers `plan` with the current (host) graph task, so the parts of
// PyTorch that read it (task_should_compute_output,
// _will_engine_execute_node, register_multi_grad_hook) see the real graph:
// every node reached goes into its nodes_in_graph, and, for a filtered plan,
// every node that runs or captures into its exec_info. The one place
// torch_ext writes a GraphTask's internals (host_task.cpp).
void publish_plan_to_host_task(const GraphPlan& plan);

} // namespace torch_ext
