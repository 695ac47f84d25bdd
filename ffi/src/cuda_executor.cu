// CUDA backend: XLA FFI handler "jax_blink_cuda" and the thin layer that issues a GPU program.
//
// Every ordering decision is made by the plain C++ builder (gpu_program.cc: streams, ops, event
// records and waits), which CI emulates and race-checks without a GPU. This file only:
//  1. sets up everything that can fail before anything is enqueued (peer access per buffer, the
//     program (cached per call site), streams, events, scratch, a kernel image for each device);
//  2. issues the program's ops in order (cudaMemcpy[Peer]Async, the fused reduce kernel,
//     cudaMemsetAsync, cudaEventRecord, cudaStreamWaitEvent);
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
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "cuda_compat.h"
#include "cuda_executor.h"
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

struct CachedProgram {
  GpuProgram prog;
  std::vector<void*> scratch;  // device pointers, one per prog.scratch
};
std::map<std::string, std::shared_ptr<CachedProgram>> g_programs;

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

std::string WorkStream(int device, int slot, cudaStream_t* s) {
  auto it = g_streams.find({device, slot});
  if (it != g_streams.end()) { *s = it->second; return ""; }
  BLINK_CUDA(cudaSetDevice(device));
  BLINK_CUDA(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking));
  g_streams[{device, slot}] = *s;
  return "";
}

// Takes events from the per-device pools (next[device] counts those used by this enqueue).
std::string TakeEvent(int device, std::map<int, size_t>* next, cudaEvent_t* ev) {
  auto& pool = g_events[device];
  size_t& i = (*next)[device];
  if (i == pool.size()) {
    BLINK_CUDA(cudaSetDevice(device));
    cudaEvent_t e;
    BLINK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    pool.push_back(e);
  }
  *ev = pool[i++];
  return "";
}

std::string ProgramKey(int64_t cache_key, int64_t plan_id, Dtype dt, const std::vector<CudaRank>& ranks,
                       const std::vector<uint8_t>& peer, int cap) {
  std::string k = std::to_string(cache_key) + "/" + std::to_string(plan_id) + "/" +
                  std::to_string(static_cast<int>(dt)) + "/" + std::to_string(cap) + "/";
  for (auto& r : ranks) k += std::to_string(r.device) + ",";
  k += "/";
  for (uint8_t p : peer) k += static_cast<char>('0' + p);
  return k;
}

CudaStatus Fail(int kind, std::string msg) { return CudaStatus{kind, std::move(msg)}; }

CudaStatus EnqueueLocked(const ExecPlan& plan, Dtype dt, const std::vector<CudaRank>& ranks, int64_t cache_key,
                         int64_t group) {
  const int32_t n = static_cast<int32_t>(ranks.size());
  if (n != plan.schedule.nranks) return Fail(1, "jax_blink: rank count differs from the schedule's");
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
        ok = dev_ok && PointerReadable(ranks[r].device, ranks[o].in) && PointerReadable(ranks[r].device, ranks[o].out);
      }
      peer[static_cast<size_t>(r) * n + o] = ok;
    }
  const int cap = MaxConnections();
  const std::string key = ProgramKey(cache_key, group, dt, ranks, peer, cap);
  std::shared_ptr<CachedProgram> cp;
  auto it = g_programs.find(key);
  if (it != g_programs.end()) {
    cp = it->second;
  } else {
    cp = std::make_shared<CachedProgram>();
    GpuProgramOptions opt;
    for (auto& r : ranks) opt.rank_device.push_back(r.device);
    opt.peer_ok = peer;
    opt.max_streams_per_device = cap;
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
    }
    g_programs[key] = cp;
  }
  const GpuProgram& prog = cp->prog;
  for (auto& r : ranks) {
    if (g_kernel_ok.count({r.device, dt})) continue;
    if (cudaSetDevice(r.device) != cudaSuccess) return Fail(2, CudaErr("cudaSetDevice", cudaGetLastError()));
    int64_t lanes;
    std::string e = Dispatch(dt, &lanes, [](auto tag) { return KernelImage<decltype(tag)>(); });
    if (!e.empty()) return Fail(2, e + " (device " + std::to_string(r.device) + ": no reduce kernel image for it; "
                                        "see jax_blink.lowering.ffi.UNAVAILABLE)");
    g_kernel_ok.insert({r.device, dt});
  }
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

  // ---- 2. issue the program
  auto ptr = [&](const ByteRange& b) -> char* {
    char* base = b.buf.kind == BufKind::kIn ? static_cast<char*>(const_cast<void*>(ranks[b.buf.owner].in))
                 : b.buf.kind == BufKind::kOut ? static_cast<char*>(ranks[b.buf.owner].out)
                                               : static_cast<char*>(cp->scratch[b.buf.owner]);
    return base + b.offset;
  };
  auto dev_of = [&](const BufRef& b) {
    return b.kind == BufKind::kScratch ? ranks[prog.scratch[b.owner].rank].device : ranks[b.owner].device;
  };
  std::vector<uint8_t> used(prog.streams.size(), 0);
  int current = -1;
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
    used[op.stream] = 1;
  }
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

}  // namespace

CudaStatus EnqueueOnCuda(const ExecPlan& plan, Dtype dt, const std::vector<CudaRank>& ranks, int64_t cache_key,
                         int64_t group) {
  std::lock_guard<std::mutex> lock(g_mu);
  int saved = 0;
  if (cudaGetDevice(&saved) != cudaSuccess) { cudaGetLastError(); saved = -1; }
  CudaStatus st = EnqueueLocked(plan, dt, ranks, cache_key, group);
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
// Device.local_hardware_id); the handler finds its own from the operand's pointer, falling back to the
// FFI device ordinal only when the pointer query fails.
ffi::Error BlinkCudaImpl(cudaStream_t stream, ffi::RunId run, int32_t ordinal, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Span<const int64_t> schedule,
                         ffi::Span<const int64_t> device_table, int64_t call_site, int64_t timeout_ms) {
  const int64_t nelems = static_cast<int64_t>(x.element_count());
  if (nelems == 0) return ffi::Error::Success();
  int hw = DeviceOfPointer(x.untyped_data());
  if (hw < 0) hw = ordinal;
  if (IsTestAbsentDevice(hw)) return ffi::Error::Success();
  const int64_t generation = NextGeneration(run.run_id, call_site, hw);
  auto cannot_join = [&](ffi::ErrorCode code, const std::string& why) {
    std::string msg = "jax_blink: device " + std::to_string(hw) + " cannot join the collective: " + why;
    FailCall(run.run_id, call_site, generation, msg);
    return ffi::Error(code, msg);
  };
  auto dt = DtypeFromXla(x.element_type());
  if (!dt) return cannot_join(ffi::ErrorCode::kInvalidArgument, "unsupported dtype for the ffi collective");
  std::shared_ptr<const CallSiteInfo> info;
  std::string err = GetCallSiteInfo(call_site, schedule.begin(), schedule.size(), device_table.begin(),
                                    device_table.size(), &info);
  if (!err.empty()) return cannot_join(ffi::ErrorCode::kInvalidArgument, err);
  const DeviceTable::Entry* e = info->table.Find(hw);
  if (!e)
    return cannot_join(ffi::ErrorCode::kInvalidArgument,
                       "CUDA device " + std::to_string(hw) + " is not in the device table (keyed by local hardware id)");
  CudaRank me{hw, stream, x.untyped_data(), y->untyped_data()};
  auto result = std::make_shared<std::promise<std::string>>();
  std::future<std::string> fut = result->get_future();
  Arrival a;
  a.device = hw;
  a.rank = e->rank;
  a.dtype = *dt;
  a.nelems = nelems;
  a.in = me.in;
  a.out = me.out;
  a.backend = &me;  // valid: this thread waits below until the meeting finished
  a.done = [result](const std::string& msg) { result->set_value(msg); };
  MeetingKey key{run.run_id, call_site, e->group, generation};
  auto meeting = Arrive(key, info, std::move(a), EffectiveTimeoutMs(timeout_ms));
  if (meeting) {
    std::vector<CudaRank> ranks;
    for (auto& arr : meeting->arrivals) ranks.push_back(*static_cast<CudaRank*>(arr.backend));
    CudaStatus st = EnqueueOnCuda(*meeting->plan, *dt, ranks, call_site, e->group);
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
                           .Arg<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>()
                           .Attr<ffi::Span<const int64_t>>("schedule")
                           .Attr<ffi::Span<const int64_t>>("device_table")
                           .Attr<int64_t>("call_site")
                           .Attr<int64_t>("timeout_ms"));

void* CudaHandlerAddress() { return reinterpret_cast<void*>(BlinkCuda); }

}  // namespace jax_blink
