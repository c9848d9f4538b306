#pragma once

// What one backward call is asked for beside its graph and stock's flags
// (call_options.h): its own priorities, and whether it is the backward that
// torch_ext.overlap_microbatches handed to its backward thread. Built once,
// where the call is asked for (the bindings, from the Python entry's
// arguments; RequestBuilder::finish), passed down with the call and read by
// whoever needs it, as stock's GraphTask owns a call's state: the call's
// priorities by its plan, the overlap by its report (run/progress_report.h)
// and by the collective order check. No part of it travels through a
// thread-local: a backward nested in one of the call's nodes is asked for
// afresh, and has a context of its own.

#include "engine/collective_progress.h"
#include "engine/plan/priority_table.h"

#include <memory>
#include <vector>

namespace torch_ext {

struct CallContext {
  // Priorities for this call only, over the priority table.
  std::vector<PriorityOverride> priority_overrides;
  // When the call runs beside the next microbatch's forward: the window's
  // record of the backward handed over (overlap/window.h), to which the call
  // reports its collectives, and which says its microbatch and rule. Null
  // otherwise.
  std::shared_ptr<CollectiveProgress> beside_forward;
};

} // namespace torch_ext
