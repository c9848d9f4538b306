// The "currently evaluating node" that torch._C._current_autograd_node() and
// torch::autograd::get_current_node() report while a node runs.
//
// Stock sets it with NodeGuard around every node; NodeGuard is not exported
// from libtorch_cpu.so, so inside torch_ext's driver the current node would be
// the driver. That breaks autograd's graph logging, hooks registered on the
// current node from a saved-tensor unpack hook, and anomaly mode's parent
// traceback for double backward. On x86-64 the exported get_current_node()
// reads the slot through a c10::ThreadLocal accessor with one indirect call
// (`call *disp32(%rip)`); this file locates that accessor from the call,
// checks that both functions have the shapes it expects before calling
// anything, and uses the slot only after checking that it reports the node
// the host task set. Anything unexpected, another architecture, or
// TORCH_EXT_CURRENT_NODE=off (set_current_node_forced_off) turns the feature
// off: the driver stays the current node (the portable path). Nothing else in
// the engine needs the slot: priorities, deferred collective waits and split
// backward work the same on either path.

#include "engine/run/current_node.h"

#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <cstring>
#include <string_view>

#if defined(__x86_64__)
#include <dlfcn.h>
#endif

namespace torch_ext {
namespace {

using CurrentNodeSlot = c10::intrusive_ptr<Node>;
using SlotAccessor = CurrentNodeSlot* (*)();

std::atomic<CurrentNodeState> state{CurrentNodeState::kUnknown};
std::atomic<SlotAccessor> accessor{nullptr};

// TORCH_EXT_CURRENT_NODE=off, parsed once, by torch_ext/_loader.py, which
// sets this before any backward (set_current_node_forced_off).
std::atomic<bool> forced_off{false};

#if defined(__x86_64__)

bool same_library(const void* a, const void* b) {
  Dl_info info_a{};
  Dl_info info_b{};
  return dladdr(a, &info_a) != 0 && dladdr(b, &info_b) != 0 &&
      info_a.dli_fbase == info_b.dli_fbase;
}

// Whether `code` begins like a thread_local accessor: a dynamic-TLS lookup
// (`lea disp32(%rip),%rdi; call __tls_get_addr`, after at most a short
// prologue) or a static one (`mov %fs:0,%rax`).
bool looks_like_tls_accessor(const unsigned char* code) {
  constexpr int kPrologueBytes = 8;
  for (int i = 0; i <= kPrologueBytes; ++i) {
    const bool dynamic = code[i] == 0x48 && code[i + 1] == 0x8d &&
        code[i + 2] == 0x3d && code[i + 7] == 0xe8;
    const bool static_tls = code[i] == 0x64 && code[i + 1] == 0x48 &&
        code[i + 2] == 0x8b && code[i + 3] == 0x04 && code[i + 4] == 0x25;
    if (dynamic || static_tls) {
      return true;
    }
  }
  return false;
}

// The accessor get_current_node() calls, read from its first instructions
// and checked before it is ever called: get_current_node() must load the
// node pointer from the slot the call returns (`mov (%rax),%reg`), and the
// accessor, in the same library, must look like a thread_local accessor.
SlotAccessor find_accessor() {
  const auto* code = reinterpret_cast<const unsigned char*>(
      &torch::autograd::get_current_node);
  // The indirect call comes after a short prologue; look at the first bytes.
  constexpr int kSearchBytes = 24;
  for (int i = 0; i + 9 <= kSearchBytes + 3; ++i) {
    if (code[i] != 0xFF || code[i + 1] != 0x15) {
      continue;
    }
    // mov (%rax),%r64: REX.W, 8b, ModRM with mod 00 and base rax.
    const unsigned char* after = code + i + 6;
    if (after[0] != 0x48 || after[1] != 0x8b || (after[2] & 0xC7) != 0x00) {
      return nullptr;
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
        !same_library(code, reinterpret_cast<const void*>(found)) ||
        !looks_like_tls_accessor(
            reinterpret_cast<const unsigned char*>(found))) {
      return nullptr;
    }
    return found;
  }
  return nullptr;
}

#else

SlotAccessor find_accessor() {
  // The decoder reads x86-64 machine code only.
  return nullptr;
}

#endif

} // namespace

CurrentNodeSlot* current_node_slot(Node* expected_current) {
  CurrentNodeState known = state.load(std::memory_order_acquire);
  if (known == CurrentNodeState::kUnknown) {
    // Validated on the first call, inside the host task: the slot must hold
    // the driver, which stock's NodeGuard made current.
    SlotAccessor found =
        forced_off.load(std::memory_order_relaxed) ? nullptr : find_accessor();
    const bool valid = found != nullptr && found()->get() == expected_current &&
        torch::autograd::get_current_node().get() == expected_current;
    accessor.store(valid ? found : nullptr, std::memory_order_release);
    known =
        valid ? CurrentNodeState::kAvailable : CurrentNodeState::kUnavailable;
    state.store(known, std::memory_order_release);
  }
  if (known != CurrentNodeState::kAvailable) {
    return nullptr;
  }
  return accessor.load(std::memory_order_acquire)();
}

void set_current_node_forced_off(bool off) {
  forced_off.store(off, std::memory_order_relaxed);
}

CurrentNodeState current_node_state() {
  return state.load(std::memory_order_acquire);
}

} // namespace torch_ext
