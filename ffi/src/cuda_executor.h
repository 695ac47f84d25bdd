// CUDA executor for jax_blink schedules (see cuda_executor.cu). Host API, no CUDA headers needed.
#pragma once

#include <string>
#include <vector>

#include "blink_core.h"

namespace jax_blink {

struct CudaRank {
  int device = 0;          // CUDA device ordinal holding this rank's buffers
  void* stream = nullptr;  // the rank's cudaStream_t (XLA's stream for the call)
  const void* in = nullptr;
  void* out = nullptr;
};

// Enqueues `plan` over the ranks' buffers: work starts once every rank's stream reached this point,
// runs on one stream per (device, tree), and every rank's stream waits until all work (including
// peers' reads of its buffers) finished. Host calls only; returns "" or an error message.
std::string EnqueueOnCuda(const ExecPlan& plan, Dtype dtype, const std::vector<CudaRank>& ranks);

// out[i] = a[i] + b[i] for n elements on `stream` (the reduction kernel; fp16/bf16 add in fp32).
std::string LaunchAdd(Dtype dtype, const void* a, const void* b, void* out, int64_t n, void* stream);

// Address of the XLA FFI handler (platform "CUDA").
void* CudaHandlerAddress();

}  // namespace jax_blink
