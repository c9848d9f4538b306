// The "currently evaluating node" that torch._C._current_autograd_node() and
// torch::autograd::get_current_node() report while a node runs.
//
// Stock sets it with NodeGuard around every node; NodeGuard is not exported
// from libtorch_cpu.so, so inside torch_ext's driver the current node would be
// the driver. That breaks autograd's graph logging, hooks registered on the
// current node from a saved-tensor unpack hook, and anomaly mode's parent
// traceback for double backward. The exported get_current_node() reads the
// slot through a c10::ThreadLocal accessor with one indirect call
// (`call *disp32(%rip)`); this file locates that accessor from the call, and
// uses it only after checking that it reports the node the host task set.
// Anything unexpected turns the feature off, leaving the driver as the
// current node (the documented fallback).

#include "engine_api.h"

#include <torch/csrc/autograd/function.h>

#include <dlfcn.h>

#include <atomic>
#include <cstring>

namespace torch_ext {
namespace {

using CurrentNodeSlot = c10::intrusive_ptr<Node>;
using SlotAccessor = CurrentNodeSlot* (*)();

enum class State { kUnknown, kAvailable, kUnavailable };
std::atomic<State> state{State::kUnknown};
std::atomic<SlotAccessor> accessor{nullptr};

bool same_library(const void* a, const void* b) {
  Dl_info info_a{};
  Dl_info info_b{};
  return dladdr(a, &info_a) != 0 && dladdr(b, &info_b) != 0 &&
      info_a.dli_fbase == info_b.dli_fbase;
}

// The accessor get_current_node() calls, read from its first instructions.
SlotAccessor find_accessor() {
  const auto* code = reinterpret_cast<const unsigned char*>(
      &torch::autograd::get_current_node);
  // The indirect call comes after a short prologue; look at the first bytes.
  constexpr int kSearchBytes = 24;
  for (int i = 0; i + 6 <= kSearchBytes; ++i) {
    if (code[i] != 0xFF || code[i + 1] != 0x15) {
      continue;
    }
    int32_t displacement = 0;
    std::memcpy(&displacement, code + i + 2, sizeof(displacement));
    const auto* accessor_location = code + i + 6 + displacement;
    if (!same_library(code, accessor_location)) {
      return nullptr;
    }
    SlotAccessor found = nullptr;
    std::memcpy(&found, accessor_location, sizeof(found));
    if (found == nullptr ||
        !same_library(code, reinterpret_cast<const void*>(found))) {
      return nullptr;
    }
    return found;
  }
  return nullptr;
}

} // namespace

CurrentNodeSlot* current_node_slot(Node* expected_current) {
  State known = state.load(std::memory_order_acquire);
  if (known == State::kUnknown) {
    // Validated on the first call, inside the host task: the slot must hold
    // the driver, which stock's NodeGuard made current.
    SlotAccessor found = find_accessor();
    const bool valid = found != nullptr && found()->get() == expected_current &&
        torch::autograd::get_current_node().get() == expected_current;
    accessor.store(found, std::memory_order_release);
    known = valid ? State::kAvailable : State::kUnavailable;
    state.store(known, std::memory_order_release);
  }
  if (known != State::kAvailable) {
    return nullptr;
  }
  return accessor.load(std::memory_order_acquire)();
}

} // namespace torch_ext
