// The black box's C interface for other native modules (frtools' C++ process-group hooks):
// ``frtools.recorder._blackbox.C_API`` is a PyCapsule named "frtools.recorder._blackbox.C_API"
// holding one FrtBoxApi. The two modules are never linked: the hooks module reads the table
// at install time and calls through it.
//
// A handle keeps the box's native state alive (not its mapping): every call on a handle
// whose box was closed, or from a forked child, is a no-op (record returns -1). Only
// ``acquire`` needs the GIL; the others never touch Python, so they may run on any thread.
#pragma once

#include <Python.h>

#include <cstddef>
#include <cstdint>

#define FRT_BOX_API_CAPSULE "frtools.recorder._blackbox.C_API"
#define FRT_BOX_API_VERSION 1

extern "C" {

typedef struct FrtBoxApi {
  int version;  // FRT_BOX_API_VERSION
  // A handle on the open box of a BlackBox object (GIL held); NULL with a Python error set.
  void* (*acquire)(PyObject* blackbox);
  // Drop a handle (any thread).
  void (*release)(void* box);
  // BlackBox.record: the record id, -1 when the box is closed (or this is a forked child).
  int64_t (*record)(void* box, int32_t pg, uint32_t op, int64_t coll, int64_t p2p, int32_t peer,
                    int is_p2p, uint32_t in_sizes, uint32_t out_sizes, uint32_t in_dtypes,
                    uint32_t out_dtypes, uint32_t stack);
  // BlackBox.mark_completed.
  void (*mark_completed)(void* box, int64_t rid);
  // BlackBox.mark_failed with the error text (UTF-8, cut to the box's limit).
  int (*mark_failed)(void* box, int64_t rid, const char* text, size_t n);
  // BlackBox.intern: the string-table id (0 for "", 0xFFFFFFFF when the table is full or
  // the box closed).
  uint32_t (*intern)(void* box, const char* s, size_t n);
} FrtBoxApi;
}
