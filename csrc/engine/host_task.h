#pragma once

// The host task (host_task.cpp): the stock graph task each torch_ext call
// runs inside, and the one place torch_ext writes its internals.

#include "engine/graph_plan.h"

namespace torch_ext {

class BackwardCall;

// Runs `call` inside one stock graph task (host_task.cpp). `filtered`: only a
// subset of nodes runs (the host's exec_info must be non-empty).
void run_in_host_task(BackwardCall& call, bool keep_graph, bool filtered);

// Registers `plan` with the current (host) graph task, so the parts of
// PyTorch that read it (task_should_compute_output,
// _will_engine_execute_node, register_multi_grad_hook) see the real graph:
// every node reached goes into its nodes_in_graph, and, for a filtered plan,
// every node that runs or captures into its exec_info. The one place
// torch_ext writes a GraphTask's internals (host_task.cpp).
void publish_plan_to_host_task(const GraphPlan& plan);

} // namespace torch_ext
