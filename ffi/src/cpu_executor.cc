// CPU executor. The schedule's rows for one chunk are applied in row order to small tiles of the chunk
// (the pipelining unit), so the partial sums of a tile stay in cache while they travel up the tree and
// the results travel down. Every element sees exactly the adds of the schedule, in row order: the bits
// equal a row-by-row execution. fp16/bf16 add in fp32 and round once per add (as the CUDA kernels do).
#include "cpu_executor.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace jax_blink {
namespace {

using AddFn = void (*)(const void* a, const void* b, void* out, int64_t n);

template <typename T>
void AddPlain(const void* a, const void* b, void* out, int64_t n) {
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  T* o = static_cast<T*>(out);  // may alias x (dst += src in place)
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(x[i] + y[i]);
}

// Wrapping integer add (signed overflow wraps, like XLA's add).
template <typename S, typename U>
void AddWrap(const void* a, const void* b, void* out, int64_t n) {
  const S* x = static_cast<const S*>(a);
  const S* y = static_cast<const S*>(b);
  S* o = static_cast<S*>(out);
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<S>(static_cast<U>(x[i]) + static_cast<U>(y[i]));
}

void AddF16(const void* a, const void* b, void* out, int64_t n) {
#if defined(__FLT16_MAX__)
  const _Float16* x = static_cast<const _Float16*>(a);
  const _Float16* y = static_cast<const _Float16*>(b);
  _Float16* o = static_cast<_Float16*>(out);
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<_Float16>(static_cast<float>(x[i]) + static_cast<float>(y[i]));
#else
#error "jax_blink needs a compiler with _Float16 (GCC >= 12 or Clang >= 15 on x86-64/aarch64)"
#endif
}

inline float Bf16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t F32ToBf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
void AddBF16(const void* a, const void* b, void* out, int64_t n) {
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  uint16_t* o = static_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i) o[i] = F32ToBf16(Bf16ToF32(x[i]) + Bf16ToF32(y[i]));
}

// Adds n *elements*; complex types add their real and imaginary parts.
struct Adder {
  AddFn fn;
  int64_t lanes;  // scalars per element
};
Adder AdderFor(Dtype t) {
  switch (t) {
    case Dtype::kF16: return {AddF16, 1};
    case Dtype::kBF16: return {AddBF16, 1};
    case Dtype::kF32: return {AddPlain<float>, 1};
    case Dtype::kF64: return {AddPlain<double>, 1};
    case Dtype::kC64: return {AddPlain<float>, 2};
    case Dtype::kC128: return {AddPlain<double>, 2};
    case Dtype::kS8: return {AddWrap<int8_t, uint8_t>, 1};
    case Dtype::kS16: return {AddWrap<int16_t, uint16_t>, 1};
    case Dtype::kS32: return {AddWrap<int32_t, uint32_t>, 1};
    case Dtype::kS64: return {AddWrap<int64_t, uint64_t>, 1};
    case Dtype::kU8: return {AddPlain<uint8_t>, 1};
    case Dtype::kU16: return {AddPlain<uint16_t>, 1};
    case Dtype::kU32: return {AddPlain<uint32_t>, 1};
    case Dtype::kU64: return {AddPlain<uint64_t>, 1};
  }
  return {nullptr, 0};
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
  Pool() {
    unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    n_ = std::min(hw, 16u);
    if (const char* env = std::getenv("JAX_BLINK_CPU_THREADS")) {
      int v = std::atoi(env);
      if (v >= 1 && v <= 256) n_ = static_cast<unsigned>(v);
    }
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

struct Job {
  std::shared_ptr<Meeting> meeting;
  Adder add;
  size_t esize = 0;
  int64_t tile = 0;                  // elements per tile
  std::vector<int64_t> first_tile;   // per chunk, prefix sum of tile counts
  int64_t total = 0;
  std::vector<const char*> in;
  std::vector<char*> out;
  std::atomic<int64_t> next{0}, done{0};

  void RunTile(int64_t t) {
    const auto& chunks = meeting->plan->chunks;
    size_t c = std::upper_bound(first_tile.begin(), first_tile.end(), t) - first_tile.begin() - 1;
    const ChunkPlan& cp = chunks[c];
    int64_t start = cp.offset + (t - first_tile[c]) * tile;
    int64_t len = std::min(tile, cp.offset + cp.length - start);
    size_t off = static_cast<size_t>(start) * esize, bytes = static_cast<size_t>(len) * esize;
    for (const Op& op : cp.ops) {
      const char* src = (op.src_from_input ? in[op.src] : out[op.src]) + off;
      char* dst = out[op.dst] + off;
      if (op.kind == 1) {
        std::memcpy(dst, src, bytes);
      } else {
        const char* a = (op.dst_from_input ? in[op.dst] : out[op.dst]) + off;
        add.fn(a, src, dst, len * add.lanes);
      }
    }
    for (int32_t r : cp.copy_in) std::memcpy(out[r] + off, in[r] + off, bytes);
    for (int32_t r : cp.zero) std::memset(out[r] + off, 0, bytes);
  }

  // Runs tiles until none are left; the thread finishing the last tile completes the meeting.
  static void Work(const std::shared_ptr<Job>& job) {
    int64_t t;
    while ((t = job->next.fetch_add(1, std::memory_order_relaxed)) < job->total) {
      job->RunTile(t);
      if (job->done.fetch_add(1, std::memory_order_acq_rel) + 1 == job->total) job->meeting->Finish("");
    }
  }
};

}  // namespace

void ExecuteOnCpu(std::shared_ptr<Meeting> meeting) {
  auto job = std::make_shared<Job>();
  Meeting& m = *meeting;
  job->meeting = meeting;
  const Dtype dt = m.arrivals[0].dtype;
  job->add = AdderFor(dt);
  job->esize = DtypeSize(dt);
  // Tiles of 16 KiB per rank buffer: the tile's partial sums stay in L1/L2 across the tree's rows.
  job->tile = std::max<int64_t>(1, 16384 / static_cast<int64_t>(job->esize));
  for (const auto& cp : m.plan->chunks) {
    job->first_tile.push_back(job->total);
    job->total += (cp.length + job->tile - 1) / job->tile;
  }
  for (auto& a : m.arrivals) {
    job->in.push_back(static_cast<const char*>(a.in));
    job->out.push_back(static_cast<char*>(a.out));
  }
  if (job->total == 0) {
    meeting->Finish("");
    return;
  }
  const int64_t bytes = m.plan->schedule.nelems * static_cast<int64_t>(job->esize) *
                        static_cast<int64_t>(m.arrivals.size());
  // Helpers only pay off for large operands (a wake-up costs a few microseconds).
  int64_t helpers = std::min<int64_t>({Pool::Get().size(), job->total - 1, bytes / (256 << 10)});
  for (int64_t i = 0; i < helpers; ++i) Pool::Get().Post([job] { Job::Work(job); });
  Job::Work(job);
}

}  // namespace jax_blink
