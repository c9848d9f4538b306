#pragma once

// A plain CPython type whose objects hold a C++ shared_ptr<T>: split
// backward's SplitState (python_split.cpp) and the overlap's HandedBackward
// (python_overlap.cpp). Such an object refers to no Python object, is not
// tracked by the cyclic GC and can be in no reference cycle; dropping its last
// reference releases its share of the C++ object.

#include <Python.h>

#include <memory>
#include <new>
#include <utility>

namespace torch_ext {

template <typename T>
struct PySharedObject {
  PyObject_HEAD
  std::shared_ptr<T> held;

  // What `self`, an object of a type made by init_type, holds.
  static std::shared_ptr<T>& of(PyObject* self) {
    return reinterpret_cast<PySharedObject*>(self)->held;
  }

  // A new object of `type` holding `held`; null, with a Python error set, on
  // failure.
  static PyObject* wrap(PyTypeObject& type, std::shared_ptr<T> held) {
    PyObject* obj = type.tp_alloc(&type, 0);
    if (obj == nullptr) {
      return nullptr;
    }
    new (&reinterpret_cast<PySharedObject*>(obj)->held)
        std::shared_ptr<T>(std::move(held));
    return obj;
  }

  // Fills the slots every such type shares; the caller adds its own (repr,
  // getters) and readies it (PyType_Ready).
  static void init_type(PyTypeObject& type, const char* name, const char* doc) {
    type.tp_name = name;
    type.tp_basicsize = sizeof(PySharedObject);
    type.tp_dealloc = dealloc;
    type.tp_flags = Py_TPFLAGS_DEFAULT;
    type.tp_doc = doc;
  }

 private:
  static void dealloc(PyObject* self) {
    of(self).~shared_ptr();
    Py_TYPE(self)->tp_free(self);
  }
};

} // namespace torch_ext
