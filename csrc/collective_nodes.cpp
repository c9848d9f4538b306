#include "collective_nodes.h"

#include <torch/csrc/autograd/python_function.h>

#include <atomic>
#include <cstring>
#include <string_view>
#include <typeinfo>

namespace torch_ext {
namespace {

std::atomic<bool> auto_priority_enabled{true};

// PyNode's type_info. libtorch_python does not export it (typeid(PyNode)
// fails to link), so torch_ext learns it from a live PyNode at import
// (remember_python_node_type); until then no node counts as a collective.
std::atomic<const std::type_info*> python_node_type{nullptr};

bool starts_with(std::string_view text, std::string_view prefix) {
  return text.substr(0, prefix.size()) == prefix;
}

// torch.library.register_autograd names the Function class it generates
// "GeneratedBackwardFor_{namespace}_{op}_{overload}"; its node class adds
// "Backward" (torch/_library/autograd.py).
bool is_collective_class_name(std::string_view name) {
  constexpr std::string_view kGenerated = "GeneratedBackwardFor_";
  if (!starts_with(name, kGenerated)) {
    return false;
  }
  name.remove_prefix(kGenerated.size());
  constexpr std::string_view kFunctional = "_c10d_functional_";
  if (starts_with(name, kFunctional)) {
    // Also _c10d_functional_autograd_*. Two of the namespace's ops are not
    // collectives: wait_tensor, and _wrap_tensor_autograd (the identity that
    // turns a result into an AsyncCollectiveTensor). Both are on the path to
    // the collective they belong to, and so get its priority anyway.
    return name.find("wait_tensor") == std::string_view::npos &&
        name.find("_wrap_tensor_autograd") == std::string_view::npos;
  }
  constexpr std::string_view kOwn = "torch_ext_";
  if (!starts_with(name, kOwn)) {
    return false;
  }
  name.remove_prefix(kOwn.size());
  // "all_reduce_" also covers all_reduce_coalesced.
  for (std::string_view op :
       {"all_to_all_single_", "all_reduce_", "reduce_scatter_tensor_",
        "all_gather_into_tensor_"}) {
    if (starts_with(name, op)) {
      return true;
    }
  }
  return false;
}

} // namespace

bool is_collective_node(const torch::autograd::Node& fn) {
  const std::type_info* python_node = python_node_type.load(std::memory_order_relaxed);
  // Address comparison: the one type_info object of PyNode lives in
  // libtorch_python (this library cannot even name it), while
  // type_info::operator== falls back to strcmp on the mangled names, which
  // share their first 16 characters across torch's autograd nodes.
  if (python_node == nullptr || &typeid(fn) != python_node) {
    return false;
  }
  // The class name is read without the GIL: a PyNode's Python object (its
  // THPFunction) lives as long as the node, and a class's tp_name only
  // changes if Python code assigns __name__, which nothing does to these
  // generated classes.
  const PyObject* obj = static_cast<const torch::autograd::PyNode&>(fn).pyobj();
  return obj != nullptr && is_collective_class_name(Py_TYPE(obj)->tp_name);
}

bool defers_its_wait(const torch::autograd::Node& fn) {
  const PyObject* obj = static_cast<const torch::autograd::PyNode&>(fn).pyobj();
  return obj != nullptr &&
      starts_with(Py_TYPE(obj)->tp_name, "GeneratedBackwardFor_torch_ext_");
}

void remember_python_node_type(const torch::autograd::Node& example) {
  TORCH_CHECK(
      std::string_view(typeid(example).name()) == "N5torch8autograd6PyNodeE",
      "remember_python_node_type: expected the node of a Python autograd.Function, got ",
      example.name());
  python_node_type.store(&typeid(example), std::memory_order_relaxed);
}

void set_auto_collective_priority(bool enabled) {
  auto_priority_enabled.store(enabled, std::memory_order_relaxed);
}

bool auto_collective_priority() {
  return auto_priority_enabled.load(std::memory_order_relaxed);
}

} // namespace torch_ext
