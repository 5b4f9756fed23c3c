// frtools call-site cache: the calling Python stack of a recorded op, as an interned id,
// without building a Python object per op.
//
// StackCache(skip_code).lookup() walks the current frame chain (PyEval_GetFrame /
// PyFrame_GetBack), skips the innermost frames whose code lives in the same file as
// ``skip_code`` (frtools' own capture module), keys the next (at most) ``depth`` frames by
// (code object, last instruction) and returns the id stored for that key, or -1 on a miss.
// On a miss the caller works the text out in Python, interns it, and calls store(id) from
// the same place, which walks the same frames again and remembers the id. The cache holds a
// reference to every code object of a stored key, so an address is never reused for another
// code object while its key is in the table. Everything runs under the GIL.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
// CPython 3.11: read the interpreter's frame chain directly. PyEval_GetFrame /
// PyFrame_GetBack would create a frame object for every frame of the chain that has none
// (the op's own new frames, each call), which costs more than the rest of the walk.
#define FRTOOLS_FRAME_CHAIN 1
#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#endif

#include <cstdint>
#include <cstring>
#include <unordered_map>
#include <vector>

namespace {

constexpr int kMaxDepth = 64;

struct Key {
  int n = 0;
  uintptr_t v[2 * kMaxDepth];
};

struct Entry {
  std::vector<uintptr_t> key;
  long id;
};

struct StackCacheObject {
  PyObject_HEAD
  PyObject* skip_file;  // co_filename of frtools' capture module
  int depth;
  std::unordered_multimap<uint64_t, Entry>* table;
  std::vector<PyObject*>* kept;  // code objects referenced by stored keys
};

inline uint64_t mix(uint64_t h, uint64_t x) {
  h ^= x + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  return h;
}

#ifndef FRTOOLS_FRAME_CHAIN
int lasti_of(PyFrameObject* f) {
#if PY_VERSION_HEX >= 0x030B0000
  return PyFrame_GetLasti(f);
#else
  return f->f_lasti;
#endif
}
#endif

bool is_skipped(StackCacheObject* self, PyCodeObject* code) {
  PyObject* fn = code->co_filename;
  if (fn == self->skip_file) return true;
  return PyUnicode_Check(fn) && PyUnicode_Compare(fn, self->skip_file) == 0;
}

// Fill key from the current stack; returns the hash. keep: also collect new refs to the
// code objects (for store). A Python error set here is cleared by the callers.
uint64_t walk(StackCacheObject* self, Key* key, std::vector<PyObject*>* keep) {
  key->n = 0;
  uint64_t h = 1469598103934665603ULL;
#ifdef FRTOOLS_FRAME_CHAIN
  // the same frames PyEval_GetFrame / PyFrame_GetBack visit: incomplete ones skipped
  _PyInterpreterFrame* f = PyThreadState_Get()->cframe->current_frame;
  bool skip = true;
  for (; f != nullptr && key->n < self->depth; f = f->previous) {
    if (_PyFrame_IsIncomplete(f)) continue;
    PyCodeObject* code = f->f_code;
    if (skip && is_skipped(self, code)) continue;
    skip = false;
    uintptr_t c = reinterpret_cast<uintptr_t>(code);
    uintptr_t l = static_cast<uintptr_t>(_PyInterpreterFrame_LASTI(f));
    key->v[2 * key->n] = c;
    key->v[2 * key->n + 1] = l;
    key->n++;
    h = mix(mix(h, c), l);
    if (keep) {
      Py_INCREF(code);
      keep->push_back(reinterpret_cast<PyObject*>(code));
    }
  }
  return mix(h, uint64_t(key->n));
#else
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  bool skipping = true;
  while (frame != nullptr && key->n < self->depth) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new ref
    if (skipping && is_skipped(self, code)) {
      Py_DECREF(code);
    } else {
      skipping = false;
      uintptr_t c = reinterpret_cast<uintptr_t>(code);
      uintptr_t l = static_cast<uintptr_t>(lasti_of(frame));
      key->v[2 * key->n] = c;
      key->v[2 * key->n + 1] = l;
      key->n++;
      h = mix(mix(h, c), l);
      if (keep) {
        keep->push_back(reinterpret_cast<PyObject*>(code));
      } else {
        Py_DECREF(code);
      }
    }
    PyFrameObject* back = PyFrame_GetBack(frame);  // new ref
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  return mix(h, uint64_t(key->n));
#endif
}

const Entry* find(StackCacheObject* self, uint64_t h, const Key& key) {
  auto range = self->table->equal_range(h);
  size_t bytes = sizeof(uintptr_t) * 2 * size_t(key.n);
  for (auto it = range.first; it != range.second; ++it) {
    const Entry& e = it->second;
    if (e.key.size() == size_t(2 * key.n) && std::memcmp(e.key.data(), key.v, bytes) == 0) {
      return &e;
    }
  }
  return nullptr;
}

PyObject* StackCache_lookup(StackCacheObject* self, PyObject*) {
  Key key;
  uint64_t h = walk(self, &key, nullptr);
  if (PyErr_Occurred()) return nullptr;
  const Entry* e = find(self, h, key);
  return PyLong_FromLong(e ? e->id : -1);
}

PyObject* StackCache_store(StackCacheObject* self, PyObject* arg) {
  long id = PyLong_AsLong(arg);
  if (id == -1 && PyErr_Occurred()) return nullptr;
  Key key;
  std::vector<PyObject*> codes;
  uint64_t h = walk(self, &key, &codes);
  if (PyErr_Occurred()) {
    for (PyObject* c : codes) Py_DECREF(c);
    return nullptr;
  }
  if (find(self, h, key) != nullptr) {
    for (PyObject* c : codes) Py_DECREF(c);
    Py_RETURN_NONE;
  }
  Entry e;
  e.key.assign(key.v, key.v + 2 * key.n);
  e.id = id;
  self->table->emplace(h, std::move(e));
  for (PyObject* c : codes) self->kept->push_back(c);  // references kept for good
  Py_RETURN_NONE;
}

PyObject* StackCache_len(StackCacheObject* self, void*) {
  return PyLong_FromSize_t(self->table->size());
}

int StackCache_init(StackCacheObject* self, PyObject* args, PyObject* kwds) {
  static const char* kwlist[] = {"skip_code", "depth", nullptr};
  PyObject* code = nullptr;
  int depth = 32;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|i", const_cast<char**>(kwlist), &code,
                                   &depth)) {
    return -1;
  }
  if (!PyCode_Check(code)) {
    PyErr_SetString(PyExc_TypeError, "skip_code must be a code object");
    return -1;
  }
  if (depth < 1 || depth > kMaxDepth) {
    PyErr_Format(PyExc_ValueError, "depth must be 1..%d", kMaxDepth);
    return -1;
  }
  PyObject* fn = reinterpret_cast<PyCodeObject*>(code)->co_filename;
  Py_INCREF(fn);
  Py_XSETREF(self->skip_file, fn);
  self->depth = depth;
  if (self->table == nullptr) self->table = new std::unordered_multimap<uint64_t, Entry>();
  if (self->kept == nullptr) self->kept = new std::vector<PyObject*>();
  return 0;
}

void StackCache_dealloc(StackCacheObject* self) {
  Py_XDECREF(self->skip_file);
  delete self->table;
  if (self->kept) {
    for (PyObject* c : *self->kept) Py_DECREF(c);
    delete self->kept;
  }
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyObject* StackCache_new(PyTypeObject* type, PyObject*, PyObject*) {
  auto* self = reinterpret_cast<StackCacheObject*>(type->tp_alloc(type, 0));
  if (self) {
    self->skip_file = nullptr;
    self->depth = 32;
    self->table = nullptr;
    self->kept = nullptr;
  }
  return reinterpret_cast<PyObject*>(self);
}

PyMethodDef StackCache_methods[] = {
    {"lookup", (PyCFunction)StackCache_lookup, METH_NOARGS,
     "lookup() -> stack id stored for the calling stack, or -1."},
    {"store", (PyCFunction)StackCache_store, METH_O,
     "store(id): remember id for the calling stack (call from where lookup() missed)."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef StackCache_getset[] = {
    {"size", (getter)StackCache_len, nullptr, "stacks stored", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject StackCacheType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef callsite_module = {PyModuleDef_HEAD_INIT, "frtools.recorder._callsite",
                               "Cached call-stack ids for frtools' recorder.", -1, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__callsite(void) {
  StackCacheType.tp_name = "frtools.recorder._callsite.StackCache";
  StackCacheType.tp_basicsize = sizeof(StackCacheObject);
  StackCacheType.tp_flags = Py_TPFLAGS_DEFAULT;
  StackCacheType.tp_doc = "Calling-stack ids keyed by (code object, last instruction) chains.";
  StackCacheType.tp_new = StackCache_new;
  StackCacheType.tp_init = (initproc)StackCache_init;
  StackCacheType.tp_dealloc = (destructor)StackCache_dealloc;
  StackCacheType.tp_methods = StackCache_methods;
  StackCacheType.tp_getset = StackCache_getset;
  if (PyType_Ready(&StackCacheType) < 0) return nullptr;
  PyObject* m = PyModule_Create(&callsite_module);
  if (m == nullptr) return nullptr;
  Py_INCREF(&StackCacheType);
  if (PyModule_AddObject(m, "StackCache", reinterpret_cast<PyObject*>(&StackCacheType)) < 0) {
    Py_DECREF(&StackCacheType);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
