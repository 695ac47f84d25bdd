// CPU executor. Each chunk is cut into tiles (the pipelining unit) and a tile goes through the WHOLE
// tree while it is cache resident: the reduce steps (a parent adds its children's tile into its own, k
// children fused into one pass out = first + c1 + ... + ck, added left to right in row order) and then
// the broadcast copies down. So memory traffic is about the inputs read once and the outputs written
// once. Every element sees exactly the adds of the schedule, in row order: the bits equal a row-by-row
// execution (schedule.execute). fp16/bf16 add in fp32 and round once per add (as the CUDA kernels do).
// Threads: the caller plus JAX_BLINK_CPU_THREADS - 1 helpers (default: one thread per core) claim tiles;
// nobody waits for another: the thread finishing the last tile completes every participant's future.
#include "cpu_executor.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "cpu_sum.h"

namespace jax_blink {

int EnvInt(const char* name, int lo, int hi, int fallback) {
  const char* env = std::getenv(name);
  if (!env) return fallback;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(env, &end, 10);
  if (end == env || errno != 0) return fallback;
  while (*end == ' ' || (*end >= '\t' && *end <= '\r')) ++end;
  if (*end != '\0') return fallback;
  return v >= lo && v <= hi ? static_cast<int>(v) : fallback;
}

namespace {

// Threads that execute a meeting (the caller included): JAX_BLINK_CPU_THREADS, else the cores.
int CpuThreads() {
  static const int n = EnvInt("JAX_BLINK_CPU_THREADS", 1, 256,
                              static_cast<int>(std::min(16u, std::max(1u, std::thread::hardware_concurrency()))));
  return n;
}

class Pool {
 public:
  static Pool& Get() {
    static Pool* p = new Pool();  // leaked: workers must outlive static destruction
    return *p;
  }
  int size() const { return static_cast<int>(n_); }
  void Post(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      q_.push_back(std::move(f));
    }
    cv_.notify_one();
  }

 private:
  // Helpers = threads - 1: the calling thread works too, so with one thread per core nothing is
  // oversubscribed (XLA's own threads are idle while their calls' futures are pending).
  Pool() {
    n_ = static_cast<unsigned>(CpuThreads() - 1);
    for (unsigned i = 0; i < n_; ++i) std::thread([this] { Loop(); }).detach();
  }
  void Loop() {
    for (;;) {
      std::function<void()> f;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !q_.empty(); });
        f = std::move(q_.front());
        q_.pop_front();
      }
      f();
    }
  }
  unsigned n_ = 1;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
};

// Output buffers are usually fresh pages from XLA's allocator: every 4 KiB page faults (and is zeroed
// by the kernel) on first touch, which costs more than the all-reduce itself at tens of MiB. Asking
// for transparent huge pages on the 2 MiB-aligned interior of a large output makes that one fault per
// 2 MiB. A hint only (contents unchanged); no effect where THP is disabled. JAX_BLINK_CPU_HUGEPAGES=0
// turns it off.
void AdviseHugePages(void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < static_cast<int64_t>(4 * kHuge)) return;
  uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

// Advises each run of adjacent ranges [p, p + bytes) as one: a buffer cut into leaves (a block order,
// BlockOrderLeaves, whose blocks may be smaller than the hint's threshold) is hinted as the whole.
void AdviseHugePageRuns(std::vector<std::pair<char*, int64_t>> ranges) {
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 0; i < ranges.size();) {
    char* lo = ranges[i].first;
    char* hi = lo + ranges[i].second;
    for (++i; i < ranges.size() && ranges[i].first <= hi; ++i) hi = std::max(hi, ranges[i].first + ranges[i].second);
    AdviseHugePages(lo, hi - lo);
  }
}

// Copies n bytes with non-temporal (streaming) stores where the target has them: the destination's
// lines are not read first (no read-for-ownership) and do not evict the tile's working set. For
// broadcast copies into outputs that nothing reads again in this call, when the call moves more data
// than the last-level cache holds. The caller fences (StreamFence) before anyone else reads.
void StreamCopy(char* dst, const char* src, size_t n) {
#if defined(__SSE2__)
  size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
  head = std::min(head, n);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  const size_t body = n & ~size_t{63};
  for (size_t i = 0; i < body; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + body, src + body, n - body);
#else
  std::memcpy(dst, src, n);
#endif
}

void StreamFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// True when a step after steps[i] reads rank r's output (so a write to it should stay in cache).
bool ReadLater(const std::vector<Step>& steps, size_t i, int32_t r) {
  for (size_t j = i + 1; j < steps.size(); ++j)
    for (const Operand& o : steps[j].reads)
      if (o.rank == r) return true;
  return false;
}

// A tile: the pipelining unit, inside one chunk and one leaf (the leaves are one virtual
// concatenation; a tile never straddles a leaf boundary, so every pointer below is a plain offset).
struct Tile {
  int32_t chunk, leaf;
  int64_t offset, length;  // elements, within the leaf
};

struct Job {
  std::shared_ptr<Meeting> meeting;
  Adder add;
  size_t esize = 0;
  std::vector<Tile> tiles;
  std::vector<std::vector<const char*>> in;  // [rank][leaf]
  std::vector<std::vector<char*>> out;
  bool stream = false;  // final broadcast copies with non-temporal stores (StreamCopy)
  // Reduce-scatter: a rank's output outside the shards it owns is scratch nobody returns, so the
  // input is not copied there (copy_in only on the segment's root).
  bool scratch_non_root = false;
  std::atomic<int64_t> next{0}, done{0};

  void RunTile(int64_t t) {
    const Tile& tl = tiles[t];
    const ChunkPlan& cp = meeting->plan->chunks[tl.chunk];
    const size_t off = static_cast<size_t>(tl.offset) * esize, bytes = static_cast<size_t>(tl.length) * esize;
    const int l = tl.leaf;
    auto ptr = [&](const Operand& r) { return (r.input ? in[r.rank][l] : out[r.rank][l]) + off; };
    const void* srcs[64];
    bool streamed = false;
    for (size_t si = 0; si < cp.steps.size(); ++si) {
      const Step& st = cp.steps[si];
      if (st.kind == 1) {
        const char* src = ptr(st.reads[0]);
        for (int32_t w : st.writes) {
          if (stream && !ReadLater(cp.steps, si, w)) {
            StreamCopy(out[w][l] + off, src, bytes);
            streamed = true;
          } else {
            std::memcpy(out[w][l] + off, src, bytes);
          }
        }
        continue;
      }
      const int k = static_cast<int>(st.reads.size()) - 1;
      const char* first = ptr(st.reads[0]);
      char* dst = out[st.writes[0]][l] + off;
      for (int j = 0; j < k; j += 64) {  // at most 64 source pointers at a time
        const int m = std::min(k - j, 64);
        for (int i = 0; i < m; ++i) srcs[i] = ptr(st.reads[1 + j + i]);
        add.fn(dst, first, srcs, m, tl.length * add.lanes);
        first = dst;
      }
    }
    // (segment -1: the one-rank plan without chunks, its rank 0 keeps its input)
    const int64_t root = cp.segment >= 0 ? meeting->plan->schedule.seg_root[cp.segment] : 0;
    for (int32_t r : cp.copy_in)  // nothing to copy where XLA aliased the output to the input
      if (out[r][l] != in[r][l] && (!scratch_non_root || r == root))
        std::memcpy(out[r][l] + off, in[r][l] + off, bytes);
    for (int32_t r : cp.zero) std::memset(out[r][l] + off, 0, bytes);
    if (streamed) StreamFence();  // visible before the tile counts as done (Work's acq_rel counter)
  }

  // Runs tiles until none are left; the thread finishing the last tile completes the meeting.
  // inline_rank: the rank whose handler thread this is (-1 on a helper), completed inline.
  static void Work(const std::shared_ptr<Job>& job, int64_t inline_rank) {
    const int64_t total = static_cast<int64_t>(job->tiles.size());
    int64_t t;
    while ((t = job->next.fetch_add(1, std::memory_order_relaxed)) < total) {
      job->RunTile(t);
      if (job->done.fetch_add(1, std::memory_order_acq_rel) + 1 == total) job->meeting->Finish("", inline_rank);
    }
  }
};

// Cuts every chunk [offset, offset + length) of the virtual concatenation into tiles of at most
// `tile` elements that do not cross a leaf boundary.
std::vector<Tile> MakeTiles(const std::vector<ChunkPlan>& chunks, const std::vector<Leaf>& leaves, int64_t tile) {
  std::vector<Tile> out;
  size_t leaf = 0;
  int64_t leaf_start = 0;  // element offset of `leaf` in the concatenation
  for (size_t c = 0; c < chunks.size(); ++c) {
    int64_t pos = chunks[c].offset, end = chunks[c].offset + chunks[c].length;
    while (pos < end) {
      while (leaf_start + leaves[leaf].nelems <= pos) leaf_start += leaves[leaf++].nelems;  // chunks are sorted
      const int64_t stop = std::min({end, pos + tile, leaf_start + leaves[leaf].nelems});
      out.push_back(Tile{static_cast<int32_t>(c), static_cast<int32_t>(leaf), pos - leaf_start, stop - pos});
      pos = stop;
    }
  }
  return out;
}

}  // namespace

void SumInto(Dtype dtype, void* out, const void* first, const void* const* srcs, int k, int64_t n) {
  Adder a = AdderFor(dtype);
  if (k <= 0) {
    if (out != first) std::memmove(out, first, static_cast<size_t>(n) * DtypeSize(dtype));
    return;
  }
  a.fn(out, first, srcs, k, n * a.lanes);
}

void ExecuteOnCpu(std::shared_ptr<Meeting> meeting, int64_t caller_rank) {
  // 32 KiB tiles: a star tree over 8 ranks touches 16 such buffers per tile (512 KiB), within L2.
  constexpr int64_t kTileBytes = 32 << 10;
  // A helper's wake-up costs tens of microseconds: only worth it from 1 MiB moved (all ranks).
  constexpr int64_t kHelperBytes = 1 << 20;
  static const bool huge = EnvInt("JAX_BLINK_CPU_HUGEPAGES", 0, 1, 1) == 1;
  auto job = std::make_shared<Job>();
  Meeting& m = *meeting;
  job->meeting = meeting;
  const Dtype dt = m.arrivals[0].dtype;
  job->add = AdderFor(dt);
  job->esize = DtypeSize(dt);
  const int64_t tile = std::max<int64_t>(1, kTileBytes / static_cast<int64_t>(job->esize));
  job->tiles = MakeTiles(m.plan->chunks, m.arrivals[0].leaves, tile);
  const int64_t rank_bytes = m.plan->schedule.nelems * static_cast<int64_t>(job->esize);
  const int64_t esize = static_cast<int64_t>(job->esize);
  for (auto& a : m.arrivals) {
    job->in.emplace_back();
    job->out.emplace_back();
    std::vector<std::pair<char*, int64_t>> fresh;  // this rank's output memory, hinted run by run
    for (const Leaf& leaf : a.leaves) {
      job->in.back().push_back(static_cast<const char*>(leaf.in));
      job->out.back().push_back(static_cast<char*>(leaf.out));
      if (!huge || leaf.out == leaf.in || !leaf.out_memory) continue;
      if (leaf.out_shard) {  // only the rank's shard is memory
        const int64_t shard = leaf.nelems / m.plan->schedule.nranks;
        fresh.emplace_back(static_cast<char*>(leaf.out) + a.rank * shard * esize, shard * esize);
      } else {
        fresh.emplace_back(static_cast<char*>(leaf.out), leaf.nelems * esize);
      }
    }
    if (!fresh.empty()) AdviseHugePageRuns(std::move(fresh));
  }
  const int64_t total = static_cast<int64_t>(job->tiles.size());
  if (total == 0) {
    meeting->Finish("", caller_rank);
    return;
  }
  const int64_t bytes = rank_bytes * static_cast<int64_t>(m.arrivals.size());
  // Inputs and outputs together larger than a last-level cache (32 MiB on the EPYC VM measured):
  // the outputs would be evicted before anyone reads them anyway. JAX_BLINK_CPU_STREAM=0: off.
  static const bool stream_ok = EnvInt("JAX_BLINK_CPU_STREAM", 0, 1, 1) == 1;
  constexpr int64_t kStreamBytes = 32 << 20;
  job->stream = stream_ok && 2 * bytes >= kStreamBytes;
  {
    const CollectiveRow& row = *CollectiveRowOf(static_cast<int64_t>(job->meeting->plan->schedule.collective));
    job->scratch_non_root = row.sharded && row.reduces;
  }
  int64_t helpers = std::min<int64_t>({Pool::Get().size(), total - 1, bytes / kHelperBytes});
  for (int64_t i = 0; i < helpers; ++i) Pool::Get().Post([job] { Job::Work(job, -1); });
  Job::Work(job, caller_rank);
}

}  // namespace jax_blink
