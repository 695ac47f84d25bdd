// Device-side schedule interpreter: one kernel launch per device per call runs that rank's part of an
// ExecPlan (blink_core.h) - the trees' chunk steps (receive-reduce, forward, copy, zero) - reading
// peers' buffers through a pointer table (pull model) and synchronising with per-task flags in
// peer-visible memory. Plain C++ over a small set of memory primitives, compiled for CUDA
// (cuda_executor.cu, `__device__`) and for the host (interp_host.cc: one std::thread per (rank,
// block), std::atomic-equivalent __atomic builtins, run under ThreadSanitizer in CI).
//
// The program (InterpView, built once per call site by interp_plan.cc) is a list of tasks, each run
// by one thread block of one rank, in that block's order. A task:
//   1. waits until every rank it reads for the first time in its block has arrived in this call
//      (the rank's arrival flag == epoch: its kernel started, so XLA wrote its operands);
//   2. waits for its dependency tasks' done flags (>= epoch): read-after-write, write-after-read and
//      write-after-write edges over (buffer, chunk) regions, derived once from the plan;
//   3. runs: out[rank] = first + s1 + ... (adds left to right: the schedule's summation order), or
//      out[rank] = src, or out[rank] = 0, or (staging for a pair without peer access) the owner copies
//      its own value into a staging slot the reader then loads;
//   4. signals its done flag = epoch (release), if any task waits on it.
// After its last task, block 0 of each rank waits until every other rank arrived (so a rank that never
// does fails every peer, also those that read nothing of it) and for every peer task that reads this
// rank's buffers (so XLA can reuse them when the kernel ends). Epochs: every rank counts its calls of a call site
// (1, 2, ...) and uses that count as the value of this call's flags, so nothing is reset between calls
// (a flag of an older call is < epoch, a newer one cannot exist before this rank's kernel ended).
//
// Bounded waits: a wait on a rank that has not arrived gives up at (block start + timeout) and writes
// the rank's error record {epoch, missing rank, waiting rank, task}; while waiting it polls the
// owner's error record and passes on the missing rank it names (an owner that arrived is itself
// waiting: it gets half a timeout more to give its verdict). So a rank that never arrives makes every
// peer fail within 1.5 x timeout naming that rank, and nothing hangs. The host turns records into errors.
//
// Memory primitives (the policy class M):
//   M::LoadAcquire(const uint64_t*)       acquire load of a flag (system scope on the GPU)
//   M::StoreRelease(uint64_t*, uint64_t)  release store of a flag (after the block's data writes)
//   M::NowNs()                            clock for the timeout
//   M::Tid(), M::Threads()                this thread's index in its block, the block's thread count
//   M::Sync()                             block barrier (orders the block's data accesses around flags)
//   M::Exchange(uint64_t*, uint64_t)      atomic exchange (claims the error record)
//   M::Pause(spins)                       back-off while spinning (spins so far)
//   M::Jitter()                           test hook: a random delay (host checks), nothing on the GPU
//   M::CountWide(n)                       test hook: n scalars moved by 16-byte accesses (host checks)
// Data is loaded, added and stored by every thread of the block on its share of the elements: in
// 16-byte words where the destination and every source of a piece sit at the same offset within 16
// bytes (a scalar head up to the boundary, words, a scalar tail; the same adds per element, so the
// same bits), else one scalar at a time.
#pragma once

#include <cstdint>
#include <cstring>

#include "element_add.h"  // the adds (and BLINK_HD)

namespace jax_blink {
namespace interp {

enum TaskKind : int32_t { kReduce = 0, kCopy = 1, kZero = 2, kStage = 3 };
enum SrcWhere : int32_t { kOut = 0, kIn = 1, kStaging = 2 };

struct Src {
  int32_t where;   // SrcWhere
  int32_t rank;    // kOut / kIn: whose buffer
  int64_t slot;    // kStaging: element offset of the slot in the staging area
};

// A flag address: rank `rank`'s flag array, entry `index` (entry 0 is the rank's arrival flag, entry
// 1 the claim word of its error record, tasks' done flags from 2 on).
constexpr int32_t kArrivalFlag = 0, kClaimFlag = 1, kFirstTaskFlag = 2;
struct FlagRef {
  int32_t rank;
  int32_t index;
};

struct Task {
  int32_t kind;                   // TaskKind
  int32_t rank;                   // the rank that runs it (and writes: pull model)
  int32_t block;                  // its block within that rank
  int32_t flag;                   // its done flag in rank's array, or -1 when nobody waits for it
  int64_t offset, length;         // elements of the leaves' concatenation
  int64_t stage_slot;             // kStage: destination slot (elements into the staging area)
  int32_t src_begin, src_count;   // into srcs: reduce: first operand, then sources; copy/stage: one
  int32_t dep_begin, dep_count;   // into deps: done flags to wait for
  int32_t arrive_begin, arrive_count;  // into arrives: ranks whose arrival to wait for first
};

// A program as the kernel sees it: flat arrays (host memory on the host, device memory on the GPU).
struct View {
  int32_t nranks = 0, nleaves = 0, max_blocks = 0;
  int32_t scalar = 0;             // Scalar (dtype.h)
  int64_t lanes = 1;              // scalars per element
  int64_t elem_size = 0;          // bytes per element
  const Task* tasks = nullptr;
  const int32_t* block_begin = nullptr;  // [nranks * max_blocks + 1]: tasks of block (r, b) are
                                         // tasks[block_begin[r * max_blocks + b] .. next)
  const Src* srcs = nullptr;
  const FlagRef* deps = nullptr;
  const int32_t* arrives = nullptr;
  const int64_t* leaf_start = nullptr;   // [nleaves + 1] element offsets of the leaves
  const FlagRef* tail = nullptr;         // [tail_begin[r] .. tail_begin[r + 1]): rank r's exit waits
  const int32_t* tail_begin = nullptr;   // [nranks + 1]
};

// Error record of one rank (in host-readable memory on the GPU). `epoch` is written last (release):
// a record whose epoch differs from the call's is stale.
struct ErrorRecord {
  uint64_t epoch;
  int64_t missing_rank;  // the rank that never signalled (or whose error was passed on)
  int64_t waiting_rank;  // the rank that gave up
  int64_t task;          // the task that gave up (-1: the exit wait)
};

// Per call: where every rank's buffers, flags and error record are (the pointer table the rendezvous
// fills in one process; across processes, windows of XLA's communicator can fill it).
struct Ptrs {
  const void* const* in = nullptr;   // [rank * nleaves + leaf]
  void* const* out = nullptr;        // [rank * nleaves + leaf] (== in for an aliased leaf)
  uint64_t* const* flags = nullptr;  // [rank]: that rank's flag array (peer-visible)
  ErrorRecord* const* errors = nullptr;  // [rank]
  char* staging = nullptr;           // staging area (host-pinned on the GPU), staging slots
};

// ------------------------------------------------------------------------------ 16-byte words
template <typename V>
struct alignas(16) Word {
  V x[16 / sizeof(V)];
};
BLINK_HD inline uint32_t Misalignment(const void* p) { return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p) & 15u); }
template <typename V>
BLINK_HD inline Word<V> Load16(const V* p) {  // p 16-byte aligned
  Word<V> w;
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(&w) = *reinterpret_cast<const uint4*>(p);
#else
  std::memcpy(&w, p, 16);
#endif
  return w;
}
template <typename V>
BLINK_HD inline void Store16(V* p, const Word<V>& w) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&w);
#else
  std::memcpy(p, &w, 16);
#endif
}

// ------------------------------------------------------------------------------ the interpreter
template <class M>
struct Interpreter {
  const View& v;
  const Ptrs& p;
  int32_t rank;
  uint64_t epoch;
  uint64_t deadline_ns;
  uint64_t grace_ns;  // after the deadline, how long to wait for the verdict of a peer that did arrive
  int64_t task = -1;
  bool failed = false;

  // Records that this rank gave up waiting on `missing` (thread 0 only).
  BLINK_HD void Fail(int64_t missing) {
    ErrorRecord* e = p.errors[rank];
    // the first block of this rank to give up this call claims the record (the claim word is flag 1
    // in the rank's own device memory: no atomic read-modify-write on host memory)
    if (M::Exchange(&p.flags[rank][kClaimFlag], epoch) != epoch) {
      e->missing_rank = missing;
      e->waiting_rank = rank;
      e->task = task;
      M::StoreRelease(&e->epoch, epoch);
    }
    failed = true;
  }

  // Waits (thread 0) until flag >= epoch; false on timeout or when `owner` reported an error.
  BLINK_HD bool Wait(const uint64_t* flag, int32_t owner) {
    uint32_t spins = 0;
    while (M::LoadAcquire(flag) < epoch) {
      if ((++spins & 63u) == 0) {
        const ErrorRecord* oe = p.errors[owner];
        if (M::LoadAcquire(&oe->epoch) == epoch) {  // the owner gave up: pass its verdict on
          Fail(oe->missing_rank);
          return false;
        }
        const uint64_t now = M::NowNs();
        if (now > deadline_ns) {
          // blame the owner only if it never arrived (or its own verdict does not come in time):
          // an owner that arrived is itself waiting for someone, and will name them
          const bool arrived = owner == rank || M::LoadAcquire(&p.flags[owner][kArrivalFlag]) >= epoch;
          if (!arrived || now > deadline_ns + grace_ns) {
            Fail(owner);
            return false;
          }
        }
      }
      M::Pause(spins);
    }
    return true;
  }

  // Element pointer of a source at virtual element e (inside one leaf: the caller cuts by leaf).
  BLINK_HD const char* SrcPtr(const Src& s, int32_t leaf, int64_t e) const {
    if (s.where == kStaging) return p.staging + (s.slot + e) * v.elem_size;
    const int64_t i = static_cast<int64_t>(s.rank) * v.nleaves + leaf;
    const char* base = static_cast<const char*>(s.where == kIn ? p.in[i] : p.out[i]);
    return base + (e - v.leaf_start[leaf]) * v.elem_size;
  }

  template <class A>
  BLINK_HD void RunTyped(const Task& t) {
    using V = typename A::V;
    const Src* srcs = v.srcs + t.src_begin;
    const int64_t a0 = t.offset, a1 = t.offset + t.length;
    int32_t leaf = 0;
    while (leaf + 1 < v.nleaves && v.leaf_start[leaf + 1] <= a0) ++leaf;
    for (int64_t a = a0; a < a1; ++leaf) {  // one piece per leaf the task's elements span
      const int64_t b = v.leaf_start[leaf + 1] < a1 ? v.leaf_start[leaf + 1] : a1;
      const int64_t n = (b - a) * v.lanes;
      V* dst;
      if (t.kind == kStage) {
        dst = reinterpret_cast<V*>(p.staging + (t.stage_slot + (a - a0)) * v.elem_size);
      } else {
        char* base = static_cast<char*>(p.out[static_cast<int64_t>(t.rank) * v.nleaves + leaf]);
        dst = reinterpret_cast<V*>(base + (a - v.leaf_start[leaf]) * v.elem_size);
      }
      // a stage slot holds elements [0, length) of the task's chunk: staged sources index from there
      auto src_at = [&](const Src& s) -> const V* {
        if (s.where == kStaging) return reinterpret_cast<const V*>(p.staging + (s.slot + (a - a0)) * v.elem_size);
        return reinterpret_cast<const V*>(SrcPtr(s, leaf, a));
      };
      const int64_t tid = M::Tid(), nt = M::Threads();
      constexpr int64_t K = static_cast<int64_t>(16 / sizeof(V));  // scalars per 16-byte word
      // Words where every pointer of the piece has the same offset within 16 bytes (the ranks'
      // buffers are equally aligned and a task reads them at its own elements): scalars up to the
      // first 16-byte boundary, words, then the tail.
      const uint32_t mis = Misalignment(dst);
      bool wide = n >= 2 * K && mis % sizeof(V) == 0;
      if (t.kind != kZero)
        for (int32_t k = 0; k < t.src_count && wide; ++k) wide = Misalignment(src_at(srcs[k])) == mis;
      const int64_t h = wide ? static_cast<int64_t>(((16u - mis) & 15u) / sizeof(V)) : 0;  // head scalars
      const int64_t nw = wide ? (n - h) / K : 0;  // words over [h, h + nw * K)
      auto scalar = [&](int64_t i0, int64_t i1) {  // one scalar at a time over [i0, i1)
        if (t.kind == kZero) {
          for (int64_t i = i0 + tid; i < i1; i += nt) dst[i] = V(0);
        } else if (t.kind == kCopy || t.kind == kStage) {
          const V* s = src_at(srcs[0]);
          if (s != dst)  // copy-in of an aliased leaf: out already is in
            for (int64_t i = i0 + tid; i < i1; i += nt) dst[i] = s[i];
        } else {
          const V* first = src_at(srcs[0]);
          for (int64_t i = i0 + tid; i < i1; i += nt) {
            V acc = first[i];
            for (int32_t k = 1; k < t.src_count; ++k) acc = A::Add(acc, src_at(srcs[k])[i]);
            dst[i] = acc;
          }
        }
      };
      scalar(0, h);
      V* wdst = dst + h;
      if (t.kind == kZero) {
        Word<V> z;
        for (int64_t j = 0; j < K; ++j) z.x[j] = V(0);
        for (int64_t w = tid; w < nw; w += nt) Store16(wdst + w * K, z);
      } else if (t.kind == kCopy || t.kind == kStage) {
        const V* s = src_at(srcs[0]) + h;
        if (s != wdst)
          for (int64_t w = tid; w < nw; w += nt) Store16(wdst + w * K, Load16(s + w * K));
      } else {
        const V* first = src_at(srcs[0]) + h;
        for (int64_t w = tid; w < nw; w += nt) {
          Word<V> acc = Load16(first + w * K);
          for (int32_t k = 1; k < t.src_count; ++k) {
            const Word<V> x = Load16(src_at(srcs[k]) + h + w * K);
            for (int64_t j = 0; j < K; ++j) acc.x[j] = A::Add(acc.x[j], x.x[j]);
          }
          Store16(wdst + w * K, acc);
        }
      }
      scalar(h + nw * K, n);
      if (tid == 0 && nw) M::CountWide(nw * K);
      a = b;
    }
  }

  BLINK_HD void RunData(const Task& t) {
    arith::WithAdd(static_cast<Scalar>(v.scalar), [&](auto add) { RunTyped<decltype(add)>(t); });
  }

  // Thread 0 waits for everything task t needs; the result is shared through `ok` by the caller.
  BLINK_HD bool WaitFor(const Task& t) {
    for (int32_t k = 0; k < t.arrive_count; ++k) {
      const int32_t r = v.arrives[t.arrive_begin + k];
      if (!Wait(&p.flags[r][kArrivalFlag], r)) return false;
    }
    for (int32_t k = 0; k < t.dep_count; ++k) {
      const FlagRef& d = v.deps[t.dep_begin + k];
      if (!Wait(&p.flags[d.rank][d.index], d.rank)) return false;
    }
    return true;
  }
};

// Runs block `block` of rank `rank` for the call of `epoch` (every thread of the block calls it).
// `shared_ok` is block-shared storage for thread 0's verdicts. Block 0 signals the rank's arrival
// first. Returns false when the block gave up (the rank's error record says why).
template <class M>
BLINK_HD bool RunBlock(const View& v, const Ptrs& p, int32_t rank, int32_t block, uint64_t epoch,
                       uint64_t timeout_ns, volatile int* shared_ok) {
  Interpreter<M> it{v, p, rank, epoch, M::NowNs() + timeout_ns, timeout_ns / 2};
  const bool leader = M::Tid() == 0;
  if (block == 0 && leader) M::StoreRelease(&p.flags[rank][kArrivalFlag], epoch);  // arrival: our operands are ready
  const int32_t b0 = v.block_begin[rank * v.max_blocks + block], b1 = v.block_begin[rank * v.max_blocks + block + 1];
  bool ok = true;
  for (int32_t i = b0; i < b1 && ok; ++i) {
    const Task& t = v.tasks[i];
    it.task = i;
    if (leader) *shared_ok = it.WaitFor(t) ? 1 : 0;
    M::Sync();  // the waits (acquire by thread 0) happen before every thread's loads
    ok = *shared_ok != 0;
    M::Sync();
    if (!ok) break;
    M::Jitter();
    it.RunData(t);
    M::Jitter();
    M::Sync();  // every thread's stores happen before thread 0's release
    if (leader && t.flag >= 0) M::StoreRelease(&p.flags[rank][t.flag], epoch);
  }
  if (ok && block == 0) {  // exit: peers' reads of our buffers are done
    it.task = -1;
    if (leader) {
      int w = 1;
      for (int32_t k = v.tail_begin[rank]; k < v.tail_begin[rank + 1] && w; ++k)
        w = it.Wait(&p.flags[v.tail[k].rank][v.tail[k].index], v.tail[k].rank) ? 1 : 0;
      *shared_ok = w;
    }
    M::Sync();
    ok = *shared_ok != 0;
  }
  return ok;
}

}  // namespace interp
}  // namespace jax_blink
