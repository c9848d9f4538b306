#pragma once

// torch_ext's one host (engine/host_interface.h): the Python objects the
// engine's questions reach, held as its members, made and installed once by
// torch_ext._C.install_host when torch_ext is imported (torch_ext/_host.py
// hands it the Python functions that answer). No C++ imports a Python module,
// and no Python object is reached through a global.
//
// Its methods are defined beside the bindings of what they serve:
// python_collectives.cpp (node classes' roles, lanes, the order check, a
// collective's error), python_overlap.cpp (the overlap's error type, Ctrl-C
// raised later, the GIL around a wait, twin groups), python_split.cpp
// (needs_input_grad narrowed), python_bindings.cpp (anomaly metadata) and
// python_host.cpp (its making and installing, Ctrl-C).

#include "collectives/role_cache.h"
#include "engine/host_interface.h"

#include <torch/csrc/utils/object_ptr.h>

#include <Python.h>

#include <atomic>
#include <typeinfo>

namespace torch_ext {

class PythonHost final : public Host {
 public:
  // What Python hands torch_ext._C.install_host (torch_ext/_host.py), each a
  // new reference.
  struct Answers {
    // node class -> (its role, an int of collective_roles; whether it defers
    // its wait), once per class not registered: torch_ext.collectives.roles'
    // built-in rules.
    THPObjectPtr node_class_kind;
    // a lane node's ctx -> its process group: torch_ext.collectives.lanes.
    THPObjectPtr lane_group;
    // a group's registered name -> its twin's: torch_ext.collectives.
    // twin_groups.
    THPObjectPtr twin_group_name;
    // torch_ext._C.ForwardStoppedByBackward.
    THPObjectPtr forward_stopped_by_backward_type;
  };

  // `python_node`: the type of the node of a Python autograd.Function
  // (PyNode), which libtorch_python does not export (typeid(PyNode) fails to
  // link), learnt from a live one.
  PythonHost(Answers answers, const std::type_info& python_node);
  PythonHost(const PythonHost&) = delete;
  PythonHost& operator=(const PythonHost&) = delete;

  CollectiveKind collective_kind(const Node& fn) override;
  uintptr_t lane_group_key(const Node& fn) override;
  bool collective_check_enabled() override;
  std::shared_ptr<CollectiveOrderCheck> begin_collective_check(
      const std::vector<CheckedCollective>& sequence,
      const CollectiveProgress* beside_forward) override;
  void raise_if_interrupted() override;
  void raise_interrupt_later(std::exception_ptr interrupt) override;
  void wait_releasing_gil(c10::function_ref<void()> wait) override;
  std::exception_ptr forward_stopped_by_backward(std::string message) override;
  std::string twin_group_name(const std::string& group_name) override;
  std::exception_ptr name_collective_node_in_error(
      std::exception_ptr error,
      const Node& fn,
      bool in_lane) override;
  void* narrow_needs_input_grad(Node& fn) override;
  void restore_needs_input_grad(Node& fn, void* token) override;
  void copy_anomaly_metadata(Node& from, Node& to) override;

  // What torch_ext._C's collective functions ask and tell the host
  // (python_collectives.cpp).

  // Whether `fn` is the node of a Python autograd.Function (a PyNode).
  bool is_python_node(const Node& fn) const {
    return &typeid(fn) == &python_node_;
  }
  // The kind of a node class, deciding it if it is new.
  CollectiveKind kind_of_class(PyTypeObject* node_class);
  // With the GIL. Records `node_class`'s kind (see RoleCache::store).
  CollectiveKind remember_kind(
      PyTypeObject* node_class,
      CollectiveKind kind,
      bool overwrite);
  // With the GIL: the weak reference to a class the cache holds has died.
  void forget_dead_class(PyObject* weakref);
  size_t role_cache_size() const {
    return role_cache_.size();
  }
  // torch_ext.collectives.order_check's checker, or None to switch the check
  // off. With the GIL.
  void set_collective_checker(PyObject* checker);

 private:
  CollectiveKind decide_kind(PyTypeObject* node_class);

  // Address comparison in is_python_node: the one type_info object of PyNode
  // lives in libtorch_python (this library cannot even name it), while
  // type_info::operator== falls back to strcmp on the mangled names, which
  // share their first 16 characters across torch's autograd nodes.
  const std::type_info& python_node_;
  // Python's functions and the error type; read and called with the GIL.
  Answers answers_;
  // The weak references' callback (forget_dead_class).
  THPObjectPtr forget_callback_;
  // Each node class's kind (collectives/role_cache.h), keyed by its
  // PyTypeObject*, with a weak reference to the class as the entry's death
  // token.
  RoleCache role_cache_;
  // The order check's checker, or null when the check is off. Written with
  // the GIL; whether it is set is read without it.
  THPObjectPtr collective_checker_;
  std::atomic<bool> collective_check_on_{false};
};

// The host torch_ext's import installed. Raises if none is yet.
PythonHost& python_host();

// Adds install_host to torch_ext._C. False, with a Python error set, on
// failure.
bool init_host_bindings(PyObject* module);

} // namespace torch_ext
