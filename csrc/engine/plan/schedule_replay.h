#pragma once

// Replays of the schedule from the plan alone, nothing run: stock's delivery
// order, for bit-stable accumulation, and torch_ext's own run order, for
// torch_ext.debug.execution_order() and _current_graph_task_execution_order().
//
// An input buffer sums the gradients reaching it in arrival order, and
// floating-point addition is not associative: with three or more producers,
// running them in another order (priorities, a deferred collective wait,
// split backward) changes the last bits of the sum. Stock's CPU schedule is a
// deterministic heap over sequence_nr and readiness, so the order in which it
// would deliver into each input can be computed from the plan alone. The
// executor then adds an early arrival only once its predecessors in that
// order are in, holding it until then (BackwardCall::deliver). A call that
// cannot deviate from stock's order computes nothing and holds nothing.

#include "engine/plan/graph_plan.h"

namespace torch_ext {

// Replays stock's scheduling of `plan` (every priority equal, no deferred
// wait) and fills plan.ordered_input_of_edge, stock_rank_of_edge and
// num_ordered_inputs. With `every_slot_runs`, the order is that of one full
// backward() over every node of the plan, whatever `needed` says (split
// backward's two passes together must sum as one full backward does).
void order_deliveries_as_stock(GraphPlan& plan, bool every_slot_runs);

// Whether a collective node `fn` of `plan` that can defer its wait
// (NodeSlot::defers_wait) hands its result over in flight when it runs,
// rather than waiting inside its own node: the one rule the executor
// (defer_wait_to_first_use, run/running_node.h) and the replay below both
// follow. It waits inside when its post hooks would read the result, when
// anomaly mode checks outputs for NaN (a result in flight cannot be read), and
// when stock's delivery order is unknown (waiting later reorders the nodes
// after it, whose sums could change).
bool hands_result_in_flight(const GraphPlan& plan, const Node& fn);

// The nodes torch_ext runs for `plan`, in the order it runs them: each
// slot's effective priority, and the late key of a node fed by a result in
// flight (a slot that `defers_wait` delivers to). Replayed from the plan
// alone, nothing run.
std::vector<Node*> planned_run_order(const GraphPlan& plan);
// The same order, as the plan's slots: what fixes the order of a call's
// collectives on every rank (run/collective_turns.h).
std::vector<int32_t> planned_run_slots(const GraphPlan& plan);

} // namespace torch_ext
