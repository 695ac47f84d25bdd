// CPU executor for jax_blink schedules: walks the execution plan over each rank's buffers.
#pragma once

#include <memory>

#include "blink_core.h"

namespace jax_blink {

// Runs the meeting's plan over the arrivals' buffers on the calling thread plus a small worker pool
// (JAX_BLINK_CPU_THREADS threads in all, caller included; default one per core), then calls
// meeting->Finish(""). Never blocks waiting for other threads: the thread that completes the last tile
// finishes the meeting. caller_rank: the rank whose handler thread calls this (its completion may run
// inline; every other rank's runs on a thread of its own, see Meeting::Finish), or -1.
// Large outputs get a transparent-huge-page hint (JAX_BLINK_CPU_HUGEPAGES=0: off).
void ExecuteOnCpu(std::shared_ptr<Meeting> meeting, int64_t caller_rank);

// out[i] = first[i] + srcs[0][i] + ... + srcs[k-1][i] for n elements of `dtype`, added left to right
// with the executors' arithmetic (integers wrap, fp16/bf16 add in fp32 and round after every add,
// complex adds its parts). `out` may alias `first`, not the sources. Used by the GPU emulator.
void SumInto(Dtype dtype, void* out, const void* first, const void* const* srcs, int k, int64_t n);

// The executor's integer setting `name` from the environment: ASCII blanks, an optional sign, decimal
// digits, ASCII blanks (the grammar jax_blink/lowering/ffi.py checks at lowering); unset, blank,
// malformed or outside [lo, hi]: `fallback`.
int EnvInt(const char* name, int lo, int hi, int fallback);

}  // namespace jax_blink
