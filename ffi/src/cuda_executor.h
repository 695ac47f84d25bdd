// CUDA executor for jax_blink schedules (see cuda_executor.cu). Host API, no CUDA headers needed.
//
// All ordering logic lives in gpu_program.{h,cc} (plain C++, emulated and race-checked in CI); the CUDA
// layer sets up streams, events, scratch and peer access, then issues the program's ops in order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "blink_core.h"
#include "gpu_program.h"

namespace jax_blink {

struct CudaRank {
  int device = 0;          // CUDA device ordinal (in this process) holding this rank's buffers
  void* stream = nullptr;  // the rank's cudaStream_t (XLA's stream for the call)
  std::vector<const void*> in;  // per leaf: the operand (separate allocations)
  std::vector<void*> out;       // per leaf: the result (== in[leaf] when XLA aliased them)
};

// Error from the CUDA layer. kind: 0 none, 1 invalid argument (bad plan / sizes), 2 internal (a CUDA
// call failed: no kernel image, out of memory, launch error, ...).
struct CudaStatus {
  int kind = 0;
  std::string message;
  bool ok() const { return kind == 0; }
};

// Enqueues `plan` over the ranks' buffers: a bucket of leaves of `leaf_elems` elements each (empty:
// one leaf of the schedule's nelems), the schedule running over their concatenation; every rank
// brings one pointer per leaf, and a leaf is aliased (result = operand) on every rank or on none
// (else kind 1). First all fallible set-up (peer access per buffer, program build or cache lookup by
// `cache_key`, streams, events, scratch, kernel image check) with nothing enqueued; then the
// program's ops. (cache_key, group) must identify `plan` for the life of the process (the handler
// passes the call site id and the group): the program and its scratch are cached under it, with the
// dtype, the leaf layout (sizes, aliasing), the ranks' devices and the peer-access map, for at most
// JAX_BLINK_CUDA_CACHE_PROGRAMS call sites (default 64; least recently used evicted, freed once the
// work of its last call completed: program_cache.h). If issuing fails midway, every rank's XLA stream
// is still made to wait for all work already enqueued (so XLA never reuses a buffer a peer still reads). Env:
// JAX_BLINK_CUDA_FORCE_STAGING=1 stages every cross-rank reduce source through the copy engine (as
// when peer access is missing); CUDA_DEVICE_MAX_CONNECTIONS (default 8) caps work streams per device.
// Thread-safe (one global lock: pooled events are re-recorded only after all waits on them were issued).
//
// Issue: when every rank is on one device, the program is captured once into a CUDA graph per
// (program, buffer pointers), instantiated, and launched each call (a handful of host calls instead of
// one per op, record and wait); a small LRU per program (JAX_BLINK_CUDA_GRAPH_CACHE, default 4) and
// cudaGraphExecUpdate when pointers change. Ranks on several devices, JAX_BLINK_CUDA_GRAPHS=0, a
// capture / instantiate / launch failure (the capture is ended and dropped: nothing enqueued), or
// pointers that change on most calls: op by op (the same ops, one CUDA call each).
CudaStatus EnqueueOnCuda(const ExecPlan& plan, Dtype dtype, const std::vector<CudaRank>& ranks, int64_t cache_key,
                         int64_t group, const std::vector<int64_t>& leaf_elems = {});

// Counters of the issue paths since the process started (the gpu_check harness prints them).
struct CudaGraphStats {
  int64_t launches = 0;          // calls issued as one graph launch
  int64_t op_by_op = 0;          // calls issued op by op
  int64_t captures = 0, capture_failures = 0, instantiates = 0, updates = 0;
  std::string last_fallback;     // why the latest call that did not launch a graph went op by op
  int64_t evicted_sites = 0;     // call sites evicted from the program cache
  int64_t released_programs = 0; // evicted programs freed (after their work completed)
};
CudaGraphStats GetCudaGraphStats();

// Fused k-source reduce: out[i] = first[i] + srcs[0][i] + ... + srcs[k-1][i] (left to right, the
// executors' arithmetic) for n elements on `stream`; 16-byte vector loads on the aligned middle
// (head and tail peeled) when all pointers share their alignment mod 16. Returns "" or the error.
std::string LaunchReduce(Dtype dtype, void* out, const void* first, const void* const* srcs, int k, int64_t n,
                         void* stream);

// The CUDA device (ordinal in this process) that owns device memory at `ptr`, or -1.
int DeviceOfPointer(const void* ptr);

// "" when this build can run on every visible GPU with the installed driver, else why not (driver
// older than the CUDA runtime this module was built with; a GPU whose architecture has neither a
// cubin nor a usable PTX in this binary). No GPU visible: "no CUDA device visible (...)".
std::string CheckCudaCompatibility();
// Build facts: CUDA runtime version (e.g. 13000) and the architectures compiled in (CMake syntax).
int BuiltCudaVersion();
const char* BuiltCudaArchitectures();

// Address of the XLA FFI handler (platform "CUDA").
void* CudaHandlerAddress();

}  // namespace jax_blink
