// The Python side of collectives: which node classes are collectives (the
// role cache, the built-in rules' decider and explicit registrations), the
// questions the engine asks torch_ext.collectives.lanes and
// torch_ext.collectives.order_check (installed as HostCallbacks), and their
// torch_ext._C bindings.

#include "bindings/python_collectives.h"
#include "bindings/python_request.h"
#include "collectives/role_cache.h"
#include "engine/collective_progress.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <typeinfo>
#include <unordered_map>
#include <vector>

namespace torch_ext {
namespace {

// PyNode's type_info. libtorch_python does not export it (typeid(PyNode)
// fails to link), so torch_ext learns it from a live PyNode at import
// (remember_python_node_type); until then no node has a role.
std::atomic<const std::type_info*> python_node_type{nullptr};

// Each node class's role (collectives/role_cache.h), keyed by its
// PyTypeObject*, with a weak reference to the class as the entry's death
// token. Never destroyed: weak reference callbacks and discovery on other
// threads may run during interpreter shutdown.
RoleCache& role_cache() {
  static auto* cache = new RoleCache();
  return *cache;
}

// torch_ext.collectives.roles' built-in rules, called with a node class seen
// for the first time; returns its role as an int. Guarded by the GIL.
PyObject* role_decider = nullptr;
// The weak references' callback (forget_dead_class below).
PyObject* forget_callback = nullptr;
// torch_ext.collectives.lanes' resolver: a lane node's ctx -> its process
// group. Guarded by the GIL.
PyObject* lane_group_resolver = nullptr;
// torch_ext.collectives.order_check's checker, or null when the check is off.
// Written with the GIL; read without it by collective_check_enabled.
PyObject* collective_checker = nullptr;
std::atomic<bool> collective_check_on{false};

// With the GIL. Records `node_class`'s role (see RoleCache::store).
CollectiveRole remember_role(
    PyTypeObject* node_class,
    CollectiveRole role,
    bool overwrite) {
  // Made before the cache is locked: allocating may collect garbage and so
  // run finalizers, including forget_dead_class, which locks it.
  THPObjectPtr weakref(PyWeakref_NewRef(
      reinterpret_cast<PyObject*>(node_class),
      forget_callback));
  if (!weakref) {
    throw python_error();
  }
  const RoleCache::Stored stored =
      role_cache().store(node_class, role, overwrite, weakref.get());
  if (stored.token_kept) {
    // The cache's now; dropped by forget_dead_class. Otherwise `weakref` is
    // released here, outside the cache's lock.
    weakref.release();
  }
  return stored.role;
}

CollectiveRole role_from_int(long value) {
  TORCH_CHECK(
      value >= 0 && value <= static_cast<long>(CollectiveRole::kLane),
      "a collective role is 0 (none), 1 (launch), 2 (wait) or 3 (lane), got ",
      value);
  return static_cast<CollectiveRole>(value);
}

// The slow path: `node_class` is not in the cache.
CollectiveRole decide_role(PyTypeObject* node_class) {
  pybind11::gil_scoped_acquire gil;
  // Another thread may have decided, or registered, it while this one waited.
  if (auto role = role_cache().find(node_class)) {
    return *role;
  }
  if (role_decider == nullptr) {
    // torch_ext.collectives.roles not imported yet: decide again next time.
    return CollectiveRole::kNone;
  }
  THPObjectPtr decided(PyObject_CallOneArg(
      role_decider,
      reinterpret_cast<PyObject*>(node_class)));
  if (!decided) {
    throw python_error();
  }
  const long value = PyLong_AsLong(decided.get());
  if (value == -1 && PyErr_Occurred()) {
    throw python_error();
  }
  // Not overwriting: a registration made while the decider ran wins.
  return remember_role(node_class, role_from_int(value), /*overwrite=*/false);
}

PyObject* forget_dead_class(PyObject* /*self*/, PyObject* weakref) {
  if (role_cache().remove(weakref)) {
    Py_DECREF(weakref);
  }
  Py_RETURN_NONE;
}

PyMethodDef forget_dead_class_def = {
    "_forget_dead_node_class",
    forget_dead_class,
    METH_O,
    "Weak reference callback: a node class the collective role cache holds is dying."};

PyTypeObject* checked_node_class(PyObject* obj) {
  TORCH_CHECK_TYPE(
      PyType_Check(obj) &&
          PyType_IsSubtype(
              reinterpret_cast<PyTypeObject*>(obj),
              &THPFunctionType),
      "expected the backward node class of an autograd.Function (Function._backward_cls), got ",
      PyType_Check(obj) ? reinterpret_cast<PyTypeObject*>(obj)->tp_name
                        : Py_TYPE(obj)->tp_name);
  return reinterpret_cast<PyTypeObject*>(obj);
}

PyObject* py_set_collective_role(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* node_class = nullptr;
  long role = 0;
  if (!PyArg_ParseTuple(args, "Ol", &node_class, &role)) {
    return nullptr;
  }
  remember_role(
      checked_node_class(node_class),
      role_from_int(role),
      /*overwrite=*/true);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* py_set_collective_role_decider(
    PyObject* /*module*/,
    PyObject* decider) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(
      PyCallable_Check(decider),
      "the role decider must be callable");
  Py_INCREF(decider);
  Py_XSETREF(role_decider, decider);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// The role of a node class, deciding it if it is new.
CollectiveRole role_of_class(PyTypeObject* node_class) {
  if (auto role = role_cache().find(node_class)) {
    return *role;
  }
  return decide_role(node_class);
}

// HostCallbacks::collective_role.
CollectiveRole python_collective_role(const Node& fn) {
  const std::type_info* python_node =
      python_node_type.load(std::memory_order_relaxed);
  // Address comparison: the one type_info object of PyNode lives in
  // libtorch_python (this library cannot even name it), while
  // type_info::operator== falls back to strcmp on the mangled names, which
  // share their first 16 characters across torch's autograd nodes.
  if (python_node == nullptr || &typeid(fn) != python_node) {
    return CollectiveRole::kNone;
  }
  // Read without the GIL: a PyNode's Python object (its THPFunction) lives
  // as long as the node, and so does its class.
  PyObject* obj = static_cast<const torch::autograd::PyNode&>(fn).pyobj();
  if (obj == nullptr) {
    return CollectiveRole::kNone;
  }
  return role_of_class(Py_TYPE(obj));
}

// HostCallbacks::defers_its_wait.
bool python_defers_its_wait(const Node& fn) {
  // Only discovery calls this, for a node it found to be a launch (a PyNode),
  // once per launch node: a handful per call.
  const PyObject* obj = static_cast<const torch::autograd::PyNode&>(fn).pyobj();
  constexpr std::string_view kOwnOps = "GeneratedBackwardFor_torch_ext_";
  return obj != nullptr &&
      std::string_view(Py_TYPE(obj)->tp_name).substr(0, kOwnOps.size()) ==
      kOwnOps;
}

// HostCallbacks::lane_group_key: asks torch_ext.collectives.lanes with the GIL,
// which also refuses a group the engine can see is unsafe (DDP reducing on it).
uintptr_t python_lane_group_key(const Node& fn) {
  pybind11::gil_scoped_acquire gil;
  TORCH_INTERNAL_ASSERT(
      lane_group_resolver != nullptr,
      "torch_ext.collectives.lanes is not imported");
  PyObject* ctx = static_cast<const torch::autograd::PyNode&>(fn).pyobj();
  TORCH_INTERNAL_ASSERT(ctx != nullptr);
  THPObjectPtr group(PyObject_CallOneArg(lane_group_resolver, ctx));
  if (!group) {
    throw python_error();
  }
  // The group outlives the call: the node's ctx holds it (ctx.group), or it
  // is the default group. torch_ext.collectives.lanes holds it only weakly, so
  // that destroy_process_group can free it (test_clean_exit.py says why).
  return reinterpret_cast<uintptr_t>(group.get());
}

bool python_collective_check_enabled() {
  return collective_check_on.load(std::memory_order_relaxed);
}

// The node as the checker names it: a Python Function's ctx (whose
// ctx.group it reads), another node by its name(). With the GIL.
PyObject* checked_node(const Node& fn) {
  PyObject* ctx =
      &typeid(fn) == python_node_type.load(std::memory_order_relaxed)
      ? static_cast<const torch::autograd::PyNode&>(fn).pyobj()
      : nullptr;
  return ctx != nullptr ? Py_NewRef(ctx)
                        : PyUnicode_FromString(fn.name().c_str());
}

// The gradients `fn` will be given, as their metadata says (validate_outputs
// makes every producer's match it): (shape, dtype) each, None for a nested
// tensor's. With the GIL.
PyObject* expected_gradients(const Node& fn) {
  THPObjectPtr gradients(PyList_New(static_cast<Py_ssize_t>(fn.num_inputs())));
  if (!gradients) {
    return nullptr;
  }
  for (uint32_t i = 0; i < fn.num_inputs(); ++i) {
    const torch::autograd::InputMetadata& metadata = fn.input_metadata(i);
    PyObject* gradient = nullptr;
    if (metadata.was_default_constructed() || metadata.is_nested_tensor()) {
      gradient = Py_NewRef(Py_None);
    } else {
      const c10::SymIntArrayRef sizes = metadata.shape_as_dim_vector();
      THPObjectPtr shape(PyTuple_New(static_cast<Py_ssize_t>(sizes.size())));
      if (!shape) {
        return nullptr;
      }
      for (size_t d = 0; d < sizes.size(); ++d) {
        const std::optional<int64_t> size = sizes[d].maybe_as_int();
        PyObject* item = PyLong_FromLongLong(size.value_or(-1));
        if (item == nullptr) {
          return nullptr;
        }
        PyTuple_SET_ITEM(shape.get(), static_cast<Py_ssize_t>(d), item);
      }
      PyObject* dtype = reinterpret_cast<PyObject*>(
          torch::getTHPDtype(metadata.dtype().toScalarType()));
      gradient = PyTuple_Pack(2, shape.get(), dtype);
    }
    if (gradient == nullptr) {
      return nullptr;
    }
    PyList_SET_ITEM(gradients.get(), static_cast<Py_ssize_t>(i), gradient);
  }
  return gradients.release();
}

// One call's check, in torch_ext.collectives.order_check's hands:
// checker.begin's exchange in flight, awaited with checker.wait.
class PythonOrderCheck final : public CollectiveOrderCheck {
 public:
  PythonOrderCheck(PyObject* checker, PyObject* pending)
      : checker_(checker), pending_(pending) {}
  PythonOrderCheck(const PythonOrderCheck&) = delete;
  PythonOrderCheck& operator=(const PythonOrderCheck&) = delete;

  ~PythonOrderCheck() override {
    if (!Py_IsInitialized()) {
      return;
    }
    pybind11::gil_scoped_acquire gil;
    Py_DECREF(pending_);
    Py_DECREF(checker_);
  }

  void await(int32_t collective) override {
    if (every_verdict_in_.load(std::memory_order_acquire)) {
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (mismatch_) {
        std::rethrow_exception(mismatch_);
      }
    }
    try {
      // Naming a mismatch exchanges the sequences: part of the check, which
      // the collective gate lets through (collective_progress.h).
      const StartingPlannedCollective starting;
      pybind11::gil_scoped_acquire gil;
      // The checker keeps each group's verdict, and waits for an exchange
      // with the GIL released: threads awaiting different groups do not
      // wait for each other.
      THPObjectPtr result(
          collective == kEveryCollective
              ? PyObject_CallMethod(checker_, "wait", "O", pending_)
              : PyObject_CallMethod(
                    checker_,
                    "wait",
                    "Oi",
                    pending_,
                    collective));
      if (!result) {
        // Fetched now: the mismatch may be rethrown on another thread.
        python_error mismatch;
        mismatch.persist();
        throw mismatch;
      }
      // True once every group's verdict is in and agrees: later questions
      // need not take the GIL (a lane may wait milliseconds for it).
      if (result.get() == Py_True) {
        every_verdict_in_.store(true, std::memory_order_release);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!mismatch_) {
        mismatch_ = std::current_exception();
      }
      std::rethrow_exception(mismatch_);
    }
  }

 private:
  std::atomic<bool> every_verdict_in_{false};
  std::mutex mutex_;
  std::exception_ptr mismatch_;
  // Owned references, released with the GIL.
  PyObject* checker_;
  PyObject* pending_;
};

// HostCallbacks::begin_collective_check: checker.begin(collectives), each
// (node, sequence_nr, expected gradients), in the order the call starts them.
std::shared_ptr<CollectiveOrderCheck> python_begin_collective_check(
    const std::vector<CheckedCollective>& sequence) {
  pybind11::gil_scoped_acquire gil;
  if (collective_checker == nullptr) {
    return nullptr; // switched off since the call started
  }
  THPObjectPtr collectives(
      PyList_New(static_cast<Py_ssize_t>(sequence.size())));
  if (!collectives) {
    throw python_error();
  }
  for (size_t i = 0; i < sequence.size(); ++i) {
    THPObjectPtr node(checked_node(*sequence[i].fn));
    THPObjectPtr gradients(
        node ? expected_gradients(*sequence[i].fn) : nullptr);
    PyObject* entry = gradients
        ? Py_BuildValue(
              "(OKO)",
              node.get(),
              static_cast<unsigned long long>(sequence[i].created),
              gradients.get())
        : nullptr;
    if (entry == nullptr) {
      throw python_error();
    }
    PyList_SET_ITEM(collectives.get(), static_cast<Py_ssize_t>(i), entry);
  }
  // The exchange starts before any of the call's collectives, on every rank.
  const StartingPlannedCollective starting;
  PyObject* pending =
      PyObject_CallMethod(collective_checker, "begin", "O", collectives.get());
  if (pending == nullptr) {
    throw python_error();
  }
  return std::make_shared<PythonOrderCheck>(
      Py_NewRef(collective_checker),
      pending);
}

// HostCallbacks::raise_if_interrupted. Python runs signal handlers on the
// main thread only, so elsewhere this does nothing.
void python_raise_if_interrupted() {
  pybind11::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) {
    throw python_error();
  }
}

// HostCallbacks::name_collective_node_in_error: a note on a Python exception
// (its type and message stay the node's own), context on a c10::Error.
std::exception_ptr python_name_collective_node_in_error(
    std::exception_ptr error,
    const Node& fn,
    bool in_lane) {
  const std::string where = "raised by " + fn.name() +
      (in_lane ? " in its torch_ext collective lane"
               : ", a collective node, on torch_ext's engine thread");
  try {
    std::rethrow_exception(error);
  } catch (python_error& e) {
    pybind11::gil_scoped_acquire gil;
    if (e.type != nullptr) {
      // An error set from C (pybind11's translation of a c10::Error, as
      // gloo's) is fetched unnormalized: its value may be the message, not
      // the exception, which has no add_note.
      PyErr_NormalizeException(&e.type, &e.value, &e.traceback);
    }
    if (e.value != nullptr) {
      THPObjectPtr note(PyUnicode_FromString(where.c_str()));
      THPObjectPtr added(
          note ? PyObject_CallMethod(e.value, "add_note", "O", note.get())
               : nullptr);
      if (!added) {
        PyErr_Clear(); // the node's own error matters more than the note
      }
    }
  } catch (c10::Error& e) {
    e.add_context(where);
  } catch (...) {
  }
  return error;
}

// `example` is the node of a Python autograd.Function (a PyNode), whose type
// collective_role must recognise.
void remember_python_node_type(const Node& example) {
  TORCH_CHECK(
      std::string_view(typeid(example).name()) == "N5torch8autograd6PyNodeE",
      "remember_python_node_type: expected the node of a Python autograd.Function, got ",
      example.name());
  python_node_type.store(&typeid(example), std::memory_order_relaxed);
}

PyObject* py_collective_role(PyObject* /*module*/, PyObject* node_or_class) {
  HANDLE_TH_ERRORS
  if (PyType_Check(node_or_class)) {
    return PyLong_FromLong(
        static_cast<long>(role_of_class(checked_node_class(node_or_class))));
  }
  TORCH_CHECK_TYPE(
      THPFunction_Check(node_or_class),
      "collective_role expects the node of a Python autograd.Function or its class, got ",
      Py_TYPE(node_or_class)->tp_name);
  const auto node = reinterpret_cast<THPFunction*>(node_or_class)->cdata;
  CollectiveRole role = CollectiveRole::kNone;
  if (node) {
    pybind11::gil_scoped_release no_gil; // as discovery calls it
    role = python_collective_role(*node);
  }
  return PyLong_FromLong(static_cast<long>(role));
  END_HANDLE_TH_ERRORS
}

PyObject* py_set_lane_group_resolver(PyObject* /*module*/, PyObject* resolver) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(
      PyCallable_Check(resolver),
      "the lane group resolver must be callable");
  Py_INCREF(resolver);
  Py_XSETREF(lane_group_resolver, resolver);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* py_set_collective_checker(PyObject* /*module*/, PyObject* checker) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(
      checker == Py_None ||
          (PyObject_HasAttrString(checker, "begin") != 0 &&
           PyObject_HasAttrString(checker, "wait") != 0),
      "the collective checker must have begin and wait methods, or be None");
  if (checker == Py_None) {
    collective_check_on.store(false);
    Py_CLEAR(collective_checker);
  } else {
    Py_INCREF(checker);
    Py_XSETREF(collective_checker, checker);
    collective_check_on.store(true);
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* py_collective_role_cache_size(
    PyObject* /*module*/,
    PyObject* /*unused*/) {
  return PyLong_FromSize_t(role_cache().size());
}

PyObject* py_set_auto_collective_priority(
    PyObject* /*module*/,
    PyObject* enabled) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(
      PyBool_Check(enabled),
      "set_auto_collective_priority expects a bool, got ",
      Py_TYPE(enabled)->tp_name);
  set_auto_collective_priority(enabled == Py_True);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* py_auto_collective_priority(
    PyObject* /*module*/,
    PyObject* /*unused*/) {
  return PyBool_FromLong(auto_collective_priority());
}

PyObject* py_is_collective_node(PyObject* /*module*/, PyObject* node) {
  HANDLE_TH_ERRORS
  return PyBool_FromLong(
      is_launch(python_collective_role(*checked_node_of(node))));
  END_HANDLE_TH_ERRORS
}

PyObject* py_remember_python_node_type(PyObject* /*module*/, PyObject* node) {
  HANDLE_TH_ERRORS
  remember_python_node_type(*checked_node_of(node));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef collective_methods[] = {
    {"set_collective_role",
     py_set_collective_role,
     METH_VARARGS,
     "set_collective_role(node_class, role): 0 none, 1 launch, 2 wait; wins over "
     "the built-in rules."},
    {"set_collective_role_decider",
     py_set_collective_role_decider,
     METH_O,
     "set_collective_role_decider(fn): fn(node_class) -> role, called once per "
     "class not registered."},
    {"collective_role",
     py_collective_role,
     METH_O,
     "collective_role(node or node class) -> role of a Python Function's node, "
     "as the engine sees it (0 none, 1 launch, 2 wait, 3 lane)."},
    {"set_collective_checker",
     py_set_collective_checker,
     METH_O,
     "set_collective_checker(checker or None): checker.begin(collectives) "
     "when a call's plan is made, collectives its sequence as (node, "
     "sequence_nr, expected gradients); checker.wait(what begin returned) before the first "
     "starts and at the call's end, raising on a mismatch; None switches the "
     "check off."},
    {"set_lane_group_resolver",
     py_set_lane_group_resolver,
     METH_O,
     "set_lane_group_resolver(fn): fn(ctx) -> the process group whose lane runs "
     "that lane node."},
    {"_collective_role_cache_size",
     py_collective_role_cache_size,
     METH_NOARGS,
     "_collective_role_cache_size() -> number of node classes whose role is cached."},
    {"set_auto_collective_priority",
     py_set_auto_collective_priority,
     METH_O,
     "set_auto_collective_priority(enabled): switch collectives' automatic "
     "priority."},
    {"auto_collective_priority",
     py_auto_collective_priority,
     METH_NOARGS,
     "auto_collective_priority() -> bool."},
    {"remember_python_node_type",
     py_remember_python_node_type,
     METH_O,
     "remember_python_node_type(node): the grad_fn of a Python "
     "autograd.Function, so the engine can recognise collectives' nodes."},
    {"is_collective_node",
     py_is_collective_node,
     METH_O,
     "is_collective_node(node) -> bool: whether the engine prioritises the "
     "node as a collective."},
    {nullptr, nullptr, 0, nullptr}};

} // namespace

void fill_collective_callbacks(HostCallbacks& callbacks) {
  callbacks.collective_role = python_collective_role;
  callbacks.defers_its_wait = python_defers_its_wait;
  callbacks.lane_group_key = python_lane_group_key;
  callbacks.collective_check_enabled = python_collective_check_enabled;
  callbacks.begin_collective_check = python_begin_collective_check;
  callbacks.raise_if_interrupted = python_raise_if_interrupted;
  callbacks.name_collective_node_in_error =
      python_name_collective_node_in_error;
}

bool init_collective_bindings(PyObject* module) {
  forget_callback = PyCFunction_New(&forget_dead_class_def, nullptr);
  if (forget_callback == nullptr ||
      PyModule_AddFunctions(module, collective_methods) != 0) {
    return false;
  }
  // The engine's values, which torch_ext/collectives.py reads rather than
  // restating them: each role's number, and the automatic priority.
  THPObjectPtr roles(Py_BuildValue(
      "{s:i,s:i,s:i,s:i}",
      "none",
      static_cast<int>(CollectiveRole::kNone),
      "launch",
      static_cast<int>(CollectiveRole::kLaunch),
      "wait",
      static_cast<int>(CollectiveRole::kWait),
      "lane",
      static_cast<int>(CollectiveRole::kLane)));
  THPObjectPtr priority(PyLong_FromLongLong(kCollectivePriority));
  return roles && priority &&
      PyModule_AddObjectRef(module, "collective_roles", roles.get()) == 0 &&
      PyModule_AddObjectRef(module, "collective_priority", priority.get()) == 0;
}

} // namespace torch_ext
