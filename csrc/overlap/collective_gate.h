#pragma once

// The microbatch overlap's collective order rule (docs/design.md, "The
// collective order rule"; its rules and progress in
// engine/collective_progress.h, the backward in flight in window.h),
// enforced on every c10d collective: a kernel at the Autograd key of the
// c10d operators (the collective gate), a kernel at the functional
// collectives' BackendSelect key (they reach c10d past the first), and an
// observer of the forward thread's ops, which counts what the forward has
// issued. A forward collective waits here for its turn; a collective no plan
// holds, started while a backward runs, is refused before it starts; a
// forward collective that finds the backward beside it failed raises
// Host::forward_stopped_by_backward's error instead of starting.

#include <ATen/record_function.h>

namespace torch_ext {

// Registers the gate's kernels, once per process: at the Autograd key of
// every gated c10d operator, and at the BackendSelect key of every
// functional collective on a group (the ops of _c10d_functional and
// _c10d_functional_autograd that take a group_name).
void install_collective_gate();

// Adds, on this thread (the window's forward thread), the observer of every
// op it dispatches: a c10d collective reached with the Autograd key excluded
// (a functional collective's kernel calls c10d under autograd's fallback)
// skips the gate's kernel, so the forward thread waits there too. Removed
// with at::removeCallback, on this thread.
at::CallbackHandle observe_forward_thread_ops();

} // namespace torch_ext
