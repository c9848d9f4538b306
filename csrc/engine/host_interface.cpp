#include "engine/host_interface.h"

#include <c10/util/Exception.h>

namespace torch_ext {
namespace {

// The answers of a process without Python: what the engine gets before
// torch_ext's import installs its host.
class ProcessWithoutHost final : public Host {
 public:
  CollectiveKind collective_kind(const Node&) override {
    return {};
  }
  uintptr_t lane_group_key(const Node&) override {
    return 0;
  }
  bool collective_check_enabled() override {
    return false;
  }
  std::shared_ptr<CollectiveOrderCheck> begin_collective_check(
      const std::vector<CheckedCollective>&,
      const CollectiveProgress*) override {
    return nullptr;
  }
  void raise_if_interrupted() override {}
  void raise_interrupt_later(std::exception_ptr) override {}
  void wait_releasing_gil(c10::function_ref<void()> wait) override {
    wait();
  }
  std::exception_ptr forward_stopped_by_backward(std::string message) override {
    return std::make_exception_ptr(
        c10::Error(
            {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
            std::move(message)));
  }
  std::string twin_group_name(const std::string& group_name) override {
    TORCH_CHECK(false, "torch_ext: no host to make a twin of ", group_name);
  }
  std::exception_ptr name_collective_node_in_error(
      std::exception_ptr error,
      const Node&,
      bool) override {
    return error;
  }
  void* narrow_needs_input_grad(Node&) override {
    return nullptr;
  }
  void restore_needs_input_grad(Node&, void*) override {}
  void copy_anomaly_metadata(Node&, Node&) override {}
};

ProcessWithoutHost process_without_host;

} // namespace

namespace detail {
std::atomic<Host*> installed_host{&process_without_host};
} // namespace detail

void install_host(Host& host) {
  Host* expected = &process_without_host;
  TORCH_CHECK(
      detail::installed_host
          .compare_exchange_strong(expected, &host, std::memory_order_acq_rel),
      "torch_ext: a host is installed once, when torch_ext is imported");
}

} // namespace torch_ext
