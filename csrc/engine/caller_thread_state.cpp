#include "engine/caller_thread_state.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define TORCH_EXT_HAS_MXCSR 1
#endif

// OpenMP's and MKL's per-thread counts, declared weak: libtorch_cpu.so
// exports MKL's where torch was built with it (x86 wheels), and its OpenMP
// runtime (the bundled libgomp) exports OpenMP's. A build without one leaves
// the symbol null, and that setting is skipped. MKL's C functions are the
// mixed-case names its header maps the lower-case ones to: the lower-case
// exports are its Fortran entries, which take their argument by pointer
// (called with an int, they crash). at::get_num_threads is not used to read
// the count: on a thread that never ran a parallel op it first sets the
// count from the last torch.set_num_threads, changing what it reads.
extern "C" {
__attribute__((weak)) int omp_get_max_threads(void);
__attribute__((weak)) void omp_set_num_threads(int);
__attribute__((weak)) int MKL_Get_Max_Threads(void);
__attribute__((weak)) int MKL_Set_Num_Threads_Local(int);
}

namespace torch_ext {
namespace {

#ifdef TORCH_EXT_HAS_MXCSR
// MXCSR's low six bits are sticky exception flags, state rather than a
// setting; the rest (denormals-are-zero, the exception masks, the rounding
// mode, flush-to-zero) are the controls.
constexpr uint32_t kMxcsrExceptionFlags = 0x3f;
#endif

} // namespace

ThreadNumerics ThreadNumerics::of_this_thread() {
  ThreadNumerics numerics;
  if (omp_get_max_threads != nullptr && omp_set_num_threads != nullptr) {
    numerics.openmp_threads = omp_get_max_threads();
  }
  if (MKL_Get_Max_Threads != nullptr && MKL_Set_Num_Threads_Local != nullptr) {
    numerics.mkl_threads = MKL_Get_Max_Threads();
  }
#ifdef TORCH_EXT_HAS_MXCSR
  numerics.mxcsr_controls = _mm_getcsr() & ~kMxcsrExceptionFlags;
#endif
  return numerics;
}

void ThreadNumerics::install() const {
  if (openmp_threads) {
    omp_set_num_threads(*openmp_threads);
  }
  if (mkl_threads) {
    MKL_Set_Num_Threads_Local(*mkl_threads);
  }
#ifdef TORCH_EXT_HAS_MXCSR
  if (mxcsr_controls) {
    _mm_setcsr((_mm_getcsr() & kMxcsrExceptionFlags) | *mxcsr_controls);
  }
#endif
}

CallerThreadStateGuard::CallerThreadStateGuard(const CallerThreadState& state)
    : previous_numerics_(ThreadNumerics::of_this_thread()),
      thread_local_state_(state.thread_local_state) {
  state.numerics.install();
}

CallerThreadStateGuard::~CallerThreadStateGuard() {
  previous_numerics_.install();
}

} // namespace torch_ext
