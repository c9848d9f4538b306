// The Python side of collectives: which node classes are collectives (the
// host's role cache, filled by the built-in rules and explicit
// registrations), the host's questions to torch_ext.collectives.lanes and
// torch_ext.collectives.order_check, and their torch_ext._C bindings.

#include "bindings/python_collectives.h"
#include "bindings/python_host.h"
#include "bindings/python_request.h"
#include "engine/collective_progress.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <typeinfo>
#include <unordered_map>
#include <vector>

namespace torch_ext {

CollectiveKind PythonHost::remember_kind(
    PyTypeObject* node_class,
    CollectiveKind kind,
    bool overwrite) {
  // Made before the cache is locked: allocating may collect garbage and so
  // run finalizers, including forget_dead_class, which locks it.
  THPObjectPtr weakref(PyWeakref_NewRef(
      reinterpret_cast<PyObject*>(node_class),
      forget_callback_.get()));
  if (!weakref) {
    throw python_error();
  }
  const RoleCache::Stored stored =
      role_cache_.store(node_class, kind, overwrite, weakref.get());
  if (stored.token_kept) {
    // The cache's now; dropped by forget_dead_class. Otherwise `weakref` is
    // released here, outside the cache's lock.
    weakref.release();
  }
  return stored.kind;
}

void PythonHost::forget_dead_class(PyObject* weakref) {
  if (role_cache_.remove(weakref)) {
    Py_DECREF(weakref);
  }
}

namespace {

CollectiveKind kind_from_python(long role, int defers_wait) {
  TORCH_CHECK(
      role >= 0 && role <= static_cast<long>(CollectiveRole::kLane),
      "a collective role is 0 (none), 1 (launch), 2 (wait) or 3 (lane), got ",
      role);
  return {static_cast<CollectiveRole>(role), defers_wait != 0};
}

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
  int defers_wait = 0;
  if (!PyArg_ParseTuple(args, "Olp", &node_class, &role, &defers_wait)) {
    return nullptr;
  }
  python_host().remember_kind(
      checked_node_class(node_class),
      kind_from_python(role, defers_wait),
      /*overwrite=*/true);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

} // namespace

// The slow path: `node_class` is not in the cache.
CollectiveKind PythonHost::decide_kind(PyTypeObject* node_class) {
  pybind11::gil_scoped_acquire gil;
  // Another thread may have decided, or registered, it while this one waited.
  if (auto kind = role_cache_.find(node_class)) {
    return *kind;
  }
  THPObjectPtr decided(PyObject_CallOneArg(
      answers_.node_class_kind.get(),
      reinterpret_cast<PyObject*>(node_class)));
  if (!decided) {
    throw python_error();
  }
  long role = 0;
  int defers_wait = 0;
  if (!PyArg_ParseTuple(decided.get(), "lp", &role, &defers_wait)) {
    throw python_error();
  }
  // Not overwriting: a registration made while the decider ran wins.
  return remember_kind(
      node_class,
      kind_from_python(role, defers_wait),
      /*overwrite=*/false);
}

CollectiveKind PythonHost::kind_of_class(PyTypeObject* node_class) {
  if (auto kind = role_cache_.find(node_class)) {
    return *kind;
  }
  return decide_kind(node_class);
}

CollectiveKind PythonHost::collective_kind(const Node& fn) {
  if (!is_python_node(fn)) {
    return {};
  }
  // Read without the GIL: a PyNode's Python object (its THPFunction) lives
  // as long as the node, and so does its class.
  PyObject* obj = static_cast<const torch::autograd::PyNode&>(fn).pyobj();
  if (obj == nullptr) {
    return {};
  }
  return kind_of_class(Py_TYPE(obj));
}

// Asks torch_ext.collectives.lanes with the GIL, which also refuses a group
// the engine can see is unsafe (DDP reducing on it).
uintptr_t PythonHost::lane_group_key(const Node& fn) {
  pybind11::gil_scoped_acquire gil;
  PyObject* ctx = static_cast<const torch::autograd::PyNode&>(fn).pyobj();
  TORCH_INTERNAL_ASSERT(ctx != nullptr);
  THPObjectPtr group(PyObject_CallOneArg(answers_.lane_group.get(), ctx));
  if (!group) {
    throw python_error();
  }
  // The group outlives the call: the node's ctx holds it (ctx.group), or it
  // is the default group. torch_ext.collectives.lanes holds it only weakly, so
  // that destroy_process_group can free it (test_clean_exit.py says why).
  return reinterpret_cast<uintptr_t>(group.get());
}

bool PythonHost::collective_check_enabled() {
  return collective_check_on_.load(std::memory_order_relaxed);
}

namespace {

// The node as the checker names it: a Python Function's ctx (whose
// ctx.group it reads), another node by its name(). With the GIL.
PyObject* checked_node(const PythonHost& host, const Node& fn) {
  PyObject* ctx = host.is_python_node(fn)
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

} // namespace

// checker.begin(collectives, overlap), each collective (node, sequence_nr,
// expected gradients), in the order the call starts them; overlap the call's
// (microbatch, forward_collectives) when it runs beside the next forward,
// else None.
std::shared_ptr<CollectiveOrderCheck> PythonHost::begin_collective_check(
    const std::vector<CheckedCollective>& sequence,
    const CollectiveProgress* beside_forward) {
  pybind11::gil_scoped_acquire gil;
  if (!collective_checker_) {
    return nullptr; // switched off since the call started
  }
  THPObjectPtr collectives(
      PyList_New(static_cast<Py_ssize_t>(sequence.size())));
  if (!collectives) {
    throw python_error();
  }
  for (size_t i = 0; i < sequence.size(); ++i) {
    THPObjectPtr node(checked_node(*this, *sequence[i].fn));
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
  THPObjectPtr overlap(Py_NewRef(Py_None));
  if (beside_forward != nullptr) {
    const std::string_view rule = name_of(beside_forward->rule);
    overlap = Py_BuildValue(
        "(LN)",
        static_cast<long long>(beside_forward->microbatch),
        PyUnicode_FromStringAndSize(
            rule.data(),
            static_cast<Py_ssize_t>(rule.size())));
    if (!overlap) {
      throw python_error();
    }
  }
  // The exchange starts before any of the call's collectives, on every rank.
  const StartingPlannedCollective starting;
  PyObject* pending = PyObject_CallMethod(
      collective_checker_.get(),
      "begin",
      "OO",
      collectives.get(),
      overlap.get());
  if (pending == nullptr) {
    throw python_error();
  }
  return std::make_shared<PythonOrderCheck>(
      Py_NewRef(collective_checker_.get()),
      pending);
}

void PythonHost::set_collective_checker(PyObject* checker) {
  // Released last, as Py_XSETREF does: freeing it may run Python code.
  const THPObjectPtr previous(collective_checker_.release());
  if (checker == Py_None) {
    collective_check_on_.store(false);
  } else {
    collective_checker_ = Py_NewRef(checker);
    collective_check_on_.store(true);
  }
}

// A note on a Python exception (its type and message stay the node's own),
// context on a c10::Error.
std::exception_ptr PythonHost::name_collective_node_in_error(
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

namespace {

PyObject* py_collective_role(PyObject* /*module*/, PyObject* node_or_class) {
  HANDLE_TH_ERRORS
  if (PyType_Check(node_or_class)) {
    return PyLong_FromLong(
        static_cast<long>(python_host()
                              .kind_of_class(checked_node_class(node_or_class))
                              .role));
  }
  TORCH_CHECK_TYPE(
      THPFunction_Check(node_or_class),
      "collective_role expects the node of a Python autograd.Function or its class, got ",
      Py_TYPE(node_or_class)->tp_name);
  const auto node = reinterpret_cast<THPFunction*>(node_or_class)->cdata;
  CollectiveRole role = CollectiveRole::kNone;
  if (node) {
    pybind11::gil_scoped_release no_gil; // as discovery calls it
    role = python_host().collective_kind(*node).role;
  }
  return PyLong_FromLong(static_cast<long>(role));
  END_HANDLE_TH_ERRORS
}

PyObject* py_set_collective_checker(PyObject* /*module*/, PyObject* checker) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(
      checker == Py_None ||
          (PyObject_HasAttrString(checker, "begin") != 0 &&
           PyObject_HasAttrString(checker, "wait") != 0),
      "the collective checker must have begin and wait methods, or be None");
  python_host().set_collective_checker(checker);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* py_collective_role_cache_size(
    PyObject* /*module*/,
    PyObject* /*unused*/) {
  HANDLE_TH_ERRORS
  return PyLong_FromSize_t(python_host().role_cache_size());
  END_HANDLE_TH_ERRORS
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
      is_launch(python_host().collective_kind(*checked_node_of(node)).role));
  END_HANDLE_TH_ERRORS
}

PyMethodDef collective_methods[] = {
    {"set_collective_role",
     py_set_collective_role,
     METH_VARARGS,
     "set_collective_role(node_class, role, defers_wait): role 0 none, 1 "
     "launch, 2 wait, 3 lane, and whether the node hands its result over in "
     "flight; wins over the built-in rules."},
    {"collective_role",
     py_collective_role,
     METH_O,
     "collective_role(node or node class) -> role of a Python Function's node, "
     "as the engine sees it (0 none, 1 launch, 2 wait, 3 lane)."},
    {"set_collective_checker",
     py_set_collective_checker,
     METH_O,
     "set_collective_checker(checker or None): checker.begin(collectives, "
     "overlap) when a call's plan is made, collectives its sequence as (node, "
     "sequence_nr, expected gradients), overlap (microbatch, "
     "forward_collectives) for a backward handed over by "
     "overlap_microbatches, else None; checker.wait(what begin returned) before the first "
     "starts and at the call's end, raising on a mismatch; None switches the "
     "check off."},
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
    {"is_collective_node",
     py_is_collective_node,
     METH_O,
     "is_collective_node(node) -> bool: whether the engine prioritises the "
     "node as a collective."},
    {nullptr, nullptr, 0, nullptr}};

} // namespace

bool init_collective_bindings(PyObject* module) {
  if (PyModule_AddFunctions(module, collective_methods) != 0) {
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
