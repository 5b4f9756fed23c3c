// frtools' process-group hooks in C++ (torch >= 2.15): the body of hot_path.make_hooks
// without the interpreter.
//
// ProcessGroup::registerPreHook / registerPostHook take std::function hooks; these record
// each op into the black box through its C interface (box_api.h, a capsule of
// frtools.recorder._blackbox) and hand its Work to a native completion poller, all without
// the GIL. Built on demand against the installed torch (frtools.recorder.native_hooks): it
// depends on torch's exact C++ ABI.
//
// Per op, the same record as the Python hooks: the op's interned "<backend>:<op>" name by
// HookOpName (the table comes from Python: hooks.HOOK_OPS), frtools' own collective / P2P
// sequence ids per group, shapes and dtypes as interned text (cached by shape), the P2P peer
// as a global rank, and the calling Python stack's id. The stack is read from the calling
// thread's frame chain without the GIL (CPython 3.11: the thread is blocked in this hook, so
// its frames cannot change), keyed by (code object, last instruction) and cached; only the
// first sight of a stack takes the GIL, to have Python intern its text (CallSites.miss), so
// both bodies write the same text. On other Python versions the walk takes the GIL.
//
// Completion: the post hook puts the Work into a lock-free bounded ring for a native poller
// thread (no lock the caller could wait on while the poller is preempted, no allocation per
// op; every poll_ms:
// isCompleted(), then the future's error if any: mark_failed with the backend's text, else
// mark_completed; a completed collective also completes its group's older ones), as the
// Python poller does. CUDA ops with CUDA events on are handed to the Recorder's watch_cuda
// (Python, under the GIL).
//
// Nothing here raises into the job: a failure turns recording off (the Recorder's fail(),
// one warning).
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>
#include <torch/csrc/distributed/c10d/Hooks.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <Python.h>
#include <frameobject.h>
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define FRTOOLS_FRAME_CHAIN 1
#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#endif

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "box_api.h"

namespace py = pybind11;

#if PY_VERSION_HEX >= 0x030D0000
#define FRT_FINALIZING() Py_IsFinalizing()
#else
#define FRT_FINALIZING() _Py_IsFinalizing()
#endif

namespace {

constexpr int kMaxDepth = 64;
constexpr uint32_t kStrFull = 0xFFFFFFFFu;

// Set in a forked child (a DataLoader worker): the hooks do nothing there — the parent's box
// is not its to write, and a lock a parent thread held at the fork would never be released.
std::atomic<bool> g_forked{false};
void on_fork_child() { g_forked.store(true, std::memory_order_relaxed); }

// HookShape (hot_path.py), as integers
enum Shape : int { kInPlace = 0, kOutIn = 1, kNoTensors = 2, kPeer = 3 };

struct VecHash {
  size_t operator()(const std::vector<int64_t>& v) const noexcept {
    uint64_t h = 1469598103934665603ULL;
    for (int64_t x : v) h = (h ^ uint64_t(x)) * 1099511628211ULL;
    return size_t(h);
  }
};

inline uint64_t mix(uint64_t h, uint64_t x) {
  return h ^ (x + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2));
}

// The text of an exception thrown by a backend, as Python's str() of it reads.
std::string error_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& err) {
    return err.what_without_backtrace();
  } catch (const std::exception& err) {
    std::string s = err.what();
    return s.empty() ? std::string("Exception") : s;
  } catch (...) {
    return "unknown error";
  }
}

struct Group;

struct Pending {
  int64_t rid;
  c10::intrusive_ptr<c10d::Work> work;
  int64_t order;  // group id for collectives (completed in issue order), -1 for P2P
};

// What every hooked group of the process shares: the box, the caches, the poller.
struct Recorder : std::enable_shared_from_this<Recorder> {
  const FrtBoxApi* api = nullptr;
  void* box = nullptr;
  std::atomic<bool> enabled{true};
  std::atomic<bool> stacks{true};
  bool cuda_events = false;
  int depth = 32;
  pid_t pid = getpid();
  PyObject* skip_file = nullptr;  // co_filename of hot_path.py (its frames are skipped)
  PyObject* stack_miss = nullptr;  // CallSites.miss: interns the calling stack's text
  PyObject* fail_fn = nullptr;     // Recorder.fail, through a str -> None adapter
  PyObject* watch_cuda = nullptr;  // Recorder.watch_cuda(rid, work)
  std::atomic<int64_t> next_group{0};

  // shapes and dtypes -> interned text ids
  std::mutex cache_mutex;
  std::unordered_map<std::vector<int64_t>, uint32_t, VecHash> sizes;
  std::unordered_map<std::vector<int64_t>, uint32_t, VecHash> dtypes;

  // calling stacks -> ids
  struct Entry {
    std::vector<uintptr_t> key;
    int64_t id;
  };
  std::mutex stack_mutex;
  std::unordered_multimap<uint64_t, Entry> stack_table;
  std::vector<PyObject*> kept_codes;  // referenced by stored keys, for good

  // completion: the post hook puts each Work into a bounded ring (Vyukov's MPMC queue with
  // one consumer): no lock the caller could wait on while the poller is preempted, and no
  // allocation per op (a node per op, allocated by the caller and freed by the poller, cost
  // the caller 0 to 0.7 µs more per op in a 2-rank Gloo job, median 0.5). Full (the poller
  // starved for kRing ops), it falls back to a lock-free stack of nodes. The poller takes
  // both per pass and keeps what is not done yet.
  static constexpr uint64_t kRing = 1024;  // a power of two
  struct Cell {
    std::atomic<uint64_t> seq;  // pos: free for the producer of pos; pos + 1: holds pos's item
    Pending item;
  };
  std::unique_ptr<Cell[]> ring{new Cell[kRing]};
  alignas(64) std::atomic<uint64_t> ring_tail{0};  // the next position a producer claims
  alignas(64) uint64_t ring_head = 0;              // the next one to take (under poll_mutex)
  struct Node {
    Pending item;
    Node* next;
  };
  std::atomic<Node*> incoming{nullptr};  // the overflow stack
  std::vector<Pending> waiting;          // under poll_mutex
  std::mutex poll_mutex;         // one pass at a time
  std::mutex queue_mutex;        // the poller's start and stop
  std::condition_variable queue_cv;
  std::thread poller;
  std::atomic<bool> poller_started{false};
  bool stopping = false;
  std::chrono::milliseconds poll_every{10};

  Recorder() {
    for (uint64_t i = 0; i < kRing; ++i) ring[i].seq.store(i, std::memory_order_relaxed);
  }

  ~Recorder() {
    stop_poller();
    drop_pending();
    if (api && box) api->release(box);
    // Python references: dropped only while the interpreter can take them back
    if (Py_IsInitialized() && !FRT_FINALIZING()) {
      PyGILState_STATE g = PyGILState_Ensure();
      Py_XDECREF(skip_file);
      Py_XDECREF(stack_miss);
      Py_XDECREF(fail_fn);
      Py_XDECREF(watch_cuda);
      for (PyObject* c : kept_codes) Py_DECREF(c);
      PyGILState_Release(g);
    }
  }

  // Recording off for good, said once by the Python Recorder.
  void fail(const std::string& why) {
    bool was = enabled.exchange(false);
    if (!was || !Py_IsInitialized() || FRT_FINALIZING()) return;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject* r = PyObject_CallFunction(fail_fn, "s#", why.data(), Py_ssize_t(why.size()));
    if (!r) PyErr_Clear();
    Py_XDECREF(r);
    PyGILState_Release(g);
  }

  uint32_t intern(const std::string& s) {
    if (s.empty()) return 0;
    uint32_t id = api->intern(box, s.data(), s.size());
    return id;
  }

  // (sizes id, dtypes id) of a tensor list: "[[4,2],[3]]", "Float,Half" (model.trace's keys)
  std::pair<uint32_t, uint32_t> sizes_id(const std::vector<at::Tensor>& ts) {
    thread_local std::vector<int64_t> skey, dkey;
    skey.clear();
    dkey.clear();
    for (const auto& t : ts) {
      auto sz = t.sizes();
      skey.push_back(int64_t(sz.size()));
      skey.insert(skey.end(), sz.begin(), sz.end());
      dkey.push_back(int64_t(t.scalar_type()));
    }
    uint32_t sid = 0, did = 0;
    bool have_s = false, have_d = false;
    {
      std::lock_guard<std::mutex> lock(cache_mutex);
      auto a = sizes.find(skey);
      if (a != sizes.end()) {
        sid = a->second;
        have_s = true;
      }
      auto b = dtypes.find(dkey);
      if (b != dtypes.end()) {
        did = b->second;
        have_d = true;
      }
    }
    if (!have_s) {
      std::string text = "[";
      for (size_t i = 0; i < ts.size(); ++i) {
        if (i) text += ",";
        text += "[";
        auto sz = ts[i].sizes();
        for (size_t j = 0; j < sz.size(); ++j) {
          if (j) text += ",";
          text += std::to_string(sz[j]);
        }
        text += "]";
      }
      text += "]";
      sid = intern(text);
      if (sid != kStrFull) {
        std::lock_guard<std::mutex> lock(cache_mutex);
        sizes.emplace(skey, sid);
      }
    }
    if (!have_d) {
      std::string text;
      for (size_t i = 0; i < ts.size(); ++i) {
        if (i) text += ",";
        text += c10::toString(ts[i].scalar_type());
      }
      did = intern(text);
      if (did != kStrFull) {
        std::lock_guard<std::mutex> lock(cache_mutex);
        dtypes.emplace(dkey, did);
      }
    }
    return {sid, did};
  }

  bool skipped(PyCodeObject* code) {
    PyObject* fn = code->co_filename;
    if (fn == skip_file) return true;
    if (!PyUnicode_Check(fn) || PyUnicode_GET_LENGTH(fn) != PyUnicode_GET_LENGTH(skip_file) ||
        PyUnicode_KIND(fn) != PyUnicode_KIND(skip_file)) {
      return false;
    }
    return std::memcmp(PyUnicode_DATA(fn), PyUnicode_DATA(skip_file),
                       size_t(PyUnicode_GET_LENGTH(fn)) * PyUnicode_KIND(fn)) == 0;
  }

  // The calling thread's stack as (code, last instruction) pairs, frtools' frames skipped.
  uint64_t walk(uintptr_t* v, int* n) {
    *n = 0;
    uint64_t h = 1469598103934665603ULL;
#ifdef FRTOOLS_FRAME_CHAIN
    PyThreadState* ts = PyGILState_GetThisThreadState();
    _PyInterpreterFrame* f = ts ? ts->cframe->current_frame : nullptr;
    bool skip = true;
    for (; f != nullptr && *n < depth; f = f->previous) {
      if (_PyFrame_IsIncomplete(f)) continue;
      PyCodeObject* code = f->f_code;
      if (skip && skipped(code)) continue;
      skip = false;
      uintptr_t c = reinterpret_cast<uintptr_t>(code);
      uintptr_t l = static_cast<uintptr_t>(_PyInterpreterFrame_LASTI(f));
      v[2 * *n] = c;
      v[2 * *n + 1] = l;
      ++*n;
      h = mix(mix(h, c), l);
    }
#else
    // GIL held by the caller (stack_id)
    PyFrameObject* frame = PyEval_GetFrame();
    Py_XINCREF(frame);
    bool skip = true;
    while (frame != nullptr && *n < depth) {
      PyCodeObject* code = PyFrame_GetCode(frame);
      if (!(skip && skipped(code))) {
        skip = false;
        uintptr_t c = reinterpret_cast<uintptr_t>(code);
#if PY_VERSION_HEX >= 0x030B0000
        uintptr_t l = static_cast<uintptr_t>(PyFrame_GetLasti(frame));
#else
        uintptr_t l = static_cast<uintptr_t>(frame->f_lasti);
#endif
        v[2 * *n] = c;
        v[2 * *n + 1] = l;
        ++*n;
        h = mix(mix(h, c), l);
      }
      Py_DECREF(code);
      PyFrameObject* back = PyFrame_GetBack(frame);
      Py_DECREF(frame);
      frame = back;
    }
    Py_XDECREF(frame);
#endif
    return mix(h, uint64_t(*n));
  }

  int64_t find_stack(uint64_t h, const uintptr_t* v, int n) {
    std::lock_guard<std::mutex> lock(stack_mutex);
    auto range = stack_table.equal_range(h);
    for (auto it = range.first; it != range.second; ++it) {
      const Entry& e = it->second;
      if (e.key.size() == size_t(2 * n) &&
          std::memcmp(e.key.data(), v, sizeof(uintptr_t) * 2 * size_t(n)) == 0) {
        return e.id;
      }
    }
    return -1;
  }

  // The calling stack's string id (0: no Python stack, or stacks off); -1 after a failure.
  int64_t stack_id() {
    if (!stacks.load(std::memory_order_relaxed)) return 0;
    uintptr_t v[2 * kMaxDepth];
    int n = 0;
#ifdef FRTOOLS_FRAME_CHAIN
    uint64_t h = walk(v, &n);
    if (n == 0) return 0;
    int64_t id = find_stack(h, v, n);
    if (id >= 0) return id;
    PyGILState_STATE g = PyGILState_Ensure();
#else
    PyGILState_STATE g = PyGILState_Ensure();
    uint64_t h = walk(v, &n);
    int64_t id = n == 0 ? 0 : find_stack(h, v, n);
    if (id >= 0) {
      PyGILState_Release(g);
      return id;
    }
#endif
    // first sight: Python interns the text (the same as the Python hooks write)
    PyObject* r = PyObject_CallNoArgs(stack_miss);
    if (r) {
      id = PyLong_AsLongLong(r);
      Py_DECREF(r);
    }
    if (!r || PyErr_Occurred()) {
      PyErr_Clear();
      PyGILState_Release(g);
      return -1;
    }
    Entry e;
    e.key.assign(v, v + 2 * n);
    e.id = id;
    {
      std::lock_guard<std::mutex> lock(stack_mutex);
      for (int i = 0; i < n; ++i) {
        PyObject* code = reinterpret_cast<PyObject*>(v[2 * i]);
        Py_INCREF(code);
        kept_codes.push_back(code);
      }
      stack_table.emplace(h, std::move(e));
    }
    PyGILState_Release(g);
    return id;
  }

  void enqueue(Pending&& p) {
    if (!ring_push(p)) {
      Node* n = new Node{std::move(p), incoming.load(std::memory_order_relaxed)};
      while (!incoming.compare_exchange_weak(n->next, n, std::memory_order_release,
                                             std::memory_order_relaxed)) {
      }
    }
    if (!poller_started.load(std::memory_order_relaxed)) start_poller();
  }

  // Claim the next cell and fill it; false when the ring is full.
  bool ring_push(Pending& p) {
    uint64_t pos = ring_tail.load(std::memory_order_relaxed);
    for (;;) {
      Cell& c = ring[pos & (kRing - 1)];
      uint64_t seq = c.seq.load(std::memory_order_acquire);
      int64_t dif = int64_t(seq - pos);
      if (dif == 0) {
        if (ring_tail.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          c.item = std::move(p);
          c.seq.store(pos + 1, std::memory_order_release);
          return true;
        }
      } else if (dif < 0) {
        return false;  // the poller has not taken this cell's previous item yet
      } else {
        pos = ring_tail.load(std::memory_order_relaxed);
      }
    }
  }

  void start_poller() {
    std::lock_guard<std::mutex> lock(queue_mutex);
    if (poller_started.load() || stopping || getpid() != pid) return;
    poller = std::thread([self = this] { self->poll_loop(); });
    poller_started.store(true);
  }

  void poll_loop() {
    pthread_setname_np(pthread_self(), "frtools-hooks");
    std::unique_lock<std::mutex> lock(queue_mutex);
    while (!stopping) {
      queue_cv.wait_for(lock, poll_every, [this] { return stopping; });
      if (stopping) break;
      lock.unlock();
      poll();
      lock.lock();
    }
  }

  // Move what the post hooks pushed since the last pass behind `waiting` (the poll's rules
  // compare record ids, not positions: the overflow's items may come after later ones).
  void take_incoming() {
    for (;;) {  // up to the first cell whose producer is still filling it (next pass)
      Cell& c = ring[ring_head & (kRing - 1)];
      if (c.seq.load(std::memory_order_acquire) != ring_head + 1) break;
      waiting.push_back(std::move(c.item));
      c.item.work.reset();
      c.seq.store(ring_head + kRing, std::memory_order_release);
      ++ring_head;
    }
    Node* n = incoming.exchange(nullptr, std::memory_order_acquire);
    Node* rev = nullptr;
    while (n) {  // the stack is newest first
      Node* next = n->next;
      n->next = rev;
      rev = n;
      n = next;
    }
    while (rev) {
      Node* next = rev->next;
      waiting.push_back(std::move(rev->item));
      delete rev;
      rev = next;
    }
  }

  // One completion pass (the Python Recorder.poll's rules).
  void poll() {
    std::lock_guard<std::mutex> one(poll_mutex);
    take_incoming();
    if (waiting.empty()) return;
    std::unordered_map<int64_t, int64_t> done_upto;
    std::vector<Pending> still;
    for (auto& it : waiting) {
      bool completed = false;
      try {
        completed = it.work->isCompleted();
      } catch (...) {
        completed = false;
      }
      if (!completed) {
        still.push_back(std::move(it));
        continue;
      }
      std::string error;
      bool failed = false;
      try {
        auto fut = it.work->getFuture();
        if (fut && fut->hasError()) {
          failed = true;
          error = error_text(fut->exception_ptr());
        }
      } catch (...) {  // no future (Gloo P2P): completion is all there is to know
      }
      if (failed) {
        api->mark_failed(box, it.rid, error.data(), error.size());
      } else {
        api->mark_completed(box, it.rid);
        if (it.order >= 0) {
          auto d = done_upto.find(it.order);
          if (d == done_upto.end() || it.rid > d->second) done_upto[it.order] = it.rid;
        }
      }
    }
    waiting.clear();
    for (auto& it : still) {
      auto d = it.order >= 0 ? done_upto.find(it.order) : done_upto.end();
      if (d != done_upto.end() && it.rid < d->second) {
        api->mark_completed(box, it.rid);
      } else {
        waiting.push_back(std::move(it));
      }
    }
  }

  // Drop every queued work (after the last pass).
  void drop_pending() {
    std::lock_guard<std::mutex> one(poll_mutex);
    take_incoming();
    waiting.clear();
  }

  // Stop the poller, mark what finished since its last pass, drop the queued works.
  void stop_poller() {
    std::thread t;
    {
      std::lock_guard<std::mutex> lock(queue_mutex);
      stopping = true;
      if (poller_started.load()) t = std::move(poller);
    }
    queue_cv.notify_all();
    if (t.joinable()) {
      if (getpid() == pid) {
        t.join();
      } else {
        t.detach();  // a forked child: the thread lives only in the parent
      }
    }
  }

  // Works queued and not known to be done (under poll_mutex the pushed nodes are stable).
  size_t pending() {
    std::lock_guard<std::mutex> one(poll_mutex);
    size_t n = waiting.size() + size_t(ring_tail.load(std::memory_order_acquire) - ring_head);
    for (Node* p = incoming.load(std::memory_order_acquire); p; p = p->next) ++n;
    return n;
  }
};

struct InFlight {
  int64_t op_id;
  int64_t rid;
  bool cuda;
  bool collective;
};

// One hooked group: its op names, its sequence counters, its ops between pre and post hook.
struct Group {
  std::shared_ptr<Recorder> rec;
  int64_t id = 0;
  std::vector<uint32_t> ops;            // interned "<backend>:<op>" by op code
  std::vector<std::pair<int, int>> specs;  // by HookOpName value: (op code, shape), (-1, -1)
  PyObject* bind_fn = nullptr;          // () -> (pg index, global ranks) or None
  bool maybe_cuda = false;

  std::mutex mutex;
  std::atomic<int32_t> pg{-1};
  std::vector<int64_t> ranks;
  int64_t coll_seq = 0;
  int64_t p2p_seq = 0;
  std::vector<InFlight> inflight;

  ~Group() {
    if (bind_fn && Py_IsInitialized() && !FRT_FINALIZING()) {
      PyGILState_STATE g = PyGILState_Ensure();
      Py_DECREF(bind_fn);
      PyGILState_Release(g);
    }
  }

  // The group's row in the black box, once torch has published its members.
  bool bind() {
    PyGILState_STATE g = PyGILState_Ensure();
    bool ok = false;
    PyObject* r = PyObject_CallNoArgs(bind_fn);
    if (r && r != Py_None) {
      try {
        auto t = py::reinterpret_borrow<py::tuple>(r);
        int32_t index = t[0].cast<int32_t>();
        std::vector<int64_t> members = t[1].cast<std::vector<int64_t>>();
        {
          std::lock_guard<std::mutex> lock(mutex);
          ranks = std::move(members);
        }
        pg.store(index);
        ok = index >= 0;
      } catch (py::error_already_set& e) {
        e.restore();
      } catch (...) {
      }
    }
    Py_XDECREF(r);
    if (PyErr_Occurred()) PyErr_Clear();
    PyGILState_Release(g);
    return ok;
  }

  void pre(const c10d::PreHookArgs& a) {
    Recorder& r = *rec;
    if (!r.enabled.load(std::memory_order_relaxed) || g_forked.load(std::memory_order_relaxed)) {
      return;
    }
    try {
      size_t name = size_t(a.name);
      if (name >= specs.size() || specs[name].first < 0) return;
      if (pg.load(std::memory_order_acquire) < 0 && !bind()) return;
      int code = specs[name].first;
      int shape = specs[name].second;
      uint32_t isz, idt, osz, odt;
      bool cuda = false;
      const std::vector<at::Tensor>* tensors = nullptr;
      if (shape == kInPlace || shape == kOutIn) {
        tensors = &a.input_tensors;
        std::tie(isz, idt) = r.sizes_id(a.input_tensors);
        if (shape == kInPlace) {
          osz = isz;
          odt = idt;
        } else {
          std::tie(osz, odt) = r.sizes_id(a.output_tensors);
        }
      } else if (shape == kPeer) {
        tensors = a.input_tensors.empty() ? &a.output_tensors : &a.input_tensors;
        std::tie(isz, idt) = r.sizes_id(*tensors);
        osz = isz;
        odt = idt;
      } else {
        static const std::vector<at::Tensor> none;
        std::tie(isz, idt) = r.sizes_id(none);
        osz = isz;
        odt = idt;
      }
      if (maybe_cuda && r.cuda_events && tensors && !tensors->empty()) {
        cuda = (*tensors)[0].is_cuda();
      }
      int64_t sid = r.stack_id();
      if (sid < 0) throw std::runtime_error("the calling stack could not be interned");
      int32_t index = pg.load(std::memory_order_relaxed);
      std::lock_guard<std::mutex> lock(mutex);
      int64_t rid;
      bool collective = shape != kPeer;
      if (!collective) {
        ++p2p_seq;
        int64_t peer = a.root;
        int64_t gpeer = (peer >= 0 && size_t(peer) < ranks.size()) ? ranks[size_t(peer)] : peer;
        rid = r.api->record(r.box, index, ops[size_t(code)], 0, p2p_seq, int32_t(gpeer), 1, isz,
                            osz, idt, odt, uint32_t(sid));
      } else {
        ++coll_seq;
        rid = r.api->record(r.box, index, ops[size_t(code)], coll_seq, 0, -1, 0, isz, osz, idt,
                            odt, uint32_t(sid));
      }
      if (rid >= 0) inflight.push_back(InFlight{a.op_id, rid, cuda, collective});
    } catch (const std::exception& e) {
      r.fail(std::string("native hooks: ") + e.what());
    } catch (...) {
      r.fail("native hooks: unknown error");
    }
  }

  void post(const c10d::PostHookArgs& a) {
    Recorder& r = *rec;
    if (g_forked.load(std::memory_order_relaxed)) return;
    try {
      InFlight item;
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (inflight.empty()) return;
        size_t i = inflight.size();
        while (i > 0 && inflight[i - 1].op_id != a.op_id) --i;
        if (i == 0) return;
        item = inflight[i - 1];
        inflight.erase(inflight.begin() + long(i - 1));
      }
      if (!a.work) {
        r.api->mark_completed(r.box, item.rid);
      } else if (item.cuda) {
        PyGILState_STATE g = PyGILState_Ensure();
        try {
          py::object work = py::cast(a.work);
          py::handle(r.watch_cuda)(item.rid, work);
        } catch (py::error_already_set& e) {
          std::string why = e.what();
          PyGILState_Release(g);
          r.fail(why);
          return;
        }
        PyGILState_Release(g);
      } else {
        r.enqueue(Pending{item.rid, a.work, item.collective ? id : -1});
      }
    } catch (const std::exception& e) {
      r.fail(std::string("native hooks: ") + e.what());
    } catch (...) {
      r.fail("native hooks: unknown error");
    }
  }
};

std::shared_ptr<Recorder> make_recorder(py::object box, py::object stack_miss, py::object fail,
                                        py::object watch_cuda, py::object skip_file, int depth,
                                        bool cuda_events, int poll_ms) {
  auto* api = static_cast<const FrtBoxApi*>(PyCapsule_Import(FRT_BOX_API_CAPSULE, 0));
  if (!api) throw py::error_already_set();
  if (api->version != FRT_BOX_API_VERSION) {
    throw std::runtime_error("frtools.recorder._blackbox has another C API version");
  }
  if (depth < 1 || depth > kMaxDepth) throw std::invalid_argument("depth must be 1..64");
  if (!PyUnicode_Check(skip_file.ptr())) throw std::invalid_argument("skip_file: a str");
  auto r = std::make_shared<Recorder>();
  r->api = api;
  r->box = api->acquire(box.ptr());
  if (!r->box) throw py::error_already_set();
  r->stack_miss = stack_miss.release().ptr();
  r->fail_fn = fail.release().ptr();
  r->watch_cuda = watch_cuda.release().ptr();
  r->skip_file = skip_file.release().ptr();
  r->depth = depth;
  r->cuda_events = cuda_events;
  r->poll_every = std::chrono::milliseconds(poll_ms > 0 ? poll_ms : 10);
  return r;
}

std::shared_ptr<Group> make_group(std::shared_ptr<Recorder> rec, std::vector<uint32_t> ops,
                                  std::vector<std::pair<int, int>> specs, py::object bind,
                                  bool maybe_cuda) {
  auto g = std::make_shared<Group>();
  g->rec = std::move(rec);
  g->id = g->rec->next_group++;
  g->ops = std::move(ops);
  g->specs = std::move(specs);
  g->bind_fn = bind.release().ptr();
  g->maybe_cuda = maybe_cuda;
  for (auto& s : g->specs) {
    if (s.first >= 0 && size_t(s.first) >= g->ops.size()) {
      throw std::invalid_argument("an op code outside the op table");
    }
  }
  return g;
}

void attach(std::shared_ptr<Group> g, const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
            int64_t hook_id) {
  pg->registerPreHook(hook_id, [g](const c10d::PreHookArgs& a) { g->pre(a); });
  pg->registerPostHook(hook_id, [g](const c10d::PostHookArgs& a) { g->post(a); });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "frtools' process-group hooks in C++ (see pg_hooks.cpp)";
  pthread_atfork(nullptr, nullptr, &on_fork_child);
  py::class_<Recorder, std::shared_ptr<Recorder>>(m, "Recorder")
      .def(py::init(&make_recorder), py::arg("box"), py::arg("stack_miss"), py::arg("fail"),
           py::arg("watch_cuda"), py::arg("skip_file"), py::arg("depth") = 32,
           py::arg("cuda_events") = true, py::arg("poll_ms") = 10)
      .def("set_enabled", [](Recorder& r, bool on) { r.enabled.store(on); })
      .def("set_stacks", [](Recorder& r, bool on) { r.stacks.store(on); })
      .def_property_readonly("enabled", [](Recorder& r) { return r.enabled.load(); })
      .def("poll", &Recorder::poll, py::call_guard<py::gil_scoped_release>(),
           "one completion pass in the calling thread")
      .def("stop", &Recorder::stop_poller, py::call_guard<py::gil_scoped_release>(),
           "stop the completion poller")
      .def("final_poll",
           [](Recorder& r) {
             r.stop_poller();
             r.poll();
             r.drop_pending();
           },
           py::call_guard<py::gil_scoped_release>(),
           "stop the poller, mark what finished since its last pass, drop the queued works")
      .def_property_readonly("pending", &Recorder::pending)
      .def_property_readonly("stacks_cached", [](Recorder& r) {
        std::lock_guard<std::mutex> lock(r.stack_mutex);
        return r.stack_table.size();
      });
  py::class_<Group, std::shared_ptr<Group>>(m, "Group")
      .def(py::init(&make_group), py::arg("recorder"), py::arg("ops"), py::arg("specs"),
           py::arg("bind"), py::arg("maybe_cuda") = false)
      .def("attach", &attach, py::arg("pg"), py::arg("hook_id"),
           "register this group's pre/post hooks on pg under hook_id")
      .def_property_readonly("pg", [](Group& g) { return g.pg.load(); })
      .def(
          "_fire_pre",
          [](std::shared_ptr<Group> g, int name, int64_t op_id, std::vector<at::Tensor> ins,
             std::vector<at::Tensor> outs, int64_t root) {
            c10d::PreHookArgs a;
            a.name = static_cast<c10d::HookOpName>(name);
            a.input_tensors = std::move(ins);
            a.output_tensors = std::move(outs);
            a.root = root;
            a.op_id = op_id;
            py::gil_scoped_release nogil;
            g->pre(a);
          },
          "test seam: run the pre hook as a process group would (GIL released)")
      .def(
          "_fire_post",
          [](std::shared_ptr<Group> g, int name, int64_t op_id,
             std::optional<c10::intrusive_ptr<c10d::Work>> work) {
            c10d::PostHookArgs a;
            a.name = static_cast<c10d::HookOpName>(name);
            a.op_id = op_id;
            if (work) a.work = *work;
            py::gil_scoped_release nogil;
            g->post(a);
          },
          "test seam: run the post hook as a process group would (GIL released)");
  m.def(
      "_flight_recorder",
      [](const std::string& backend, std::optional<bool> on) {
        auto* fr = c10d::getFlightRecorder(backend);
        bool was = fr->enabled_;
        if (on) fr->enabled_ = *on;
        return was;
      },
      py::arg("backend"), py::arg("on") = py::none(),
      "benchmark seam: whether PyTorch's own FlightRecorder instance of `backend` records (Gloo's "
      "does by default), switched to `on` if given; benchmarks/recorder_overhead.py times "
      "PyTorch's Gloo recorder against no recording in the same job with it. Only from the "
      "thread that issues the backend's ops.");
  m.def(
      "_work",
      [](bool done, std::optional<std::string> error) {
        auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
        if (done && error) {
          fut->setError(std::make_exception_ptr(std::runtime_error(*error)));
        } else if (done) {
          fut->markCompleted(c10::IValue(c10::List<at::Tensor>()));
        }
        return c10d::Work::create_from_future(fut);
      },
      py::arg("done") = true, py::arg("error") = py::none(),
      "test seam: a c10d Work over a future: pending, completed, or failed with error (as a "
      "backend fails it)");
}
