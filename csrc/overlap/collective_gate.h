#pragma once

// The microbatch overlap's collective order rule (window.h), enforced for
// every c10d collective through a kernel at the Autograd key of the c10d
// operators (the collective gate) and an observer of the forward thread's
// ops: on every process group, each rank issues all the collectives backward
// i's plan starts, then forward i+1's, then backward i+1's. The forward
// thread's collectives wait until backward i has started every collective
// its plan holds (engine/collective_progress.h; a lane node's counts as
// started once the gate has seen it issued), or until it has finished, when
// the microbatch saved the RNG state in forward (an activation checkpoint,
// whose recompute may issue collectives no plan holds). Asked to
// (forward_collectives="in_turns_with_backward_collectives") and where the
// backward's collectives wait for their turns (a call that runs them in
// sequence), the two threads' collectives take turns instead, the
// backward's first (B0 F0 B1 F1 ...), until one thread has none left, then
// the other's rest: the forward's k-th waits until backward i has started
// k, backward i's (k+1)-th until the forward has issued k (the observer
// counts them) or waits for backward i to end. Any other collective started
// while backward i runs (a hook's, a nested backward's, a lane node's
// second) is refused with an error on every rank alike, before it starts;
// a functional collective, which reaches c10d past the gate, by a second
// kernel at the functional collectives' BackendSelect key.
//
// A forward collective that finds the backward beside it failed is not
// started either: it raises HostCallbacks::forward_stopped_by_backward's
// error.

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
