#pragma once

// What a thread torch_ext starts inherits from the thread it works for
// (docs/design.md, "What a torch_ext thread inherits from its caller").
//
// The microbatch overlap's backward thread and the collective lanes run ATen
// ops that stock runs on the caller's own thread. They must compute as that
// thread would, or the bits change. at::ThreadLocalState carries most of
// what PyTorch keeps per thread (grad and inference mode, autocast, dispatch
// keys, saved-tensor hooks, Python modes, the profiler), but not the
// numerics that live below ATen, each per thread and each starting at its
// own default on a new thread:
// - OpenMP's thread count (the nthreads-var ICV) and MKL's
//   (mkl_set_num_threads_local), both set by torch.set_num_threads: a gemm
//   that splits its reduction over another number of threads rounds
//   differently (seen on an Intel Xeon, not on an AMD EPYC);
// - the SSE control register MXCSR (flush-to-zero and denormals-are-zero,
//   set by torch.set_flush_denormal; the rounding mode), which a new thread
//   copies from its creator when it is created, not later.
// Stock's engine calls at::init_num_threads() in each thread it starts,
// which sets both counts from the last torch.set_num_threads. Copying the
// caller's own values instead, at each hand-over, also follows a call of
// torch.set_num_threads or torch.set_flush_denormal made after the thread
// started, and sets no process-wide value.

#include <ATen/ThreadLocalState.h>

#include <cstdint>
#include <optional>

namespace torch_ext {

// The per-thread numeric settings above, of one thread. A setting this build
// has no way to read (no MKL in this torch, a CPU without MXCSR) is absent
// and left alone.
struct ThreadNumerics {
  std::optional<int> openmp_threads;
  std::optional<int> mkl_threads;
  std::optional<uint32_t> mxcsr_controls;

  // This thread's settings.
  static ThreadNumerics of_this_thread();
  // Gives this thread the settings `this` holds.
  void install() const;
};

// Everything a thread of torch_ext takes from its caller: PyTorch's
// thread-local state and the numerics it does not carry. Captured on the
// caller's thread, installed on ours for as long as a guard lives.
struct CallerThreadState {
  at::ThreadLocalState thread_local_state;
  ThreadNumerics numerics = ThreadNumerics::of_this_thread();
};

// Installs a CallerThreadState on this thread, and restores what the thread
// had when it ends.
class CallerThreadStateGuard {
 public:
  explicit CallerThreadStateGuard(const CallerThreadState& state);
  ~CallerThreadStateGuard();
  CallerThreadStateGuard(const CallerThreadStateGuard&) = delete;
  CallerThreadStateGuard& operator=(const CallerThreadStateGuard&) = delete;

 private:
  ThreadNumerics previous_numerics_;
  at::ThreadLocalStateGuard thread_local_state_;
};

} // namespace torch_ext
