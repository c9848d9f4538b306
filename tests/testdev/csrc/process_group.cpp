#include "process_group.h"

#include "streams.h"

#include <ATen/ops/from_blob.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <utility>

namespace testdev {
namespace {

constexpr auto kDevice = c10::DeviceType::PrivateUse1;

// What the communication stream needs to alias a device tensor's memory as a
// CPU tensor: taken at launch, so that the task holds no reference to the
// tensor itself (the work does, until the collective has run).
struct HostView {
  void* storage;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t storage_offset;
  c10::ScalarType dtype;

  explicit HostView(const at::Tensor& t)
      : storage(t.storage().mutable_data()),
        sizes(t.sizes().vec()),
        strides(t.strides().vec()),
        storage_offset(t.storage_offset()),
        dtype(t.scalar_type()) {}

  // Device memory is host memory, so gloo can read and write it in place.
  at::Tensor alias() const {
    return at::from_blob(
        storage,
        sizes,
        strides,
        storage_offset,
        [](void*) {},
        at::TensorOptions().dtype(dtype).device(c10::kCPU));
  }
};

std::vector<HostView> host_views(const std::vector<at::Tensor>& tensors) {
  return {tensors.begin(), tensors.end()};
}

std::vector<at::Tensor> aliases(const std::vector<HostView>& views) {
  std::vector<at::Tensor> out;
  out.reserve(views.size());
  for (const auto& view : views) {
    out.push_back(view.alias());
  }
  return out;
}

// The device all of `tensors` are on; they must be testdev tensors on one
// device (gloo itself judges their layout, as it would for CPU tensors).
c10::Device common_device(
    const std::vector<at::Tensor>& tensors,
    const char* op) {
  TORCH_CHECK(!tensors.empty(), "testdev_gloo ", op, ": no tensors");
  c10::Device device = tensors.front().device();
  for (const auto& t : tensors) {
    TORCH_CHECK(
        t.device().type() == kDevice,
        "testdev_gloo ",
        op,
        ": expected testdev tensors, got one on ",
        t.device());
    TORCH_CHECK(
        t.device() == device,
        "testdev_gloo ",
        op,
        ": tensors on different devices (",
        device,
        " and ",
        t.device(),
        ")");
    TORCH_CHECK(
        !t.is_sparse(),
        "testdev_gloo ",
        op,
        ": sparse tensors unsupported");
  }
  return device;
}

std::vector<at::Tensor> flatten(
    const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> flat;
  for (const auto& list : lists) {
    flat.insert(flat.end(), list.begin(), list.end());
  }
  return flat;
}

// Splits `flat` back into lists of the sizes `lists` had.
std::vector<std::vector<at::Tensor>> nest(
    const std::vector<at::Tensor>& flat,
    const std::vector<size_t>& list_sizes) {
  std::vector<std::vector<at::Tensor>> lists;
  auto it = flat.begin();
  for (size_t n : list_sizes) {
    lists.emplace_back(it, it + static_cast<std::ptrdiff_t>(n));
    it += static_cast<std::ptrdiff_t>(n);
  }
  return lists;
}

std::vector<size_t> list_sizes(
    const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<size_t> sizes;
  for (const auto& list : lists) {
    sizes.push_back(list.size());
  }
  return sizes;
}

} // namespace

// --- WorkTestdev -----------------------------------------------------------

WorkTestdev::WorkTestdev(
    int rank,
    c10d::OpType op_type,
    c10::Stream comm_stream,
    std::vector<at::Tensor> inputs,
    std::vector<at::Tensor> outputs,
    bool host_blocking_wait)
    : c10d::Work(rank, op_type),
      comm_stream_(comm_stream),
      end_(kDevice),
      host_blocking_wait_(host_blocking_wait),
      outputs_(std::move(outputs)),
      stashed_(std::move(inputs)),
      future_(
          c10::make_intrusive<c10::ivalue::Future>(
              c10::ListType::create(c10::TensorType::get()),
              std::vector<c10::Device>{comm_stream.device()})) {
  stashed_.insert(stashed_.end(), outputs_.begin(), outputs_.end());
}

bool WorkTestdev::isCompleted() {
  return end_.query();
}

void WorkTestdev::synchronize() {
  if (!isSuccess()) {
    std::rethrow_exception(exception());
  }
  c10::impl::VirtualGuardImpl impl(kDevice);
  end_.block(impl.getStream(comm_stream_.device()));
}

void WorkTestdev::blockCurrentStream() {
  synchronize();
}

bool WorkTestdev::wait(std::chrono::milliseconds timeout) {
  if (host_blocking_wait_ || timeout != kNoTimeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    auto done = [&] { return completed_; };
    if (timeout == kNoTimeout) {
      cv_.wait(lock, done);
    } else if (!cv_.wait_for(lock, timeout, done)) {
      C10_THROW_ERROR(
          DistBackendError,
          c10::str(
              "testdev_gloo: ",
              c10d::opTypeToString(retrieveOpType()),
              " did not complete within ",
              timeout.count(),
              " ms"));
    }
  }
  synchronize();
  return true;
}

std::vector<at::Tensor> WorkTestdev::result() {
  return outputs_;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkTestdev::getFuture() {
  return future_;
}

void WorkTestdev::finished(std::exception_ptr error) {
  finish(std::move(error));
}

void WorkTestdev::complete_future() {
  if (auto error = exception()) {
    future_->setError(error);
  } else {
    // The future records its events on the current stream: make that the
    // communication stream, which has passed the collective.
    c10::StreamGuard guard(comm_stream_);
    future_->markCompleted(c10::IValue(outputs_));
  }
  // The collective has run: the tensors are no longer needed for safety.
  stashed_.clear();
}

// --- ProcessGroupTestdev ---------------------------------------------------

ProcessGroupTestdev::ProcessGroupTestdev(
    int rank,
    int size,
    c10::intrusive_ptr<c10d::Backend> gloo)
    : c10d::Backend(rank, size), gloo_(std::move(gloo)) {
  TORCH_CHECK(gloo_, "testdev_gloo: no gloo backend given");
  TORCH_CHECK(
      gloo_->getRank() == rank && gloo_->getSize() == size,
      "testdev_gloo: the gloo backend is rank ",
      gloo_->getRank(),
      " of ",
      gloo_->getSize(),
      ", not ",
      rank,
      " of ",
      size);
  init();
  completion_thread_ = std::thread(completion_loop, shared_);
}

ProcessGroupTestdev::~ProcessGroupTestdev() {
  stop_completion_thread();
}

void ProcessGroupTestdev::shutdown() {
  stop_completion_thread();
  gloo_->shutdown();
}

void ProcessGroupTestdev::stop_completion_thread() {
  {
    std::lock_guard<std::mutex> lock(shared_->pending_mu);
    shared_->stopping = true;
  }
  shared_->pending_cv.notify_all();
  if (!completion_thread_.joinable()) {
    return;
  }
  if (completion_thread_.get_id() == std::this_thread::get_id()) {
    // Destroyed by a future callback: the thread drains the rest on its own.
    completion_thread_.detach();
    return;
  }
  // Draining may run Python future callbacks, which take the GIL: the caller
  // (the Python object's destructor, destroy_process_group) may hold it.
  std::optional<pybind11::gil_scoped_release> no_gil;
  if (Py_IsInitialized() && PyGILState_Check()) {
    no_gil.emplace();
  }
  completion_thread_.join();
}

void ProcessGroupTestdev::completion_loop(
    const std::shared_ptr<Shared>& shared) {
  for (;;) {
    c10::intrusive_ptr<WorkTestdev> work;
    {
      std::unique_lock<std::mutex> lock(shared->pending_mu);
      shared->pending_cv.wait(lock, [&] {
        return shared->stopping || !shared->pending.empty();
      });
      if (shared->pending.empty()) {
        return; // stopping, and every launched collective completed
      }
      work = shared->pending.front();
      shared->pending.pop_front();
    }
    // The end event fires after the task's closure was destroyed, so from
    // here on nothing on the stream refers to the work.
    work->end_.synchronize();
    try {
      work->complete_future();
    } catch (const std::exception& e) {
      // A callback's own errors go to its child future; this is the future
      // machinery itself failing, which must not end the thread.
      LOG(ERROR) << "testdev_gloo: completing a future failed: " << e.what();
    }
  }
}

c10::Stream ProcessGroupTestdev::comm_stream(c10::Device device) {
  std::lock_guard<std::mutex> lock(comm_streams_mu_);
  auto it = comm_streams_.find(device.index());
  if (it == comm_streams_.end()) {
    c10::impl::VirtualGuardImpl impl(kDevice);
    it = comm_streams_
             .emplace(device.index(), impl.getStreamFromGlobalPool(device))
             .first;
  }
  return it->second;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTestdev::launch(
    c10d::OpType op_type,
    c10::Device device,
    std::vector<at::Tensor> inputs,
    std::vector<at::Tensor> outputs,
    GlooCall call,
    bool host_blocking_wait) {
  {
    std::lock_guard<std::mutex> lock(shared_->pending_mu);
    TORCH_CHECK(
        !shared_->stopping,
        "testdev_gloo: the backend has been shut down");
  }
  c10::impl::VirtualGuardImpl impl(kDevice);
  c10::Stream comm = comm_stream(device);

  // (1) The collective reads its inputs after the work the caller has
  // already enqueued on its current stream.
  c10::Event ready(kDevice);
  ready.record(impl.getStream(device));
  ready.block(comm);

  // (2) The caching allocator must not reuse the tensors' memory until the
  // communication stream has passed the collective, even if the caller
  // frees them first.
  auto* allocator = c10::getDeviceAllocator(kDevice);
  for (const auto* list : {&inputs, &outputs}) {
    for (const auto& t : *list) {
      allocator->recordStream(t.storage().data_ptr(), comm);
    }
  }

  auto in_views = host_views(inputs);
  auto out_views = host_views(outputs);
  auto work = c10::make_intrusive<WorkTestdev>(
      rank_,
      op_type,
      comm,
      std::move(inputs),
      std::move(outputs),
      host_blocking_wait);

  // (3) The task. It holds the work by raw pointer: the completion thread
  // holds a reference until the end event, which fires after the task (and
  // its closure) is gone.
  WorkTestdev* raw_work = work.get();
  std::lock_guard<std::mutex> launch_lock(launch_mu_);
  const uint64_t ticket = next_ticket_++;
  enqueue(
      comm,
      [shared = shared_,
       gloo = gloo_,
       raw_work,
       ticket,
       call = std::move(call),
       in_views = std::move(in_views),
       out_views = std::move(out_views)]() {
        std::exception_ptr error;
        c10::intrusive_ptr<c10d::Work> gloo_work;
        {
          std::unique_lock<std::mutex> turn(shared->turn_mu);
          shared->turn_cv.wait(turn, [&] { return shared->turn == ticket; });
          try {
            auto in = aliases(in_views);
            auto out = aliases(out_views);
            gloo_work = call(*gloo, in, out);
          } catch (...) {
            error = std::current_exception();
          }
          // Passed on whether or not the call threw: the next collective's
          // call must not wait forever for this one.
          ++shared->turn;
          shared->turn_cv.notify_all();
        }
        // The stream waits for the collective here, as for a kernel.
        if (gloo_work) {
          try {
            gloo_work->wait();
          } catch (...) {
            error = std::current_exception();
          }
        }
        // Errors are kept in the work (for wait() and the future), not thrown
        // to the stream, which would rethrow them at an unrelated synchronize.
        raw_work->finished(std::move(error));
      });

  // (4) The end event: what wait() and isCompleted() look at.
  work->end_.record(comm);
  {
    std::lock_guard<std::mutex> lock(shared_->pending_mu);
    shared_->pending.push_back(work);
  }
  shared_->pending_cv.notify_one();
  return work;
}

// --- Collectives -----------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupTestdev::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  auto device = common_device(tensors, "broadcast");
  return launch(
      c10d::OpType::BROADCAST,
      device,
      {},
      tensors,
      [opts](c10d::Backend& gloo, auto&, auto& out) {
        return gloo.broadcast(out, opts);
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTestdev::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  auto device = common_device(tensors, "allreduce");
  return launch(
      c10d::OpType::ALLREDUCE,
      device,
      {},
      tensors,
      [opts](c10d::Backend& gloo, auto&, auto& out) {
        return gloo.allreduce(out, opts);
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTestdev::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  auto device = common_device(tensors, "allreduce_coalesced");
  return launch(
      c10d::OpType::ALLREDUCE_COALESCED,
      device,
      {},
      tensors,
      [opts](c10d::Backend& gloo, auto&, auto& out) {
        return gloo.allreduce_coalesced(out, opts);
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTestdev::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  auto flat = flatten(outputs);
  auto all = inputs;
  all.insert(all.end(), flat.begin(), flat.end());
  auto device = common_device(all, "allgather");
  return launch(
      c10d::OpType::ALLGATHER,
      device,
      inputs,
      flat,
      [opts,
       sizes = list_sizes(outputs)](c10d::Backend& gloo, auto& in, auto& out) {
        auto lists = nest(out, sizes);
        return gloo.allgather(lists, in, opts);
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTestdev::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  auto device = common_device({input, output}, "_allgather_base");
  return launch(
      c10d::OpType::_ALLGATHER_BASE,
      device,
      {input},
      {output},
      [opts](c10d::Backend& gloo, auto& in, auto& out) {
        return gloo._allgather_base(out[0], in[0], opts);
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTestdev::
    allgather_into_tensor_coalesced(
        std::vector<at::Tensor>& outputs,
        std::vector<at::Tensor>& inputs,
        const c10d::AllgatherOptions& opts) {
  auto all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  auto device = common_device(all, "allgather_into_tensor_coalesced");
  return launch(
      c10d::OpType::COALESCED,
      device,
      inputs,
      outputs,
      [opts](c10d::Backend& gloo, auto& in, auto& out) {
        return gloo.allgather_into_tensor_coalesced(out, in, opts);
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTestdev::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  auto flat = flatten(inputs);
  auto all = flat;
  all.insert(all.end(), outputs.begin(), outputs.end());
  auto device = common_device(all, "reduce_scatter");
  return launch(
      c10d::OpType::REDUCE_SCATTER,
      device,
      flat,
      outputs,
      [opts,
       sizes = list_sizes(inputs)](c10d::Backend& gloo, auto& in, auto& out) {
        auto lists = nest(in, sizes);
        return gloo.reduce_scatter(out, lists, opts);
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTestdev::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  auto device = common_device({input, output}, "_reduce_scatter_base");
  return launch(
      c10d::OpType::_REDUCE_SCATTER_BASE,
      device,
      {input},
      {output},
      [opts](c10d::Backend& gloo, auto& in, auto& out) {
        return gloo._reduce_scatter_base(out[0], in[0], opts);
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTestdev::
    reduce_scatter_tensor_coalesced(
        std::vector<at::Tensor>& outputs,
        std::vector<at::Tensor>& inputs,
        const c10d::ReduceScatterOptions& opts) {
  auto all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  auto device = common_device(all, "reduce_scatter_tensor_coalesced");
  return launch(
      c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED,
      device,
      inputs,
      outputs,
      [opts](c10d::Backend& gloo, auto& in, auto& out) {
        return gloo.reduce_scatter_tensor_coalesced(out, in, opts);
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTestdev::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes,
    const c10d::AllToAllOptions& opts) {
  auto device = common_device({input, output}, "alltoall_base");
  return launch(
      c10d::OpType::ALLTOALL_BASE,
      device,
      {input},
      {output},
      [opts, out_splits = output_split_sizes, in_splits = input_split_sizes](
          c10d::Backend& gloo,
          auto& in,
          auto& out) mutable {
        return gloo.alltoall_base(out[0], in[0], out_splits, in_splits, opts);
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTestdev::barrier(
    const c10d::BarrierOptions& opts) {
  // As NCCL: the given device, else the bound one, else the current one.
  c10::Device device(kDevice, 0);
  if (opts.device && opts.device->type() == kDevice) {
    device = *opts.device;
  } else if (!opts.device_ids.empty()) {
    device = c10::Device(kDevice, opts.device_ids.front());
  } else if (
      auto bound = getBoundDeviceId(); bound && bound->type() == kDevice) {
    device = *bound;
  } else {
    device = c10::impl::VirtualGuardImpl(kDevice).getDevice();
  }
  c10d::BarrierOptions gloo_opts;
  gloo_opts.timeout = opts.timeout;
  // A barrier's wait blocks the host, as NCCL's does: its callers expect
  // every rank to have reached it when wait() returns.
  return launch(
      c10d::OpType::BARRIER,
      device,
      {},
      {},
      [gloo_opts](c10d::Backend& gloo, auto&, auto&) {
        return gloo.barrier(gloo_opts);
      },
      /*host_blocking_wait=*/true);
}

// --- Python ----------------------------------------------------------------

void register_process_group(pybind11::module& m) {
  namespace py = pybind11;
  // The base class is bound by torch.distributed's initialisation.
  py::module_::import("torch.distributed");
  py::class_<
      ProcessGroupTestdev,
      c10d::Backend,
      c10::intrusive_ptr<ProcessGroupTestdev>>(
      m,
      "ProcessGroupTestdev",
      "torch.distributed backend for testdev tensors, staging through a gloo "
      "backend on an internal communication stream per device.")
      .def(
          py::init<int, int, c10::intrusive_ptr<c10d::Backend>>(),
          py::arg("rank"),
          py::arg("size"),
          py::arg("gloo"))
      .def_property_readonly("gloo", &ProcessGroupTestdev::gloo);
}

} // namespace testdev
