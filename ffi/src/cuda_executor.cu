// CUDA executor: one launch of the device interpreter per rank (the XLA FFI handler that calls it:
// cuda_handler.cc).
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
#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda/atomic>

#include <algorithm>
#include <cstring>
#include <cstdlib>
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

#ifndef JAX_BLINK_CUDA_ARCHS
#define JAX_BLINK_CUDA_ARCHS "unknown"
#endif

namespace jax_blink {
namespace {

// Default bound of the device-side waits: below PjRt's 10 s abort window even with the half timeout
// of grace an arrived peer gets (device_interp.h), so a missing rank fails the call, not the process.
constexpr int64_t kDefaultGpuTimeoutMs = 5000;

std::string CudaErr(const char* what, cudaError_t e) {
  return std::string("jax_blink CUDA error at ") + what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
         ")";
}
#define BLINK_CUDA(expr)                                 \
  do {                                                   \
    cudaError_t _e = (expr);                             \
    if (_e != cudaSuccess) return CudaErr(#expr, _e);    \
  } while (0)

}  // namespace

int64_t CudaTimeoutMs(int64_t attr_ms) {
  const char* v = std::getenv("JAX_BLINK_TIMEOUT_S");
  if (v && *v) return EffectiveTimeoutMs(0);
  return attr_ms > 0 ? std::min(attr_ms, kDefaultGpuTimeoutMs) : kDefaultGpuTimeoutMs;
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

CudaStats g_stats;


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
  const int64_t timeout_ms = CudaTimeoutMs(0);
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

CudaStats GetCudaStats() {
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

}  // namespace jax_blink
