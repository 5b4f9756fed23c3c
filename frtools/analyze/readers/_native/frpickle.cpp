// frpickle.cpp - read a PyTorch Flight Recorder pickle straight into columns, GIL released.
//
// Why: Python's unpickler builds ~20 objects per entry (40 M for 1,024 ranks x 2,000
// entries) and the reader then walks them in Python, holding the GIL throughout. Here a
// small pickle VM runs over the bytes into its own value nodes with the GIL released, pulls
// the entry fields the reader uses into typed columns (int64 / float64 buffers, flags, and
// dictionary codes over the few distinct values), and takes the GIL only to hand back the
// small top-level dict and those distinct values as Python objects.
//
// It never decides an error. Any opcode outside plain data (GLOBAL, REDUCE, BUILD, ...),
// truncation, a bad memo index, a stack underflow, a non-dict top level, no "entries"
// list, an entry dict with a non-str key, or a value of a type its column does not expect
// makes parse() return None; Python then takes its own restricted-unpickler path, which
// owns every error message and the refusal of hostile pickles. Every read is checked
// against the buffer end; allocations are bounded by the input size.
//
// Bounded work (frtools.formats.limits, passed in by the reader): the parser keeps the
// estimate safe_pickle.scan computes — 48 bytes per opcode + the bytes up to STOP + 40 per
// container or string + 200 more per dict + 16 per memo slot up to the highest PUT or
// LONG_BINPUT index —
// and leaves a pickle beyond
// max_parsed_bytes to Python (which refuses it with the reason) as soon as the running
// estimate passes it; likewise a pickle whose values, each shared reference counted for
// what it refers to (strings one plus one per 8 bytes), exceed max_expanded.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <string_view>
#include <unordered_map>
#include <array>
#include <utility>
#include <vector>

namespace {

// ---------------------------------------------------------------------------------------
// Value nodes

// (containers last: ``kind >= K_LIST`` is a container)
enum Kind : uint8_t { K_NONE, K_BOOL, K_INT, K_FLOAT, K_STR, K_LIST, K_TUPLE, K_DICT };

struct Node {
  Node(Kind k, bool h, uint32_t n, uint64_t p) : kind(k), hashable(h), len(n), payload(p) {}
  Kind kind;
  bool hashable;       // a valid dict key (Python would raise TypeError otherwise)
  bool shared = true;  // may be referenced more than once (memo, DUP, singletons)
  uint32_t len;        // K_STR: byte length
  uint64_t payload;  // K_BOOL/K_INT: value; K_FLOAT: bits; K_STR: offset; containers: index
};

constexpr uint32_t kNone = 0, kTrue = 1, kFalse = 2;  // shared singleton nodes
constexpr uint32_t kAbsent = UINT32_MAX;              // key missing from an entry
constexpr int kMaxDepth = 200;                        // Python objects built recursively

inline uint64_t le_uint(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// UTF-8 as Python's unpickler accepts it (errors="surrogatepass": lone surrogates pass);
// *surrogates is set where a surrogate (ED A0..BF ..) is among them.
bool valid_utf8(const uint8_t* s, size_t n, bool* surrogates) {
  size_t i = 0;
  while (i < n) {
    if (i + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, s + i, 8);
      if ((w & 0x8080808080808080ULL) == 0) {
        i += 8;
        continue;
      }
    }
    uint8_t c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    int extra;
    uint8_t lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      extra = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      extra = 2;
      if (c == 0xE0) lo = 0xA0;
    } else if (c >= 0xF0 && c <= 0xF4) {
      extra = 3;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (n - i <= static_cast<size_t>(extra)) return false;
    if (s[i + 1] < lo || s[i + 1] > hi) return false;
    if (c == 0xED && s[i + 1] >= 0xA0) *surrogates = true;
    for (int k = 2; k <= extra; ++k)
      if ((s[i + k] & 0xC0) != 0x80) return false;
    i += extra + 1;
  }
  return true;
}

// ---------------------------------------------------------------------------------------
// The restricted pickle VM (protocols 0-5, plain data only)

// The VM's buffers, kept per thread between calls: fresh multi-megabyte vectors for every
// file cost more in page faults and malloc than the parse itself.
struct Scratch {
  std::vector<Node> nodes;
  std::vector<std::vector<uint32_t>> conts;  // items of lists / tuples, k,v pairs of dicts
  // per container (as conts): values it expands to so far; whether a container holds it
  std::vector<uint64_t> expanded;
  std::vector<uint8_t> adopted;
  std::vector<uint32_t> stack, memo;
  std::vector<size_t> marks;
  bool busy = false;

  // after a parse: give back the buffers of a huge input now, not at the next parse
  void release_if_big() {
    constexpr size_t kKeep = 1 << 18;
    if (nodes.capacity() > kKeep * 4 || conts.size() > kKeep || memo.capacity() > kKeep * 4 ||
        stack.capacity() > kKeep)
      reset();
  }

  void reset() {
    constexpr size_t kKeep = 1 << 18;  // a hostile or huge input does not pin its memory
    if (nodes.capacity() > kKeep * 4) std::vector<Node>().swap(nodes);
    if (conts.size() > kKeep) std::vector<std::vector<uint32_t>>().swap(conts);
    for (auto& c : conts)
      if (c.capacity() > kKeep / 16) std::vector<uint32_t>().swap(c);
    if (memo.capacity() > kKeep * 4) std::vector<uint32_t>().swap(memo);
    if (stack.capacity() > kKeep) std::vector<uint32_t>().swap(stack);
    if (expanded.capacity() > kKeep) {
      std::vector<uint64_t>().swap(expanded);
      std::vector<uint8_t>().swap(adopted);
    }
    nodes.clear();
    stack.clear();
    memo.clear();
    marks.clear();
  }
};

thread_local Scratch thread_scratch;

class Parser {
 public:
  Parser(const uint8_t* data, size_t size, Scratch& scratch)
      : data_(data),
        nodes(scratch.nodes),
        conts(scratch.conts),
        expanded_(scratch.expanded),
        adopted_(scratch.adopted),
        p_(data),
        end_(data + size),
        stack_(scratch.stack),
        marks_(scratch.marks),
        memo_(scratch.memo) {
    scratch.reset();
    nodes.emplace_back(K_NONE, true, 0, 0);
    nodes.emplace_back(K_BOOL, true, 0, 1);
    nodes.emplace_back(K_BOOL, true, 0, 0);
  }

  // Runs to STOP; false when the pickle is not plain data or not consistent, or its
  // estimate passes max_bytes (0: no limit).
  bool run(uint64_t max_bytes = 0);
  // The values the root expands to (shared references counted for what they refer to)
  // are at most max_values (0: no limit), and no container holds itself.
  bool expansion_within(uint64_t max_values) const;

  const uint8_t* data_;
  bool surrogates = false;  // some text holds a surrogate (UTF-8 cannot carry it as is)
  std::vector<Node>& nodes;
  std::vector<std::vector<uint32_t>>& conts;  // only the first nconts are this pickle's
  std::vector<uint64_t>& expanded_;            // as conts
  std::vector<uint8_t>& adopted_;              // as conts
  size_t nconts = 0;
  uint32_t root = kNone;

  std::string_view str(uint32_t n) const {
    const Node& x = nodes[n];
    return {reinterpret_cast<const char*>(data_ + x.payload), x.len};
  }
  const std::vector<uint32_t>& items(uint32_t n) const { return conts[nodes[n].payload]; }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
  const uint8_t* frame_end_ = nullptr;  // end of the current FRAME (protocol 4+)
  std::vector<uint32_t>& stack_;
  std::vector<size_t>& marks_;
  std::vector<uint32_t>& memo_;
  size_t memo_len_ = 0;
  std::array<uint32_t, 1024> small_ints_{};  // value -> node (0: none yet)
  // The expansion is summed as containers are built: a container's items are complete
  // when they go in, except when a container already held by another one (or by itself)
  // gets more items later; then the sums may be stale and expansion_within walks the data.
  bool walk_needed_ = false;
  static uint64_t sat_add(uint64_t a, uint64_t b) {
    uint64_t s = a + b;
    return s < a || s > (1ULL << 62) ? (1ULL << 62) : s;
  }
  uint64_t expansion_of(uint32_t n) const {
    const Node& x = nodes[n];
    switch (x.kind) {
      case K_LIST:
      case K_TUPLE:
      case K_DICT:
        return expanded_[x.payload];
      case K_STR:
        return 1 + x.len / 8;
      default:
        return 1;
    }
  }
  // items stack[from:] go into container ``target``'s sum (and are held by it)
  void adopt(uint32_t target, size_t from) {
    uint64_t leaves = 0, sum = expanded_[nodes[target].payload];
    for (size_t i = from; i < stack_.size(); ++i) {
      uint32_t item = stack_[i];
      const Node& x = nodes[item];
      if (x.kind >= K_LIST) {  // a container (K_LIST, K_TUPLE, K_DICT)
        sum = sat_add(sum, expanded_[x.payload]);
        adopted_[x.payload] = 1;
        if (item == target) walk_needed_ = true;  // holds itself
      } else {
        leaves += x.kind == K_STR ? 1 + x.len / 8 : 1;  // < 2**29 each: no overflow
      }
    }
    expanded_[nodes[target].payload] = sat_add(sum, leaves);
  }
  // for the estimate (safe_pickle.scan)
  uint64_t ops_ = 0, objects_ = 0, dicts_ = 0, memo_top_ = 0;
  uint64_t estimate() const {
    return 48 * ops_ + static_cast<uint64_t>(p_ - data_) + 40 * objects_ + 200 * dicts_ +
           16 * memo_top_;
  }

  // Bytes readable before the end of the data or of the current frame. CPython's
  // unpickler (reading a file) drops the rest of a frame when a read crosses its end, so
  // a pickle whose reads cross a frame boundary (never one a pickler wrote) is Python's.
  size_t remaining() const { return static_cast<size_t>(end_ - p_); }
  size_t readable() const {
    return p_ < frame_end_ ? static_cast<size_t>(frame_end_ - p_) : remaining();
  }
  size_t fence() const { return marks_.empty() ? 0 : marks_.back(); }
  bool take(size_t n, const uint8_t** out) {
    if (readable() < n) return false;
    *out = p_;
    p_ += n;
    return true;
  }
  bool line(std::string_view* out) {  // protocol-0 argument, without its '\n'
    const void* nl = std::memchr(p_, '\n', readable());
    if (!nl) return false;
    const uint8_t* e = static_cast<const uint8_t*>(nl);
    *out = {reinterpret_cast<const char*>(p_), static_cast<size_t>(e - p_)};
    p_ = e + 1;
    return true;
  }
  uint32_t add(Kind k, uint64_t payload, uint32_t len = 0) {
    // built in place: a temporary written field by field and copied as 16 bytes stalls
    nodes.emplace_back(k, k != K_LIST && k != K_DICT, len, payload);
    nodes.back().shared = false;  // until the memo or DUP refers to it again
    return static_cast<uint32_t>(nodes.size() - 1);
  }
  // A new container holding stack[from:] (which is popped).
  uint32_t add_container(Kind k, size_t from) {
    if (nconts == conts.size()) conts.emplace_back();
    if (nconts >= expanded_.size()) {
      expanded_.resize(nconts + 1);
      adopted_.resize(nconts + 1);
    }
    expanded_[nconts] = 1;
    adopted_[nconts] = 0;
    std::vector<uint32_t>& items = conts[nconts];
    items.assign(stack_.begin() + from, stack_.end());
    uint32_t n = add(k, nconts++);
    adopt(n, from);
    stack_.resize(from);
    if (k == K_TUPLE)
      for (uint32_t i : items)
        if (!nodes[i].hashable) nodes[n].hashable = false;
    return n;
  }
  // Small ints are one node each (ints are immutable): a value shared by identity is
  // found by identity later (a pg_id that every entry repeats).
  bool push_int(int64_t v) {
    if (v >= 0 && v < static_cast<int64_t>(small_ints_.size())) {
      uint32_t& n = small_ints_[static_cast<size_t>(v)];
      if (n == 0) {
        n = add(K_INT, static_cast<uint64_t>(v));
        nodes[n].shared = true;
      }
      stack_.push_back(n);
      return true;
    }
    stack_.push_back(add(K_INT, static_cast<uint64_t>(v)));
    return true;
  }
  bool push_str(size_t n, bool ascii_only) {
    const uint8_t* s;
    if (n > UINT32_MAX || !take(n, &s)) return false;
    if (ascii_only) {
      for (size_t i = 0; i < n; ++i)
        if (s[i] >= 0x80) return false;
    } else if (!valid_utf8(s, n, &surrogates)) {
      return false;
    }
    stack_.push_back(add(K_STR, static_cast<uint64_t>(s - data_), static_cast<uint32_t>(n)));
    return true;
  }
  bool pop_mark(size_t* mark) {
    if (marks_.empty()) return false;
    *mark = marks_.back();
    marks_.pop_back();
    return *mark <= stack_.size();
  }
  bool push_from_mark(Kind k) {
    size_t mark;
    if (!pop_mark(&mark)) return false;
    if (k == K_DICT && !check_pairs(mark)) return false;
    uint32_t n = add_container(k, mark);
    stack_.push_back(n);
    return true;
  }
  bool push_tuple(size_t n) {
    if (stack_.size() < fence() + n) return false;
    uint32_t t = add_container(K_TUPLE, stack_.size() - n);
    stack_.push_back(t);
    return true;
  }
  bool check_pairs(size_t from) const {  // stack[from:] as dict keys and values
    if ((stack_.size() - from) % 2) return false;
    for (size_t i = from; i < stack_.size(); i += 2)
      if (!nodes[stack_[i]].hashable) return false;
    return true;
  }
  // APPEND / APPENDS / SETITEM / SETITEMS: items stack[x:] go into the container stack[x-1]
  bool extend(size_t x, Kind want) {
    if (x == 0 || x > stack_.size() || x - 1 < fence()) return false;
    uint32_t target = stack_[x - 1];
    if (nodes[target].kind != want) return false;
    if (want == K_DICT && !check_pairs(x)) return false;
    if (adopted_[nodes[target].payload]) walk_needed_ = true;  // its holders' sums go stale
    adopt(target, x);
    auto& dst = conts[nodes[target].payload];
    dst.insert(dst.end(), stack_.begin() + x, stack_.end());
    stack_.resize(x);
    return true;
  }
  bool put(uint64_t idx, bool explicit_index = true) {
    if (stack_.size() <= fence()) return false;
    // a pickler numbers its memo from 0, one PUT at a time: an index beyond the bytes read
    // so far is no pickler's, and the memo stays smaller than the input
    if (idx >= static_cast<uint64_t>(p_ - data_)) return false;
    if (explicit_index && idx + 1 > memo_top_) memo_top_ = idx + 1;
    if (idx >= memo_.size()) memo_.resize(idx + 1, kAbsent);
    if (memo_[idx] == kAbsent) ++memo_len_;
    memo_[idx] = stack_.back();
    nodes[stack_.back()].shared = true;
    return true;
  }
  bool get(uint64_t idx) {
    if (idx >= memo_.size() || memo_[idx] == kAbsent) return false;
    stack_.push_back(memo_[idx]);
    return true;
  }
  static bool decimal(std::string_view s, int64_t* out) {
    if (s.empty()) return false;
    auto r = std::from_chars(s.data(), s.data() + s.size(), *out);
    return r.ec == std::errc() && r.ptr == s.data() + s.size();
  }
};

bool Parser::run(uint64_t max_bytes) {
  const uint8_t* a;
  std::string_view s;
  int64_t v;
  while (p_ < end_) {
    // the estimate so far (it only grows), every 1,024 opcodes: beyond the limit, Python
    // refuses (checked again exactly at STOP)
    if (max_bytes && (ops_ & 1023) == 0 && estimate() > max_bytes) return false;
    ++ops_;
    uint8_t op = *p_++;
    switch (op) {
      case 0x80:  // PROTO
        if (!take(1, &a) || a[0] > 5) return false;
        break;
      case 0x95:  // FRAME: only where the previous frame ended, as a pickler writes them
        if (!take(8, &a) || p_ < frame_end_ || le_uint(a, 8) > remaining()) return false;
        frame_end_ = p_ + le_uint(a, 8);
        break;
      case '.':  // STOP
        if (stack_.size() <= fence()) return false;
        if (max_bytes && estimate() > max_bytes) return false;
        root = stack_.back();
        return true;
      case '(':  // MARK
        marks_.push_back(stack_.size());
        break;
      case '0':  // POP (as _pickle.c: a mark on top is popped instead)
        if (!marks_.empty() && marks_.back() == stack_.size()) {
          marks_.pop_back();
        } else {
          if (stack_.size() <= fence()) return false;
          stack_.pop_back();
        }
        break;
      case '1': {  // POP_MARK
        size_t mark;
        if (!pop_mark(&mark)) return false;
        stack_.resize(mark);
        break;
      }
      case '2':  // DUP
        if (stack_.size() <= fence()) return false;
        nodes[stack_.back()].shared = true;
        stack_.push_back(stack_.back());
        break;
      case 'N':
        stack_.push_back(kNone);
        break;
      case 0x88:
        stack_.push_back(kTrue);
        break;
      case 0x89:
        stack_.push_back(kFalse);
        break;
      case 'I':  // INT: "00"/"01" are the booleans; else a plain decimal
        if (!line(&s)) return false;
        if (s == "00" || s == "01") {
          stack_.push_back(s == "01" ? kTrue : kFalse);
          break;
        }
        if (s.size() > 1 && (s[0] == '0' || (s[0] == '-' && s[1] == '0'))) return false;
        if (!decimal(s, &v) || !push_int(v)) return false;
        break;
      case 'L':  // LONG: decimal with an optional trailing 'L'
        if (!line(&s)) return false;
        if (!s.empty() && s.back() == 'L') s.remove_suffix(1);
        if (!decimal(s, &v) || !push_int(v)) return false;
        break;
      case 'J':  // BININT
        if (!take(4, &a)) return false;
        push_int(static_cast<int32_t>(le_uint(a, 4)));
        break;
      case 'K':  // BININT1
        if (!take(1, &a)) return false;
        push_int(a[0]);
        break;
      case 'M':  // BININT2
        if (!take(2, &a)) return false;
        push_int(static_cast<int64_t>(le_uint(a, 2)));
        break;
      case 0x8a:    // LONG1
      case 0x8b: {  // LONG4
        size_t n;
        if (op == 0x8a) {
          if (!take(1, &a)) return false;
          n = a[0];
        } else {
          if (!take(4, &a)) return false;
          int32_t n4 = static_cast<int32_t>(le_uint(a, 4));
          if (n4 < 0) return false;
          n = static_cast<size_t>(n4);
        }
        if (n > 8 || !take(n, &a)) return false;  // beyond int64: Python's path decides
        uint64_t u = le_uint(a, static_cast<int>(n));
        if (n > 0 && n < 8 && (a[n - 1] & 0x80)) u |= ~0ULL << (8 * n);  // sign-extend
        push_int(static_cast<int64_t>(u));
        break;
      }
      case 'G': {  // BINFLOAT (big-endian)
        if (!take(8, &a)) return false;
        uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits = (bits << 8) | a[i];
        stack_.push_back(add(K_FLOAT, bits));
        break;
      }
      case 'T':  // BINSTRING: decoded as ASCII by Python 3's default unpickler
        ++objects_;
        if (!take(4, &a) || static_cast<int32_t>(le_uint(a, 4)) < 0) return false;
        if (!push_str(le_uint(a, 4), true)) return false;
        break;
      case 'U':  // SHORT_BINSTRING
        ++objects_;
        if (!take(1, &a) || !push_str(a[0], true)) return false;
        break;
      case 'X':  // BINUNICODE
        ++objects_;
        if (!take(4, &a) || !push_str(le_uint(a, 4), false)) return false;
        break;
      case 0x8c:  // SHORT_BINUNICODE
        ++objects_;
        if (!take(1, &a) || !push_str(a[0], false)) return false;
        break;
      case 0x8d:  // BINUNICODE8
        ++objects_;
        if (!take(8, &a) || !push_str(le_uint(a, 8), false)) return false;
        break;
      case '}':  // EMPTY_DICT
      case ']':  // EMPTY_LIST
      case ')': {  // EMPTY_TUPLE
        ++objects_;
        dicts_ += op == '}';
        uint32_t n = add_container(op == '}' ? K_DICT : op == ']' ? K_LIST : K_TUPLE, stack_.size());
        stack_.push_back(n);
        break;
      }
      case 'd':  // DICT
        ++objects_;
        ++dicts_;
        if (!push_from_mark(K_DICT)) return false;
        break;
      case 'l':  // LIST
        ++objects_;
        if (!push_from_mark(K_LIST)) return false;
        break;
      case 't':  // TUPLE
        ++objects_;
        if (!push_from_mark(K_TUPLE)) return false;
        break;
      case 0x85:  // TUPLE1-3
      case 0x86:
      case 0x87:
        ++objects_;
        if (!push_tuple(op - 0x84)) return false;
        break;
      case 'a':  // APPEND
        if (stack_.size() < 2 || !extend(stack_.size() - 1, K_LIST)) return false;
        break;
      case 's':  // SETITEM
        if (stack_.size() < 3 || !extend(stack_.size() - 2, K_DICT)) return false;
        break;
      case 'e':    // APPENDS
      case 'u': {  // SETITEMS
        size_t mark;
        if (!pop_mark(&mark) || !extend(mark, op == 'e' ? K_LIST : K_DICT)) return false;
        break;
      }
      case 'p':  // PUT
        if (!line(&s) || !decimal(s, &v) || v < 0 || !put(static_cast<uint64_t>(v)))
          return false;
        break;
      case 'q':  // BINPUT (an index below 256 sizes no memo worth counting)
        if (!take(1, &a) || !put(a[0], false)) return false;
        break;
      case 'r':  // LONG_BINPUT
        if (!take(4, &a) || !put(le_uint(a, 4))) return false;
        break;
      case 0x94:  // MEMOIZE
        if (!put(memo_len_, false)) return false;
        break;
      case 'g':  // GET
        if (!line(&s) || !decimal(s, &v) || v < 0 || !get(static_cast<uint64_t>(v)))
          return false;
        break;
      case 'h':  // BINGET
        if (!take(1, &a) || !get(a[0])) return false;
        break;
      case 'j':  // LONG_BINGET
        if (!take(4, &a) || !get(le_uint(a, 4))) return false;
        break;
      default:  // code, bytes, sets, protocol-0 text strings/floats: Python's path decides
        return false;
    }
  }
  return false;  // no STOP: truncated
}

bool Parser::expansion_within(uint64_t max_values) const {
  if (!max_values) return true;
  if (!walk_needed_) return expansion_of(root) <= max_values;
  constexpr uint64_t kUnseen = 0, kOpen = UINT64_MAX;
  std::vector<uint64_t> total(nodes.size(), kUnseen);  // values + 1, once known
  auto leaf = [&](uint32_t n) -> uint64_t {
    const Node& x = nodes[n];
    return x.kind == K_STR ? 1 + x.len / 8 : 1;
  };
  auto container = [&](uint32_t n) {
    Kind k = nodes[n].kind;
    return k == K_LIST || k == K_TUPLE || k == K_DICT;
  };
  if (!container(root)) return leaf(root) <= max_values;
  std::vector<std::pair<uint32_t, size_t>> stack;  // (node, next child)
  stack.emplace_back(root, 0);
  total[root] = kOpen;
  while (!stack.empty()) {
    auto& [n, next] = stack.back();
    const auto& kids = items(n);
    if (next < kids.size()) {
      uint32_t c = kids[next++];
      if (!container(c)) continue;
      if (total[c] == kOpen) return false;  // holds itself
      if (total[c] == kUnseen) {
        total[c] = kOpen;
        stack.emplace_back(c, 0);
      }
      continue;
    }
    uint64_t sum = 1;
    for (uint32_t c : kids) {
      sum += container(c) ? total[c] - 1 : leaf(c);
      if (sum > max_values) return false;
    }
    total[n] = sum + 1;
    stack.pop_back();
  }
  return total[root] - 1 <= max_values;
}

// ---------------------------------------------------------------------------------------
// Columns

enum Key {
  RECORD_ID,
  PG_ID,
  PROCESS_GROUP,
  COLLECTIVE_SEQ_ID,
  P2P_SEQ_ID,
  SEQ_ID,
  IS_P2P,
  PROFILING_NAME,
  TIME_CREATED_NS,
  DURATION_MS,
  INPUT_SIZES,
  OUTPUT_SIZES,
  INPUT_DTYPES,
  OUTPUT_DTYPES,
  STATE,
  TIME_STARTED_NS,
  TIME_COMPLETED_NS,
  RETIRED,
  TIMEOUT_MS,
  THREAD_ID,
  THREAD_NAME,
  FRAMES,
  NKEYS
};

// the entry keys the reader uses, any version (frtools.formats.torch_fr.READ_KEYS)
const char* const kKeyNames[NKEYS] = {
    "record_id",      "pg_id",         "process_group",
    "collective_seq_id", "p2p_seq_id", "seq_id",
    "is_p2p",         "profiling_name", "time_created_ns",
    "duration_ms",    "input_sizes",   "output_sizes",
    "input_dtypes",   "output_dtypes", "state",
    "time_discovered_started_ns", "time_discovered_completed_ns", "retired",
    "timeout_ms",     "thread_id",     "thread_name",
    "frames",
};

// all_to_all split sizes (frtools.formats.torch_fr.SPLIT_KEYS): an entry that has one is
// not this parser's, the whole dump goes to Python (which reads them). Found here, with the
// keys the parser looks at anyway, rather than by a scan of every file's bytes.
const char* const kSplitKeys[] = {"input_split_sizes", "output_split_sizes"};
constexpr int8_t kSplitKey = -3;

const Key kIntKeys[] = {RECORD_ID,       COLLECTIVE_SEQ_ID, P2P_SEQ_ID,        SEQ_ID,
                        TIME_CREATED_NS, TIME_STARTED_NS,   TIME_COMPLETED_NS, TIMEOUT_MS};

template <typename T>
struct NumColumn {  // values (0 where null) and validity
  std::vector<T> values;
  std::vector<uint8_t> valid;
  size_t nulls = 0;
  void push(T v, bool ok) {
    values.push_back(ok ? v : T{});
    valid.push_back(ok);
    nulls += !ok;
  }
};

// Dictionary codes over distinct values; a value is looked up by node identity first
// (pickles share objects through the memo), then by a content key.
struct DictColumn {
  std::vector<int32_t> codes;
  std::vector<uint64_t> reps;      // a representative node (pair) per code
  std::vector<std::string> texts;  // or the computed text per code
  std::unordered_map<uint64_t, int32_t> by_node;
  std::unordered_map<std::string, int32_t> by_key;
  struct Recent {
    uint64_t node = UINT64_MAX;
    int32_t code = -1;
  };
  std::array<Recent, 64> recent;  // in front of by_node: most lookups are repeats

  int32_t by_identity(uint64_t node, bool shared) {
    if (!shared) return -1;  // seen once only: by content
    Recent& r = recent[(node ^ (node >> 29)) & 63];
    if (r.node == node) return r.code;
    auto it = by_node.find(node);
    if (it == by_node.end()) return -1;
    r = {node, it->second};
    return it->second;
  }
  int32_t add(uint64_t node, bool shared, std::string&& key) {
    auto [it, fresh] = by_key.emplace(std::move(key), static_cast<int32_t>(reps.size()));
    if (fresh) reps.push_back(node);
    if (shared) by_node.emplace(node, it->second);
    return it->second;
  }
  int32_t add_text(uint64_t node, bool shared, std::string&& text) {
    auto [it, fresh] = by_key.emplace(text, static_cast<int32_t>(texts.size()));
    if (fresh) texts.push_back(std::move(text));
    if (shared) by_node.emplace(node, it->second);
    return it->second;
  }
};

class Extractor {
 public:
  explicit Extractor(const Parser& ps) : ps_(ps), key_of_node_(ps.nodes.size(), -2) {}

  bool run();

  const Parser& ps_;
  size_t n = 0, bad = 0;
  bool seen[NKEYS] = {};
  bool first_has[NKEYS] = {};
  NumColumn<int64_t> ints[NKEYS];
  NumColumn<double> duration;
  std::vector<int8_t> flags[NKEYS];  // is_p2p / retired: 0, 1, 2 = None
  DictColumn dicts[NKEYS];           // process_group holds (process_group, pg_id) pairs
  uint32_t entries_node = kAbsent;

 private:
  std::vector<int8_t> key_of_node_;
  std::unordered_map<std::string_view, int32_t> str_ids_;
  std::vector<int32_t> str_id_of_node_;
  std::string buf_;

  const Node& node(uint32_t i) const { return ps_.nodes[i]; }
  int key_index(uint32_t k);
  int32_t str_id(uint32_t n);
  bool scalar_key(uint32_t n, std::string* out);
  bool entry(const uint32_t* slot);
  bool push_int(Key k, uint32_t v);
  bool push_any(Key k, uint32_t v);
  bool push_pg(uint32_t pg, uint32_t pg_id);
  bool push_frames(uint32_t v);
  // a value whose canonical text (sizes "[[4,2]]", dtypes "Float,Half") is its dictionary key
  bool push_text(Key k, uint32_t v, bool (Extractor::*text_of)(uint32_t, std::string*));
  bool sizes_text(uint32_t v, std::string* out);
  bool dtypes_text(uint32_t v, std::string* out);
};

int Extractor::key_index(uint32_t k) {
  int8_t& c = key_of_node_[k];
  if (c == -2) {
    c = -1;
    std::string_view s = ps_.str(k);
    for (int i = 0; i < NKEYS; ++i)
      if (s == kKeyNames[i]) c = static_cast<int8_t>(i);
    for (const char* split : kSplitKeys)
      if (s == split) c = kSplitKey;
  }
  return c;
}

int32_t Extractor::str_id(uint32_t n) {
  if (str_id_of_node_.empty()) str_id_of_node_.assign(ps_.nodes.size(), -1);
  int32_t& id = str_id_of_node_[n];
  if (id < 0) id = str_ids_.emplace(ps_.str(n), static_cast<int32_t>(str_ids_.size())).first->second;
  return id;
}

// A type-strict content key for a scalar (str by content, NaN never equal): two values
// with one key are equal for Python too, so merging them never changes a result.
bool Extractor::scalar_key(uint32_t n, std::string* out) {
  const Node& x = node(n);
  char tag;
  uint64_t bits;
  switch (x.kind) {
    case K_NONE:
      out->push_back('n');
      return true;
    case K_BOOL:
      out->push_back(x.payload ? 't' : 'f');
      return true;
    case K_INT:
      tag = 'i', bits = x.payload;
      break;
    case K_FLOAT: {
      double d;
      std::memcpy(&d, &x.payload, 8);
      if (std::isnan(d)) return false;
      tag = 'd', bits = x.payload;
      break;
    }
    case K_STR:
      tag = 's', bits = static_cast<uint64_t>(str_id(n));
      break;
    default:
      return false;
  }
  out->push_back(tag);
  out->append(reinterpret_cast<const char*>(&bits), 8);
  return true;
}

bool Extractor::run() {
  const Node& top = node(ps_.root);
  if (top.kind != K_DICT) return false;
  const auto& kv = ps_.items(ps_.root);
  for (size_t i = 0; i < kv.size(); i += 2)
    if (node(kv[i]).kind == K_STR && ps_.str(kv[i]) == "entries") entries_node = kv[i + 1];
  if (entries_node == kAbsent || node(entries_node).kind != K_LIST) return false;

  const auto& entries = ps_.items(entries_node);
  for (int k = 0; k < NKEYS; ++k) dicts[k].codes.reserve(entries.size());
  uint32_t slot[NKEYS];
  for (uint32_t e : entries) {
    if (node(e).kind != K_DICT) {
      ++bad;
      continue;
    }
    std::fill(slot, slot + NKEYS, kAbsent);
    const auto& pairs = ps_.items(e);
    for (size_t i = 0; i < pairs.size(); i += 2) {
      if (node(pairs[i]).kind != K_STR) return false;
      int k = key_index(pairs[i]);
      if (k == kSplitKey) return false;    // all_to_all split sizes: Python reads them
      if (k >= 0) slot[k] = pairs[i + 1];  // a repeated key: the last one wins, as in Python
    }
    uint32_t pn = slot[PROFILING_NAME];
    if (pn == kAbsent || node(pn).kind != K_STR) {
      ++bad;
      continue;
    }
    if (n == 0)
      for (int k = 0; k < NKEYS; ++k) first_has[k] = slot[k] != kAbsent;
    for (int k = 0; k < NKEYS; ++k) seen[k] |= slot[k] != kAbsent;
    if (!entry(slot)) return false;
    ++n;
  }
  return true;
}

bool Extractor::entry(const uint32_t* slot) {
  auto val = [&](Key k) { return slot[k] == kAbsent ? kNone : slot[k]; };
  for (Key k : kIntKeys)
    if (!push_int(k, val(k))) return false;

  // duration_ms: a number, anything else null; ints beyond 2**53 are Python's to judge
  const Node& d = node(val(DURATION_MS));
  if (d.kind == K_INT) {
    int64_t i = static_cast<int64_t>(d.payload);
    if (i > (1LL << 53) || i < -(1LL << 53)) return false;
    duration.push(static_cast<double>(i), true);
  } else if (d.kind == K_FLOAT) {
    double f;
    std::memcpy(&f, &d.payload, 8);
    duration.push(f, true);
  } else {
    duration.push(0.0, false);
  }

  // is_p2p: Python's truthiness; retired: a bool
  const Node& p = node(val(IS_P2P));
  int8_t truth;
  switch (p.kind) {
    case K_NONE:
      truth = 2;
      break;
    case K_BOOL:
    case K_INT:
      truth = p.payload != 0;
      break;
    case K_FLOAT: {
      double f;
      std::memcpy(&f, &p.payload, 8);
      truth = f != 0.0;
      break;
    }
    case K_STR:
      truth = p.len != 0;
      break;
    default:
      truth = !ps_.items(val(IS_P2P)).empty();
  }
  flags[IS_P2P].push_back(truth);
  const Node& r = node(val(RETIRED));
  if (r.kind == K_NONE) {
    flags[RETIRED].push_back(2);
  } else if (r.kind == K_BOOL) {
    flags[RETIRED].push_back(static_cast<int8_t>(r.payload));
  } else {
    return false;
  }

  return push_pg(val(PROCESS_GROUP), val(PG_ID)) && push_any(PROFILING_NAME, val(PROFILING_NAME)) &&
         push_any(STATE, val(STATE)) && push_any(THREAD_ID, val(THREAD_ID)) &&
         push_any(THREAD_NAME, val(THREAD_NAME)) && push_frames(val(FRAMES)) &&
         push_text(INPUT_SIZES, val(INPUT_SIZES), &Extractor::sizes_text) &&
         push_text(OUTPUT_SIZES, val(OUTPUT_SIZES), &Extractor::sizes_text) &&
         push_text(INPUT_DTYPES, val(INPUT_DTYPES), &Extractor::dtypes_text) &&
         push_text(OUTPUT_DTYPES, val(OUTPUT_DTYPES), &Extractor::dtypes_text);
}

bool Extractor::push_int(Key k, uint32_t v) {
  const Node& x = node(v);
  if (x.kind == K_NONE) {
    ints[k].push(0, false);
  } else if (x.kind == K_INT) {
    ints[k].push(static_cast<int64_t>(x.payload), true);
  } else {
    return false;  // a str or bool in an int column: Python cleans it and says so
  }
  return true;
}

// A value Python maps per distinct value (state, thread ids, profiling_name): None -> -1;
// scalars by content, containers by identity only.
bool Extractor::push_any(Key k, uint32_t v) {
  DictColumn& c = dicts[k];
  if (node(v).kind == K_NONE) {
    c.codes.push_back(-1);
    return true;
  }
  bool shared = node(v).shared;
  int32_t code = c.by_identity(v, shared);
  if (code < 0) {
    buf_.clear();
    if (!scalar_key(v, &buf_)) {
      buf_ = "N";
      buf_.append(reinterpret_cast<const char*>(&v), 4);
    }
    code = c.add(v, shared, std::move(buf_));
  }
  c.codes.push_back(code);
  return true;
}

// (process_group, pg_id) pairs, keyed as Python's reader caches them: list == tuple.
// Only None / int / str parts, so that type-strict equality is Python's equality.
bool Extractor::push_pg(uint32_t pg, uint32_t pg_id) {
  DictColumn& c = dicts[PROCESS_GROUP];
  uint64_t pair = (static_cast<uint64_t>(pg) << 32) | pg_id;
  bool shared = node(pg).shared && node(pg_id).shared;
  int32_t code = c.by_identity(pair, shared);
  if (code < 0) {
    auto plain = [&](uint32_t x) {
      Kind k = node(x).kind;
      return k == K_NONE || k == K_INT || k == K_STR;
    };
    if (!plain(pg_id)) return false;
    buf_.clear();
    scalar_key(pg_id, &buf_);
    Kind k = node(pg).kind;
    if (k == K_LIST || k == K_TUPLE) {
      buf_.push_back('T');
      for (uint32_t x : ps_.items(pg)) {
        if (!plain(x)) return false;
        scalar_key(x, &buf_);
      }
    } else if (plain(pg)) {
      scalar_key(pg, &buf_);
    } else {
      return false;
    }
    code = c.add(pair, shared, std::move(buf_));
  }
  c.codes.push_back(code);
  return true;
}

// frames: a non-empty list, else null. Lists of flat frame dicts are merged by content;
// any other list only by identity (Python interns what it gets).
bool Extractor::push_frames(uint32_t v) {
  DictColumn& c = dicts[FRAMES];
  if (node(v).kind != K_LIST || ps_.items(v).empty()) {
    c.codes.push_back(-1);
    return true;
  }
  bool shared = node(v).shared;
  int32_t code = c.by_identity(v, shared);
  if (code < 0) {
    buf_.clear();
    bool flat = true;
    for (uint32_t f : ps_.items(v)) {
      if (node(f).kind != K_DICT) {
        flat = false;
        break;
      }
      const auto& kv = ps_.items(f);
      buf_.push_back('D');
      uint32_t npairs = static_cast<uint32_t>(kv.size() / 2);
      buf_.append(reinterpret_cast<const char*>(&npairs), 4);
      for (size_t i = 0; i < kv.size() && flat; i += 2)
        flat = node(kv[i]).kind == K_STR && scalar_key(kv[i], &buf_) && scalar_key(kv[i + 1], &buf_);
      if (!flat) break;
    }
    if (!flat) {
      buf_ = "N";
      buf_.append(reinterpret_cast<const char*>(&v), 4);
    }
    code = c.add(v, shared, std::move(buf_));
  }
  c.codes.push_back(code);
  return true;
}

// trace.sizes_key: "[[4,2],[3]]"; None and non-container scalars -> "" as the reader
// does; anything else (ints outside lists, bools, floats, str) is Python's to judge.
bool Extractor::sizes_text(uint32_t v, std::string* out) {
  Kind k = node(v).kind;
  if (k == K_NONE || k == K_INT || k == K_FLOAT || k == K_BOOL) return true;
  if (k != K_LIST && k != K_TUPLE) return false;
  char num[24];
  out->push_back('[');
  bool first = true;
  for (uint32_t shape : ps_.items(v)) {
    Kind sk = node(shape).kind;
    if (sk != K_LIST && sk != K_TUPLE) return false;
    if (!first) out->push_back(',');
    first = false;
    out->push_back('[');
    bool first_dim = true;
    for (uint32_t dim : ps_.items(shape)) {
      if (node(dim).kind != K_INT) return false;
      if (!first_dim) out->push_back(',');
      first_dim = false;
      auto r = std::to_chars(num, num + sizeof num, static_cast<int64_t>(node(dim).payload));
      out->append(num, r.ptr);
    }
    out->push_back(']');
  }
  out->push_back(']');
  return true;
}

// "Float,Half": a str stays, a list/tuple of str is joined, other scalars and dicts -> ""
bool Extractor::dtypes_text(uint32_t v, std::string* out) {
  Kind k = node(v).kind;
  if (k == K_STR) {
    out->append(ps_.str(v));
    return true;
  }
  if (k != K_LIST && k != K_TUPLE) return true;
  bool first = true;
  for (uint32_t d : ps_.items(v)) {
    if (node(d).kind != K_STR) return false;
    if (!first) out->push_back(',');
    first = false;
    out->append(ps_.str(d));
  }
  return true;
}

bool Extractor::push_text(Key k, uint32_t v,
                          bool (Extractor::*text_of)(uint32_t, std::string*)) {
  DictColumn& c = dicts[k];
  bool shared = node(v).shared;
  int32_t code = c.by_identity(v, shared);
  if (code < 0) {
    std::string text;
    if (!(this->*text_of)(v, &text)) return false;
    code = c.add_text(v, shared, std::move(text));
  }
  c.codes.push_back(code);
  return true;
}

// ---------------------------------------------------------------------------------------
// Python results (GIL held)

class Builder {
 public:
  explicit Builder(const Parser& ps) : ps_(ps) {}
  ~Builder() {
    for (auto& kv : cache_) Py_DECREF(kv.second);
  }

  // A new reference, or nullptr (error set, or nesting too deep / cyclic).
  PyObject* object(uint32_t n, int depth = 0);
  PyObject* top_without_entries();
  PyObject* columns(const Extractor& ex);

 private:
  const Parser& ps_;
  std::unordered_map<uint32_t, PyObject*> cache_;  // containers and str, shared as in the memo
};

PyObject* Builder::object(uint32_t n, int depth) {
  if (depth > kMaxDepth) return nullptr;
  const Node& x = ps_.nodes[n];
  switch (x.kind) {
    case K_NONE:
      Py_RETURN_NONE;
    case K_BOOL:
      return PyBool_FromLong(static_cast<long>(x.payload));
    case K_INT:
      return PyLong_FromLongLong(static_cast<long long>(x.payload));
    case K_FLOAT: {
      double d;
      std::memcpy(&d, &x.payload, 8);
      return PyFloat_FromDouble(d);
    }
    default:
      break;
  }
  auto hit = cache_.find(n);
  if (hit != cache_.end()) {
    Py_INCREF(hit->second);
    return hit->second;
  }
  PyObject* out = nullptr;
  if (x.kind == K_STR) {
    std::string_view s = ps_.str(n);
    out = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "surrogatepass");
  } else {
    const auto& items = ps_.items(n);
    Py_ssize_t size = static_cast<Py_ssize_t>(items.size());
    if (x.kind == K_DICT) {
      out = PyDict_New();
      for (Py_ssize_t i = 0; out && i < size; i += 2) {
        PyObject* k = object(items[i], depth + 1);
        PyObject* v = k ? object(items[i + 1], depth + 1) : nullptr;
        if (!v || PyDict_SetItem(out, k, v) < 0) Py_CLEAR(out);
        Py_XDECREF(k);
        Py_XDECREF(v);
      }
    } else {
      out = x.kind == K_LIST ? PyList_New(size) : PyTuple_New(size);
      for (Py_ssize_t i = 0; out && i < size; ++i) {
        PyObject* v = object(items[i], depth + 1);
        if (!v) {
          Py_CLEAR(out);
        } else if (x.kind == K_LIST) {
          PyList_SET_ITEM(out, i, v);
        } else {
          PyTuple_SET_ITEM(out, i, v);
        }
      }
    }
  }
  if (out) {
    Py_INCREF(out);
    cache_.emplace(n, out);
  }
  return out;
}

PyObject* Builder::top_without_entries() {
  PyObject* top = PyDict_New();
  const auto& kv = ps_.items(ps_.root);
  for (size_t i = 0; top && i < kv.size(); i += 2) {
    const Node& k = ps_.nodes[kv[i]];
    if (k.kind == K_STR && ps_.str(kv[i]) == "entries") continue;
    PyObject* key = object(kv[i]);
    PyObject* value = key ? object(kv[i + 1]) : nullptr;
    if (!value || PyDict_SetItem(top, key, value) < 0) Py_CLEAR(top);
    Py_XDECREF(key);
    Py_XDECREF(value);
  }
  return top;
}

template <typename T>
PyObject* buffer_bytes(const std::vector<T>& v) {
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(v.data()),
                                   static_cast<Py_ssize_t>(v.size() * sizeof(T)));
}

// (values, Arrow validity bitmap or None, null count)
template <typename T>
PyObject* num_column(const NumColumn<T>& c) {
  PyObject* bitmap;
  if (c.nulls == 0) {
    Py_INCREF(Py_None);
    bitmap = Py_None;
  } else {
    std::string bits((c.valid.size() + 7) / 8, '\0');
    for (size_t i = 0; i < c.valid.size(); ++i)
      if (c.valid[i]) bits[i / 8] |= static_cast<char>(1 << (i % 8));
    bitmap = PyBytes_FromStringAndSize(bits.data(), static_cast<Py_ssize_t>(bits.size()));
  }
  return Py_BuildValue("(NNn)", buffer_bytes(c.values), bitmap, static_cast<Py_ssize_t>(c.nulls));
}

int set_new(PyObject* d, const char* key, PyObject* value) {
  if (!value) return -1;
  int rc = PyDict_SetItemString(d, key, value);
  Py_DECREF(value);
  return rc;
}

PyObject* Builder::columns(const Extractor& ex) {
  PyObject* cols = PyDict_New();
  if (!cols) return nullptr;
  bool ok = set_new(cols, "n", PyLong_FromSize_t(ex.n)) == 0 &&
            set_new(cols, "bad", PyLong_FromSize_t(ex.bad)) == 0 &&
            set_new(cols, "surrogates", PyBool_FromLong(ps_.surrogates)) == 0;
  PyObject* first = ok ? PyList_New(0) : nullptr;
  for (int k = 0; first && k < NKEYS; ++k) {
    if (!ex.first_has[k]) continue;
    PyObject* name = PyUnicode_FromString(kKeyNames[k]);
    if (!name || PyList_Append(first, name) < 0) Py_CLEAR(first);
    Py_XDECREF(name);
  }
  ok = ok && set_new(cols, "first_keys", first) == 0;
  for (Key k : kIntKeys)
    if (ok && ex.seen[k]) ok = set_new(cols, kKeyNames[k], num_column(ex.ints[k])) == 0;
  if (ok && ex.seen[DURATION_MS]) ok = set_new(cols, "duration_ms", num_column(ex.duration)) == 0;
  for (Key k : {IS_P2P, RETIRED})
    if (ok && ex.seen[k]) ok = set_new(cols, kKeyNames[k], buffer_bytes(ex.flags[k])) == 0;

  for (Key k : {PROCESS_GROUP, PROFILING_NAME, STATE, THREAD_ID, THREAD_NAME, FRAMES, INPUT_SIZES,
                OUTPUT_SIZES, INPUT_DTYPES, OUTPUT_DTYPES}) {
    if (!ok) break;
    const DictColumn& c = ex.dicts[k];
    bool text = k == INPUT_SIZES || k == OUTPUT_SIZES || k == INPUT_DTYPES || k == OUTPUT_DTYPES;
    size_t nvalues = text ? c.texts.size() : c.reps.size();
    PyObject* values = PyList_New(static_cast<Py_ssize_t>(nvalues));
    for (size_t i = 0; values && i < nvalues; ++i) {
      PyObject* v;
      if (text) {
        const std::string& s = c.texts[i];
        v = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "surrogatepass");
      } else if (k == PROCESS_GROUP) {
        uint64_t pair = c.reps[i];
        PyObject* pg = object(static_cast<uint32_t>(pair >> 32));
        PyObject* pg_id = pg ? object(static_cast<uint32_t>(pair)) : nullptr;
        v = pg_id ? PyTuple_Pack(2, pg, pg_id) : nullptr;
        Py_XDECREF(pg);
        Py_XDECREF(pg_id);
      } else {
        v = object(static_cast<uint32_t>(c.reps[i]));
      }
      if (!v) {
        Py_CLEAR(values);
      } else {
        PyList_SET_ITEM(values, static_cast<Py_ssize_t>(i), v);
      }
    }
    PyObject* codes = values ? buffer_bytes(c.codes) : nullptr;
    PyObject* pair = codes ? PyTuple_Pack(2, codes, values) : nullptr;
    Py_XDECREF(codes);
    Py_XDECREF(values);
    ok = set_new(cols, kKeyNames[k], pair) == 0;
  }
  if (!ok) Py_CLEAR(cols);
  return cols;
}

// ---------------------------------------------------------------------------------------

PyObject* parse(PyObject*, PyObject* args) {
  PyObject* arg;
  unsigned long long max_bytes = 0, max_values = 0;
  if (!PyArg_ParseTuple(args, "O|KK:parse", &arg, &max_bytes, &max_values)) return nullptr;
  Py_buffer view;
  if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return nullptr;
  const uint8_t* data = static_cast<const uint8_t*>(view.buf);
  size_t size = static_cast<size_t>(view.len);
  Parser* ps = nullptr;
  Extractor* ex = nullptr;
  bool ok = false;
  // re-entered on this thread (a finalizer run by the GC while results are built): the
  // thread's buffers are in use, so this call gets its own
  Scratch own;
  Scratch& scratch = thread_scratch.busy ? own : thread_scratch;
  scratch.busy = true;
  Py_BEGIN_ALLOW_THREADS
  try {
    if (size < UINT32_MAX / 2) {  // node indexes are 32-bit
      ps = new Parser(data, size, scratch);
      if (ps->run(max_bytes) && ps->expansion_within(max_values)) {
        ex = new Extractor(*ps);
        ok = ex->run();
      }
    }
  } catch (const std::bad_alloc&) {
    ok = false;
  }
  Py_END_ALLOW_THREADS
  PyObject* result = nullptr;
  if (ok) {
    Builder b(*ps);
    PyObject* top = b.top_without_entries();
    PyObject* cols = top ? b.columns(*ex) : nullptr;
    if (cols) result = PyTuple_Pack(2, top, cols);
    Py_XDECREF(top);
    Py_XDECREF(cols);
  }
  delete ex;
  delete ps;
  scratch.release_if_big();  // a huge input does not keep its buffers while Python goes on
  scratch.busy = false;
  PyBuffer_Release(&view);
  if (!result) {
    PyErr_Clear();  // an odd value (cycle, unhashable, too deep): Python's path decides
    Py_RETURN_NONE;
  }
  return result;
}

PyMethodDef kMethods[] = {
    {"parse", parse, METH_VARARGS,
     "parse(data, max_parsed_bytes=0, max_expanded=0) -> (top, columns) | None: a Flight "
     "Recorder pickle as columns, or None when it is anything but plain data of the expected "
     "shape, or beyond the limits (0: none), as safe_pickle.scan and expanded_values count "
     "them (Python's reader then decides)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_frpickle",
                       "Flight Recorder pickles parsed into columns without the GIL.", -1,
                       kMethods,
                       nullptr,
                       nullptr,
                       nullptr,
                       nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__frpickle(void) {
  PyObject* m = PyModule_Create(&kModule);
  // this build leaves a dump with split-size keys to Python itself (older builds did not
  // look: their callers scanned the bytes first)
  if (m && PyModule_AddIntConstant(m, "DEFERS_SPLIT_KEYS", 1) < 0) Py_CLEAR(m);
  return m;
}
