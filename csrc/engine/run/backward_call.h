#pragma once

// One torch_ext backward()/grad() call: the plan, the ready queue and the
// results. It lives for the duration of the call only, so nested calls (a
// backward inside a node, reentrant checkpoint) and calls from other threads
// never share state. Included only by the run layer's own files: what starts
// a call uses run_call.h, the bindings running_node.h. Its parts live beside
// it: bit-stable delivery (ordered_delivery.h), the collective sequence and
// lanes (collective_sequence.h, made only for a call that uses them), what
// split backward's passes give it (deferred_accumulation.h, KeptNode).

#include "engine/call_options.h"
#include "engine/collective_progress.h"
#include "engine/host/host_task.h"
#include "engine/host_callbacks.h"
#include "engine/plan/graph_plan.h"
#include "engine/plan/scheduler.h"
#include "engine/run/ordered_delivery.h"
#include "engine/trace.h"

#include <c10/core/AutogradState.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace torch_ext {

class DeferredAccumulation;
struct CollectiveSequence;
struct RunningNode;

class BackwardCall final : public HostedRun {
 public:
  BackwardCall(
      edge_list roots,
      variable_list root_grads,
      edge_list inputs,
      CallOptions options,
      std::vector<PriorityOverride> priority_overrides);
  BackwardCall(const BackwardCall&) = delete;
  BackwardCall& operator=(const BackwardCall&) = delete;
  ~BackwardCall();

  // Runs `plan` in place of discovering one from the roots: split
  // backward's passes, which rewrite a discovered plan (split_backward.cpp).
  // Its root edges are this call's roots.
  void use_plan(GraphPlan&& plan) {
    plan_ = std::move(plan);
    has_plan_ = true;
  }
  // Where the plan's kept indices point (NodeSlot::kept): what one pass of
  // split backward keeps for the next, and the next resumes. Outlives the
  // call.
  void set_kept_nodes(std::vector<KeptNode>* kept) {
    kept_ = kept;
  }
  // The weight pass's batch of unobserved accumulations, for a plan with
  // batches_accumulation; flushed as the host task's first final callback.
  void set_accumulation_batch(DeferredAccumulation* batch) {
    batch_ = batch;
  }
  // The streams the root gradients were produced on, when not the caller's
  // current ones now (a pass resuming gradients kept since an earlier one).
  void set_root_streams(std::vector<std::optional<c10::Stream>> streams) {
    root_streams_ = std::move(streams);
  }
  // What the call's span is called in a trace.
  void set_trace_label(const char* label) {
    trace_label_ = label;
  }

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
  // The run loop of a plan with lane nodes (collective_sequence.cpp): as
  // run()'s, but a node of the collective sequence starts only in its turn,
  // lane nodes go to their lanes, and what the lanes finish is delivered as it
  // finishes.
  template <bool kTraced>
  void run_in_sequence();
  // Whether this call runs its collectives in sequence (run_in_sequence): to
  // hand lane nodes to lanes, or for the collective order check. Not in
  // split backward's passes, whose kept and resumed nodes the sequence does
  // not replay.
  bool runs_collective_sequence() const {
    return (plan_.has_lanes ||
            (plan_.has_collectives &&
             host_callbacks().collective_check_enabled())) &&
        plan_.seeds_roots && !plan_.resumes_kept_nodes && kept_ == nullptr &&
        batch_ == nullptr;
  }
  // The collective sequence: every node that issues a collective (a launch,
  // in a lane or not) in the order the plan runs them, the same on every
  // rank with the same graph and priorities. One starts only when every one
  // before it has; one the engine runs itself also waits for the lanes to
  // be idle, so no collective it knows of is issued beside a lane's.
  void build_collective_sequence();
  // The nodes that issue a collective (a launch, in a lane or not), in the
  // order the plan runs them: the same on every rank with the same graph and
  // priorities.
  std::vector<int32_t> planned_collectives() const;
  // Begins the collective order check of `in_order` (planned_collectives)
  // when it is on (order_check_).
  void begin_order_check(const std::vector<int32_t>& in_order);
  bool may_start(int32_t slot) const;
  // Makes the parked nodes whose turn has come ready again.
  void unpark();
  // A lane node on CPU (collective_sequence.cpp): its hooks before apply() run
  // here, apply() on its group's lane; finish_lane_node does the rest when
  // the lane returns (validate_outputs, post hooks, release, delivery).
  bool runs_in_lane(int32_t slot) const;
  void dispatch_to_lane(int32_t slot);
  void finish_lane_node(
      int32_t slot,
      variable_list&& outputs,
      std::exception_ptr error);
  // A lane node on an accelerator (execute_node): the side stream of
  // `node_stream`'s device that it runs on instead, made to wait for what
  // that stream has queued; `inputs` are recorded as used on it.
  c10::Stream move_to_side_stream(
      const c10::Stream& node_stream,
      const variable_list& inputs);
  // Routes a node's outputs along its next edges (NaN check in anomaly mode);
  // an AccumulateGrad's empty outputs mark its stream a leaf stream.
  void deliver_outputs(
      int32_t slot,
      variable_list& outputs,
      const std::optional<c10::Stream>& node_stream);
  // Executes one ready node (node_executor.cpp).
  // `kTraced`: record it in trace_. Two instantiations, so that a call that
  // is not traced runs exactly the code it ran before tracing existed.
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
  // Marks `target` as receiving a pending result if `grad` is one.
  void note_pending_delivery(int32_t target, const at::Tensor& grad);
  // Waits on the pending results delivered to `slot` (or, with kNoSlot, on
  // every one still pending) and forgets them.
  void wait_pending(int32_t slot);
  // Error path: waits on everything still in flight, keeping the first error.
  void wait_pending_after_error() noexcept;

  struct PendingWait;
  // Waits on a pending result, recording the wait while tracing: `consumer`
  // is the slot that reads it, or kNoSlot (the end of the call, or `why`).
  void wait_traced(
      const PendingWait& pending,
      int32_t consumer,
      const char* why);

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
  // Collective results in flight (defer_wait_to_first_use), with the slot
  // each was delivered to (kNoSlot until delivered). A handful per call.
  struct PendingWait {
    at::Tensor result;
    int32_t slot = kNoSlot;
    // While tracing: the event of the node that launched it.
    int32_t launch_event = trace::kNoEvent;
  };
  std::vector<PendingWait> pending_waits_;
  // Bit-stable accumulation (ordered_delivery.h).
  OrderedDelivery ordered_delivery_;
  Node* failed_node_ = nullptr;
  // Where each node is made the current node while it runs, as stock's
  // NodeGuard does; null if unavailable.
  c10::intrusive_ptr<Node>* current_node_slot_ = nullptr;
  // The host graph task's node set: identifies the host task while it is
  // current (a backward nested inside a node makes its own task current).
  const std::unordered_set<Node*>* host_nodes_in_graph_ = nullptr;
  // Whether plan_ was given (use_plan) rather than discovered by run().
  bool has_plan_ = false;
  // Set for the passes of split backward only.
  std::vector<KeptNode>* kept_ = nullptr;
  DeferredAccumulation* batch_ = nullptr;
  // What the call's span is called in a trace.
  const char* trace_label_ = nullptr;
  // Non-null only while tracing was on when the call started: the executor's
  // hooks test this pointer and do nothing else when tracing is off.
  std::unique_ptr<trace::CallTrace> trace_;
  // While tracing: the event of the node running now (its launches).
  int32_t running_node_event_ = trace::kNoEvent;

  // While a call runs its collectives in sequence (run_in_sequence): the
  // lanes and each collective's turn (collective_sequence.h).
  std::unique_ptr<CollectiveSequence> sequence_;
  // The collective order check of this call, when it is on: begun with the
  // collective sequence, awaited before each collective starts (its group's
  // verdict; shared with the lanes, which start theirs), before the first
  // hook runs and before the call returns (every verdict).
  std::shared_ptr<CollectiveOrderCheck> order_check_;
  // Where this call reports the collectives it starts, when it runs beside
  // the next microbatch's forward (collective_progress.h); taken from the
  // calling thread by the constructor, so a nested call has none.
  std::shared_ptr<CollectiveProgress> progress_;
  // Whether this thread has seen every group agree (the engine thread asks no
  // more after that).
  bool order_check_passed_ = false;
  // Awaits the order check's verdict if `slot` starts a collective on this
  // thread or has a hook; the run loops call it until it has passed.
  void await_order_check_before(int32_t slot);
};

} // namespace torch_ext
