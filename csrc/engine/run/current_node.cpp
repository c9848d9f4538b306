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
// anything, and uses the slot only after checking, once per process, that
// get_current_node() reports a node placed in it (and only it). The check
// needs no backward: it holds a probe node in the calling thread's slot for
// an instant and puts back what was there, so asking whether the feature is
// on (torch_ext.debug.is_current_node_supported) runs nothing and changes
// nothing. Anything unexpected, another architecture, or
// TORCH_EXT_CURRENT_NODE=off (set_current_node_forced_off) turns the feature
// off: the driver stays the current node (the portable path). Nothing else in
// the engine needs the slot: priorities, deferred collective waits and split
// backward work the same on either path.

#include "engine/run/current_node.h"

#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string_view>
#include <utility>

#if defined(__x86_64__)
#include <dlfcn.h>
#endif

namespace torch_ext {
namespace {

using CurrentNodeSlot = c10::intrusive_ptr<Node>;
using SlotAccessor = CurrentNodeSlot* (*)();

// Settled once, by the first question (settle below); the mutex keeps two
// first questions from probing at once.
std::atomic<CurrentNodeState> state{CurrentNodeState::kUnknown};
std::atomic<SlotAccessor> accessor{nullptr};
std::mutex settle_mutex;

// TORCH_EXT_CURRENT_NODE=off, parsed once, by torch_ext/_loader.py, which
// sets this before the first question (set_current_node_forced_off).
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

// A node no graph holds, placed in the slot for the check only. Made with
// an explicit sequence number, so that making it does not advance the
// thread's (the next node forward makes keeps the number it would have had).
struct SlotProbe final : Node {
  SlotProbe() : Node(/*sequence_nr=*/UINT64_MAX, /*next_edges=*/{}) {}
  torch::autograd::variable_list apply(
      torch::autograd::variable_list&& /*inputs*/) override {
    return {};
  }
};

// Whether the slot `found` returns is the one get_current_node() reads: it
// must hold what get_current_node() reports now, and report a probe held in
// it instead. What the slot held is put back before returning.
bool is_the_current_node_slot(SlotAccessor found) {
  CurrentNodeSlot* slot = found();
  if (slot == nullptr ||
      slot->get() != torch::autograd::get_current_node().get()) {
    return false;
  }
  CurrentNodeSlot held = std::exchange(*slot, c10::make_intrusive<SlotProbe>());
  Node* const probe = slot->get();
  const bool reads_it = torch::autograd::get_current_node().get() == probe;
  *slot = std::move(held);
  return reads_it;
}

CurrentNodeState settle() {
  std::lock_guard<std::mutex> lock(settle_mutex);
  CurrentNodeState known = state.load(std::memory_order_acquire);
  if (known != CurrentNodeState::kUnknown) {
    return known;
  }
  SlotAccessor found =
      forced_off.load(std::memory_order_relaxed) ? nullptr : find_accessor();
  const bool valid = found != nullptr && is_the_current_node_slot(found);
  accessor.store(valid ? found : nullptr, std::memory_order_release);
  known = valid ? CurrentNodeState::kAvailable : CurrentNodeState::kUnavailable;
  state.store(known, std::memory_order_release);
  return known;
}

} // namespace

CurrentNodeSlot* current_node_slot() {
  if (current_node_state() != CurrentNodeState::kAvailable) {
    return nullptr;
  }
  return accessor.load(std::memory_order_acquire)();
}

void set_current_node_forced_off(bool off) {
  forced_off.store(off, std::memory_order_relaxed);
}

CurrentNodeState current_node_state() {
  const CurrentNodeState known = state.load(std::memory_order_acquire);
  return known != CurrentNodeState::kUnknown ? known : settle();
}

} // namespace torch_ext
