// frtools black box: a per-rank ring buffer of collective records in a memory-mapped file.
//
// The file layout is the contract with the analyzer; it is written down in
// docs/snapshot-format.md and mirrored by frtools/formats/blackbox.py. Every write goes
// straight to a MAP_SHARED mapping, so the kernel keeps the data when the process is
// SIGKILLed, segfaults or calls os._exit: nothing has to run in a dying process.
//
// Concurrency: each slot carries a sequence counter (a seqlock). A writer takes the slot by
// turning the counter odd with a CAS, writes, and makes it even again; a reader keeps a slot
// only when the counter is even and unchanged around its copy. Record ids come from one
// atomic counter, so two threads never share a record id.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <sched.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "box_api.h"

namespace {

// ---------------------------------------------------------------------------------------
// File layout (little-endian, native alignment). Keep in sync with docs/snapshot-format.md
// and frtools/formats/blackbox.py (tests/test_snapshot_reader.py compares them).
// ---------------------------------------------------------------------------------------

constexpr char kMagic[8] = {'F', 'R', 'T', 'B', 'O', 'X', '\0', '\1'};
constexpr uint32_t kVersion = 3;  // 2: failed ops (slot error) and exit facts (header);
                                   // 3: start-up phases, identity update (header)
constexpr uint32_t kHeaderBytes = 4096;
constexpr uint32_t kIdentityOffset = 512;
constexpr uint32_t kIdentityMax = kHeaderBytes - kIdentityOffset;
constexpr uint32_t kDefaultPgCapacity = 1024;
constexpr uint32_t kStringsReserved = 8;  // offset 0 of the string area is "no string"

constexpr uint32_t kStrNone = 0;
constexpr uint32_t kStrFull = 0xFFFFFFFFu;

enum : uint8_t { kEmpty = 0, kScheduled = 1, kStarted = 2, kCompleted = 3 };
enum : uint32_t { kAckNone = 0, kAckStacksWritten = 1, kAckNoHandler = 2 };
enum : uint32_t { kWatchdogNone = 0, kWatchdogRunning = 1, kWatchdogStopped = 2 };
// How the process ended (Header::exit_kind); 0: nothing recorded (running, or killed).
enum : uint32_t {
  kExitNone = 0,
  kExitClean = 1,
  kExitStatus = 2,
  kExitException = 3,
  kExitOsExit = 4,
  kExitSignal = 5
};
constexpr uint16_t kFlagCudaDuration = 1;  // Slot::flags bit 0
constexpr uint16_t kFlagFailed = 2;        // Slot::flags bit 1: the op failed (Slot::error)

struct Header {
  char magic[8];              // 0
  uint32_t version;           // 8
  uint32_t header_bytes;      // 12
  uint32_t slot_bytes;        // 16
  uint32_t capacity;          // 20
  uint32_t pg_entry_bytes;    // 24
  uint32_t pg_capacity;       // 28
  uint64_t pg_offset;         // 32
  uint64_t slots_offset;      // 40
  uint64_t strings_offset;    // 48
  uint64_t strings_bytes;     // 56
  uint64_t file_bytes;        // 64
  int64_t created_ns;         // 72
  uint64_t next_record_id;    // 80  atomic: records ever written
  uint64_t strings_used;      // 88  atomic: bytes of the string area in use
  uint32_t pg_count;          // 96  atomic: process groups published
  uint32_t string_count;      // 100
  int64_t heartbeat_ns;       // 104 watchdog heartbeat (CLOCK_REALTIME)
  uint32_t stalled;           // 112 1 while the oldest incomplete op is older than stall_seconds
  uint32_t watchdog_state;    // 116 0 never started, 1 running, 2 stopped
  int64_t stall_record_id;    // 120 record that triggered the last stall (-1 none)
  int64_t stall_time_ns;      // 128 when the last stall was detected
  uint64_t dump_request_seq;  // 136 written by an outside process (frtools dump)
  uint64_t dump_ack_seq;      // 144 written by the watchdog once stacks are out
  int64_t dump_ack_time_ns;   // 152
  uint32_t dump_ack_status;   // 160 1 stacks written, 2 no handler for the signal
  uint32_t closed;            // 164 1 after a clean close()
  uint32_t strings_dropped;   // 168 interns refused because the table was full
  uint32_t identity_bytes;    // 172 length of the identity JSON at kIdentityOffset
  double stall_seconds;       // 176
  uint32_t poll_ms;           // 184
  uint32_t stack_signal;      // 188
  int64_t owner_pid;          // 192
  uint32_t exit_kind;         // 200 kExit*: how the process ended (written last; first wins)
  int32_t exit_status;        // 204 exit status; the signal number for kExitSignal
  int64_t exit_time_ns;       // 208
  uint32_t exit_detail;       // 216 string id: "Type: message" of an uncaught exception
  uint32_t exit_stack;        // 220 string id: its traceback, innermost frame first
  uint32_t ops_failed;        // 224 records marked failed
  uint32_t thread_error;      // 228 string id: the last uncaught exception of another thread
  uint32_t exit_watched;      // 232 1 once exit facts are watched (watch_exit)
  uint32_t startup_phase;     // 236 kPhase*: the last start-up phase entered (0: not recorded)
  uint32_t identity_update;   // 240 string id: the identity JSON restated at the first group
  uint32_t startup_failed;    // 244 1: init_process_group raised
  int64_t phase_started_ns;   // 248 when each phase was entered (0: never) ...
  int64_t phase_init_ns;      // 256
  int64_t phase_rendezvous_ns;  // 264
  int64_t phase_connect_ns;   // 272
  int64_t phase_ready_ns;     // 280
};
static_assert(offsetof(Header, owner_pid) == 192, "header layout");
static_assert(offsetof(Header, exit_watched) == 232, "header layout");
static_assert(offsetof(Header, phase_ready_ns) == 280, "header layout");
constexpr uint32_t kPhaseCount = 5;  // started, init, rendezvous, connect, ready
static_assert(sizeof(Header) <= kIdentityOffset, "header fits before identity");

struct Slot {
  uint64_t seq;                // 0  seqlock: odd while a writer holds the slot
  int64_t record_id;           // 8
  int64_t collective_seq_id;   // 16
  int64_t p2p_seq_id;          // 24
  int64_t time_created_ns;     // 32
  int64_t time_started_ns;     // 40 0: unknown
  int64_t time_completed_ns;   // 48 0: unknown
  double duration_ms;          // 56 NaN: unknown (GPU time from CUDA events)
  uint64_t thread_id;          // 64 native thread id (gettid)
  int32_t pg;                  // 72 index into the process-group table, -1 none
  int32_t peer;                // 76 global rank of the P2P peer, -1 none
  uint32_t op;                 // 80 string ids ...
  uint32_t input_sizes;        // 84
  uint32_t output_sizes;       // 88
  uint32_t input_dtypes;       // 92
  uint32_t output_dtypes;      // 96
  uint32_t stack;              // 100
  uint8_t state;               // 104
  uint8_t is_p2p;              // 105
  uint16_t flags;              // 106 bit 0: duration from CUDA events; bit 1: failed
  uint32_t thread_name;        // 108 string id (0: unknown)
  uint32_t error;              // 112 string id of the failure (0: none)
  uint32_t splits;             // 116 all_to_all: string id of its split sizes (0: none)
  int64_t time_failed_ns;      // 120 when the failure was seen (0: not failed)
};
static_assert(sizeof(Slot) == 128, "slot layout");
static_assert(offsetof(Slot, state) == 104, "slot layout");
static_assert(offsetof(Slot, time_failed_ns) == 120, "slot layout");

struct PgEntry {
  uint32_t name;                       // 0 string id
  uint32_t desc;                       // 4 string id
  uint32_t ranks;                      // 8 string id of the members ("0-3,8")
  uint32_t size;                       // 12
  int64_t last_enqueued_collective;    // 16
  int64_t last_started_collective;     // 24
  int64_t last_completed_collective;   // 32
  int64_t last_enqueued_p2p;           // 40
  int64_t last_completed_p2p;          // 48
  uint8_t reserved[8];                 // 56
};
static_assert(sizeof(PgEntry) == 64, "pg layout");

inline int64_t now_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

inline uint64_t native_thread_id() {
  static thread_local uint64_t tid = 0;
  if (tid == 0) tid = uint64_t(syscall(SYS_gettid));
  return tid;
}

struct Box;
// an all_to_all's split sizes waiting for this thread's next record on box (Box::pend_splits)
struct PendingSplits {
  Box* box;
  uint32_t id;
};
static thread_local PendingSplits t_pending = {nullptr, 0};

template <typename T>
inline T aload(const T* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
template <typename T>
struct same_type {
  typedef T type;
};
template <typename T>
inline void astore(T* p, typename same_type<T>::type v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
inline void atomic_max(int64_t* p, int64_t v) {
  int64_t cur = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (v > cur &&
         !__atomic_compare_exchange_n(p, &cur, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

inline uint64_t slot_lock(Slot* s) {
  uint64_t cur = __atomic_load_n(&s->seq, __ATOMIC_RELAXED);
  for (;;) {
    if ((cur & 1) == 0 &&
        __atomic_compare_exchange_n(&s->seq, &cur, cur + 1, true, __ATOMIC_ACQUIRE,
                                    __ATOMIC_RELAXED)) {
      return cur + 1;
    }
    cur = __atomic_load_n(&s->seq, __ATOMIC_RELAXED);
  }
}
inline void slot_unlock(Slot* s, uint64_t locked) {
  __atomic_store_n(&s->seq, locked + 1, __ATOMIC_RELEASE);
}

// ---------------------------------------------------------------------------------------
// CUDA runtime, loaded with dlopen on first use (never linked).
// ---------------------------------------------------------------------------------------

struct CudaApi {
  typedef int (*EventQuery)(void*);
  typedef int (*EventElapsed)(float*, void*, void*);
  typedef int (*GetDevice)(int*);
  typedef int (*SetDevice)(int);
  EventQuery event_query = nullptr;
  EventElapsed event_elapsed = nullptr;
  GetDevice get_device = nullptr;
  SetDevice set_device = nullptr;
  bool tried = false;
  std::string error;
};

constexpr int kCudaSuccess = 0;
constexpr int kCudaNotReady = 600;

std::mutex g_cuda_mutex;
CudaApi g_cuda;

uint64_t g_fork_generation = 0;
void on_fork_child() { ++g_fork_generation; }

bool load_cuda(std::string* why) {
  std::lock_guard<std::mutex> lock(g_cuda_mutex);
  if (g_cuda.tried) {
    *why = g_cuda.error;
    return g_cuda.event_query != nullptr;
  }
  g_cuda.tried = true;
  const char* names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0",
                         "libcudart.so"};
  void* handle = nullptr;
  // Prefer the runtime torch already loaded, so both sides share one runtime.
  for (const char* n : names) {
    handle = dlopen(n, RTLD_NOW | RTLD_NOLOAD);
    if (handle) break;
  }
  const char* override_path = getenv("FRTOOLS_CUDART");
  if (!handle && override_path && *override_path) handle = dlopen(override_path, RTLD_NOW);
  for (size_t i = 0; !handle && i < sizeof(names) / sizeof(names[0]); ++i) {
    handle = dlopen(names[i], RTLD_NOW);
  }
  if (!handle) {
    g_cuda.error = "libcudart could not be loaded";
    *why = g_cuda.error;
    return false;
  }
  g_cuda.event_query = (CudaApi::EventQuery)dlsym(handle, "cudaEventQuery");
  g_cuda.event_elapsed = (CudaApi::EventElapsed)dlsym(handle, "cudaEventElapsedTime");
  g_cuda.get_device = (CudaApi::GetDevice)dlsym(handle, "cudaGetDevice");
  g_cuda.set_device = (CudaApi::SetDevice)dlsym(handle, "cudaSetDevice");
  if (!g_cuda.event_query || !g_cuda.event_elapsed || !g_cuda.get_device ||
      !g_cuda.set_device) {
    g_cuda.event_query = nullptr;
    g_cuda.error = "libcudart lacks cudaEventQuery/cudaEventElapsedTime";
    *why = g_cuda.error;
    return false;
  }
  return true;
}

struct CudaWatch {
  int64_t rid;
  uintptr_t start;
  uintptr_t end;
  int device;
  bool started;
};

struct FakeEvent {
  bool done;
  double ms;
};

// ---------------------------------------------------------------------------------------
// Exit facts: how the process ended, in the header of its black box.
//
// Written through a mapping of the header page of its own (watch_exit), never unmapped: a
// fatal-signal handler, and the on_exit handler that runs after Python has finalized (and
// closed the box), still find it. Signal-handler paths use plain stores, getpid,
// clock_gettime, sigaction and raise only (async-signal-safe).
// ---------------------------------------------------------------------------------------

struct ExitWatch {
  Header* hdr = nullptr;    // the watched header page (own mapping)
  const void* box = nullptr;  // the Box it belongs to (compared, never dereferenced)
  uint32_t claim = 0;       // the ending recorded there (0: none yet): our memory, not the file's
  pid_t pid = 0;            // the watching process: a forked child must not write
  pid_t on_exit_pid = 0;    // process that registered on_exit (inherited across fork)
  struct sigaction previous[NSIG];
  bool installed[NSIG] = {};
};
ExitWatch g_exit;

// SIGTERM only where nobody handles it (its default kills): the launcher's "stop", not a crash.
const int kFatalSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTERM};

// First writer wins: `claim` (the process's own memory, never the file's) goes from 0 to
// `kind` by compare-and-swap; the fields are written, exit_kind last. False when an ending
// was already recorded.
bool record_exit(Header* h, uint32_t* claim, uint32_t kind, int32_t status, uint32_t detail,
                 uint32_t stack, int64_t t) {
  uint32_t expected = kExitNone;
  if (!__atomic_compare_exchange_n(claim, &expected, kind, false, __ATOMIC_ACQ_REL,
                                   __ATOMIC_ACQUIRE)) {
    return false;
  }
  h->exit_status = status;
  h->exit_time_ns = t;
  h->exit_detail = detail;
  h->exit_stack = stack;
  __atomic_store_n(&h->exit_kind, kind, __ATOMIC_RELEASE);
  return true;
}

inline Header* watched_header() {
  Header* h = __atomic_load_n(&g_exit.hdr, __ATOMIC_ACQUIRE);
  return (h && getpid() == g_exit.pid) ? h : nullptr;
}

void on_fatal_signal(int sig, siginfo_t* info, void* ctx) {
  int saved_errno = errno;
  if (Header* h = watched_header()) {
    record_exit(h, &g_exit.claim, kExitSignal, sig, kStrNone, kStrNone, now_ns());
  }
  struct sigaction* prev = (sig > 0 && sig < NSIG) ? &g_exit.previous[sig] : nullptr;
  if (prev && (prev->sa_flags & SA_SIGINFO) && prev->sa_sigaction) {
    prev->sa_sigaction(sig, info, ctx);  // faulthandler's, torch's: they re-raise themselves
  } else if (prev && prev->sa_handler != SIG_DFL && prev->sa_handler != SIG_IGN) {
    prev->sa_handler(sig);
  } else {
    // what was there before (the default action): put it back and let the signal have its
    // way — delivered when this handler returns (a fault re-faults on return)
    if (prev) {
      sigaction(sig, prev, nullptr);
    } else {
      signal(sig, SIG_DFL);
    }
    raise(sig);
  }
  errno = saved_errno;
}

// exit() with this status: sys.exit, the end of the main module, an uncaught exception (1).
void on_process_exit(int status, void*) {
  Header* h = watched_header();
  if (!h) return;
  if (!record_exit(h, &g_exit.claim, status == 0 ? kExitClean : kExitStatus, status, kStrNone,
                   kStrNone, now_ns())) {
    if (__atomic_load_n(&g_exit.claim, __ATOMIC_ACQUIRE) == kExitException) {
      h->exit_status = status;  // the status the uncaught exception ended with
    }
  }
}

void install_fatal_signal_handlers() {
  for (int sig : kFatalSignals) {
    struct sigaction current;
    if (sigaction(sig, nullptr, &current) != 0) continue;
    bool ours = (current.sa_flags & SA_SIGINFO) && current.sa_sigaction == &on_fatal_signal;
    if (ours) continue;
    bool is_default = !(current.sa_flags & SA_SIGINFO) && current.sa_handler == SIG_DFL;
    if (sig == SIGTERM && !is_default) continue;  // someone handles it: their business
    struct sigaction mine;
    memset(&mine, 0, sizeof(mine));
    mine.sa_sigaction = &on_fatal_signal;
    mine.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&mine.sa_mask);
    g_exit.previous[sig] = current;
    if (sigaction(sig, &mine, nullptr) == 0) g_exit.installed[sig] = true;
  }
}

// ---------------------------------------------------------------------------------------
// The black box.
// ---------------------------------------------------------------------------------------

struct Box {
  std::string path;
  uint8_t* mem = nullptr;
  size_t bytes = 0;
  Header* hdr = nullptr;
  PgEntry* pgs = nullptr;
  Slot* slots = nullptr;
  uint8_t* strings = nullptr;
  uint32_t capacity = 0;
  pid_t owner_pid = 0;
  uint64_t fork_generation = 0;
  uint32_t ops_failed = 0;  // header: ops_failed (published, not read back), atomic
  uint32_t exit_claim = 0;  // the ending recorded in this box when it is not the watched one

  // The process's own copies of every size, cursor and counter it acts on. The header
  // carries them for readers, but anyone who can write the file can change the header under
  // us: what the header says is published, never read back (a corrupted header can spoil
  // the record's content, never this process's memory).
  uint64_t strings_cap = 0;          // bytes of the string area (header: strings_bytes)
  uint64_t strings_used = 0;         // bytes in use (header: strings_used), under intern_mutex
  uint32_t string_count = 0;         // strings interned (header: string_count)
  uint32_t pg_capacity = 0;          // rows of the pg table (header: pg_capacity)
  uint32_t pg_count = 0;             // rows published (header: pg_count), atomic
  uint64_t next_rid = 0;             // records claimed (header: next_record_id), atomic
  uint32_t stalled_now = 0;          // header: stalled, atomic
  int64_t stall_rid = -1;            // header: stall_record_id

  // Native writers through the C API (box_api.h) run without the GIL: close() waits until
  // none is inside a call before it unmaps, and the Box itself lives on while a handle
  // holds it (refs: the BlackBox object + one per handle).
  std::atomic<int> users{0};
  std::atomic<bool> closing{false};
  std::atomic<int> refs{1};

  std::mutex intern_mutex;
  std::unordered_map<std::string, uint32_t> interned;
  std::unordered_map<std::string, int32_t> pg_by_name;

  // watchdog
  std::mutex watch_mutex;
  std::vector<CudaWatch> watches;
  std::vector<int64_t> cuda_done;
  bool fake = false;
  std::unordered_map<uintptr_t, FakeEvent> fake_events;
  pthread_t thread{};
  bool thread_started = false;
  bool stop = false;
  pthread_cond_t stop_cond = PTHREAD_COND_INITIALIZER;
  pthread_mutex_t stop_pmutex = PTHREAD_MUTEX_INITIALIZER;
  uint32_t poll_ms = 100;
  double stall_seconds = 0;
  int stack_signal = 0;
  uint64_t stall_cursor = 0;

  Slot* slot_for(int64_t rid) { return &slots[uint64_t(rid) % capacity]; }
  bool pg_published(int32_t pg) { return pg >= 0 && uint32_t(pg) < aload(&pg_count); }

  uint32_t intern(const char* s, size_t n) {
    if (n == 0) return kStrNone;
    std::lock_guard<std::mutex> lock(intern_mutex);
    std::string key(s, n);
    auto it = interned.find(key);
    if (it != interned.end()) return it->second;
    uint64_t used = strings_used;
    uint64_t need = 4 + uint64_t(n);
    uint64_t aligned = (need + 3) & ~uint64_t(3);
    if (n > 0xFFFFFFF0ull || used + aligned > strings_cap || used + aligned > 0xFFFFFFF0ull) {
      __atomic_add_fetch(&hdr->strings_dropped, 1u, __ATOMIC_RELAXED);
      return kStrFull;
    }
    uint8_t* at = strings + used;
    memcpy(at + 4, s, n);
    astore(reinterpret_cast<uint32_t*>(at), uint32_t(n));
    strings_used = used + aligned;
    ++string_count;
    astore(&hdr->strings_used, strings_used);
    astore(&hdr->string_count, string_count);
    uint32_t id = uint32_t(used);
    interned.emplace(std::move(key), id);
    return id;
  }

  int64_t record(int32_t pg, uint32_t op, int64_t coll, int64_t p2p, int32_t peer, bool is_p2p,
                 uint32_t in_sizes, uint32_t out_sizes, uint32_t in_dtypes, uint32_t out_dtypes,
                 uint32_t stack) {
    int64_t rid = int64_t(__atomic_fetch_add(&next_rid, 1, __ATOMIC_ACQ_REL));
    __atomic_fetch_add(&hdr->next_record_id, 1, __ATOMIC_RELEASE);  // published, not read
    int64_t t = now_ns();
    Slot* s = slot_for(rid);
    uint64_t locked = slot_lock(s);
    s->record_id = rid;
    s->collective_seq_id = coll;
    s->p2p_seq_id = p2p;
    s->time_created_ns = t;
    s->time_started_ns = 0;
    s->time_completed_ns = 0;
    s->duration_ms = NAN;
    s->thread_id = native_thread_id();
    s->pg = pg;
    s->peer = peer;
    s->op = op;
    s->input_sizes = in_sizes;
    s->output_sizes = out_sizes;
    s->input_dtypes = in_dtypes;
    s->output_dtypes = out_dtypes;
    s->stack = stack;
    s->state = kScheduled;
    s->is_p2p = is_p2p ? 1 : 0;
    s->flags = 0;
    s->thread_name = 0;
    s->error = kStrNone;
    s->splits = kStrNone;
    if (t_pending.box == this) {
      s->splits = t_pending.id;
      t_pending.box = nullptr;
    }
    s->time_failed_ns = 0;
    slot_unlock(s, locked);
    if (pg_published(pg)) {
      if (is_p2p) {
        atomic_max(&pgs[pg].last_enqueued_p2p, p2p);
      } else {
        atomic_max(&pgs[pg].last_enqueued_collective, coll);
      }
    }
    return rid;
  }

  // Stamp a state on rid's slot; false when the slot holds another record.
  bool mark(int64_t rid, uint8_t state, int64_t t, double duration_ms, bool from_cuda) {
    if (rid < 0) return false;
    Slot* s = slot_for(rid);
    uint64_t locked = slot_lock(s);
    if (s->record_id != rid || (s->state == kEmpty)) {
      slot_unlock(s, locked);
      return false;
    }
    int32_t pg = s->pg;
    bool is_p2p = s->is_p2p;
    int64_t coll = s->collective_seq_id;
    int64_t p2p = s->p2p_seq_id;
    if (state == kStarted) {
      if (s->time_started_ns == 0) s->time_started_ns = t;
      if (s->state < kStarted) s->state = kStarted;
    } else if (state == kCompleted) {
      if (s->flags & kFlagFailed) {  // a failure is final: no completion inferred after it
        slot_unlock(s, locked);
        return false;
      }
      if (s->time_completed_ns == 0) s->time_completed_ns = t;
      s->state = kCompleted;
      if (!std::isnan(duration_ms)) {
        s->duration_ms = duration_ms;
        if (from_cuda) s->flags |= kFlagCudaDuration;
      }
    }
    slot_unlock(s, locked);
    if (pg_published(pg)) {
      if (is_p2p) {
        if (state == kCompleted) atomic_max(&pgs[pg].last_completed_p2p, p2p);
      } else if (state == kStarted) {
        atomic_max(&pgs[pg].last_started_collective, coll);
      } else {
        atomic_max(&pgs[pg].last_started_collective, coll);
        atomic_max(&pgs[pg].last_completed_collective, coll);
      }
    }
    return true;
  }

  // The op of rid failed with the interned text err: kept apart from completion (its state
  // stays scheduled/started; a completion inferred before the failure was known is undone).
  bool mark_failed(int64_t rid, uint32_t err, int64_t t) {
    if (rid < 0) return false;
    Slot* s = slot_for(rid);
    uint64_t locked = slot_lock(s);
    if (s->record_id != rid || s->state == kEmpty || (s->flags & kFlagFailed)) {
      slot_unlock(s, locked);
      return false;
    }
    s->flags |= kFlagFailed;
    s->error = err;
    s->time_failed_ns = t;
    if (s->state == kCompleted) {
      s->state = kStarted;
      s->time_completed_ns = 0;
    }
    slot_unlock(s, locked);
    astore(&hdr->ops_failed, __atomic_add_fetch(&ops_failed, 1u, __ATOMIC_RELAXED));
    return true;
  }

  // The string id of an all_to_all's split sizes (kStrFull: their share is used up, counted
  // as dropped). Split texts vary per step (MoE token counts), so they may fill at most half
  // the string area: the rest stays for stacks and errors.
  uint32_t splits_id(const char* text, size_t n) {
    uint32_t id = kStrFull;
    bool room = false;
    {
      std::lock_guard<std::mutex> lock(intern_mutex);
      auto it = interned.find(std::string(text, n));
      if (it != interned.end()) id = it->second;
      room = strings_used + ((4 + uint64_t(n) + 3) & ~uint64_t(3)) <= strings_cap / 2;
    }
    if (id == kStrFull && room) {
      id = intern(text, n);
    } else if (id == kStrFull) {
      __atomic_add_fetch(&hdr->strings_dropped, 1u, __ATOMIC_RELAXED);
    }
    return id;
  }

  // Split sizes this thread's next record takes (written with the record, so that a rank
  // the backend aborts while the call is still in flight keeps them); n == 0 clears them.
  // True where pending ones were still unused.
  bool pend_splits(const char* text, size_t n) {
    bool unused = t_pending.box == this;
    t_pending.box = nullptr;
    if (n == 0) return unused;
    uint32_t id = splits_id(text, n);
    if (id != kStrFull) t_pending = {this, id};
    return unused;
  }

  int state_of(int64_t rid) {
    if (rid < 0) return 0;
    Slot* s = slot_for(rid);
    for (int tries = 0; tries < 1000; ++tries) {
      uint64_t a = aload(&s->seq);
      if (a & 1) continue;
      int64_t r = __atomic_load_n(&s->record_id, __ATOMIC_RELAXED);
      uint8_t st = __atomic_load_n(&s->state, __ATOMIC_RELAXED);
      if (aload(&s->seq) == a) return r == rid ? st : 0;
    }
    return 0;
  }

  // One watchdog pass: CUDA events, stall detection, heartbeat, dump requests.
  void poll_once() {
    poll_cuda();
    if (stall_seconds > 0) check_stall();
    astore(&hdr->heartbeat_ns, now_ns());
    serve_dump_request();
  }

  bool query_event(uintptr_t ev, int device, bool* done) {
    if (fake) {
      auto it = fake_events.find(ev);
      *done = it != fake_events.end() && it->second.done;
      return true;
    }
    int cur = -1;
    if (g_cuda.get_device(&cur) == kCudaSuccess && cur != device && device >= 0) {
      g_cuda.set_device(device);
    }
    int rc = g_cuda.event_query(reinterpret_cast<void*>(ev));
    if (rc == kCudaSuccess) {
      *done = true;
      return true;
    }
    if (rc == kCudaNotReady) {
      *done = false;
      return true;
    }
    return false;  // destroyed or invalid event: stop watching
  }

  double elapsed_ms(uintptr_t start, uintptr_t end) {
    if (!start) return NAN;
    if (fake) {
      auto a = fake_events.find(start), b = fake_events.find(end);
      if (a == fake_events.end() || b == fake_events.end()) return NAN;
      return b->second.ms - a->second.ms;
    }
    float ms = 0;
    if (g_cuda.event_elapsed(&ms, reinterpret_cast<void*>(start), reinterpret_cast<void*>(end)) ==
        kCudaSuccess) {
      return ms;
    }
    return NAN;
  }

  void poll_cuda() {
    std::lock_guard<std::mutex> lock(watch_mutex);
    if (watches.empty()) return;
    size_t keep = 0;
    for (size_t i = 0; i < watches.size(); ++i) {
      CudaWatch w = watches[i];
      bool done = false, finished = false;
      if (!w.started && w.start) {
        if (!query_event(w.start, w.device, &done)) {
          finished = true;
        } else if (done) {
          w.started = true;
          mark(w.rid, kStarted, now_ns(), NAN, true);
        }
      }
      if (!finished && (w.started || !w.start)) {
        if (!query_event(w.end, w.device, &done)) {
          finished = true;
        } else if (done) {
          int64_t t = now_ns();
          if (!w.started) mark(w.rid, kStarted, t, NAN, true);
          mark(w.rid, kCompleted, t, elapsed_ms(w.start, w.end), true);
          finished = true;
        }
      }
      if (state_of(w.rid) == 0) finished = true;  // slot reused: nothing left to stamp
      if (finished) {
        cuda_done.push_back(w.rid);
      } else {
        watches[keep++] = w;
      }
    }
    watches.resize(keep);
  }

  void check_stall() {
    uint64_t next = aload(&next_rid);
    uint64_t lo = next > capacity ? next - capacity : 0;
    if (stall_cursor < lo) stall_cursor = lo;
    int64_t oldest_rid = -1, oldest_t = 0;
    for (uint64_t rid = stall_cursor; rid < next; ++rid) {
      Slot* s = slot_for(int64_t(rid));
      uint64_t a = aload(&s->seq);
      int64_t r = __atomic_load_n(&s->record_id, __ATOMIC_RELAXED);
      uint8_t st = __atomic_load_n(&s->state, __ATOMIC_RELAXED);
      int64_t t = __atomic_load_n(&s->time_created_ns, __ATOMIC_RELAXED);
      if ((a & 1) || aload(&s->seq) != a) break;  // being written: look again next time
      if (st == kEmpty) break;                      // claimed, not yet written
      if (uint64_t(r) != rid) {
        if (uint64_t(r) > rid) {  // overwritten by a newer record: skip
          if (rid == stall_cursor) ++stall_cursor;
          continue;
        }
        break;  // claimed but not yet written
      }
      if (st == kCompleted) {
        if (rid == stall_cursor) ++stall_cursor;
        continue;
      }
      oldest_rid = int64_t(rid);
      oldest_t = t;
      break;
    }
    int64_t now = now_ns();
    if (oldest_rid >= 0 && double(now - oldest_t) / 1e9 > stall_seconds) {
      if (!aload(&stalled_now) || stall_rid != oldest_rid) {
        stall_rid = oldest_rid;
        astore(&hdr->stall_record_id, oldest_rid);
        astore(&hdr->stall_time_ns, now);
      }
      astore(&stalled_now, 1u);
      astore(&hdr->stalled, 1u);
    } else {
      astore(&stalled_now, 0u);
      astore(&hdr->stalled, 0u);
    }
  }

  void serve_dump_request() {
    uint64_t req = aload(&hdr->dump_request_seq);
    uint64_t ack = aload(&hdr->dump_ack_seq);
    if (req <= ack) return;
    uint32_t status = kAckNoHandler;
    if (stack_signal > 0) {
      struct sigaction current;
      if (sigaction(stack_signal, nullptr, &current) == 0) {
        bool has_handler = (current.sa_flags & SA_SIGINFO) ||
                           (current.sa_handler != SIG_DFL && current.sa_handler != SIG_IGN);
        if (has_handler) {
          // Delivered to this thread before pthread_kill returns: faulthandler writes every
          // Python thread's stack from the handler, without the GIL.
          pthread_kill(pthread_self(), stack_signal);
          status = kAckStacksWritten;
        }
      }
    }
    astore(&hdr->dump_ack_status, status);
    astore(&hdr->dump_ack_time_ns, now_ns());
    astore(&hdr->dump_ack_seq, req);
  }

  static void* watchdog_main(void* arg) {
    Box* box = static_cast<Box*>(arg);
    sigset_t all;
    sigfillset(&all);
    if (box->stack_signal > 0) sigdelset(&all, box->stack_signal);
    pthread_sigmask(SIG_SETMASK, &all, nullptr);
    pthread_setname_np(pthread_self(), "frtools-watch");
    pthread_mutex_lock(&box->stop_pmutex);
    while (!box->stop) {
      pthread_mutex_unlock(&box->stop_pmutex);
      box->poll_once();
      pthread_mutex_lock(&box->stop_pmutex);
      if (box->stop) break;
      struct timespec deadline;
      clock_gettime(CLOCK_REALTIME, &deadline);
      int64_t ns = deadline.tv_nsec + int64_t(box->poll_ms) * 1000000LL;
      deadline.tv_sec += ns / 1000000000LL;
      deadline.tv_nsec = ns % 1000000000LL;
      pthread_cond_timedwait(&box->stop_cond, &box->stop_pmutex, &deadline);
    }
    pthread_mutex_unlock(&box->stop_pmutex);
    return nullptr;
  }

  void stop_watchdog() {
    if (!thread_started) return;
    thread_started = false;
    if (getpid() != owner_pid) return;  // forked child: the thread lives only in the parent
    pthread_mutex_lock(&stop_pmutex);
    stop = true;
    pthread_cond_broadcast(&stop_cond);
    pthread_mutex_unlock(&stop_pmutex);
    pthread_join(thread, nullptr);
    if (hdr) astore(&hdr->watchdog_state, kWatchdogStopped);
  }

  void unmap(bool clean) {
    if (!mem) return;
    closing.store(true, std::memory_order_seq_cst);
    if (getpid() == owner_pid) {  // a forked child's count is a copy: nobody writes there
      while (users.load(std::memory_order_seq_cst) != 0) sched_yield();
    }
    if (clean && getpid() == owner_pid) astore(&hdr->closed, 1u);
    munmap(mem, bytes);
    mem = nullptr;
    hdr = nullptr;
  }
};

// ---------------------------------------------------------------------------------------
// Python objects.
// ---------------------------------------------------------------------------------------

struct BlackBoxObject {
  PyObject_HEAD Box* box;
};

struct CompleterObject {
  PyObject_HEAD BlackBoxObject* owner;
  int64_t rid;
};

PyTypeObject BlackBoxType = {PyVarObject_HEAD_INIT(nullptr, 0)};
PyTypeObject CompleterType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// A forked child (a DataLoader worker, say) inherits the mapping: it must not write into its
// parent's black box, nor touch locks a parent thread may have held at fork time.
inline bool forked(BlackBoxObject* self) {
  Box* b = self->box;
  return b && b->mem && b->fork_generation != g_fork_generation;
}

inline Box* open_box(BlackBoxObject* self) {
  Box* b = self->box;
  return (b && b->mem && b->fork_generation == g_fork_generation) ? b : nullptr;
}

PyObject* closed_error() {
  PyErr_SetString(PyExc_ValueError, "the black box is closed");
  return nullptr;
}

// Create the black-box file as a new file of ours, never through what is already at the path.
// O_EXCL|O_NOFOLLOW: a symlink, FIFO or file planted at the path is not opened (nor
// truncated, nor followed); whatever non-directory is there (a stale box of an earlier run
// with the same job id and rank, most often) is unlinked and the file created anew, once.
// The new file must be a regular file owned by this user; its mode is set exactly (the umask
// does not widen nor narrow it) and, with gid >= 0, its group. Returns the fd, or -1 with
// errno set.
int create_private_file(const char* path, mode_t mode, long long gid) {
  const int flags = O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC;
  int fd = open(path, flags, mode);
  if (fd < 0 && errno == EEXIST) {
    struct stat st;
    if (lstat(path, &st) != 0) return -1;
    if (S_ISDIR(st.st_mode)) {
      errno = EISDIR;
      return -1;
    }
    if (unlink(path) != 0) return -1;
    fd = open(path, flags, mode);
  }
  if (fd < 0) return -1;
  struct stat st;
  int e = 0;
  if (fstat(fd, &st) != 0) {
    e = errno;
  } else if (!S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
    e = EPERM;
  } else if (fchmod(fd, mode) != 0) {
    e = errno;
  } else if (gid >= 0 && fchown(fd, uid_t(-1), gid_t(gid)) != 0) {
    e = errno;
  } else {
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    return fd;
  }
  close(fd);
  errno = e;
  return -1;
}

int BlackBox_init(BlackBoxObject* self, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"path", "capacity", "strings_bytes", "identity_json",
                                 "pg_capacity", "mode", "gid", nullptr};
  const char* path = nullptr;
  long long capacity = 0, strings_bytes = 0;
  const char* identity = nullptr;
  Py_ssize_t identity_len = 0;
  long long pg_capacity = kDefaultPgCapacity;
  int mode = 0600;
  long long gid = -1;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sLLs#|LiL", const_cast<char**>(kwlist), &path,
                                   &capacity, &strings_bytes, &identity, &identity_len,
                                   &pg_capacity, &mode, &gid)) {
    return -1;
  }
  if (mode & ~0666) {
    PyErr_SetString(PyExc_ValueError, "mode may only hold read/write permission bits (0666)");
    return -1;
  }
  if (capacity <= 0 || capacity > (1LL << 28)) {
    PyErr_SetString(PyExc_ValueError, "capacity must be between 1 and 2**28");
    return -1;
  }
  if (strings_bytes < 64 || strings_bytes > 0xFFFFFFF0LL) {
    PyErr_SetString(PyExc_ValueError, "strings_bytes must be between 64 and 2**32 - 16");
    return -1;
  }
  if (pg_capacity <= 0 || pg_capacity > (1LL << 20)) {
    PyErr_SetString(PyExc_ValueError, "pg_capacity must be between 1 and 2**20");
    return -1;
  }
  if (identity_len >= Py_ssize_t(kIdentityMax)) {
    PyErr_Format(PyExc_ValueError, "identity_json is longer than %u bytes", kIdentityMax - 1);
    return -1;
  }
  if (self->box) {
    PyErr_SetString(PyExc_RuntimeError, "BlackBox already initialised");
    return -1;
  }
  uint64_t pg_offset = kHeaderBytes;
  uint64_t slots_offset = pg_offset + uint64_t(pg_capacity) * sizeof(PgEntry);
  slots_offset = (slots_offset + 4095) & ~uint64_t(4095);
  uint64_t strings_offset = slots_offset + uint64_t(capacity) * sizeof(Slot);
  uint64_t file_bytes = strings_offset + uint64_t(strings_bytes);
  file_bytes = (file_bytes + 4095) & ~uint64_t(4095);

  int fd = create_private_file(path, mode_t(mode), gid);
  if (fd < 0) {
    PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
    return -1;
  }
  if (ftruncate(fd, off_t(file_bytes)) != 0) {
    int e = errno;
    close(fd);
    errno = e;
    PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
    return -1;
  }
  void* mem = mmap(nullptr, file_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int e = errno;
  close(fd);
  if (mem == MAP_FAILED) {
    errno = e;
    PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
    return -1;
  }
  Box* b = new Box();
  b->path = path;
  b->mem = static_cast<uint8_t*>(mem);
  b->bytes = file_bytes;
  b->hdr = reinterpret_cast<Header*>(mem);
  b->pgs = reinterpret_cast<PgEntry*>(b->mem + pg_offset);
  b->slots = reinterpret_cast<Slot*>(b->mem + slots_offset);
  b->strings = b->mem + strings_offset;
  b->capacity = uint32_t(capacity);
  b->strings_cap = uint64_t(strings_bytes);
  b->strings_used = kStringsReserved;
  b->pg_capacity = uint32_t(pg_capacity);
  b->owner_pid = getpid();
  b->fork_generation = g_fork_generation;

  Header* h = b->hdr;
  h->version = kVersion;
  h->header_bytes = kHeaderBytes;
  h->slot_bytes = sizeof(Slot);
  h->capacity = uint32_t(capacity);
  h->pg_entry_bytes = sizeof(PgEntry);
  h->pg_capacity = uint32_t(pg_capacity);
  h->pg_offset = pg_offset;
  h->slots_offset = slots_offset;
  h->strings_offset = strings_offset;
  h->strings_bytes = uint64_t(strings_bytes);
  h->file_bytes = file_bytes;
  h->created_ns = now_ns();
  h->next_record_id = 0;
  h->strings_used = kStringsReserved;
  h->stall_record_id = -1;
  h->owner_pid = b->owner_pid;
  h->identity_bytes = uint32_t(identity_len);
  memcpy(b->mem + kIdentityOffset, identity, size_t(identity_len));
  // The magic goes last: a reader never sees a half-written header as valid.
  __atomic_thread_fence(__ATOMIC_RELEASE);
  memcpy(h->magic, kMagic, sizeof(kMagic));
  self->box = b;
  return 0;
}

void BlackBox_dealloc(BlackBoxObject* self) {
  if (self->box) {
    Box* b = self->box;
    self->box = nullptr;
    Py_BEGIN_ALLOW_THREADS b->stop_watchdog();
    Py_END_ALLOW_THREADS b->unmap(true);
    // the watched page stays mapped for the exit handlers; a Box allocated later at the same
    // address must not be taken for this one (it would share its claim)
    if (g_exit.box == b) g_exit.box = nullptr;
    if (b->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete b;
  }
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyObject* BlackBox_intern(BlackBoxObject* self, PyObject* arg) {
  Box* b = open_box(self);
  if (!b) return forked(self) ? PyLong_FromLong(kStrNone) : closed_error();
  Py_ssize_t n = 0;
  const char* s = PyUnicode_AsUTF8AndSize(arg, &n);
  if (!s) return nullptr;
  return PyLong_FromUnsignedLong(b->intern(s, size_t(n)));
}

// Member ranks as compact text: comma-separated terms "a", "a-b" (a..b inclusive) or
// "a-b:s" (a, a+s, ..., b), so a 16,384-rank default group is "0-16383", not 90 KB.
std::string encode_ranks(const std::vector<long long>& r) {
  std::string out;
  size_t i = 0, n = r.size();
  while (i < n) {
    if (!out.empty()) out += ",";
    size_t j = i;
    if (i + 2 < n && r[i + 1] > r[i] && r[i + 2] - r[i + 1] == r[i + 1] - r[i]) {
      long long step = r[i + 1] - r[i];
      j = i + 2;
      while (j + 1 < n && r[j + 1] - r[j] == step) ++j;
      out += std::to_string(r[i]) + "-" + std::to_string(r[j]);
      if (step != 1) out += ":" + std::to_string(step);
    } else {
      out += std::to_string(r[i]);
    }
    i = j + 1;
  }
  return out;
}

PyObject* BlackBox_add_process_group(BlackBoxObject* self, PyObject* args) {
  Box* b = open_box(self);
  if (!b) return forked(self) ? PyLong_FromLong(-1) : closed_error();
  const char *name = nullptr, *desc = nullptr;
  Py_ssize_t name_len = 0, desc_len = 0;
  PyObject* ranks = nullptr;
  int fresh = 0;  // a new instance: a row of its own even where its name has one
  if (!PyArg_ParseTuple(args, "s#s#O|p", &name, &name_len, &desc, &desc_len, &ranks, &fresh)) {
    return nullptr;
  }
  PyObject* seq = PySequence_Fast(ranks, "ranks must be a sequence of ints");
  if (!seq) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  std::vector<long long> members;
  members.reserve(size_t(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    long long r = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (r == -1 && PyErr_Occurred()) {
      Py_DECREF(seq);
      return nullptr;
    }
    members.push_back(r);
  }
  Py_DECREF(seq);
  std::string ranks_text = encode_ranks(members);

  std::string key(name, size_t(name_len));
  if (!fresh) {
    std::lock_guard<std::mutex> lock(b->intern_mutex);
    auto it = b->pg_by_name.find(key);
    if (it != b->pg_by_name.end()) return PyLong_FromLong(it->second);
  }
  uint32_t name_id = b->intern(name, size_t(name_len));
  uint32_t desc_id = b->intern(desc, size_t(desc_len));
  uint32_t ranks_id = b->intern(ranks_text.data(), ranks_text.size());
  std::lock_guard<std::mutex> lock(b->intern_mutex);
  auto it = b->pg_by_name.find(key);
  if (!fresh && it != b->pg_by_name.end()) return PyLong_FromLong(it->second);
  uint32_t count = b->pg_count;
  if (count >= b->pg_capacity) {
    PyErr_Format(PyExc_OverflowError, "process-group table full (%u groups)", count);
    return nullptr;
  }
  PgEntry* e = &b->pgs[count];
  e->name = name_id;
  e->desc = desc_id;
  e->ranks = ranks_id;
  e->size = uint32_t(n);
  e->last_enqueued_collective = 0;
  e->last_started_collective = 0;
  e->last_completed_collective = 0;
  e->last_enqueued_p2p = 0;
  e->last_completed_p2p = 0;
  astore(&b->pg_count, count + 1);
  astore(&b->hdr->pg_count, count + 1);
  b->pg_by_name[std::move(key)] = int32_t(count);  // a name's newest row
  return PyLong_FromLong(long(count));
}

inline bool as_i64(PyObject* o, int64_t* out) {
  long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) return false;
  *out = v;
  return true;
}

PyObject* BlackBox_record(BlackBoxObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 11) {
    PyErr_Format(PyExc_TypeError,
                 "record(pg, op, collective_seq_id, p2p_seq_id, peer, is_p2p, in_sizes, "
                 "out_sizes, in_dtypes, out_dtypes, stack) takes 11 arguments (%zd given)",
                 nargs);
    return nullptr;
  }
  Box* b = open_box(self);
  if (!b) return PyLong_FromLong(-1);
  int64_t v[11];
  for (int i = 0; i < 11; ++i) {
    if (i == 5) continue;
    if (!as_i64(args[i], &v[i])) return nullptr;
  }
  int truth = PyObject_IsTrue(args[5]);
  if (truth < 0) return nullptr;
  int64_t rid = b->record(int32_t(v[0]), uint32_t(v[1]), v[2], v[3], int32_t(v[4]), truth != 0,
                          uint32_t(v[6]), uint32_t(v[7]), uint32_t(v[8]), uint32_t(v[9]),
                          uint32_t(v[10]));
  return PyLong_FromLongLong(rid);
}

PyObject* BlackBox_mark_started(BlackBoxObject* self, PyObject* arg) {
  int64_t rid;
  if (!as_i64(arg, &rid)) return nullptr;
  Box* b = open_box(self);
  if (b) b->mark(rid, kStarted, now_ns(), NAN, false);
  Py_RETURN_NONE;
}

PyObject* BlackBox_mark_completed(BlackBoxObject* self, PyObject* arg) {
  int64_t rid;
  if (!as_i64(arg, &rid)) return nullptr;
  Box* b = open_box(self);
  if (b) b->mark(rid, kCompleted, now_ns(), NAN, false);
  Py_RETURN_NONE;
}

// Texts of failures are capped: a backend's message is one line, a traceback a few dozen.
constexpr Py_ssize_t kMaxFactBytes = 8192;

// The string id of a Python str (None or "" -> 0), cut to kMaxFactBytes at a UTF-8 boundary.
bool intern_fact(Box* b, PyObject* text, uint32_t* id) {
  *id = kStrNone;
  if (text == Py_None) return true;
  Py_ssize_t n = 0;
  const char* s = PyUnicode_AsUTF8AndSize(text, &n);
  if (!s) return false;
  if (n > kMaxFactBytes) {
    n = kMaxFactBytes;
    while (n > 0 && (uint8_t(s[n]) & 0xC0) == 0x80) --n;
  }
  *id = b->intern(s, size_t(n));
  return true;
}

PyObject* BlackBox_mark_failed(BlackBoxObject* self, PyObject* args) {
  long long rid = 0;
  PyObject* text = nullptr;
  if (!PyArg_ParseTuple(args, "LO", &rid, &text)) return nullptr;
  Box* b = open_box(self);
  if (!b) Py_RETURN_FALSE;
  uint32_t err = kStrNone;
  if (!intern_fact(b, text, &err)) return nullptr;
  return PyBool_FromLong(b->mark_failed(rid, err, now_ns()));
}

PyObject* BlackBox_pend_splits(BlackBoxObject* self, PyObject* args) {
  const char* text = nullptr;
  Py_ssize_t n = 0;
  if (!PyArg_ParseTuple(args, "z#", &text, &n)) return nullptr;
  Box* b = open_box(self);
  if (!b) Py_RETURN_FALSE;
  return PyBool_FromLong(b->pend_splits(text, text ? size_t(n) : 0));
}

PyObject* BlackBox_mark_exit(BlackBoxObject* self, PyObject* args) {
  unsigned int kind = 0;
  int status = 0;
  PyObject *detail = Py_None, *stack = Py_None;
  if (!PyArg_ParseTuple(args, "Ii|OO", &kind, &status, &detail, &stack)) return nullptr;
  if (kind < kExitClean || kind > kExitSignal) {
    PyErr_Format(PyExc_ValueError, "unknown exit kind %u", kind);
    return nullptr;
  }
  Box* b = open_box(self);
  if (!b) Py_RETURN_FALSE;
  uint32_t detail_id = kStrNone, stack_id = kStrNone;
  if (!intern_fact(b, detail, &detail_id) || !intern_fact(b, stack, &stack_id)) return nullptr;
  // the watched box shares its claim with the signal and exit handlers
  uint32_t* claim = g_exit.box == b ? &g_exit.claim : &b->exit_claim;
  return PyBool_FromLong(record_exit(b->hdr, claim, kind, status, detail_id, stack_id, now_ns()));
}

PyObject* BlackBox_note_thread_error(BlackBoxObject* self, PyObject* text) {
  Box* b = open_box(self);
  if (!b) Py_RETURN_NONE;
  uint32_t id = kStrNone;
  if (!intern_fact(b, text, &id)) return nullptr;
  astore(&b->hdr->thread_error, id);
  Py_RETURN_NONE;
}

// set_phase(code[, failed]): the process entered start-up phase ``code`` (1..kPhaseCount) now.
// Its time is written once (the first entry), then the phase itself; ``failed`` marks an
// init_process_group that raised.
PyObject* BlackBox_set_phase(BlackBoxObject* self, PyObject* args) {
  unsigned int code = 0;
  int failed = 0;
  if (!PyArg_ParseTuple(args, "I|p", &code, &failed)) return nullptr;
  if (code < 1 || code > kPhaseCount) {
    PyErr_Format(PyExc_ValueError, "start-up phase %u is not 1..%u", code, kPhaseCount);
    return nullptr;
  }
  Box* b = open_box(self);
  if (!b) Py_RETURN_NONE;
  int64_t* times = &b->hdr->phase_started_ns;
  int64_t zero = 0;
  __atomic_compare_exchange_n(&times[code - 1], &zero, now_ns(), false, __ATOMIC_RELEASE,
                              __ATOMIC_RELAXED);
  if (failed) astore(&b->hdr->startup_failed, uint32_t(1));
  astore(&b->hdr->startup_phase, uint32_t(code));
  Py_RETURN_NONE;
}

// set_identity(json): the identity restated (backend, device: known at the first group),
// interned and pointed to by the header; readers merge it over the one at kIdentityOffset.
PyObject* BlackBox_set_identity(BlackBoxObject* self, PyObject* text) {
  Box* b = open_box(self);
  if (!b) Py_RETURN_NONE;
  uint32_t id = kStrNone;
  if (!intern_fact(b, text, &id)) return nullptr;
  astore(&b->hdr->identity_update, id);
  Py_RETURN_NONE;
}

PyObject* BlackBox_watch_exit(BlackBoxObject* self, PyObject*) {
  Box* b = open_box(self);
  if (!b) return closed_error();
  // a second mapping of the header page (same pages: old_size 0 on a shared mapping)
  void* page = mremap(b->mem, 0, kHeaderBytes, MREMAP_MAYMOVE);
  if (page == MAP_FAILED) return PyErr_SetFromErrno(PyExc_OSError);
  pid_t pid = getpid();
  g_exit.pid = pid;
  if (g_exit.box != b) {
    __atomic_store_n(&g_exit.claim, __atomic_load_n(&b->exit_claim, __ATOMIC_ACQUIRE),
                     __ATOMIC_RELEASE);
    g_exit.box = b;
  }
  // a previously watched page stays mapped: a handler may be reading it right now
  __atomic_store_n(&g_exit.hdr, static_cast<Header*>(page), __ATOMIC_RELEASE);
  if (g_exit.on_exit_pid != pid) {
    if (on_exit(&on_process_exit, nullptr) != 0) {
      PyErr_SetString(PyExc_RuntimeError, "on_exit failed");
      return nullptr;
    }
    g_exit.on_exit_pid = pid;
  }
  install_fatal_signal_handlers();
  astore(&b->hdr->exit_watched, 1u);
  Py_RETURN_NONE;
}

PyObject* BlackBox_state(BlackBoxObject* self, PyObject* arg) {
  int64_t rid;
  if (!as_i64(arg, &rid)) return nullptr;
  Box* b = open_box(self);
  return PyLong_FromLong(b ? b->state_of(rid) : 0);
}

PyObject* BlackBox_completer(BlackBoxObject* self, PyObject* arg) {
  int64_t rid;
  if (!as_i64(arg, &rid)) return nullptr;
  CompleterObject* c = PyObject_New(CompleterObject, &CompleterType);
  if (!c) return nullptr;
  Py_INCREF(self);
  c->owner = self;
  c->rid = rid;
  return reinterpret_cast<PyObject*>(c);
}

PyObject* BlackBox_watch_cuda(BlackBoxObject* self, PyObject* args) {
  long long rid = 0;
  unsigned long long start = 0, end = 0;
  if (!PyArg_ParseTuple(args, "LKK", &rid, &start, &end)) return nullptr;
  Box* b = open_box(self);
  if (!b) return closed_error();
  if (!end) {
    PyErr_SetString(PyExc_ValueError, "watch_cuda needs an end event");
    return nullptr;
  }
  int device = -1;
  if (!b->fake) {
    std::string why;
    if (!load_cuda(&why)) {
      PyErr_Format(PyExc_RuntimeError, "CUDA events cannot be watched: %s", why.c_str());
      return nullptr;
    }
    g_cuda.get_device(&device);
  }
  std::lock_guard<std::mutex> lock(b->watch_mutex);
  b->watches.push_back(CudaWatch{rid, uintptr_t(start), uintptr_t(end), device, false});
  Py_RETURN_NONE;
}

PyObject* BlackBox_drain_cuda_done(BlackBoxObject* self, PyObject*) {
  Box* b = open_box(self);
  if (!b) return PyList_New(0);
  std::vector<int64_t> done;
  {
    std::lock_guard<std::mutex> lock(b->watch_mutex);
    done.swap(b->cuda_done);
  }
  PyObject* out = PyList_New(Py_ssize_t(done.size()));
  if (!out) return nullptr;
  for (size_t i = 0; i < done.size(); ++i) {
    PyList_SET_ITEM(out, Py_ssize_t(i), PyLong_FromLongLong(done[i]));
  }
  return out;
}

PyObject* BlackBox_cuda_pending(BlackBoxObject* self, PyObject*) {
  Box* b = open_box(self);
  if (!b) return PyLong_FromLong(0);
  std::lock_guard<std::mutex> lock(b->watch_mutex);
  return PyLong_FromSize_t(b->watches.size());
}

PyObject* BlackBox_start_watchdog(BlackBoxObject* self, PyObject* args) {
  int poll_ms = 100;
  double stall_seconds = 0;
  int stack_signal = 0;
  if (!PyArg_ParseTuple(args, "idi", &poll_ms, &stall_seconds, &stack_signal)) return nullptr;
  Box* b = open_box(self);
  if (!b) return closed_error();
  if (poll_ms <= 0) {
    PyErr_SetString(PyExc_ValueError, "poll_ms must be positive");
    return nullptr;
  }
  if (b->thread_started) {
    PyErr_SetString(PyExc_RuntimeError, "watchdog already running");
    return nullptr;
  }
  b->poll_ms = uint32_t(poll_ms);
  b->stall_seconds = stall_seconds;
  b->stack_signal = stack_signal;
  b->hdr->poll_ms = uint32_t(poll_ms);
  b->hdr->stall_seconds = stall_seconds;
  b->hdr->stack_signal = uint32_t(stack_signal);
  b->stop = false;
  int rc = pthread_create(&b->thread, nullptr, &Box::watchdog_main, b);
  if (rc != 0) {
    errno = rc;
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  b->thread_started = true;
  astore(&b->hdr->watchdog_state, kWatchdogRunning);
  Py_RETURN_NONE;
}

PyObject* BlackBox_poll_once(BlackBoxObject* self, PyObject*) {
  Box* b = open_box(self);
  if (!b) return closed_error();
  b->poll_once();  // keeps the GIL: close() cannot unmap underneath
  Py_RETURN_NONE;
}

PyObject* BlackBox_fake_events(BlackBoxObject* self, PyObject* arg) {
  Box* b = open_box(self);
  if (!b) return closed_error();
  int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  std::lock_guard<std::mutex> lock(b->watch_mutex);
  b->fake = on != 0;
  Py_RETURN_NONE;
}

PyObject* BlackBox_fake_event_set(BlackBoxObject* self, PyObject* args) {
  unsigned long long handle = 0;
  int done = 0;
  double ms = 0;
  if (!PyArg_ParseTuple(args, "Kpd", &handle, &done, &ms)) return nullptr;
  Box* b = open_box(self);
  if (!b) return closed_error();
  std::lock_guard<std::mutex> lock(b->watch_mutex);
  b->fake_events[uintptr_t(handle)] = FakeEvent{done != 0, ms};
  Py_RETURN_NONE;
}

PyObject* BlackBox_stalled(BlackBoxObject* self, PyObject*) {
  Box* b = open_box(self);
  if (!b) Py_RETURN_FALSE;
  return PyBool_FromLong(aload(&b->stalled_now) != 0);
}

PyObject* BlackBox_close(BlackBoxObject* self, PyObject*) {
  Box* b = self->box;
  if (!b || !b->mem) Py_RETURN_NONE;
  Py_BEGIN_ALLOW_THREADS b->stop_watchdog();
  Py_END_ALLOW_THREADS b->unmap(true);
  Py_RETURN_NONE;
}

PyObject* BlackBox_get_path(BlackBoxObject* self, void*) {
  if (!self->box) Py_RETURN_NONE;
  return PyUnicode_DecodeFSDefault(self->box->path.c_str());
}

PyObject* BlackBox_get_capacity(BlackBoxObject* self, void*) {
  return PyLong_FromUnsignedLong(self->box ? self->box->capacity : 0);
}

PyObject* BlackBox_get_closed(BlackBoxObject* self, void*) {
  return PyBool_FromLong(open_box(self) == nullptr);
}

PyObject* BlackBox_get_records(BlackBoxObject* self, void*) {
  Box* b = open_box(self);
  return PyLong_FromUnsignedLongLong(b ? aload(&b->next_rid) : 0);
}

PyMethodDef BlackBox_methods[] = {
    {"intern", (PyCFunction)BlackBox_intern, METH_O,
     "intern(s) -> int: string-table id of s (the same string always gets the same id)."},
    {"add_process_group", (PyCFunction)BlackBox_add_process_group, METH_VARARGS,
     "add_process_group(name, desc, ranks, fresh=False) -> int: index of the group in the pg "
     "table (the name's row; fresh: a new row, for a group created again under its name)."},
    {"record", (PyCFunction)(void (*)(void))BlackBox_record, METH_FASTCALL,
     "record(pg, op, collective_seq_id, p2p_seq_id, peer, is_p2p, in_sizes, out_sizes, "
     "in_dtypes, out_dtypes, stack) -> record id (string ids from intern)."},
    {"mark_started", (PyCFunction)BlackBox_mark_started, METH_O,
     "mark_started(rid): stamp started (ignored if the slot was reused)."},
    {"mark_completed", (PyCFunction)BlackBox_mark_completed, METH_O,
     "mark_completed(rid): stamp completed (ignored if the slot was reused)."},
    {"mark_failed", (PyCFunction)BlackBox_mark_failed, METH_VARARGS,
     "mark_failed(rid, error_text) -> bool: the op failed with this text (the backend's "
     "exception); kept apart from completion. False if the slot was reused or already failed."},
    {"pend_splits", (PyCFunction)BlackBox_pend_splits, METH_VARARGS,
     "pend_splits(text) -> bool: an all_to_all's split sizes (formats.blackbox.splits_text) "
     "written with this thread's next record, before the call runs, so that a rank the "
     "backend aborts mid-call keeps them; None clears them. True where pending ones were "
     "still unused. Dropped where the splits' share of the string table (half) is full."},
    {"mark_exit", (PyCFunction)BlackBox_mark_exit, METH_VARARGS,
     "mark_exit(kind, status, detail=None, stack=None) -> bool: how the process ends (EXIT_* "
     "kind); the first ending recorded wins."},
    {"note_thread_error", (PyCFunction)BlackBox_note_thread_error, METH_O,
     "note_thread_error(text): an uncaught exception of a thread other than the main one."},
    {"set_phase", (PyCFunction)BlackBox_set_phase, METH_VARARGS,
     "set_phase(code, failed=False): the process entered start-up phase code now"},
    {"set_identity", (PyCFunction)BlackBox_set_identity, METH_O,
     "set_identity(json): the identity restated at the first process group"},
    {"watch_exit", (PyCFunction)BlackBox_watch_exit, METH_NOARGS,
     "watch_exit(): record this process's exit status (on_exit) and fatal signals (SIGSEGV, "
     "SIGBUS, SIGFPE, SIGILL, SIGABRT; SIGTERM where it has its default action) in this box; "
     "earlier handlers are chained."},
    {"state", (PyCFunction)BlackBox_state, METH_O,
     "state(rid) -> 0 (slot reused or unknown), 1 scheduled, 2 started, 3 completed."},
    {"completer", (PyCFunction)BlackBox_completer, METH_O,
     "completer(rid) -> callable that marks rid completed when called with any arguments."},
    {"watch_cuda", (PyCFunction)BlackBox_watch_cuda, METH_VARARGS,
     "watch_cuda(rid, start_event, end_event): raw cudaEvent_t handles for the watchdog."},
    {"drain_cuda_done", (PyCFunction)BlackBox_drain_cuda_done, METH_NOARGS,
     "drain_cuda_done() -> record ids whose CUDA events the watchdog no longer needs."},
    {"cuda_pending", (PyCFunction)BlackBox_cuda_pending, METH_NOARGS,
     "cuda_pending() -> number of records whose CUDA events are still watched."},
    {"start_watchdog", (PyCFunction)BlackBox_start_watchdog, METH_VARARGS,
     "start_watchdog(poll_ms, stall_seconds, stack_signal): start the native watchdog."},
    {"stalled", (PyCFunction)BlackBox_stalled, METH_NOARGS,
     "stalled() -> bool: the watchdog sees an op older than stall_seconds."},
    {"close", (PyCFunction)BlackBox_close, METH_NOARGS,
     "close(): stop the watchdog and unmap the file (the file stays)."},
    {"_poll_once", (PyCFunction)BlackBox_poll_once, METH_NOARGS,
     "test seam: run one watchdog pass in the calling thread."},
    {"_fake_events", (PyCFunction)BlackBox_fake_events, METH_O,
     "test seam: _fake_events(True) makes the watchdog query fake events, not CUDA."},
    {"_fake_event_set", (PyCFunction)BlackBox_fake_event_set, METH_VARARGS,
     "test seam: _fake_event_set(handle, done, time_ms); elapsed = end.time_ms - "
     "start.time_ms."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef BlackBox_getset[] = {
    {"path", (getter)BlackBox_get_path, nullptr, "path of the black-box file", nullptr},
    {"capacity", (getter)BlackBox_get_capacity, nullptr, "number of ring slots", nullptr},
    {"closed", (getter)BlackBox_get_closed, nullptr, "True after close()", nullptr},
    {"records", (getter)BlackBox_get_records, nullptr, "records ever written", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

void Completer_dealloc(CompleterObject* self) {
  Py_XDECREF(self->owner);
  PyObject_Free(self);
}

PyObject* Completer_call(CompleterObject* self, PyObject*, PyObject*) {
  Box* b = self->owner ? open_box(self->owner) : nullptr;
  if (b) b->mark(self->rid, kCompleted, now_ns(), NAN, false);
  Py_RETURN_NONE;
}

PyObject* Completer_repr(CompleterObject* self) {
  return PyUnicode_FromFormat("<frtools completer for record %lld>", (long long)self->rid);
}

PyObject* Completer_get_rid(CompleterObject* self, void*) {
  return PyLong_FromLongLong(self->rid);
}

PyGetSetDef Completer_getset[] = {
    {"record_id", (getter)Completer_get_rid, nullptr, "the record this marks completed",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

// ---------------------------------------------------------------------------------------
// The C interface for other native modules (box_api.h): no GIL, no Python objects.
// ---------------------------------------------------------------------------------------

// The box of a handle, entered (close() waits for it to leave); nullptr when it is closed
// or this is a forked child.
inline Box* api_enter(void* handle) {
  Box* b = static_cast<Box*>(handle);
  if (!b || b->fork_generation != g_fork_generation) return nullptr;
  b->users.fetch_add(1, std::memory_order_seq_cst);
  if (b->closing.load(std::memory_order_seq_cst) || !b->mem) {
    b->users.fetch_sub(1, std::memory_order_release);
    return nullptr;
  }
  return b;
}

inline void api_leave(Box* b) { b->users.fetch_sub(1, std::memory_order_release); }

void* api_acquire(PyObject* obj) {
  if (!PyObject_TypeCheck(obj, &BlackBoxType)) {
    PyErr_SetString(PyExc_TypeError, "expected a frtools.recorder._blackbox.BlackBox");
    return nullptr;
  }
  Box* b = open_box(reinterpret_cast<BlackBoxObject*>(obj));
  if (!b) {
    closed_error();
    return nullptr;
  }
  b->refs.fetch_add(1, std::memory_order_relaxed);
  return b;
}

void api_release(void* handle) {
  Box* b = static_cast<Box*>(handle);
  if (b && b->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete b;
}

int64_t api_record(void* handle, int32_t pg, uint32_t op, int64_t coll, int64_t p2p,
                   int32_t peer, int is_p2p, uint32_t in_sizes, uint32_t out_sizes,
                   uint32_t in_dtypes, uint32_t out_dtypes, uint32_t stack) {
  Box* b = api_enter(handle);
  if (!b) return -1;
  int64_t rid = b->record(pg, op, coll, p2p, peer, is_p2p != 0, in_sizes, out_sizes, in_dtypes,
                          out_dtypes, stack);
  api_leave(b);
  return rid;
}

void api_mark_completed(void* handle, int64_t rid) {
  Box* b = api_enter(handle);
  if (!b) return;
  b->mark(rid, kCompleted, now_ns(), NAN, false);
  api_leave(b);
}

int api_mark_failed(void* handle, int64_t rid, const char* text, size_t n) {
  Box* b = api_enter(handle);
  if (!b) return 0;
  if (n > size_t(kMaxFactBytes)) {  // cut at a UTF-8 boundary, as intern_fact does
    n = size_t(kMaxFactBytes);
    while (n > 0 && (uint8_t(text[n]) & 0xC0) == 0x80) --n;
  }
  int ok = b->mark_failed(rid, b->intern(text, n), now_ns()) ? 1 : 0;
  api_leave(b);
  return ok;
}

uint32_t api_intern(void* handle, const char* s, size_t n) {
  Box* b = api_enter(handle);
  if (!b) return kStrFull;
  uint32_t id = b->intern(s, n);
  api_leave(b);
  return id;
}

FrtBoxApi g_box_api = {FRT_BOX_API_VERSION, &api_acquire,        &api_release, &api_record,
                       &api_mark_completed, &api_mark_failed, &api_intern};

PyModuleDef blackbox_module = {PyModuleDef_HEAD_INIT, "frtools.recorder._blackbox",
                               "frtools black box: a crash-proof ring buffer of c10d ops.", -1,
                               nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__blackbox(void) {
  BlackBoxType.tp_name = "frtools.recorder._blackbox.BlackBox";
  BlackBoxType.tp_basicsize = sizeof(BlackBoxObject);
  BlackBoxType.tp_flags = Py_TPFLAGS_DEFAULT;
  BlackBoxType.tp_doc =
      "BlackBox(path, capacity, strings_bytes, identity_json, pg_capacity=1024, mode=0o600, "
      "gid=-1): a ring buffer of c10d ops in a memory-mapped file, created as a new file (what "
      "is at the path is replaced, never followed) with exactly this mode (and group).";
  BlackBoxType.tp_new = PyType_GenericNew;
  BlackBoxType.tp_init = (initproc)BlackBox_init;
  BlackBoxType.tp_dealloc = (destructor)BlackBox_dealloc;
  BlackBoxType.tp_methods = BlackBox_methods;
  BlackBoxType.tp_getset = BlackBox_getset;
  if (PyType_Ready(&BlackBoxType) < 0) return nullptr;

  CompleterType.tp_name = "frtools.recorder._blackbox.Completer";
  CompleterType.tp_basicsize = sizeof(CompleterObject);
  CompleterType.tp_flags = Py_TPFLAGS_DEFAULT;
  CompleterType.tp_doc = "Marks one record completed when called (a Future callback).";
  CompleterType.tp_dealloc = (destructor)Completer_dealloc;
  CompleterType.tp_call = (ternaryfunc)Completer_call;
  CompleterType.tp_repr = (reprfunc)Completer_repr;
  CompleterType.tp_getset = Completer_getset;
  if (PyType_Ready(&CompleterType) < 0) return nullptr;

  PyObject* m = PyModule_Create(&blackbox_module);
  if (!m) return nullptr;
  pthread_atfork(nullptr, nullptr, &on_fork_child);
  Py_INCREF(&BlackBoxType);
  if (PyModule_AddObject(m, "BlackBox", reinterpret_cast<PyObject*>(&BlackBoxType)) < 0) {
    Py_DECREF(&BlackBoxType);
    Py_DECREF(m);
    return nullptr;
  }
  Py_INCREF(&CompleterType);
  PyModule_AddObject(m, "Completer", reinterpret_cast<PyObject*>(&CompleterType));
  PyModule_AddObject(m, "C_API", PyCapsule_New(&g_box_api, FRT_BOX_API_CAPSULE, nullptr));
  PyModule_AddIntConstant(m, "FORMAT_VERSION", kVersion);
  PyModule_AddIntConstant(m, "EXIT_CLEAN", kExitClean);
  PyModule_AddIntConstant(m, "EXIT_STATUS", kExitStatus);
  PyModule_AddIntConstant(m, "EXIT_EXCEPTION", kExitException);
  PyModule_AddIntConstant(m, "EXIT_OS_EXIT", kExitOsExit);
  PyModule_AddIntConstant(m, "EXIT_SIGNAL", kExitSignal);
  PyModule_AddIntConstant(m, "SLOT_BYTES", sizeof(Slot));
  PyModule_AddIntConstant(m, "HEADER_BYTES", kHeaderBytes);
  PyModule_AddIntConstant(m, "STRING_NONE", kStrNone);
  PyModule_AddObject(m, "STRING_FULL", PyLong_FromUnsignedLong(kStrFull));
  return m;
}
