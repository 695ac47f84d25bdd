// CUDA executor for jax_blink schedules (see cuda_executor.cu; its XLA FFI handler: cuda_handler.cc).
// Host API, no CUDA headers needed.
//
// One kernel launch per device per call runs the device interpreter (device_interp.h) over the program
// of interp_plan.h (plain C++, run on the host under ThreadSanitizer in CI); the CUDA layer sets up peer
// access once per device pair, the program, flags, error records and staging once per call site, and
// the buffer pointer table once per buffer set.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "blink_core.h"

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

// Runs `plan` over the ranks' buffers: a bucket of leaves of `leaf_elems` elements each (empty: one
// leaf of the schedule's nelems), the schedule running over their concatenation; every rank brings
// one pointer per leaf, and a leaf is aliased (result = operand) on every rank or on none (else kind
// 1). Set-up (cached under (cache_key, group) with the dtype, leaf sizes, devices and peer map, for at
// most JAX_BLINK_CUDA_CACHE_PROGRAMS call sites, default 64, least recently used evicted and freed
// once its last launches completed: program_cache.h): peer access once per device pair (pairs
// without it stage through host-pinned memory), the interpreter program copied to every rank's
// device, flags zeroed once (epochs: never reset), error records and staging host-pinned. Per call:
// the pointer table of the buffers (found by pointers, uploaded on each rank's stream only when they
// changed), then per rank one kernel launch on its XLA stream and one completion event record.
// Errors: the kernels' waits are bounded (JAX_BLINK_TIMEOUT_S, default 5 s) and a rank that gives up
// writes its error record (pinned host memory) while the kernel runs. By default the call returns
// right after its launches and never waits for the kernels: every call first polls the records of
// the calls before it (ErrorWatch, interp_plan.h), and a failed one becomes this call's error,
// naming the rank that never arrived. JAX_BLINK_CUDA_SYNC_ERRORS=1: the call waits for its kernels
// and reports its own failure. After any failure the program is rebuilt (fresh flags). JAX_BLINK_CUDA_FORCE_STAGING=1 stages every
// cross-rank source. Thread-safe (one global lock).
CudaStatus EnqueueOnCuda(const ExecPlan& plan, Dtype dtype, const std::vector<CudaRank>& ranks, int64_t cache_key,
                         int64_t group, const std::vector<int64_t>& leaf_elems = {});

// Non-blocking: the message of the first failed call not reported yet (its kernels wrote their error
// records), or "". What every call polls at its entry; for a caller that has no next call to make
// (the self-test after its last call, a user at the end of a job: jax_blink.lowering.ffi.cuda_errors).
std::string PollCudaErrors();

// Counters since the process started (the gpu_check harness checks and prints them).
struct CudaStats {
  int64_t launches = 0;          // interpreter kernel launches (one per rank and call)
  int64_t table_uploads = 0;     // pointer-table uploads (a rank's buffers changed)
  int64_t evicted_sites = 0;     // call sites evicted from the program cache
  int64_t released_programs = 0; // evicted programs freed (after their work completed)
};
CudaStats GetCudaStats();

// The bound of a call's device-side waits, ms: JAX_BLINK_TIMEOUT_S when set, else the lowering's
// attribute `attr_ms` (> 0) capped at the GPU default of 5 s (a longer wait would only end in PjRt's
// 10 s abort), else that default.
int64_t CudaTimeoutMs(int64_t attr_ms);

// The CUDA device (ordinal in this process) that owns device memory at `ptr`, or -1.
int DeviceOfPointer(const void* ptr);

// "" when this build can run on every visible GPU with the installed driver, else why not (driver
// older than the CUDA runtime this module was built with; a GPU whose architecture has neither a
// cubin nor a usable PTX in this binary). No GPU visible: "no CUDA device visible (...)".
std::string CheckCudaCompatibility();
// Build facts: CUDA runtime version (e.g. 13000) and the architectures compiled in (CMake syntax).
int BuiltCudaVersion();
const char* BuiltCudaArchitectures();

// Address of the XLA FFI handler (platform "CUDA"; cuda_handler.cc).
void* CudaHandlerAddress();

}  // namespace jax_blink
