#pragma once

// Stock's delivery order, for bit-stable accumulation.
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

#include "graph_plan.h"

namespace torch_ext {

// Replays stock's scheduling of `plan` (every priority equal, no deferred
// wait) and fills plan.ordered_input_of_edge, stock_rank_of_edge and
// num_ordered_inputs. With `every_slot_runs`, the order is that of one full
// backward() over every node of the plan, whatever `needed` says (split
// backward's two passes together must sum as one full backward does).
void order_deliveries_as_stock(GraphPlan& plan, bool every_slot_runs);

} // namespace torch_ext
