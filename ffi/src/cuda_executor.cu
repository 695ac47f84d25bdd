// CUDA backend: XLA FFI handler "jax_blink_cuda" and the thin layer that issues a GPU program.
//
// Every ordering decision is made by the plain C++ builder (gpu_program.cc: streams, ops, event
// records and waits), which CI emulates and race-checks without a GPU. This file only:
//  1. sets up everything that can fail before anything is enqueued (peer access per buffer, the
//     program (cached per call site, a bounded LRU: program_cache.h), streams, events, scratch, a
//     kernel image for each device);
//  2. issues the program's ops in order (cudaMemcpy[Peer]Async, the fused reduce kernel,
//     cudaMemsetAsync, cudaEventRecord, cudaStreamWaitEvent): either captured once into a CUDA graph
//     per (program, buffer pointers) and launched each call (all ranks on one device), or op by op
//     (several devices, JAX_BLINK_CUDA_GRAPHS=0, or any graph failure: see IssueGraph);
//  3. if an issue call fails midway, still makes every rank's XLA stream wait for the work already
//     enqueued, so XLA never frees or reuses a buffer that a peer still reads.
// The handler meets its peers on the host (blocking: XLA:GPU runs each device on its own thread); the
// last to arrive enqueues for everyone. A device that cannot join fails the whole call at once
// (FailCall), so XLA's client never waits 10 s on a replica that will not come. Not marked
// command-buffer compatible: host meetings and cross-device waits cannot be replayed in a graph.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
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

// ------------------------------------------------------------------------------ set-up state
std::mutex g_mu;  // all set-up and issuing

std::map<std::pair<int, int>, cudaStream_t> g_streams;  // (device, slot) -> work stream
std::map<int, std::vector<cudaEvent_t>> g_events;        // device -> event pool
std::map<std::pair<int, int>, bool> g_device_peer;       // (reader, owner) -> peer access enabled
std::set<std::pair<int, Dtype>> g_kernel_ok;             // (device, dtype) with a kernel image

// One instantiated CUDA graph of a cached program, for one set of buffer pointers.
struct GraphEntry {
  std::vector<const void*> ptrs;  // rank 0's leaves (in, out), then rank 1's, ...
  cudaGraphExec_t exec = nullptr;
};

struct CachedProgram {
  GpuProgram prog;
  std::vector<void*> scratch;  // device pointers, one per prog.scratch
  std::vector<int> scratch_device;
  // CUDA graphs (single-device programs only): most recently used first, at most GraphCacheSize().
  std::list<GraphEntry> graphs;
  int64_t graph_calls = 0, graph_misses = 0;
  bool graphs_off = false;     // a capture failed, or pointers change on most calls: op by op from now on
  std::string graphs_off_why;
  // Completion of the latest call: an event recorded on each of its XLA streams after the call's work
  // (every op of a call precedes an XLA stream's final wait). fence_failed: a record failed, so
  // completion is unknown and the program is never freed (leaked rather than freed in flight).
  std::vector<std::pair<int, cudaEvent_t>> fences;  // (device, event)
  bool fence_failed = false;
};

// Programs by call site, at most JAX_BLINK_CUDA_CACHE_PROGRAMS sites (read once).
ProgramCache<CachedProgram>& Programs() {
  static ProgramCache<CachedProgram> cache(ProgramCacheCapacity(std::getenv("JAX_BLINK_CUDA_CACHE_PROGRAMS")));
  return cache;
}

// Has the latest call of an evicted program completed? (cudaErrorNotReady or any other answer: no.)
bool ProgramIdle(const CachedProgram& cp) {
  if (cp.fence_failed) return false;
  for (auto& [dev, ev] : cp.fences) {
    cudaError_t e = cudaEventQuery(ev);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
  }
  return true;
}

// Frees an evicted program whose work completed: scratch, executable graphs, fence events.
void ReleaseProgram(CachedProgram& cp) {
  for (size_t i = 0; i < cp.scratch.size(); ++i) {
    cudaSetDevice(cp.scratch_device[i]);
    cudaFree(cp.scratch[i]);
  }
  for (auto& g : cp.graphs) cudaGraphExecDestroy(g.exec);
  for (auto& [dev, ev] : cp.fences) {
    cudaSetDevice(dev);
    cudaEventDestroy(ev);
  }
  cudaGetLastError();
  cp.scratch.clear();
  cp.graphs.clear();
  cp.fences.clear();
}

// Records the fences of `cp` after a call: on `xla` (device, stream) pairs after whose current work the
// call's work is complete (the graph path: its launch stream; op by op: every rank's XLA stream).
// Best effort: a failure marks the program fence_failed.
void RecordFences(CachedProgram& cp, const std::vector<std::pair<int, cudaStream_t>>& xla) {
  for (size_t i = 0; i < xla.size(); ++i) {
    const int dev = xla[i].first;
    cudaError_t e = cudaSetDevice(dev);
    if (e == cudaSuccess && (i >= cp.fences.size() || cp.fences[i].first != dev)) {
      cudaEvent_t ev = nullptr;
      e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
      if (e == cudaSuccess) {
        if (i < cp.fences.size()) cp.fences[i] = {dev, ev};  // the old one stays unfreed: it may be pending
        else cp.fences.push_back({dev, ev});
      }
    }
    if (e == cudaSuccess) e = cudaEventRecord(cp.fences[i].second, xla[i].second);
    if (e != cudaSuccess) {
      cudaGetLastError();
      cp.fence_failed = true;
    }
  }
}

bool EnvFlag(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::string(v) != "0";
}

int MaxConnections() {
  const char* v = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  int n = v ? std::atoi(v) : 8;
  return n >= 1 && n <= 32 ? n : 8;
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

// Can kernels on `reader` load `ptr`? Memory from a non-default pool or a VMM mapping may lack the
// grant even with peer access enabled: ask the driver (CU_POINTER_ATTRIBUTE_ACCESS_FLAGS, for the
// current context's device). If the query is unavailable, trust device-level peer access.
bool PointerReadable(int reader, const void* ptr) {
  using Fn = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
  static Fn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
#if CUDART_VERSION >= 12050
    if (cudaGetDriverEntryPointByVersion("cuPointerGetAttribute", &p, 12000, cudaEnableDefault, &q) != cudaSuccess)
#else
    if (cudaGetDriverEntryPoint("cuPointerGetAttribute", &p, cudaEnableDefault, &q) != cudaSuccess)
#endif
      p = nullptr;
    cudaGetLastError();
    return reinterpret_cast<Fn>(p);
  }();
  if (!fn || cudaSetDevice(reader) != cudaSuccess) { cudaGetLastError(); return true; }
  unsigned long long flags = 0;
  if (fn(&flags, CU_POINTER_ATTRIBUTE_ACCESS_FLAGS, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) return true;
  return (flags & CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READ) != 0;
}

// Work streams of the op-by-op path (g_streams), and the graph path's own streams (g_graph_streams:
// slot -1 launches the graphs, slot 0 is the capture origin, 1 + s captures work slot s). The graph
// path never captures on the op-by-op streams, so a capture that goes wrong cannot disturb them.
std::map<std::pair<int, int>, cudaStream_t> g_graph_streams;

std::string StreamOf(std::map<std::pair<int, int>, cudaStream_t>* m, int device, int slot, cudaStream_t* s) {
  auto it = m->find({device, slot});
  if (it != m->end()) { *s = it->second; return ""; }
  BLINK_CUDA(cudaSetDevice(device));
  BLINK_CUDA(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking));
  (*m)[{device, slot}] = *s;
  return "";
}
std::string WorkStream(int device, int slot, cudaStream_t* s) { return StreamOf(&g_streams, device, slot, s); }

// Takes events from the per-device pools (next[pool] counts those used by this enqueue). Pool `device`
// serves the op-by-op path and graph launches; pool -1 - device the events recorded inside captures.
std::string TakeEvent(int device, std::map<int, size_t>* next, cudaEvent_t* ev, bool capture = false) {
  const int key = capture ? -1 - device : device;
  auto& pool = g_events[key];
  size_t& i = (*next)[key];
  if (i == pool.size()) {
    BLINK_CUDA(cudaSetDevice(device));
    cudaEvent_t e;
    BLINK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    pool.push_back(e);
  }
  *ev = pool[i++];
  return "";
}

std::string ProgramKey(int64_t plan_id, Dtype dt, const std::vector<CudaRank>& ranks, const std::vector<int64_t>& leaves,
                       const std::vector<uint8_t>& aliased, const std::vector<uint8_t>& peer, int cap) {
  std::string k = std::to_string(plan_id) + "/" + std::to_string(static_cast<int>(dt)) + "/" + std::to_string(cap) + "/";
  for (size_t l = 0; l < leaves.size(); ++l) k += std::to_string(leaves[l]) + (aliased[l] ? "a," : ",");
  k += "/";
  for (auto& r : ranks) k += std::to_string(r.device) + ",";
  k += "/";
  for (uint8_t p : peer) k += static_cast<char>('0' + p);
  return k;
}

CudaStatus Fail(int kind, std::string msg) { return CudaStatus{kind, std::move(msg)}; }

CudaGraphStats g_graph_stats;

// JAX_BLINK_CUDA_GRAPHS=0: issue op by op (no CUDA graphs).
bool GraphsEnabled() {
  const char* v = std::getenv("JAX_BLINK_CUDA_GRAPHS");
  return !(v && std::string(v) == "0");
}
// Executable graphs kept per program (pointer sets), JAX_BLINK_CUDA_GRAPH_CACHE (default 4, 1..64).
size_t GraphCacheSize() {
  const char* v = std::getenv("JAX_BLINK_CUDA_GRAPH_CACHE");
  const int n = v ? std::atoi(v) : 4;
  return static_cast<size_t>(n >= 1 && n <= 64 ? n : 4);
}

// Issues the program's ops in order, stream i of the program on streams[i] (the pseudo ops are
// skipped). used[i] is set for each stream that got an op. `current`: the device set now (-1: unknown).
// Returns "" or the first error (later ops are not issued).
std::string IssueOps(const GpuProgram& prog, const CachedProgram& cp, Dtype dt, const std::vector<CudaRank>& ranks,
                     const std::vector<cudaStream_t>& streams, const std::vector<cudaEvent_t>& events,
                     std::vector<uint8_t>* used, int current) {
  auto ptr = [&](const ByteRange& b) -> char* {
    char* base = b.buf.kind == BufKind::kIn ? static_cast<char*>(const_cast<void*>(ranks[b.buf.owner].in[b.buf.leaf]))
                 : b.buf.kind == BufKind::kOut ? static_cast<char*>(ranks[b.buf.owner].out[b.buf.leaf])
                                               : static_cast<char*>(cp.scratch[b.buf.owner]);
    return base + b.offset;
  };
  auto dev_of = [&](const BufRef& b) {
    return b.kind == BufKind::kScratch ? ranks[prog.scratch[b.owner].rank].device : ranks[b.owner].device;
  };
  std::string err;
  const void* srcs[64];
  for (size_t i = 0; i < prog.ops.size() && err.empty(); ++i) {
    const GpuOp& op = prog.ops[i];
    if (op.kind == GpuOpKind::kXlaBefore || op.kind == GpuOpKind::kXlaAfter) continue;
    const int dev = prog.streams[op.stream].device;
    cudaStream_t s = streams[op.stream];
    if (dev != current) {
      cudaError_t e = cudaSetDevice(dev);
      if (e != cudaSuccess) { err = CudaErr("cudaSetDevice", e); break; }
      current = dev;
    }
    cudaError_t e = cudaSuccess;
    switch (op.kind) {
      case GpuOpKind::kRecord: e = cudaEventRecord(events[op.event], s); break;
      case GpuOpKind::kWait: e = cudaStreamWaitEvent(s, events[op.event], 0); break;
      case GpuOpKind::kZero: e = cudaMemsetAsync(ptr(op.dst), 0, static_cast<size_t>(op.dst.bytes), s); break;
      case GpuOpKind::kCopy: {
        const int sd = dev_of(op.src[0].buf), dd = dev_of(op.dst.buf);
        if (sd == dd) e = cudaMemcpyAsync(ptr(op.dst), ptr(op.src[0]), op.dst.bytes, cudaMemcpyDeviceToDevice, s);
        else e = cudaMemcpyPeerAsync(ptr(op.dst), dd, ptr(op.src[0]), sd, static_cast<size_t>(op.dst.bytes), s);
        break;
      }
      case GpuOpKind::kReduce: {
        const int k = static_cast<int>(op.src.size()) - 1;
        if (k > 64) { err = "jax_blink: more than 64 reduce sources"; break; }
        for (int j = 0; j < k; ++j) srcs[j] = ptr(op.src[1 + j]);
        err = LaunchReduce(dt, ptr(op.dst), ptr(op.src[0]), srcs, k, op.elems, s);
        break;
      }
      default: break;
    }
    if (e != cudaSuccess) err = CudaErr(GpuOpKindName(op.kind), e);
    (*used)[op.stream] = 1;
  }
  return err;
}

// The op-by-op path: every op is one CUDA call on the work streams (pooled, shared by call sites).
CudaStatus IssueOpByOp(const CachedProgram& cp, Dtype dt, const std::vector<CudaRank>& ranks) {
  const GpuProgram& prog = cp.prog;
  const int32_t n = static_cast<int32_t>(ranks.size());
  std::vector<cudaStream_t> streams(prog.streams.size());
  for (size_t i = 0; i < prog.streams.size(); ++i) {
    const GpuStream& gs = prog.streams[i];
    if (gs.xla) { streams[i] = static_cast<cudaStream_t>(ranks[gs.rank].stream); continue; }
    std::string e = WorkStream(gs.device, gs.slot, &streams[i]);
    if (!e.empty()) return Fail(2, e);
  }
  std::map<int, size_t> next;
  std::vector<cudaEvent_t> events(static_cast<size_t>(prog.nevents), nullptr);
  for (const GpuOp& op : prog.ops)
    if (op.kind == GpuOpKind::kRecord) {
      std::string e = TakeEvent(prog.streams[op.stream].device, &next, &events[op.event]);
      if (!e.empty()) return Fail(2, e);
    }
  std::vector<cudaEvent_t> tails(prog.streams.size(), nullptr);  // for the failure path
  for (size_t i = 0; i < prog.streams.size(); ++i)
    if (!prog.streams[i].xla) {
      std::string e = TakeEvent(prog.streams[i].device, &next, &tails[i]);
      if (!e.empty()) return Fail(2, e);
    }
  ++g_graph_stats.op_by_op;

  // ---- 2. issue the program
  std::vector<uint8_t> used(prog.streams.size(), 0);
  std::string err = IssueOps(prog, cp, dt, ranks, streams, events, &used, -1);
  if (err.empty()) return CudaStatus{};
  // ---- 3. failure midway: every XLA stream waits for all work already enqueued (best effort)
  cudaGetLastError();
  for (size_t i = 0; i < prog.streams.size(); ++i)
    if (used[i] && tails[i]) {
      cudaSetDevice(prog.streams[i].device);
      cudaEventRecord(tails[i], streams[i]);
    }
  for (int32_t r = 0; r < n; ++r) {
    cudaSetDevice(ranks[r].device);
    for (size_t i = 0; i < prog.streams.size(); ++i)
      if (used[i] && tails[i]) cudaStreamWaitEvent(static_cast<cudaStream_t>(ranks[r].stream), tails[i], 0);
  }
  cudaGetLastError();
  return Fail(2, err);
}

// Captures the program into one CUDA graph (every rank on device `dev`). Nothing runs during a capture:
// the capturing streams only record. The program's XLA streams become the capture origin (its
// records at the start fork the work streams, its waits at the end join them); every capture work
// stream is forked from the origin before the first op (an op on a stream outside the capture would
// run at once) and joined back after the last. Any failure ends the capture, destroys the partial
// graph and returns the error (*out stays null): nothing was enqueued anywhere.
std::string CaptureProgram(const CachedProgram& cp, Dtype dt, const std::vector<CudaRank>& ranks, int dev,
                           cudaGraph_t* out) {
  *out = nullptr;
  const GpuProgram& prog = cp.prog;
  // fallible set-up outside the capture: streams, events
  cudaStream_t origin;
  std::string e = StreamOf(&g_graph_streams, dev, 0, &origin);
  if (!e.empty()) return e;
  std::vector<cudaStream_t> streams(prog.streams.size());
  std::map<int, cudaStream_t> work;  // slot -> capture stream
  for (size_t i = 0; i < prog.streams.size(); ++i) {
    const GpuStream& gs = prog.streams[i];
    if (gs.device != dev) return "jax_blink: graph capture needs every stream on one device";
    if (gs.xla) { streams[i] = origin; continue; }
    e = StreamOf(&g_graph_streams, dev, 1 + gs.slot, &streams[i]);
    if (!e.empty()) return e;
    work[gs.slot] = streams[i];
  }
  std::map<int, size_t> next;
  std::vector<cudaEvent_t> events(static_cast<size_t>(prog.nevents), nullptr);
  for (const GpuOp& op : prog.ops)
    if (op.kind == GpuOpKind::kRecord) {
      e = TakeEvent(dev, &next, &events[op.event], /*capture=*/true);
      if (!e.empty()) return e;
    }
  cudaEvent_t fork = nullptr;
  e = TakeEvent(dev, &next, &fork, true);
  if (!e.empty()) return e;
  std::vector<cudaEvent_t> joins(work.size(), nullptr);
  for (auto& j : joins) {
    e = TakeEvent(dev, &next, &j, true);
    if (!e.empty()) return e;
  }
  BLINK_CUDA(cudaSetDevice(dev));
  // ThreadLocal: only this thread's unsafe calls are checked (XLA's other threads are left alone).
  cudaError_t ce = cudaStreamBeginCapture(origin, cudaStreamCaptureModeThreadLocal);
  if (ce != cudaSuccess) {
    cudaGetLastError();
    return CudaErr("cudaStreamBeginCapture", ce);
  }
  std::string err;
  ce = cudaEventRecord(fork, origin);
  for (auto& [slot, st] : work)
    if (ce == cudaSuccess) ce = cudaStreamWaitEvent(st, fork, 0);
  if (ce != cudaSuccess) err = CudaErr("capture fork", ce);
  std::vector<uint8_t> used(prog.streams.size(), 0);
  if (err.empty()) err = IssueOps(prog, cp, dt, ranks, streams, events, &used, dev);
  size_t j = 0;
  for (auto& [slot, st] : work) {  // join every capture stream into the origin, even after an error
    cudaError_t a = cudaEventRecord(joins[j], st);
    if (a == cudaSuccess) a = cudaStreamWaitEvent(origin, joins[j], 0);
    if (a != cudaSuccess && err.empty()) err = CudaErr("capture join", a);
    ++j;
  }
  cudaGraph_t g = nullptr;
  ce = cudaStreamEndCapture(origin, &g);
  if (ce != cudaSuccess && err.empty()) err = CudaErr("cudaStreamEndCapture", ce);
  if (err.empty() && g == nullptr) err = "jax_blink: stream capture returned no graph";
  // No stream may stay in capture mode (its later work would be recorded, not run): such a stream is
  // dropped from the pool (leaked; a fresh one is created next time).
  std::vector<std::pair<int, cudaStream_t>> all{{0, origin}};
  for (auto& [slot, st] : work) all.push_back({1 + slot, st});
  for (auto& [slot, st] : all) {
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(st, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
      g_graph_streams.erase({dev, slot});
      if (err.empty()) err = "jax_blink: a stream was left in capture mode";
    }
  }
  cudaGetLastError();  // capture errors are not sticky: clear them
  if (!err.empty()) {
    if (g) cudaGraphDestroy(g);
    return err;
  }
  *out = g;
  return "";
}

// The graph path (every rank on one device): one executable graph per (program, buffer pointers),
// captured and instantiated on first use, then launched each call. A new pointer set reuses the least
// recently used graph with cudaGraphExecUpdate when the cache is full (re-instantiates if CUDA refuses).
// Launch: each rank's XLA stream records an event the launch stream waits on (the graph starts after
// every rank reached the call), the graph runs, and every XLA stream waits for its end.
// Returns false, with *why, when the call must go op by op instead: nothing of the program has been
// enqueued then (at most waits on the launch stream). Returns true when the graph was launched (*st:
// its status; after a failure past the launch the host waits for the graph, so XLA never reuses a
// buffer it still reads).
bool IssueGraph(CachedProgram& cp, Dtype dt, const std::vector<CudaRank>& ranks, CudaStatus* st, std::string* why) {
  const int dev = ranks[0].device;
  std::vector<const void*> ptrs;
  for (auto& r : ranks)
    for (size_t l = 0; l < r.in.size(); ++l) {
      ptrs.push_back(r.in[l]);
      ptrs.push_back(r.out[l]);
    }
  ++cp.graph_calls;
  auto it = std::find_if(cp.graphs.begin(), cp.graphs.end(), [&](const GraphEntry& g) { return g.ptrs == ptrs; });
  if (it != cp.graphs.end()) {
    cp.graphs.splice(cp.graphs.begin(), cp.graphs, it);
  } else {
    ++cp.graph_misses;
    if (cp.graph_misses > 8 && cp.graph_misses * 2 > cp.graph_calls) {
      cp.graphs_off = true;  // capturing on most calls costs more than issuing op by op
      *why = "buffer pointers change on most calls";
      return false;
    }
    cudaGraph_t g = nullptr;
    ++g_graph_stats.captures;
    std::string e = CaptureProgram(cp, dt, ranks, dev, &g);
    if (!e.empty()) {
      ++g_graph_stats.capture_failures;
      cp.graphs_off = true;
      *why = "capture failed: " + e;
      return false;
    }
    cudaGraphExec_t exec = nullptr;
    if (cp.graphs.size() >= GraphCacheSize()) {
      GraphEntry old = std::move(cp.graphs.back());
      cp.graphs.pop_back();
#if CUDART_VERSION >= 12000
      cudaGraphExecUpdateResultInfo info{};
      if (cudaGraphExecUpdate(old.exec, g, &info) == cudaSuccess) {
        exec = old.exec;  // takes effect at its next launch; launches in flight are not affected
        ++g_graph_stats.updates;
      } else {
        cudaGetLastError();
        cudaGraphExecDestroy(old.exec);  // an in-flight launch completes; freed afterwards
      }
#else
      cudaGraphExecDestroy(old.exec);
#endif
    }
    if (!exec) {
#if CUDART_VERSION >= 12000
      cudaError_t ce = cudaGraphInstantiate(&exec, g, 0);
#else
      cudaError_t ce = cudaGraphInstantiateWithFlags(&exec, g, 0);
#endif
      if (ce != cudaSuccess) {
        cudaGetLastError();
        cudaGraphDestroy(g);
        cp.graphs_off = true;
        *why = CudaErr("cudaGraphInstantiate", ce);
        return false;
      }
      ++g_graph_stats.instantiates;
    }
    cudaGraphDestroy(g);
    cp.graphs.push_front(GraphEntry{ptrs, exec});
  }
  cudaGraphExec_t exec = cp.graphs.front().exec;
  // launch set-up (fallible, nothing enqueued): launch stream, events
  cudaStream_t launch;
  std::string e = StreamOf(&g_graph_streams, dev, -1, &launch);
  std::vector<cudaStream_t> xla;  // distinct XLA streams (ranks may share one)
  for (auto& r : ranks) {
    cudaStream_t s = static_cast<cudaStream_t>(r.stream);
    if (std::find(xla.begin(), xla.end(), s) == xla.end()) xla.push_back(s);
  }
  std::map<int, size_t> next;
  std::vector<cudaEvent_t> arrive(xla.size(), nullptr);
  cudaEvent_t done = nullptr;
  for (auto& a : arrive)
    if (e.empty()) e = TakeEvent(dev, &next, &a);
  if (e.empty()) e = TakeEvent(dev, &next, &done);
  if (e.empty() && cudaSetDevice(dev) != cudaSuccess) e = CudaErr("cudaSetDevice", cudaGetLastError());
  cudaError_t ce = cudaSuccess;
  for (size_t i = 0; i < xla.size() && e.empty() && ce == cudaSuccess; ++i) {
    ce = cudaEventRecord(arrive[i], xla[i]);
    if (ce == cudaSuccess) ce = cudaStreamWaitEvent(launch, arrive[i], 0);
  }
  if (e.empty() && ce != cudaSuccess) e = CudaErr("graph launch set-up", ce);
  if (e.empty()) {
    ce = cudaGraphLaunch(exec, launch);
    if (ce != cudaSuccess) {
      e = CudaErr("cudaGraphLaunch", ce);
      cp.graphs_off = true;
    }
  }
  if (!e.empty()) {  // nothing of the program enqueued: go op by op
    cudaGetLastError();
    *why = e;
    return false;
  }
  ++g_graph_stats.launches;
  ce = cudaEventRecord(done, launch);
  for (size_t i = 0; i < xla.size() && ce == cudaSuccess; ++i) ce = cudaStreamWaitEvent(xla[i], done, 0);
  if (ce != cudaSuccess) {
    cudaGetLastError();
    cudaStreamSynchronize(launch);  // XLA's streams may not wait for the graph: wait here instead
    cudaGetLastError();
    *st = Fail(2, CudaErr("graph completion event", ce));
  } else {
    *st = CudaStatus{};
  }
  return true;
}

CudaStatus EnqueueLocked(const ExecPlan& plan, Dtype dt, const std::vector<CudaRank>& ranks, int64_t cache_key,
                         int64_t group, std::vector<int64_t> leaves) {
  const int32_t n = static_cast<int32_t>(ranks.size());
  if (n != plan.schedule.nranks) return Fail(1, "jax_blink: rank count differs from the schedule's");
  if (leaves.empty()) leaves = {plan.schedule.nelems};
  std::vector<uint8_t> aliased(leaves.size(), 0);
  for (int32_t r = 0; r < n; ++r) {
    if (ranks[r].in.size() != leaves.size() || ranks[r].out.size() != leaves.size())
      return Fail(1, "jax_blink: rank " + std::to_string(r) + " brings " + std::to_string(ranks[r].in.size()) +
                         " operands for " + std::to_string(leaves.size()) + " leaves");
    for (size_t l = 0; l < leaves.size(); ++l) {
      const uint8_t a = ranks[r].in[l] == ranks[r].out[l];
      if (r == 0) aliased[l] = a;
      else if (a != aliased[l])
        return Fail(1, "jax_blink: leaf " + std::to_string(l) + " is aliased (result = operand) on some ranks only");
    }
  }
  // Evicted programs whose last call completed are freed first.
  g_graph_stats.released_programs += static_cast<int64_t>(Programs().Collect(ProgramIdle, ReleaseProgram));
  // ---- 1. set-up: nothing is enqueued until all of it succeeded
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
        for (size_t l = 0; l < leaves.size() && ok; ++l)
          ok = PointerReadable(ranks[r].device, ranks[o].in[l]) && PointerReadable(ranks[r].device, ranks[o].out[l]);
      }
      peer[static_cast<size_t>(r) * n + o] = ok;
    }
  const int cap = MaxConnections();
  const std::string key = ProgramKey(group, dt, ranks, leaves, aliased, peer, cap);
  std::shared_ptr<CachedProgram> cp = Programs().Find(cache_key, key);
  if (!cp) {
    cp = std::make_shared<CachedProgram>();
    GpuProgramOptions opt;
    for (auto& r : ranks) opt.rank_device.push_back(r.device);
    opt.peer_ok = peer;
    opt.max_streams_per_device = cap;
    opt.leaf_elems = leaves;
    opt.leaf_aliased = aliased;
    const bool cplx = dt == Dtype::kC64 || dt == Dtype::kC128;
    std::string e = BuildGpuProgram(plan, static_cast<int64_t>(DtypeSize(dt)), cplx ? 2 : 1, opt, &cp->prog);
    if (!e.empty()) return Fail(1, e);
    for (auto& sb : cp->prog.scratch) {
      void* p = nullptr;
      cudaError_t ce = cudaSetDevice(ranks[sb.rank].device);
      if (ce == cudaSuccess) ce = cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(sb.bytes, 16)));
      if (ce != cudaSuccess) {
        cudaGetLastError();
        for (size_t i = 0; i < cp->scratch.size(); ++i) {
          cudaSetDevice(ranks[cp->prog.scratch[i].rank].device);
          cudaFree(cp->scratch[i]);
        }
        return Fail(2, CudaErr("cudaMalloc (staging scratch)", ce));
      }
      cp->scratch.push_back(p);
      cp->scratch_device.push_back(ranks[sb.rank].device);
    }
    const int64_t evicted = Programs().evicted_sites();
    Programs().Insert(cache_key, key, cp);
    g_graph_stats.evicted_sites += Programs().evicted_sites() - evicted;
  }
  for (auto& r : ranks) {
    if (g_kernel_ok.count({r.device, dt})) continue;
    if (cudaSetDevice(r.device) != cudaSuccess) return Fail(2, CudaErr("cudaSetDevice", cudaGetLastError()));
    int64_t lanes;
    std::string e = Dispatch(dt, &lanes, [](auto tag) { return KernelImage<decltype(tag)>(); });
    if (!e.empty()) return Fail(2, e + " (device " + std::to_string(r.device) + ": no reduce kernel image for it; "
                                        "see jax_blink.lowering.ffi.UNAVAILABLE)");
    g_kernel_ok.insert({r.device, dt});
  }

  // ---- 2. issue: one graph launch where possible, else op by op
  bool one_device = true;
  for (auto& r : ranks) one_device = one_device && r.device == ranks[0].device;
  if (!GraphsEnabled()) {
    g_graph_stats.last_fallback = "JAX_BLINK_CUDA_GRAPHS=0";
  } else if (!one_device) {
    g_graph_stats.last_fallback = "ranks on several devices (graphs are single-device)";
  } else if (cp->graphs_off) {
    g_graph_stats.last_fallback = cp->graphs_off_why;
  } else {
    CudaStatus st;
    std::string why;
    if (IssueGraph(*cp, dt, ranks, &st, &why)) {
      RecordFences(*cp, {{ranks[0].device, g_graph_streams[{ranks[0].device, -1}]}});
      return st;
    }
    g_graph_stats.last_fallback = why;
    if (cp->graphs_off) cp->graphs_off_why = why;
  }
  CudaStatus st = IssueOpByOp(*cp, dt, ranks);
  std::vector<std::pair<int, cudaStream_t>> xla;  // distinct XLA streams
  for (auto& r : ranks) {
    const std::pair<int, cudaStream_t> x{r.device, static_cast<cudaStream_t>(r.stream)};
    if (std::find(xla.begin(), xla.end(), x) == xla.end()) xla.push_back(x);
  }
  RecordFences(*cp, xla);
  return st;
}

}  // namespace

CudaGraphStats GetCudaGraphStats() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_graph_stats;
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
// leaves, as the CPU handler takes (the schedule runs over their concatenation; gpu_program.h).
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
  int hw = any_ptr ? DeviceOfPointer(any_ptr) : -1;
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
  auto meeting = Arrive(key, info, std::move(a), EffectiveTimeoutMs(timeout_ms));
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
