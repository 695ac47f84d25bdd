// CUDA backend: XLA FFI handler "jax_blink_cuda": one launch of the device interpreter per rank.
//
// Every ordering decision is in the interpreter program (interp_plan.cc: tasks per thread block,
// flag dependencies, staging) and the interpreter itself (device_interp.h), both plain C++ that CI runs
// on the host with a thread per block under ThreadSanitizer. This file only:
//  1. sets up, once per device pair, peer access (a pair without it stages through host-pinned
//     memory: decided here, never per call), and once per call site (a bounded LRU:
//     program_cache.h) the program on every rank's device, its flags (zeroed once; epochs), error
//     records and staging area;
//  2. per call: finds the pointer table of the call's buffers (uploaded on the rank's stream only when
//     XLA's pointers changed), launches the interpreter kernel once per rank on its XLA stream and
//     records one completion event per rank: no per-op CUDA calls, no cross-device events;
//  3. turns the kernels' error records (a bounded wait gave up: JAX_BLINK_TIMEOUT_S, default 5 s,
//     below PjRt's 10 s abort) into an error naming the rank that never arrived.
// The handler meets its peers on the host only to exchange buffer pointers (blocking: XLA:GPU runs each
// device on its own thread); the last to arrive launches for everyone. A device that cannot join fails
// the whole call at once (FailCall). Not marked command-buffer compatible: the host meeting cannot be
// replayed in a graph. The fused reduce kernel (LaunchReduce) stays for the harness's bandwidth figures.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cuda/atomic>

#include <algorithm>
#include <cstring>
#include <cstdlib>
#include <future>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>

#include "cuda_compat.h"
#include "cuda_executor.h"
#include "device_interp.h"
#include "interp_plan.h"
#include "program_cache.h"
#include "xla/ffi/api/ffi.h"
#include "xla_dtype.h"

#ifndef JAX_BLINK_CUDA_ARCHS
#define JAX_BLINK_CUDA_ARCHS "unknown"
#endif

namespace jax_blink {
namespace {

std::string CudaErr(const char* what, cudaError_t e) {
  return std::string("jax_blink CUDA error at ") + what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
         ")";
}
#define BLINK_CUDA(expr)                                 \
  do {                                                   \
    cudaError_t _e = (expr);                             \
    if (_e != cudaSuccess) return CudaErr(#expr, _e);    \
  } while (0)

// ------------------------------------------------------------------------------ fused reduce kernel
template <typename T> struct Add {
  __device__ static T apply(T a, T b) { return static_cast<T>(a + b); }
};
template <> struct Add<__half> {  // fp32 add, one rounding per add (as the CPU executor)
  __device__ static __half apply(__half a, __half b) { return __float2half_rn(__half2float(a) + __half2float(b)); }
};
template <> struct Add<__nv_bfloat16> {
  __device__ static __nv_bfloat16 apply(__nv_bfloat16 a, __nv_bfloat16 b) {
    return __float2bfloat16_rn(__bfloat162float(a) + __bfloat162float(b));
  }
};

constexpr int kMaxSources = 8;  // sources per launch; more are chained (out becomes the first operand)
template <typename T> struct Sources { const T* p[kMaxSources]; };
template <typename T> struct alignas(16) Vec { T v[16 / sizeof(T)]; };

// out = first + s[0] + ... + s[k-1]. Elements [head, head + nvec * V) use 16-byte vectors (all pointers
// aligned there); the head and the tail are scalar.
template <typename T>
__global__ void ReduceKernel(T* out, const T* first, Sources<T> s, int k, int64_t head, int64_t nvec, int64_t n) {
  constexpr int V = 16 / sizeof(T);
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = tid; i < nvec; i += stride) {
    const int64_t e = head + i * V;
    Vec<T> a = *reinterpret_cast<const Vec<T>*>(first + e);
    for (int j = 0; j < k; ++j) {
      const Vec<T> b = *reinterpret_cast<const Vec<T>*>(s.p[j] + e);
#pragma unroll
      for (int v = 0; v < V; ++v) a.v[v] = Add<T>::apply(a.v[v], b.v[v]);
    }
    *reinterpret_cast<Vec<T>*>(out + e) = a;
  }
  const int64_t tail0 = head + nvec * V;
  const int64_t scalars = head + (n - tail0);
  for (int64_t i = tid; i < scalars; i += stride) {
    const int64_t e = i < head ? i : tail0 + (i - head);
    T a = first[e];
    for (int j = 0; j < k; ++j) a = Add<T>::apply(a, s.p[j][e]);
    out[e] = a;
  }
}

template <typename T>
std::string LaunchT(void* out, const void* first, const void* const* srcs, int k, int64_t n, cudaStream_t st) {
  if (n <= 0) return "";
  constexpr int V = 16 / sizeof(T);
  const void* cur_first = first;
  int done = 0;
  do {
    const int m = std::min(k - done, kMaxSources);
    Sources<T> s{};
    uintptr_t mis = reinterpret_cast<uintptr_t>(out) & 15;
    bool same = (reinterpret_cast<uintptr_t>(cur_first) & 15) == mis;
    for (int j = 0; j < m; ++j) {
      s.p[j] = static_cast<const T*>(srcs[done + j]);
      same = same && (reinterpret_cast<uintptr_t>(srcs[done + j]) & 15) == mis;
    }
    int64_t head = n, nvec = 0;
    if (same && mis % sizeof(T) == 0) {
      head = std::min<int64_t>(n, static_cast<int64_t>(((16 - mis) & 15) / sizeof(T)));
      nvec = (n - head) / V;
    }
    const int64_t work = std::max<int64_t>(nvec, head + (n - head - nvec * V));
    const int threads = 256;
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((work + threads - 1) / threads, 4096));
    ReduceKernel<T><<<static_cast<unsigned>(blocks), threads, 0, st>>>(
        static_cast<T*>(out), static_cast<const T*>(cur_first), s, m, head, nvec, n);
    BLINK_CUDA(cudaGetLastError());
    done += m;
    cur_first = out;
  } while (done < k);
  return "";
}

template <typename T>
std::string KernelImage() {
  cudaFuncAttributes a;
  BLINK_CUDA(cudaFuncGetAttributes(&a, ReduceKernel<T>));
  return "";
}

// dtype -> (kernel element type, scalars per element). Signed integers add as unsigned (wrapping,
// bitwise what XLA gives); complex numbers add their real and imaginary parts.
template <typename F>
std::string Dispatch(Dtype t, int64_t* lanes, F&& f) {
  *lanes = (t == Dtype::kC64 || t == Dtype::kC128) ? 2 : 1;
  switch (t) {
    case Dtype::kF16: return f(__half{});
    case Dtype::kBF16: return f(__nv_bfloat16{});
    case Dtype::kF32: case Dtype::kC64: return f(float{});
    case Dtype::kF64: case Dtype::kC128: return f(double{});
    case Dtype::kS8: case Dtype::kU8: return f(uint8_t{});
    case Dtype::kS16: case Dtype::kU16: return f(uint16_t{});
    case Dtype::kS32: case Dtype::kU32: return f(uint32_t{});
    case Dtype::kS64: case Dtype::kU64: return f(uint64_t{});
  }
  return "jax_blink: unsupported dtype";
}

}  // namespace

std::string LaunchReduce(Dtype dtype, void* out, const void* first, const void* const* srcs, int k, int64_t n,
                         void* stream) {
  int64_t lanes = 1;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return Dispatch(dtype, &lanes, [&](auto tag) {
    using T = decltype(tag);
    return LaunchT<T>(out, first, srcs, k, n * lanes, st);
  });
}

int DeviceOfPointer(const void* ptr) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, ptr) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? a.device : -1;
}

int BuiltCudaVersion() { return CUDART_VERSION; }
const char* BuiltCudaArchitectures() { return JAX_BLINK_CUDA_ARCHS; }

std::string CheckCudaCompatibility() {
  int driver = 0;
  cudaError_t e = cudaDriverGetVersion(&driver);
  if (e != cudaSuccess) return CudaErr("cudaDriverGetVersion", e);
  std::string why = DriverSupportReason(driver, CUDART_VERSION);
  if (!why.empty()) return why;
  int n = 0;
  e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();
    return "no CUDA device visible (" + std::string(e == cudaSuccess ? "cudaGetDeviceCount returned 0" : cudaGetErrorName(e)) + ")";
  }
  for (int d = 0; d < n; ++d) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d) != cudaSuccess) {
      cudaGetLastError();
      return "cannot read the compute capability of CUDA device " + std::to_string(d);
    }
    why = ArchSupportReason(JAX_BLINK_CUDA_ARCHS, major, minor);
    if (!why.empty()) return "CUDA device " + std::to_string(d) + ": " + why;
  }
  return "";
}

namespace {

// ------------------------------------------------------------------------------ the interpreter kernel
// Device memory primitives of the interpreter (device_interp.h): flags are system-scope atomics
// (libcu++, the C++ memory model), so a peer's or the host's view of them is ordered.
struct DeviceMem {
  __device__ static uint64_t LoadAcquire(const uint64_t* p) {
    cuda::atomic_ref<uint64_t, cuda::thread_scope_system> a(*const_cast<uint64_t*>(p));
    return a.load(cuda::memory_order_acquire);
  }
  __device__ static void StoreRelease(uint64_t* p, uint64_t v) {
    __threadfence_system();  // the block's data stores (ordered before us by the block barrier)
    cuda::atomic_ref<uint64_t, cuda::thread_scope_system> a(*p);
    a.store(v, cuda::memory_order_release);
  }
  __device__ static uint64_t Exchange(uint64_t* p, uint64_t v) {
    cuda::atomic_ref<uint64_t, cuda::thread_scope_system> a(*p);
    return a.exchange(v, cuda::memory_order_acq_rel);
  }
  __device__ static uint64_t NowNs() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  }
  __device__ static int64_t Tid() { return threadIdx.x; }
  __device__ static int64_t Threads() { return blockDim.x; }
  __device__ static void Sync() { __syncthreads(); }
  __device__ static void Pause(uint32_t spins) {
#if __CUDA_ARCH__ >= 700
    __nanosleep(spins < 1024 ? 32 : 256);
#endif
  }
  __device__ static void Jitter() {}
  __device__ static void CountWide(int64_t) {}
};

constexpr int kInterpThreads = 256;

// One launch per rank: block b of the grid runs the rank's block b of the program.
__global__ void __launch_bounds__(kInterpThreads)
InterpKernel(interp::View v, interp::Ptrs p, int32_t rank, uint64_t epoch, uint64_t timeout_ns) {
  __shared__ int ok;
  interp::RunBlock<DeviceMem>(v, p, rank, static_cast<int32_t>(blockIdx.x), epoch, timeout_ns, &ok);
}

// ------------------------------------------------------------------------------ set-up state
std::mutex g_mu;  // all set-up and launching

std::map<std::pair<int, int>, bool> g_device_peer;  // (reader, owner) -> peer access enabled
std::set<int> g_kernel_ok;                           // devices with an interpreter kernel image

// A call site's interpreter program on the ranks' devices, with its flags (device memory of each
// rank, zeroed once), error records and staging area (host-pinned, mapped), and the pointer tables
// of the last few buffer sets (device memory per rank; uploaded only when XLA's pointers change).
struct CachedProgram {
  InterpPlan plan;
  std::vector<int> rank_device;
  std::vector<void*> view_mem;             // per rank: the View arrays on its device
  std::vector<interp::View> views;         // per rank: pointing into view_mem
  std::vector<uint64_t*> flags;            // per rank: its flag array (on its device)
  interp::ErrorRecord* records = nullptr;  // host-pinned, one per rank
  char* staging = nullptr;                 // host-pinned (portable, mapped)
  std::vector<uint64_t> epoch;             // per rank: calls so far
  struct Table {
    std::vector<const void*> key;          // the buffer pointers (rank-major: in, out per leaf)
    std::vector<void*> dev;                // per rank: the table on its device
    std::vector<void*> host;               // per rank: pinned source of the upload
  };
  std::list<Table> tables;                 // most recently used first, at most kTables
  bool broken = false;                     // a call failed: flags may disagree; never reused
  ErrorWatch watch;                        // reads `records` without waiting (interp_plan.h)
  std::vector<std::pair<int, cudaEvent_t>> fences;  // per rank: end of its latest launch
};
constexpr size_t kTables = 4;

// Programs by call site, at most JAX_BLINK_CUDA_CACHE_PROGRAMS sites (read once).
ProgramCache<CachedProgram>& Programs() {
  static ProgramCache<CachedProgram> cache(ProgramCacheCapacity(std::getenv("JAX_BLINK_CUDA_CACHE_PROGRAMS")));
  return cache;
}

bool ProgramIdle(const CachedProgram& cp) {
  for (auto& [dev, ev] : cp.fences) {
    cudaError_t e = cudaEventQuery(ev);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
  }
  return true;
}

void ReleaseProgram(CachedProgram& cp) {
  for (size_t r = 0; r < cp.rank_device.size(); ++r) {
    cudaSetDevice(cp.rank_device[r]);
    if (r < cp.view_mem.size()) cudaFree(cp.view_mem[r]);
    if (r < cp.flags.size()) cudaFree(cp.flags[r]);
    for (auto& t : cp.tables) {
      if (r < t.dev.size()) cudaFree(t.dev[r]);
      if (r < t.host.size()) cudaFreeHost(t.host[r]);
    }
  }
  for (auto& [dev, ev] : cp.fences) cudaEventDestroy(ev);
  if (cp.records) cudaFreeHost(cp.records);
  if (cp.staging) cudaFreeHost(cp.staging);
  cudaGetLastError();
  cp.view_mem.clear();
  cp.flags.clear();
  cp.tables.clear();
  cp.fences.clear();
  cp.records = nullptr;
  cp.staging = nullptr;
}

bool EnvFlag(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::string(v) != "0";
}

// Device-level peer access reader -> owner, enabled once per pair (tolerating "already enabled").
std::string DevicePeer(int reader, int owner, bool* ok) {
  auto it = g_device_peer.find({reader, owner});
  if (it != g_device_peer.end()) { *ok = it->second; return ""; }
  int can = 0;
  BLINK_CUDA(cudaDeviceCanAccessPeer(&can, reader, owner));
  if (can) {
    BLINK_CUDA(cudaSetDevice(reader));
    cudaError_t e = cudaDeviceEnablePeerAccess(owner, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
    else if (e != cudaSuccess) { cudaGetLastError(); can = 0; }
    cudaMemPool_t pool;  // the default async pool also needs an access grant for the reader
    if (can && cudaDeviceGetDefaultMemPool(&pool, owner) == cudaSuccess) {
      cudaMemAccessDesc d{};
      d.location.type = cudaMemLocationTypeDevice;
      d.location.id = reader;
      d.flags = cudaMemAccessFlagsProtReadWrite;
      if (cudaMemPoolSetAccess(pool, &d, 1) != cudaSuccess) cudaGetLastError();
    } else {
      cudaGetLastError();
    }
  }
  g_device_peer[{reader, owner}] = can != 0;
  *ok = can != 0;
  return "";
}

std::string ProgramKey(int64_t group, Dtype dt, const std::vector<CudaRank>& ranks, const std::vector<int64_t>& leaves,
                       const std::vector<uint8_t>& peer) {
  std::string k = std::to_string(group) + "/" + std::to_string(static_cast<int>(dt)) + "/";
  for (int64_t l : leaves) k += std::to_string(l) + ",";
  k += "/";
  for (auto& r : ranks) k += std::to_string(r.device) + ",";
  k += "/";
  for (uint8_t p : peer) k += static_cast<char>('0' + p);
  return k;
}

CudaStatus Fail(int kind, std::string msg) { return CudaStatus{kind, std::move(msg)}; }

// The first failed call the programs' records show (each reported once; its program is rebuilt at
// its next call); "" when none. Never waits. Under g_mu.
std::string PollLocked() {
  std::string first;
  Programs().ForEach([&](CachedProgram& prog) {
    std::string m = prog.watch.Poll();
    if (m.empty()) return;
    prog.broken = true;
    if (first.empty()) first = m;
  });
  return first;
}

CudaGraphStats g_stats;

// Default bound of the device-side waits: below PjRt's 10 s abort window even with the half timeout
// of grace an arrived peer gets (device_interp.h), so a missing rank fails the call, not the process.
constexpr int64_t kDefaultGpuTimeoutMs = 5000;
// JAX_BLINK_TIMEOUT_S when set, else the lowering's attribute capped at the GPU default (a longer
// wait only ends in PjRt's abort), else the GPU default.
int64_t GpuTimeoutMs(int64_t attr_ms) {
  const char* v = std::getenv("JAX_BLINK_TIMEOUT_S");
  if (v && *v) return EffectiveTimeoutMs(0);
  return attr_ms > 0 ? std::min(attr_ms, kDefaultGpuTimeoutMs) : kDefaultGpuTimeoutMs;
}

// Copies the plan's arrays to each rank's device, allocates flags, records and staging. The blocks
// of all ranks on one device must be resident at once (they wait on each other): if they do not fit
// the occupancy, the plan is rebuilt with fewer blocks per rank.
std::string BuildProgram(const ExecPlan& plan, Dtype dt, const std::vector<CudaRank>& ranks,
                         const std::vector<int64_t>& leaves, const std::vector<uint8_t>& peer, CachedProgram* cp) {
  const int32_t n = static_cast<int32_t>(ranks.size());
  InterpOptions opt;
  opt.peer_ok = peer;
  opt.leaf_elems = leaves;
  std::string e = BuildInterpPlan(plan, dt, opt, &cp->plan);
  if (!e.empty()) return e;
  std::map<int, int> per_device;  // device -> ranks on it
  for (auto& r : ranks) ++per_device[r.device];
  int fit = 1 << 30;
  for (auto& [dev, count] : per_device) {
    int sms = 0, per_sm = 0;
    BLINK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    BLINK_CUDA(cudaSetDevice(dev));
    BLINK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, InterpKernel, kInterpThreads, 0));
    fit = std::min(fit, std::max(1, sms * per_sm / count));
  }
  if (cp->plan.max_blocks > fit) {
    opt.max_blocks = fit;
    e = BuildInterpPlan(plan, dt, opt, &cp->plan);
    if (!e.empty()) return e;
  }
  const InterpPlan& ip = cp->plan;
  for (auto& r : ranks) cp->rank_device.push_back(r.device);
  cp->epoch.assign(n, 0);
  // one allocation per rank for the View arrays
  struct Part { const void* src; size_t bytes; };
  const Part parts[] = {{ip.tasks.data(), ip.tasks.size() * sizeof(interp::Task)},
                        {ip.block_begin.data(), ip.block_begin.size() * sizeof(int32_t)},
                        {ip.srcs.data(), ip.srcs.size() * sizeof(interp::Src)},
                        {ip.deps.data(), ip.deps.size() * sizeof(interp::FlagRef)},
                        {ip.arrives.data(), ip.arrives.size() * sizeof(int32_t)},
                        {ip.leaf_start.data(), ip.leaf_start.size() * sizeof(int64_t)},
                        {ip.tail.data(), ip.tail.size() * sizeof(interp::FlagRef)},
                        {ip.tail_begin.data(), ip.tail_begin.size() * sizeof(int32_t)}};
  size_t total = 0;
  size_t offs[8];
  for (int i = 0; i < 8; ++i) {
    offs[i] = total;
    total += (parts[i].bytes + 15) & ~size_t{15};
  }
  BLINK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&cp->records), sizeof(interp::ErrorRecord) * n,
                           cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(cp->records, 0, sizeof(interp::ErrorRecord) * n);
  cp->watch.Reset(cp->records, n);
  BLINK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&cp->staging),
                           static_cast<size_t>(std::max<int64_t>(ip.staging_elems * ip.elem_size, 16)),
                           cudaHostAllocMapped | cudaHostAllocPortable));
  for (int32_t r = 0; r < n; ++r) {
    BLINK_CUDA(cudaSetDevice(ranks[r].device));
    void* mem = nullptr;
    BLINK_CUDA(cudaMalloc(&mem, std::max<size_t>(total, 16)));
    cp->view_mem.push_back(mem);
    for (int i = 0; i < 8; ++i)
      if (parts[i].bytes) BLINK_CUDA(cudaMemcpy(static_cast<char*>(mem) + offs[i], parts[i].src, parts[i].bytes,
                                                cudaMemcpyHostToDevice));
    interp::View v = ip.view();
    char* base = static_cast<char*>(mem);
    v.tasks = reinterpret_cast<const interp::Task*>(base + offs[0]);
    v.block_begin = reinterpret_cast<const int32_t*>(base + offs[1]);
    v.srcs = reinterpret_cast<const interp::Src*>(base + offs[2]);
    v.deps = reinterpret_cast<const interp::FlagRef*>(base + offs[3]);
    v.arrives = reinterpret_cast<const int32_t*>(base + offs[4]);
    v.leaf_start = reinterpret_cast<const int64_t*>(base + offs[5]);
    v.tail = reinterpret_cast<const interp::FlagRef*>(base + offs[6]);
    v.tail_begin = reinterpret_cast<const int32_t*>(base + offs[7]);
    cp->views.push_back(v);
    uint64_t* f = nullptr;
    BLINK_CUDA(cudaMalloc(&f, sizeof(uint64_t) * static_cast<size_t>(ip.flags_per_rank[r])));
    BLINK_CUDA(cudaMemset(f, 0, sizeof(uint64_t) * static_cast<size_t>(ip.flags_per_rank[r])));
    cp->flags.push_back(f);
    cudaEvent_t ev;
    BLINK_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    cp->fences.push_back({ranks[r].device, ev});
  }
  for (int32_t r = 0; r < n; ++r) {  // the uploads and the zeroing are done before any launch reads them
    BLINK_CUDA(cudaSetDevice(ranks[r].device));
    BLINK_CUDA(cudaDeviceSynchronize());
  }
  return "";
}

// The pointer table of this call's buffers on every rank's device: found by the pointers (XLA
// usually hands a call site the same buffers every step: no CUDA call), else the least recently used
// table is refilled by a stream-ordered upload on each rank's stream (its earlier kernels, the only
// readers of that rank's copy, are done before it runs).
std::string TableFor(CachedProgram& cp, const std::vector<CudaRank>& ranks, std::vector<interp::Ptrs>* ptrs) {
  const int32_t n = static_cast<int32_t>(ranks.size());
  const int32_t L = cp.plan.nleaves;
  std::vector<const void*> key;
  for (auto& r : ranks)
    for (int32_t l = 0; l < L; ++l) {
      key.push_back(r.in[l]);
      key.push_back(r.out[l]);
    }
  // layout of a table: in[n*L], out[n*L], flags[n], errors[n]
  const size_t words = static_cast<size_t>(n) * L * 2 + 2 * static_cast<size_t>(n);
  auto it = std::find_if(cp.tables.begin(), cp.tables.end(), [&](const CachedProgram::Table& t) { return t.key == key; });
  if (it != cp.tables.end()) {
    cp.tables.splice(cp.tables.begin(), cp.tables, it);
  } else {
    CachedProgram::Table t;
    if (cp.tables.size() >= kTables) {
      t = std::move(cp.tables.back());
      cp.tables.pop_back();
    } else {
      for (int32_t r = 0; r < n; ++r) {
        BLINK_CUDA(cudaSetDevice(ranks[r].device));
        void* d = nullptr;
        void* h = nullptr;
        BLINK_CUDA(cudaMalloc(&d, words * sizeof(void*)));
        BLINK_CUDA(cudaHostAlloc(&h, words * sizeof(void*), cudaHostAllocPortable));
        t.dev.push_back(d);
        t.host.push_back(h);
      }
    }
    t.key = key;
    for (int32_t r = 0; r < n; ++r) {
      void** h = static_cast<void**>(t.host[r]);
      // the pinned source may still feed an upload of an older call: wait for this rank's last launch
      BLINK_CUDA(cudaEventSynchronize(cp.fences[r].second));
      for (int32_t q = 0; q < n; ++q)
        for (int32_t l = 0; l < L; ++l) {
          h[static_cast<size_t>(q) * L + l] = const_cast<void*>(ranks[q].in[l]);
          h[static_cast<size_t>(n) * L + static_cast<size_t>(q) * L + l] = ranks[q].out[l];
        }
      for (int32_t q = 0; q < n; ++q) {
        h[static_cast<size_t>(n) * L * 2 + q] = cp.flags[q];
        h[static_cast<size_t>(n) * L * 2 + n + q] = &cp.records[q];
      }
      BLINK_CUDA(cudaSetDevice(ranks[r].device));
      BLINK_CUDA(cudaMemcpyAsync(t.dev[r], h, words * sizeof(void*), cudaMemcpyHostToDevice,
                                 static_cast<cudaStream_t>(ranks[r].stream)));
      ++g_stats.table_uploads;
    }
    cp.tables.push_front(std::move(t));
  }
  const CachedProgram::Table& t = cp.tables.front();
  ptrs->assign(n, interp::Ptrs{});
  for (int32_t r = 0; r < n; ++r) {
    void** d = static_cast<void**>(t.dev[r]);
    interp::Ptrs& p = (*ptrs)[r];
    p.in = reinterpret_cast<const void* const*>(d);
    p.out = reinterpret_cast<void* const*>(d + static_cast<size_t>(n) * L);
    p.flags = reinterpret_cast<uint64_t* const*>(d + static_cast<size_t>(n) * L * 2);
    p.errors = reinterpret_cast<interp::ErrorRecord* const*>(d + static_cast<size_t>(n) * L * 2 + n);
    p.staging = cp.staging;
  }
  return "";
}

CudaStatus EnqueueLocked(const ExecPlan& plan, Dtype dt, const std::vector<CudaRank>& ranks, int64_t cache_key,
                         int64_t group, std::vector<int64_t> leaves) {
  const int32_t n = static_cast<int32_t>(ranks.size());
  if (n != plan.schedule.nranks) return Fail(1, "jax_blink: rank count differs from the schedule's");
  if (leaves.empty()) leaves = {plan.schedule.nelems};
  for (int32_t r = 0; r < n; ++r) {
    if (ranks[r].in.size() != leaves.size() || ranks[r].out.size() != leaves.size())
      return Fail(1, "jax_blink: rank " + std::to_string(r) + " brings " + std::to_string(ranks[r].in.size()) +
                         " operands for " + std::to_string(leaves.size()) + " leaves");
    for (size_t l = 0; l < leaves.size(); ++l)
      if ((ranks[r].in[l] == ranks[r].out[l]) != (ranks[0].in[l] == ranks[0].out[l]))
        return Fail(1, "jax_blink: leaf " + std::to_string(l) + " is aliased (result = operand) on some ranks only");
  }
  // ---- earlier calls' errors (non-blocking: the kernels write their records into pinned host
  // memory while they run; a failed call is reported here, at the next call of any call site, and
  // its program is rebuilt). Before the release of retired programs, whose records it reads.
  {
    const std::string earlier = PollLocked();
    g_stats.released_programs += static_cast<int64_t>(Programs().Collect(ProgramIdle, ReleaseProgram));
    if (!earlier.empty())
      return Fail(2, earlier + " [an earlier jax_blink call failed; reported at this call, which did not run: "
                               "JAX_BLINK_CUDA_SYNC_ERRORS=1 reports it at the failed call itself]");
  }
  // ---- set-up once per device pair and per call site: peer access, program, flags, kernel image
  const bool force_staging = EnvFlag("JAX_BLINK_CUDA_FORCE_STAGING");
  std::vector<uint8_t> peer(static_cast<size_t>(n) * n, 1);
  for (int32_t r = 0; r < n; ++r)
    for (int32_t o = 0; o < n; ++o) {
      if (r == o) continue;
      uint8_t ok = 1;
      if (force_staging) {
        ok = 0;
      } else if (ranks[r].device != ranks[o].device) {
        bool dev_ok = false;
        std::string e = DevicePeer(ranks[r].device, ranks[o].device, &dev_ok);
        if (!e.empty()) return Fail(2, e);
        ok = dev_ok;
      }
      peer[static_cast<size_t>(r) * n + o] = ok;
    }
  for (auto& r : ranks) {
    if (g_kernel_ok.count(r.device)) continue;
    if (cudaSetDevice(r.device) != cudaSuccess) return Fail(2, CudaErr("cudaSetDevice", cudaGetLastError()));
    cudaFuncAttributes a;
    cudaError_t ce = cudaFuncGetAttributes(&a, InterpKernel);
    if (ce != cudaSuccess)
      return Fail(2, CudaErr("cudaFuncGetAttributes", ce) + " (device " + std::to_string(r.device) +
                         ": no interpreter kernel image for it; see jax_blink.lowering.ffi.UNAVAILABLE)");
    g_kernel_ok.insert(r.device);
  }
  const std::string key = ProgramKey(group, dt, ranks, leaves, peer);
  std::shared_ptr<CachedProgram> cp = Programs().Find(cache_key, key);
  if (!cp || cp->broken) {
    cp = std::make_shared<CachedProgram>();
    std::string e = BuildProgram(plan, dt, ranks, leaves, peer, cp.get());
    if (!e.empty()) {
      ReleaseProgram(*cp);
      return Fail(e.find("jax_blink CUDA error") != std::string::npos ? 2 : 1, e);
    }
    const int64_t evicted = Programs().evicted_sites();
    Programs().Insert(cache_key, key, cp);
    g_stats.evicted_sites += Programs().evicted_sites() - evicted;
  }
  std::vector<interp::Ptrs> ptrs;
  std::string e = TableFor(*cp, ranks, &ptrs);
  if (!e.empty()) {
    cp->broken = true;
    return Fail(2, e);
  }
  // ---- the call: one launch and one completion record per rank
  const int64_t timeout_ms = GpuTimeoutMs(0);
  const uint64_t timeout_ns = static_cast<uint64_t>(timeout_ms) * 1000000ull;
  std::string err;
  for (int32_t r = 0; r < n && err.empty(); ++r) {
    cudaStream_t st = static_cast<cudaStream_t>(ranks[r].stream);
    cudaError_t ce = cudaSetDevice(ranks[r].device);
    const uint64_t epoch = ++cp->epoch[r];
    const unsigned blocks = static_cast<unsigned>(std::max(1, cp->plan.blocks_used[r]));
    if (ce == cudaSuccess) {
      InterpKernel<<<blocks, kInterpThreads, 0, st>>>(cp->views[r], ptrs[r], r, epoch, timeout_ns);
      ce = cudaGetLastError();
    }
    if (ce == cudaSuccess) ce = cudaEventRecord(cp->fences[r].second, st);
    if (ce != cudaSuccess) err = CudaErr("interpreter launch", ce);
    ++g_stats.launches;
  }
  if (!err.empty()) {
    // a rank without its launch never arrives: the launched peers time out on the device (bounded)
    cp->broken = true;
    return Fail(2, err);
  }
  cp->watch.Launched(cp->epoch[0], timeout_ms);
  // Default: return now; the records are read at the next call's entry (above). The host thread is
  // free to enqueue what follows, which the overlap on the annotated stream needs.
  if (!EnvFlag("JAX_BLINK_CUDA_SYNC_ERRORS")) return CudaStatus{};
  // ---- JAX_BLINK_CUDA_SYNC_ERRORS=1: wait for the kernels (bounded by their own timeout), read the records
  for (int32_t r = 0; r < n; ++r) {
    cudaSetDevice(ranks[r].device);
    cudaError_t ce = cudaEventSynchronize(cp->fences[r].second);
    if (ce != cudaSuccess && err.empty()) err = CudaErr("interpreter kernel", ce);
  }
  if (err.empty()) err = cp->watch.Poll();
  if (!err.empty()) {
    cp->broken = true;
    return Fail(2, err);  // the handler maps a timeout message to kDeadlineExceeded
  }
  return CudaStatus{};
}

}  // namespace

std::string PollCudaErrors() {
  std::lock_guard<std::mutex> lock(g_mu);
  return PollLocked();
}

CudaGraphStats GetCudaGraphStats() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_stats;
}

CudaStatus EnqueueOnCuda(const ExecPlan& plan, Dtype dt, const std::vector<CudaRank>& ranks, int64_t cache_key,
                         int64_t group, const std::vector<int64_t>& leaf_elems) {
  std::lock_guard<std::mutex> lock(g_mu);
  int saved = 0;
  if (cudaGetDevice(&saved) != cudaSuccess) { cudaGetLastError(); saved = -1; }
  CudaStatus st = EnqueueLocked(plan, dt, ranks, cache_key, group, leaf_elems);
  if (saved >= 0) cudaSetDevice(saved);
  return st;
}

// ------------------------------------------------------------------------------ XLA FFI handler
namespace ffi = xla::ffi;

namespace {

// Error codes: timeouts kDeadlineExceeded, CUDA failures kInternal, everything else (bad attributes,
// mismatched participants, a peer that could not join) kInvalidArgument.
ffi::ErrorCode CodeFor(const std::string& msg) {
  switch (ErrorClassOf(msg)) {
    case 2: return ffi::ErrorCode::kDeadlineExceeded;
    case 1: return ffi::ErrorCode::kInternal;
    default: return ffi::ErrorCode::kInvalidArgument;
  }
}

// XLA:GPU runs each device's program on its own host thread, so the host meeting may block (bounded by
// the timeout, enforced by the shared watchdog). Identity: the device table of the CUDA lowering is
// keyed by each device's local hardware id (its CUDA ordinal in this process, jax's
// Device.local_hardware_id); the handler finds its own from its first non-empty operand's pointer,
// falling back to the FFI device ordinal only when the pointer query fails. Operands: a bucket of
// leaves, as the CPU handler takes (the schedule runs over their concatenation; interp_plan.h).
ffi::Error BlinkCudaImpl(cudaStream_t stream, ffi::RunId run, int32_t ordinal, ffi::RemainingArgs args,
                         ffi::RemainingRets rets, ffi::Span<const int64_t> schedule,
                         ffi::Span<const int64_t> device_table, int64_t call_site, int64_t timeout_ms) {
  // The bucket: operand i -> result i, one dtype, equal element counts (XLA may alias result i to
  // operand i); zero-size leaves take no part (the same shapes on every device).
  CudaRank me{-1, stream, {}, {}};
  std::vector<Leaf> leaves;
  std::optional<Dtype> dt;
  // A malformed call: reported to the peers below, once the generation is known.
  std::string bad = BucketArityError(args.size(), rets.size());
  int64_t nelems = 0;
  const void* any_ptr = nullptr;  // identifies the device
  for (size_t i = 0; bad.empty() && i < args.size(); ++i) {
    BucketOperand op;
    bad = ReadBucketOperand(args, rets, i, &dt, &op);
    if (!bad.empty()) break;
    const int64_t n = op.in_count;
    if (op.out_count != n) {
      bad = "operand " + std::to_string(i) + " has " + std::to_string(n) + " elements and its result " +
            std::to_string(op.out_count) + " (the CUDA target takes full buffers, not shards)";
      break;
    }
    if (n == 0) continue;
    if (!any_ptr) any_ptr = op.in;
    leaves.push_back(Leaf{op.in, op.out, n});
    me.in.push_back(op.in);
    me.out.push_back(op.out);
    nelems += n;
  }
  if (bad.empty() && nelems == 0) return ffi::Error::Success();
  // the CUDA ordinal of this executor: asked once per FFI ordinal (no per-call pointer queries)
  static std::mutex hw_mu;
  static std::map<int32_t, int> hw_of;
  int hw = -1;
  {
    std::lock_guard<std::mutex> lock(hw_mu);
    auto it = hw_of.find(ordinal);
    if (it != hw_of.end()) {
      hw = it->second;
    } else if (any_ptr) {
      hw = DeviceOfPointer(any_ptr);
      if (hw >= 0) hw_of[ordinal] = hw;
    }
  }
  if (hw < 0) hw = ordinal;
  me.device = hw;
  if (IsTestAbsentDevice(hw)) return ffi::Error::Success();
  const int64_t generation = NextGeneration(run.run_id, call_site, hw);
  auto cannot_join = [&](ffi::ErrorCode code, const std::string& why) {
    std::string msg = "jax_blink: device " + std::to_string(hw) + " cannot join the collective: " + why;
    FailCall(run.run_id, call_site, generation, msg);
    return ffi::Error(code, msg);
  };
  if (!bad.empty()) return cannot_join(ffi::ErrorCode::kInvalidArgument, bad);
  std::shared_ptr<const CallSiteInfo> info;
  std::string err = GetCallSiteInfo(call_site, schedule.begin(), schedule.size(), device_table.begin(),
                                    device_table.size(), &info);
  if (!err.empty()) return cannot_join(ffi::ErrorCode::kInvalidArgument, err);
  const DeviceTable::Entry* e = info->table.Find(hw);
  if (!e)
    return cannot_join(ffi::ErrorCode::kInvalidArgument,
                       "CUDA device " + std::to_string(hw) + " is not in the device table (keyed by local hardware id)");
  auto result = std::make_shared<std::promise<std::string>>();
  std::future<std::string> fut = result->get_future();
  Arrival a;
  a.device = hw;
  a.rank = e->rank;
  a.dtype = *dt;
  a.nelems = nelems;
  a.leaves = std::move(leaves);
  a.backend = &me;  // valid: this thread waits below until the meeting finished
  a.done = [result](const std::string& msg) { result->set_value(msg); };
  MeetingKey key{run.run_id, call_site, e->group, generation};
  auto meeting = Arrive(key, info, std::move(a), GpuTimeoutMs(timeout_ms));
  if (meeting) {
    std::vector<CudaRank> ranks;
    for (auto& arr : meeting->arrivals) ranks.push_back(*static_cast<CudaRank*>(arr.backend));
    std::vector<int64_t> leaf_elems;  // Arrive checked that every participant brings these sizes
    for (auto& l : meeting->arrivals[0].leaves) leaf_elems.push_back(l.nelems);
    CudaStatus st = EnqueueOnCuda(*meeting->plan, *dt, ranks, call_site, e->group, leaf_elems);
    meeting->Finish(st.message, e->rank);
  }
  std::string msg = fut.get();
  if (!msg.empty()) return ffi::Error(CodeFor(msg), msg);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(BlinkCuda, BlinkCudaImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::RunId>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .RemainingArgs()
                           .RemainingRets()
                           .Attr<ffi::Span<const int64_t>>("schedule")
                           .Attr<ffi::Span<const int64_t>>("device_table")
                           .Attr<int64_t>("call_site")
                           .Attr<int64_t>("timeout_ms"));

void* CudaHandlerAddress() { return reinterpret_cast<void*>(BlinkCuda); }

}  // namespace jax_blink
