#pragma once

// One torch_ext backward()/grad() call: the plan, the ready queue and the
// results. It lives for the duration of the call only, so nested calls (a
// backward inside a node, reentrant checkpoint) and calls from other threads
// never share state. Included only by the run layer's own files: what starts
// a call uses run_call.h, the bindings running_node.h. Its features are
// objects it holds by value, each beside it, with a default that costs an
// ordinary call a test of a bool or a null pointer: bit-stable delivery
// (ordered_delivery.h), the report to the next microbatch's forward
// (progress_report.h), the collective order check's verdicts
// (order_verdicts.h), the collective sequence's turns (collective_turns.h)
// and the lanes (call_lanes.h), the collective results in flight
// (deferred_waits.h), what split backward's passes give it
// (split_pass_context.h) and its trace (trace.h's CallTracing). Those that
// must clean up when the call fails register in one list (call_feature.h).

#include "engine/call_context.h"
#include "engine/call_options.h"
#include "engine/host/host_task.h"
#include "engine/host_interface.h"
#include "engine/plan/graph_plan.h"
#include "engine/plan/scheduler.h"
#include "engine/run/call_feature.h"
#include "engine/run/call_lanes.h"
#include "engine/run/collective_turns.h"
#include "engine/run/deferred_waits.h"
#include "engine/run/order_verdicts.h"
#include "engine/run/ordered_delivery.h"
#include "engine/run/progress_report.h"
#include "engine/run/split_pass_context.h"
#include "engine/trace.h"

#include <c10/core/AutogradState.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace torch_ext {

struct RunningNode;
struct SplitPass;

class BackwardCall final : public HostedRun {
 public:
  BackwardCall(
      edge_list roots,
      variable_list root_grads,
      edge_list inputs,
      CallOptions options,
      CallContext context);
  BackwardCall(const BackwardCall&) = delete;
  BackwardCall& operator=(const BackwardCall&) = delete;
  ~BackwardCall();

  // Runs as a pass of split backward (run_call.h): `pass`'s plan, a rewrite
  // of a discovered plan whose root edges are this call's roots, in place of
  // discovering one from the roots, and what else the pass gives.
  void run_as_split_pass(SplitPass& pass);

  // Discovers the graph and runs every node that must run, on the calling
  // thread. Must be called inside a stock graph task (the host task), from
  // its node `host_node`.
  void run(Node* host_node) override;

  // grad(): the captured gradient of each input, undefined where none arrived.
  variable_list take_captured() {
    return std::move(captured_);
  }

  // The node whose error is propagating out of run(), if any; the host task
  // reports it in anomaly mode in place of the driver.
  Node* failed_node() const override {
    return failed_node_;
  }

  // The nodes of this call in the order it runs them, replayed from its plan
  // (schedule_replay.h).
  std::vector<Node*> planned_order() const;

  // Whether this call's host graph task is the current one on this thread
  // (not a backward nested inside one of its nodes); running_node.h's
  // running_node_under_host_task asks it.
  bool host_task_is_current() const;

 private:
  friend bool defer_wait_to_first_use(const at::Tensor& result);

  // Makes the first nodes ready, as the plan says (GraphPlan::seeds_roots,
  // resumes_kept_nodes).
  void seed();
  void seed_roots();
  // The one node policy: does what the plan's NodeAction says with the node
  // in `slot` on its gradients, and returns the outputs to deliver, or
  // nullopt when apply() did not run (a node that only captures).
  std::optional<variable_list> run_node_action(
      int32_t slot,
      variable_list&& buffered,
      const std::optional<c10::Stream>& node_stream);
  // kRunAndKeep: runs the node and keeps what the later pass needs.
  variable_list run_and_keep(int32_t slot, variable_list&& buffered);
  // Hands the gradients `seen` of the node in `slot` to its captures.
  void capture(
      int32_t slot,
      const variable_list& seen,
      const std::optional<c10::Stream>& node_stream);
  // Once the plan is made, before any node runs: the collective features
  // decide what is on (see their members), and register for the error path.
  void plan_collectives();
  // Before the first node runs, inside the call's error handling: the turns
  // and the lanes, when the call takes turns, and the collective order
  // check, when it is on (the ranks compare the sequence before the first
  // collective starts).
  void begin_collectives();
  // The run loop of a call whose collectives take turns
  // (CollectiveTurns::takes_turns; run_loop.cpp): as run()'s, but a node of
  // the collective sequence starts only in its turn, lane nodes go to their
  // lanes, and what the lanes finish is delivered as it finishes.
  template <bool kTraced>
  void run_in_sequence();
  // A lane node on CPU (run_loop.cpp): its hooks before apply() run here,
  // apply() on its group's lane (CallLanes::dispatch_to_lane);
  // finish_lane_node does the rest when the lane returns (validate_outputs,
  // post hooks, release, delivery).
  void dispatch_to_lane(int32_t slot);
  void finish_lane_node(CallLanes::FinishedLaneNode&& finished);
  // Routes a node's outputs along its next edges (NaN check in anomaly mode);
  // an AccumulateGrad's empty outputs mark its stream a leaf stream.
  void deliver_outputs(
      int32_t slot,
      variable_list& outputs,
      const std::optional<c10::Stream>& node_stream);
  // Executes one ready node (node_executor.cpp).
  // `kTraced`: record it in tracing_'s recorder. Two instantiations, so that
  // a call that is not traced runs exactly the code it ran before tracing
  // existed.
  template <bool kTraced>
  void execute_node(int32_t slot);
  // Delivers `grad` along edge id `edge` (or kNoEdge) to input `input_nr`
  // of `target`, making it ready if that was its last pending edge. Where
  // the plan orders that input (schedule_replay.h), an early arrival is held
  // until its predecessors in stock's order are in.
  void deliver(
      int32_t target,
      uint32_t input_nr,
      at::Tensor&& grad,
      const std::optional<c10::Stream>& producer_stream,
      int32_t edge);
  // The input buffer of `slot`, which has one (NodeSlot::inputs).
  InputBuffer& buffer_of(const NodeSlot& slot) {
    return *buffers_[slot.inputs.index];
  }
  // Gives `slot` an input buffer holding `gradients` (one per input of its
  // node, all undefined for a new one), in the entry of a node that ran if
  // there is one. Only the gradient vector: InputBuffer(n) also sizes three
  // per-input stream/event vectors that only accelerator gradients use,
  // three allocations per node that a CPU graph never reads; they grow when
  // the first accelerator gradient arrives (prepare_for_accelerator_grad).
  void open_buffer(NodeSlot& slot, variable_list&& gradients) {
    if (free_buffers_.empty()) {
      slot.inputs.index = static_cast<int32_t>(buffers_.size());
      buffers_.emplace_back(std::in_place, std::move(gradients));
      return;
    }
    slot.inputs.index = free_buffers_.back();
    free_buffers_.pop_back();
    buffers_[slot.inputs.index].emplace(std::move(gradients));
  }
  // Takes the input buffer of `slot` out to run its node; its entry is free.
  InputBuffer take_buffer(NodeSlot& slot) {
    std::optional<InputBuffer>& entry = buffers_[slot.inputs.index];
    InputBuffer taken = std::move(*entry);
    entry.reset();
    free_buffers_.push_back(slot.inputs.index);
    slot.inputs.index = kNoSlot;
    return taken;
  }
  // Adds `grad` to the buffer of input `input_nr` of `target` now.
  void add_to_input(
      int32_t target,
      uint32_t input_nr,
      at::Tensor&& grad,
      const std::optional<c10::Stream>& producer_stream);
  // The key `slot` is queued with when it becomes ready: its effective
  // priority, then its sequence_nr, except that a node whose input is a
  // collective's result in flight goes behind every other ready node of its
  // priority (it would block on the wait).
  ReadyNode ready_key(int32_t slot) const;
  void sync_leaf_streams_with_caller();
  // Node::stream(), which is nullopt wherever no accelerator is: it asks
  // getAccelerator on every call (~130 instructions, twice per node on a
  // CPU chain, callgrind), which the call asks once.
  std::optional<c10::Stream> stream_of(Node& fn) const {
    return has_accelerator_ ? fn.stream() : std::nullopt;
  }
  // Adds this call's held gradients to held_gradient_stats.
  void record_held_gradients() const;
  // The thread-local state every node starts from. Stock restores the graph
  // task's whole thread-local state before every node, so state a hook or
  // node leaves behind does not leak into the next node. Restoring all of it
  // (at::ThreadLocalState) measured 1.5 us per node here, more than the rest
  // of torch_ext's per-node work; the two parts a hook realistically leaves
  // changed are restored: autograd state (grad and inference mode) and the
  // dispatch-key state that autocast toggles.
  void enter_task_state() const {
    c10::AutogradState::set_tls_state(task_autograd_state_);
    c10::impl::_force_tls_local_dispatch_key_set(task_dispatch_keys_);
  }

  edge_list roots_;
  variable_list root_grads_;
  edge_list inputs_;
  CallOptions options_;
  CallPriorities priorities_;

  GraphPlan plan_;
  // The input buffers of the nodes that have received a gradient and not run
  // yet, each indexed by its slot's NodeSlot::inputs. The entry of a node
  // that ran goes to free_buffers_ for the next slot that needs one, so the
  // pool holds about as many buffers as wait at once (one or two on a chain).
  std::vector<std::optional<InputBuffer>> buffers_;
  std::vector<int32_t> free_buffers_;
  ReadyQueue ready_;
  variable_list captured_;
  // Streams that produced results the caller will read (.grad, captures);
  // the caller's streams wait on them before run() returns.
  std::unordered_set<c10::Stream> leaf_streams_;
  std::vector<c10::Stream> caller_streams_;
  // Whether this process has an accelerator (at::accelerator::getAccelerator).
  bool has_accelerator_ = false;
  // The stream each root gradient was produced on (the caller's current one).
  std::vector<std::optional<c10::Stream>> root_streams_;
  // The thread-local state every node starts from: the host task's, with grad
  // mode equal to create_graph (part of stock's GraphTask::thread_locals_).
  c10::AutogradState task_autograd_state_ = c10::AutogradState::get_tls_state();
  c10::impl::LocalDispatchKeySet task_dispatch_keys_ =
      c10::impl::tls_local_dispatch_key_set();
  // Bit-stable accumulation (ordered_delivery.h).
  OrderedDelivery ordered_delivery_;
  Node* failed_node_ = nullptr;
  // Where each node is made the current node while it runs, as stock's
  // NodeGuard does; null if unavailable.
  c10::intrusive_ptr<Node>* current_node_slot_ = nullptr;
  // The host graph task's node set: identifies the host task while it is
  // current (a backward nested inside a node makes its own task current).
  const std::unordered_set<Node*>* host_nodes_in_graph_ = nullptr;
  // The call's features (see the top of this file), declared after the
  // members the ones below hold references to (plan_, has_accelerator_,
  // tracing_).
  SplitPassContext split_pass_;
  trace::CallTracing tracing_;
  // What the features that must clean up after a failure registered, run
  // by run()'s error path in that order.
  FailureCleanups failure_cleanups_;
  // What the call does with its collective sequence (collective_turns.h),
  // one feature each; with none of them on (an ordinary call) they hold
  // nothing: no lane, no table, and the run loop's per-node test is one of a
  // bool. The lanes come last, so they are joined before the order check and
  // the report they share are let go.
  // - the report to the next microbatch's forward (collective_progress.h),
  //   when the call runs beside it: each collective waits for its turn and
  //   says when it started;
  // - the collective order check (torch_ext.check_collective_order): the
  //   ranks compare the sequence before any of it starts;
  // - turns (takes_turns), with lane nodes or the order check: each
  //   collective starts only when every one before it has, and one the
  //   engine runs itself also waits for the lanes to be idle, so no
  //   collective it knows of is issued beside a lane's;
  // - the lanes, in a call that takes turns: lane nodes' apply() runs on
  //   their process group's lane (engine/run/collective_lane.h), or, on an
  //   accelerator, on a side stream.
  ProgressReport progress_report_;
  OrderVerdicts order_verdicts_{plan_};
  CollectiveTurns turns_{plan_};
  CallLanes lanes_{plan_, has_accelerator_};
  DeferredWaits deferred_waits_{plan_, tracing_};
};

} // namespace torch_ext
