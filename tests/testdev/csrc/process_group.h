// A c10d backend for testdev tensors that stages through an inner gloo
// backend, with NCCL's stream semantics: a collective runs on an internal
// communication stream of the tensors' device, ordered after the caller's
// current stream; the caller's thread never blocks on it. wait() makes the
// then-current stream wait for it.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <pybind11/pybind11.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace testdev {

// One collective, from launch until its communication stream passes it.
class WorkTestdev : public c10d::Work {
 public:
  WorkTestdev(
      int rank,
      c10d::OpType op_type,
      c10::Stream comm_stream,
      std::vector<at::Tensor> inputs,
      std::vector<at::Tensor> outputs,
      bool host_blocking_wait);

  // True once the communication stream has passed the collective (the end
  // event), successful or not.
  bool isCompleted() override;
  // Makes the calling thread's current stream of the device wait for the
  // collective. Rethrows the collective's error if it is already known.
  void synchronize() override;
  void blockCurrentStream() override;
  // As NCCL: orders the current stream after the collective and returns
  // without blocking the host. With a timeout (or for a barrier) it blocks the
  // host until the collective has run, and throws its error, or a timeout.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  std::vector<at::Tensor> result() override;
  // Completed with the output tensors (or the error) once the collective has
  // run; its callbacks run on the backend's completion thread.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  friend class ProcessGroupTestdev;

  // Runs on the communication stream when the gloo collective has returned.
  void finished(std::exception_ptr error);
  // Runs on the completion thread once the end event has fired.
  void complete_future();

  c10::Stream comm_stream_;
  c10::Event end_;
  const bool host_blocking_wait_;
  // Flat list of outputs: the future's value and result().
  std::vector<at::Tensor> outputs_;
  // Every input and output, kept alive until the collective has run, so that
  // even an allocator that ignores recordStream does not free them under it.
  std::vector<at::Tensor> stashed_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class ProcessGroupTestdev : public c10d::Backend {
 public:
  // `gloo` is a gloo backend of the same rank and size; the collectives run
  // through it on CPU tensors that alias the testdev memory.
  ProcessGroupTestdev(
      int rank,
      int size,
      c10::intrusive_ptr<c10d::Backend> gloo);
  ~ProcessGroupTestdev() override;

  const std::string getBackendName() const override {
    return "testdev_gloo";
  }

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts =
          c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts =
          c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts =
          c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts =
          c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& output_split_sizes,
      std::vector<int64_t>& input_split_sizes,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;

  // Waits for every launched collective to complete, then stops the
  // completion thread and shuts the gloo backend down.
  void shutdown() override;

  const c10::intrusive_ptr<c10d::Backend>& gloo() const {
    return gloo_;
  }

 private:
  // Runs one gloo collective on CPU aliases of `inputs` and `outputs` (same
  // order), returning the gloo work to wait for.
  using GlooCall = std::function<c10::intrusive_ptr<c10d::Work>(
      c10d::Backend& gloo,
      std::vector<at::Tensor>& inputs,
      std::vector<at::Tensor>& outputs)>;

  c10::intrusive_ptr<c10d::Work> launch(
      c10d::OpType op_type,
      c10::Device device,
      std::vector<at::Tensor> inputs,
      std::vector<at::Tensor> outputs,
      GlooCall call,
      bool host_blocking_wait = false);
  c10::Stream comm_stream(c10::Device device);

  c10::intrusive_ptr<c10d::Backend> gloo_;

  std::mutex comm_streams_mu_;
  std::map<c10::DeviceIndex, c10::Stream> comm_streams_;

  // What the stream tasks and the completion thread share. Owned jointly with
  // them, so that it outlives the backend should the backend be destroyed on
  // the completion thread (a future callback dropping the last reference).
  struct Shared {
    // Gloo matches collectives across ranks by the order of its calls. Calls
    // run on the communication streams, a thread per device, so each takes
    // a ticket in launch order (the same on every rank) and calls in turn.
    std::mutex turn_mu;
    std::condition_variable turn_cv;
    uint64_t turn = 0;

    // Works whose futures the completion thread completes, in launch order.
    // Future callbacks run there, not on a stream's thread, so a callback
    // that synchronizes a stream (or takes the GIL) cannot stall a stream.
    std::mutex pending_mu;
    std::condition_variable pending_cv;
    std::deque<c10::intrusive_ptr<WorkTestdev>> pending;
    bool stopping = false;
  };
  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
  static void completion_loop(const std::shared_ptr<Shared>& shared);
  void stop_completion_thread();

  // Serializes launches, so that tickets follow the order of the enqueues.
  std::mutex launch_mu_;
  uint64_t next_ticket_ = 0;
  std::thread completion_thread_;
};

// Adds ProcessGroupTestdev to the extension module (base class
// torch.distributed.Backend): ProcessGroupTestdev(rank, size, gloo).
void register_process_group(pybind11::module& m);

} // namespace testdev
