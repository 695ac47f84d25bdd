// CUDA backend: XLA FFI handler "jax_blink_cuda" and the executor it drives.
//
// One call per device meets the others on the host (blocking, with the shared timeout); the last to
// arrive enqueues the whole schedule: each rank's XLA stream records a "ready" event, every work
// stream (one per device and tree) waits for all of them, chunks move with cudaMemcpyPeerAsync (COPY)
// or a peer-load add kernel (REDUCE; staged through a local scratch copy where peer access is not
// supported), cross-stream order comes from events recorded before any wait is enqueued, and every
// rank's XLA stream finally waits on all work streams, so no peer still reads its buffers when XLA
// reuses them. Not marked command-buffer compatible (host meetings cannot be replayed in a graph).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <set>

#include "cuda_executor.h"
#include "xla/ffi/api/ffi.h"
#include "xla_dtype.h"

namespace jax_blink {
namespace {

#define BLINK_CUDA(expr)                                                                        \
  do {                                                                                          \
    cudaError_t _e = (expr);                                                                    \
    if (_e != cudaSuccess)                                                                      \
      return std::string("jax_blink CUDA error at " #expr ": ") + cudaGetErrorString(_e);       \
  } while (0)

// ------------------------------------------------------------------------------ reduction kernels
template <typename T> struct Add {
  __device__ static T apply(T a, T b) { return a + b; }
};
template <> struct Add<__half> {
  __device__ static __half apply(__half a, __half b) {
    return __float2half_rn(__half2float(a) + __half2float(b));
  }
};
template <> struct Add<__nv_bfloat16> {
  __device__ static __nv_bfloat16 apply(__nv_bfloat16 a, __nv_bfloat16 b) {
    return __float2bfloat16_rn(__bfloat162float(a) + __bfloat162float(b));
  }
};
#define BLINK_WRAP(S, U) \
  template <> struct Add<S> { \
    __device__ static S apply(S a, S b) { return static_cast<S>(static_cast<U>(a) + static_cast<U>(b)); } \
  };
BLINK_WRAP(int8_t, uint8_t)
BLINK_WRAP(int16_t, uint16_t)
BLINK_WRAP(int32_t, uint32_t)
BLINK_WRAP(int64_t, uint64_t)
template <> struct Add<uint8_t> {
  __device__ static uint8_t apply(uint8_t a, uint8_t b) { return static_cast<uint8_t>(a + b); }
};
template <> struct Add<uint16_t> {
  __device__ static uint16_t apply(uint16_t a, uint16_t b) { return static_cast<uint16_t>(a + b); }
};

template <typename T>
struct alignas(16) Vec {
  T v[16 / sizeof(T)];
};

// 16-byte vector loads when all pointers are 16-byte aligned, scalar otherwise and for the tail.
template <typename T>
__global__ void AddKernel(const T* a, const T* b, T* out, int64_t n, bool vec) {
  constexpr int V = 16 / sizeof(T);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if (vec) {
    const int64_t nv = n / V;
    const Vec<T>* va = reinterpret_cast<const Vec<T>*>(a);
    const Vec<T>* vb = reinterpret_cast<const Vec<T>*>(b);
    Vec<T>* vo = reinterpret_cast<Vec<T>*>(out);
    for (int64_t i = i0; i < nv; i += stride) {
      Vec<T> x = va[i], y = vb[i], z;
#pragma unroll
      for (int k = 0; k < V; ++k) z.v[k] = Add<T>::apply(x.v[k], y.v[k]);
      vo[i] = z;
    }
    done = nv * V;
  }
  for (int64_t i = done + i0; i < n; i += stride) out[i] = Add<T>::apply(a[i], b[i]);
}

template <typename T>
std::string Launch(const void* a, const void* b, void* out, int64_t n, cudaStream_t s) {
  if (n <= 0) return "";
  auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  bool vec = aligned(a) && aligned(b) && aligned(out);
  constexpr int V = 16 / sizeof(T);
  int64_t work = vec ? (n + V - 1) / V : n;
  int threads = 256;
  int64_t blocks = std::min<int64_t>((work + threads - 1) / threads, 4096);
  AddKernel<T><<<static_cast<unsigned>(blocks), threads, 0, s>>>(static_cast<const T*>(a), static_cast<const T*>(b),
                                                                  static_cast<T*>(out), n, vec);
  BLINK_CUDA(cudaGetLastError());
  return "";
}

}  // namespace

std::string LaunchAdd(Dtype t, const void* a, const void* b, void* out, int64_t n, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (t) {
    case Dtype::kF16: return Launch<__half>(a, b, out, n, s);
    case Dtype::kBF16: return Launch<__nv_bfloat16>(a, b, out, n, s);
    case Dtype::kF32: return Launch<float>(a, b, out, n, s);
    case Dtype::kF64: return Launch<double>(a, b, out, n, s);
    case Dtype::kC64: return Launch<float>(a, b, out, 2 * n, s);
    case Dtype::kC128: return Launch<double>(a, b, out, 2 * n, s);
    case Dtype::kS8: return Launch<int8_t>(a, b, out, n, s);
    case Dtype::kS16: return Launch<int16_t>(a, b, out, n, s);
    case Dtype::kS32: return Launch<int32_t>(a, b, out, n, s);
    case Dtype::kS64: return Launch<int64_t>(a, b, out, n, s);
    case Dtype::kU8: return Launch<uint8_t>(a, b, out, n, s);
    case Dtype::kU16: return Launch<uint16_t>(a, b, out, n, s);
    case Dtype::kU32: return Launch<uint32_t>(a, b, out, n, s);
    case Dtype::kU64: return Launch<uint64_t>(a, b, out, n, s);
  }
  return "jax_blink: unsupported dtype";
}

namespace {

// ------------------------------------------------------------------------------ executor state
// All enqueueing happens under one mutex, so pooled events can be re-recorded safely: every wait on an
// event's previous record was enqueued before the lock was released.
std::mutex g_mu;

struct DeviceState {
  std::map<int64_t, cudaStream_t> tree_streams;  // segment -> work stream
  std::vector<cudaEvent_t> events;               // pool
  size_t next_event = 0;
};
std::map<int, DeviceState> g_dev;
std::map<std::pair<int, int>, bool> g_peer;  // (reader, owner) -> peer loads allowed

std::string Peer(int reader, int owner, bool* ok) {
  if (reader == owner) { *ok = true; return ""; }
  auto it = g_peer.find({reader, owner});
  if (it != g_peer.end()) { *ok = it->second; return ""; }
  int can = 0;
  BLINK_CUDA(cudaDeviceCanAccessPeer(&can, reader, owner));
  if (can) {
    BLINK_CUDA(cudaSetDevice(reader));
    cudaError_t e = cudaDeviceEnablePeerAccess(owner, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();  // tolerate: enabled elsewhere
    else if (e != cudaSuccess) { cudaGetLastError(); can = 0; }
    // Buffers from the stream-ordered allocator also need pool access for the reader.
    cudaMemPool_t pool;
    if (can && cudaDeviceGetDefaultMemPool(&pool, owner) == cudaSuccess) {
      cudaMemAccessDesc d{};
      d.location.type = cudaMemLocationTypeDevice;
      d.location.id = reader;
      d.flags = cudaMemAccessFlagsProtReadWrite;
      if (cudaMemPoolSetAccess(pool, &d, 1) != cudaSuccess) cudaGetLastError();
    }
  }
  g_peer[{reader, owner}] = can != 0;
  *ok = can != 0;
  return "";
}

std::string Stream(int dev, int64_t seg, cudaStream_t* s) {
  auto& st = g_dev[dev].tree_streams;
  auto it = st.find(seg);
  if (it != st.end()) { *s = it->second; return ""; }
  BLINK_CUDA(cudaSetDevice(dev));
  BLINK_CUDA(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking));
  st[seg] = *s;
  return "";
}

std::string NewEvent(int dev, cudaEvent_t* ev) {
  auto& d = g_dev[dev];
  if (d.next_event == d.events.size()) {
    BLINK_CUDA(cudaSetDevice(dev));
    cudaEvent_t e;
    BLINK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    d.events.push_back(e);
  }
  *ev = d.events[d.next_event++];
  return "";
}

struct Mark {  // an event and the stream it was recorded on
  cudaEvent_t ev = nullptr;
  cudaStream_t stream = nullptr;
};

std::string EnqueueLocked(const ExecPlan& plan, Dtype dt, const std::vector<CudaRank>& ranks) {
  const size_t es = DtypeSize(dt);
  for (auto& [dev, st] : g_dev) st.next_event = 0;
  // 1. Every rank's stream records "ready" (its input is written) before any wait is enqueued.
  std::vector<Mark> ready(ranks.size());
  for (size_t r = 0; r < ranks.size(); ++r) {
    std::string e = NewEvent(ranks[r].device, &ready[r].ev);
    if (!e.empty()) return e;
    ready[r].stream = static_cast<cudaStream_t>(ranks[r].stream);
    BLINK_CUDA(cudaSetDevice(ranks[r].device));
    BLINK_CUDA(cudaEventRecord(ready[r].ev, ready[r].stream));
  }
  // Scratch per work stream for staged (non-peer) reduces, stream-ordered.
  std::map<cudaStream_t, void*> scratch;
  std::set<cudaStream_t> started;
  auto work_stream = [&](int dev, int64_t seg, cudaStream_t* s) -> std::string {
    std::string e = Stream(dev, seg, s);
    if (!e.empty()) return e;
    if (started.insert(*s).second) {
      BLINK_CUDA(cudaSetDevice(dev));
      for (auto& m : ready) BLINK_CUDA(cudaStreamWaitEvent(*s, m.ev, 0));
    }
    return "";
  };
  auto wait = [](cudaStream_t s, const Mark& m) -> std::string {
    if (m.ev && m.stream != s) BLINK_CUDA(cudaStreamWaitEvent(s, m.ev, 0));
    return "";
  };
  for (const ChunkPlan& cp : plan.chunks) {
    const size_t off = static_cast<size_t>(cp.offset) * es, bytes = static_cast<size_t>(cp.length) * es;
    std::vector<Mark> last_write(ranks.size());
    std::vector<std::vector<Mark>> reads(ranks.size());
    auto before_write = [&](cudaStream_t s, int r) -> std::string {
      std::string e = wait(s, last_write[r]);
      for (auto& m : reads[r]) if (e.empty()) e = wait(s, m);
      return e;
    };
    auto after = [&](int dev, cudaStream_t s, int dst, int src) -> std::string {
      Mark m{nullptr, s};
      std::string e = NewEvent(dev, &m.ev);
      if (!e.empty()) return e;
      BLINK_CUDA(cudaEventRecord(m.ev, s));
      last_write[dst] = m;
      reads[dst].clear();
      if (src >= 0) reads[src].push_back(m);
      return "";
    };
    for (const Op& op : cp.ops) {
      const CudaRank& S = ranks[op.src];
      const CudaRank& D = ranks[op.dst];
      cudaStream_t s;
      std::string e = work_stream(D.device, cp.segment, &s);
      if (e.empty()) e = wait(s, last_write[op.src]);
      if (e.empty()) e = before_write(s, op.dst);
      if (!e.empty()) return e;
      BLINK_CUDA(cudaSetDevice(D.device));
      const char* src = static_cast<const char*>(op.src_from_input ? S.in : S.out) + off;
      char* dst = static_cast<char*>(D.out) + off;
      if (op.kind == 1) {
        if (S.device == D.device) BLINK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
        else BLINK_CUDA(cudaMemcpyPeerAsync(dst, D.device, src, S.device, bytes, s));
      } else {
        const char* a = static_cast<const char*>(op.dst_from_input ? D.in : D.out) + off;
        bool peer = false;
        e = Peer(D.device, S.device, &peer);
        if (!e.empty()) return e;
        BLINK_CUDA(cudaSetDevice(D.device));
        if (!peer) {  // host-staged copy into local scratch, then a local add
          void*& buf = scratch[s];
          if (!buf) BLINK_CUDA(cudaMallocAsync(&buf, static_cast<size_t>(plan.max_chunk) * es, s));
          BLINK_CUDA(cudaMemcpyPeerAsync(buf, D.device, src, S.device, bytes, s));
          src = static_cast<const char*>(buf);
        }
        e = LaunchAdd(dt, a, src, dst, cp.length, s);
        if (!e.empty()) return e;
      }
      e = after(D.device, s, op.dst, op.src);
      if (!e.empty()) return e;
    }
    for (int r : cp.copy_in) {
      cudaStream_t s;
      std::string e = work_stream(ranks[r].device, cp.segment, &s);
      if (e.empty()) e = before_write(s, r);
      if (!e.empty()) return e;
      BLINK_CUDA(cudaSetDevice(ranks[r].device));
      BLINK_CUDA(cudaMemcpyAsync(static_cast<char*>(ranks[r].out) + off, static_cast<const char*>(ranks[r].in) + off,
                                 bytes, cudaMemcpyDeviceToDevice, s));
      e = after(ranks[r].device, s, r, -1);
      if (!e.empty()) return e;
    }
    for (int r : cp.zero) {
      cudaStream_t s;
      std::string e = work_stream(ranks[r].device, cp.segment, &s);
      if (e.empty()) e = before_write(s, r);
      if (!e.empty()) return e;
      BLINK_CUDA(cudaSetDevice(ranks[r].device));
      BLINK_CUDA(cudaMemsetAsync(static_cast<char*>(ranks[r].out) + off, 0, bytes, s));
      e = after(ranks[r].device, s, r, -1);
      if (!e.empty()) return e;
    }
  }
  // 2. Free scratch, record each work stream's tail, and make every rank's stream wait for all tails.
  std::vector<Mark> tails;
  for (cudaStream_t s : started) {
    int dev = -1;
    for (auto& [d, st] : g_dev)
      for (auto& [seg, ws] : st.tree_streams)
        if (ws == s) dev = d;
    BLINK_CUDA(cudaSetDevice(dev));
    auto it = scratch.find(s);
    if (it != scratch.end()) BLINK_CUDA(cudaFreeAsync(it->second, s));
    Mark m{nullptr, s};
    std::string e = NewEvent(dev, &m.ev);
    if (!e.empty()) return e;
    BLINK_CUDA(cudaEventRecord(m.ev, s));
    tails.push_back(m);
  }
  for (size_t r = 0; r < ranks.size(); ++r) {
    BLINK_CUDA(cudaSetDevice(ranks[r].device));
    for (auto& m : tails) BLINK_CUDA(cudaStreamWaitEvent(static_cast<cudaStream_t>(ranks[r].stream), m.ev, 0));
  }
  return "";
}

}  // namespace

std::string EnqueueOnCuda(const ExecPlan& plan, Dtype dt, const std::vector<CudaRank>& ranks) {
  std::lock_guard<std::mutex> lock(g_mu);
  int saved = 0;
  BLINK_CUDA(cudaGetDevice(&saved));
  std::string e = EnqueueLocked(plan, dt, ranks);
  cudaSetDevice(saved);
  return e;
}

// ------------------------------------------------------------------------------ XLA FFI handler
namespace ffi = xla::ffi;

namespace {

// XLA:GPU runs each device's program on its own host thread, so the host meeting may block (bounded by
// the timeout, enforced by the shared watchdog).
ffi::Error BlinkCudaImpl(cudaStream_t stream, ffi::RunId run, int32_t device, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Span<const int64_t> schedule,
                         ffi::Span<const int64_t> device_table, int64_t call_site, int64_t timeout_ms) {
  auto dt = DtypeFromXla(x.element_type());
  if (!dt) return ffi::Error::InvalidArgument("jax_blink: unsupported dtype for the ffi collective");
  const int64_t nelems = static_cast<int64_t>(x.element_count());
  if (nelems == 0 || IsTestAbsentDevice(device)) return ffi::Error::Success();
  std::shared_ptr<const CallSiteInfo> info;
  std::string err = GetCallSiteInfo(call_site, schedule.begin(), schedule.size(), device_table.begin(),
                                    device_table.size(), &info);
  if (!err.empty()) return ffi::Error::InvalidArgument(err);
  const DeviceTable::Entry* e = info->table.Find(device);
  if (!e) return ffi::Error::InvalidArgument("jax_blink: device " + std::to_string(device) + " is not in the device table");
  CudaRank me{device, stream, x.untyped_data(), y->untyped_data()};
  auto result = std::make_shared<std::promise<std::string>>();
  std::future<std::string> fut = result->get_future();
  Arrival a;
  a.device = device;
  a.rank = e->rank;
  a.dtype = *dt;
  a.nelems = nelems;
  a.leaves = {Leaf{me.in, me.out, nelems}};
  a.backend = &me;  // valid: this thread waits below until the meeting finished
  a.done = [result](const std::string& msg) { result->set_value(msg); };
  MeetingKey key{run.run_id, call_site, e->group, NextGeneration(run.run_id, call_site, device)};
  auto meeting = Arrive(key, info, std::move(a), EffectiveTimeoutMs(timeout_ms));
  if (meeting) {
    std::vector<CudaRank> ranks;
    for (auto& arr : meeting->arrivals) ranks.push_back(*static_cast<CudaRank*>(arr.backend));
    meeting->Finish(EnqueueOnCuda(*meeting->plan, *dt, ranks));
  }
  std::string msg = fut.get();
  if (!msg.empty()) return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, msg);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(BlinkCuda, BlinkCudaImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::RunId>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Arg<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>()
                           .Attr<ffi::Span<const int64_t>>("schedule")
                           .Attr<ffi::Span<const int64_t>>("device_table")
                           .Attr<int64_t>("call_site")
                           .Attr<int64_t>("timeout_ms"));

void* CudaHandlerAddress() { return reinterpret_cast<void*>(BlinkCuda); }

}  // namespace jax_blink
