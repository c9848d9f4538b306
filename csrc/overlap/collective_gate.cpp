#include "overlap/collective_gate.h"
#include "engine/collective_progress.h"
#include "engine/host_interface.h"
#include "overlap/window.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cstring>
#include <deque>
#include <exception>
#include <iterator>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace torch_ext {
namespace {

// The c10d operators that are not collectives of a group (point-to-point
// sends and receives pair by peer and tag, not by order; check_for_nan is
// local).
bool is_gated(std::string_view name) {
  return name != "c10d::send" && name != "c10d::recv_" &&
      name != "c10d::recv_any_source_" && name != "c10d::check_for_nan";
}

// Whether `fn` is a gated c10d collective dispatched on the forward thread
// of an open window.
bool is_forward_collective(const at::RecordFunction& fn) {
  const char* name = fn.name();
  if (std::strncmp(name, "c10d::", 6) != 0 || !is_gated(name)) {
    return false;
  }
  const Window& w = window();
  return w.open.load(std::memory_order_acquire) &&
      std::this_thread::get_id() == w.forward_thread;
}

// RecordFunction's start callback on the forward thread, for every op it
// dispatches (observe_forward_thread_ops). It cannot raise: Ctrl-C is left
// for the host to raise once the op returns.
std::unique_ptr<at::ObserverContext> on_forward_op(
    const at::RecordFunction& fn) {
  if (!is_forward_collective(fn)) {
    return nullptr;
  }
  Window& w = window();
  try {
    std::unique_lock<std::mutex> lock(w.mutex);
    forward_waits_its_turn(lock);
  } catch (...) {
    // The host's interrupt handler raised (KeyboardInterrupt): the
    // collective goes on.
    host().raise_interrupt_later(std::current_exception());
  }
  return nullptr;
}

// Its end callback: the collective has been issued (a c10d op returns once
// its work is queued on the group), which lets the backward's next one go
// (HandedBackward::backward_may_start). Counted here, where the gate's
// collectives and the functional ones both pass.
void on_forward_op_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (!is_forward_collective(fn)) {
    return;
  }
  Window& w = window();
  std::lock_guard<std::mutex> lock(w.mutex);
  if (w.current != nullptr && !w.current->finished) {
    ++w.current->forward_issued;
    w.changed.notify_all();
  }
}

// On a backward-side thread (the backward thread, its lanes): refuses the
// collective `name` unless the backward in flight planned it, before it is
// issued. The caller holds the window's mutex.
void refuse_unless_planned(
    const std::string& name,
    const HandedBackward& backward) {
  const IssuingLaneNode* lane_node = issuing_lane_node();
  TORCH_CHECK(
      lane_node == nullptr || lane_node->issued == 0,
      "torch_ext: ",
      name,
      " was not started: it is the second collective of a backward node "
      "declared with run_in_lane, whose backward must run one collective, in "
      "the backward of microbatch ",
      backward.microbatch,
      ", which runs beside the next microbatch's forward. The forward's "
      "collectives are issued right behind a lane node's first one, so a "
      "second could be ordered differently on each rank; it was refused on "
      "every rank. Declare only Functions whose backward runs one collective, "
      "or run that backward without the overlap.");
  if (backward.finished ||
      backward.rule == ForwardCollectives::kAfterBackward ||
      starting_planned_collective()) {
    return;
  }
  TORCH_CHECK(
      false,
      "torch_ext: ",
      name,
      " was started during the backward of microbatch ",
      backward.microbatch,
      ", which runs beside the next microbatch's forward, by something the "
      "engine did not plan (a hook, or a backward nested in a node): it could "
      "race the forward's collectives on another rank, so it was refused on "
      "every rank. Run that backward without the overlap (DDP: only the last "
      "microbatch syncs, so run the others under no_sync()), or make the "
      "forward wait for the whole backward: "
      "overlap_microbatches(forward_collectives='after_backward')");
}

// Whether a collective this backward-side thread may start goes to its
// group's twin (under the window's mutex).
bool goes_to_twin(const HandedBackward& backward) {
  return backward.rule == ForwardCollectives::kBesideBackwardCollectives &&
      !backward.finished;
}

// The registered name of the twin of the group registered as `group_name`.
std::string twin_name_of(const std::string& group_name) {
  Window& w = window();
  {
    std::lock_guard<std::mutex> lock(w.mutex);
    auto known = w.twin_names.find(group_name);
    if (known != w.twin_names.end()) {
      return known->second;
    }
  }
  // Asked without the window's mutex: the host takes the GIL, which the
  // forward thread may hold while it waits for the mutex.
  std::string twin = host().twin_group_name(group_name);
  std::lock_guard<std::mutex> lock(w.mutex);
  return w.twin_names.emplace(group_name, std::move(twin)).first->second;
}

// Moves the c10d collective on `stack` to its group's twin: its
// ProcessGroup argument becomes the twin.
void move_to_twin(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto group_type = arguments[i].type()->cast<c10::ClassType>();
    if (group_type == nullptr || !group_type->name().has_value() ||
        group_type->name()->qualifiedName() !=
            "__torch__.torch.classes.c10d.ProcessGroup") {
      continue;
    }
    c10::IValue& group = (*stack)[stack->size() - arguments.size() + i];
    group = c10::IValue(
        c10d::resolve_process_group(twin_name_of(
            group.toCustomClass<c10d::ProcessGroup>()->getGroupName())));
    return;
  }
  TORCH_CHECK(
      false,
      "torch_ext: ",
      op.schema().name(),
      " takes no process group, so it cannot move to a twin group");
}

// Returns whether the collective goes to its group's twin.
bool before_collective(const c10::OperatorHandle& op) {
  Window& w = window();
  std::unique_lock<std::mutex> lock(w.mutex);
  if (w.current == nullptr) {
    return false;
  }
  if (std::this_thread::get_id() == w.forward_thread) {
    const std::shared_ptr<HandedBackward> backward =
        forward_waits_its_turn(lock);
    if (!backward->error.empty()) {
      std::rethrow_exception(
          host().forward_stopped_by_backward(
              c10::str(
                  "torch_ext: ",
                  op.schema().name(),
                  " was not started: the backward of microbatch ",
                  backward->microbatch,
                  ", running beside this forward, failed (",
                  backward->error,
                  ")")));
    }
    return false;
  }
  refuse_unless_planned(op.schema().name(), *w.current);
  return goes_to_twin(*w.current);
}

void collective_gate(
    const c10::OperatorHandle& op,
    c10::DispatchKeySet keys,
    torch::jit::Stack* stack) {
  const bool open = window().open.load(std::memory_order_acquire);
  if (open && before_collective(op)) {
    move_to_twin(op, stack);
  }
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
  IssuingLaneNode* lane_node = issuing_lane_node();
  if (open && lane_node != nullptr && ++lane_node->issued == 1) {
    // Issued (queued on its group, in flight): the forward's next collective
    // is ordered behind it on every rank from here.
    lane_node->progress->started_one();
  }
}

// The namespaces of PyTorch's functional collectives
// (torch.distributed._functional_collectives): the ops, and the same
// collectives with an autograd formula of their own, whose kernels call the
// first namespace's (both gated, so that a refusal names the op called). The
// legacy namespace, c10d_functional (a group by tag and ranks), needs no
// kernel: its kernels call _c10d_functional's ops too, which are refused
// under their own names.
constexpr std::string_view kFunctionalNamespaces[] = {
    "_c10d_functional",
    "_c10d_functional_autograd"};

// Which of kFunctionalNamespaces `name` (an op's, "namespace::op") is in,
// if any.
std::optional<size_t> functional_namespace(std::string_view name) {
  const size_t end = name.find("::");
  for (size_t i = 0; i < std::size(kFunctionalNamespaces); ++i) {
    if (name.substr(0, end) == kFunctionalNamespaces[i]) {
      return i;
    }
  }
  return std::nullopt;
}

// Whether `op` is a collective on a group: it takes a group_name (a
// functional collective does; wait_tensor does not).
bool takes_a_group(const c10::OperatorHandle& op) {
  if (!op.hasSchema()) {
    return false;
  }
  const auto& arguments = op.schema().arguments();
  return std::any_of(
      arguments.begin(),
      arguments.end(),
      [](const c10::Argument& argument) {
        return argument.name() == "group_name";
      });
}

// The functional collectives' gate. Their kernels reach c10d with the
// Autograd key excluded (the op's own autograd kernel redispatches below
// autograd), past collective_gate, where only the forward thread's observer
// sees them, and an observer cannot raise. BackendSelect is in every call's
// key set (LocalDispatchKeySet's default included set), below autograd, so a
// call with autograd excluded or in inference mode reaches this kernel too;
// and the functional ops register none there, so it takes no one's place. On
// the forward thread the observer makes the collective wait, as for any
// other; on any other thread, one the backward in flight did not plan is
// refused here, before it is issued.
void functional_collective_gate(
    const c10::OperatorHandle& op,
    c10::DispatchKeySet keys,
    torch::jit::Stack* stack) {
  Window& w = window();
  bool to_twin = false;
  if (w.open.load(std::memory_order_acquire) &&
      std::this_thread::get_id() != w.forward_thread) {
    std::lock_guard<std::mutex> lock(w.mutex);
    if (w.current != nullptr) {
      refuse_unless_planned(op.schema().name(), *w.current);
      to_twin = goes_to_twin(*w.current);
    }
  }
  if (to_twin) {
    // Its group by registered name: the twin's (takes_a_group).
    const auto& arguments = op.schema().arguments();
    for (size_t i = 0; i < arguments.size(); ++i) {
      if (arguments[i].name() == "group_name") {
        c10::IValue& name = (*stack)[stack->size() - arguments.size() + i];
        name = c10::IValue(twin_name_of(name.toStringRef()));
      }
    }
  }
  op.redispatchBoxed(
      keys &
          c10::DispatchKeySet(
              c10::DispatchKeySet::FULL_AFTER,
              c10::DispatchKey::BackendSelect),
      stack);
}

// Kept for the life of the process, as the registrations they make: the
// names, because impl() takes a name as a C string.
std::deque<std::string>& registered_names() {
  static auto* names = new std::deque<std::string>();
  return *names;
}

} // namespace

void install_collective_gate() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Kept for the life of the process: the registrations last as long.
    auto* c10d = new torch::Library(
        torch::Library::IMPL,
        "c10d",
        c10::DispatchKey::Autograd,
        __FILE__,
        __LINE__);
    std::vector<torch::Library*> functional;
    for (std::string_view space : kFunctionalNamespaces) {
      functional.push_back(new torch::Library(
          torch::Library::IMPL,
          std::string(space),
          c10::DispatchKey::BackendSelect,
          __FILE__,
          __LINE__));
    }
    c10::Dispatcher& dispatcher = c10::Dispatcher::singleton();
    for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
      if (name.name.rfind("c10d::", 0) == 0 && is_gated(name.name)) {
        registered_names().push_back(name.name.substr(6));
        c10d->impl(
            registered_names().back().c_str(),
            torch::CppFunction::makeFromBoxedFunction<&collective_gate>());
        continue;
      }
      const std::optional<size_t> space = functional_namespace(name.name);
      if (!space.has_value()) {
        continue;
      }
      const std::optional<c10::OperatorHandle> op = dispatcher.findOp(name);
      if (!op.has_value() || !takes_a_group(*op)) {
        continue;
      }
      // impl() takes the name without its namespace, the library's.
      std::string op_name = name.name.substr(name.name.find("::") + 2);
      if (!name.overload_name.empty()) {
        op_name += "." + name.overload_name;
      }
      registered_names().push_back(std::move(op_name));
      functional[*space]->impl(
          registered_names().back().c_str(),
          torch::CppFunction::makeFromBoxedFunction<
              &functional_collective_gate>());
    }
  });
}

at::CallbackHandle observe_forward_thread_ops() {
  return at::addThreadLocalCallback(
      at::RecordFunctionCallback(on_forward_op, on_forward_op_end)
          .scopes({at::RecordScope::FUNCTION}));
}

} // namespace torch_ext
