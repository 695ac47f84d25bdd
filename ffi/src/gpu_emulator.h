// CPU emulator of a GpuProgram (gpu_program.h) with CUDA stream and event semantics, for CI.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpu_program.h"

namespace jax_blink {

// Runs `p` on host memory: every stream runs its ops in issue order, streams run concurrently with
// random durations drawn from `seed` (an op reads its sources when it starts and writes its
// destination when it ends, so an unordered overlap shows up as wrong bits), a wait blocks its stream
// until the most recent record of its event issued before it has completed (no record: no wait).
// XLA's stream per rank: kXlaBefore writes the rank's input (and garbage over its output buffer, as
// earlier XLA work may have; not over an aliased leaf, whose output buffer is its input); kXlaAfter
// captures the rank's output when it starts, then scribbles garbage over both buffers (XLA reuses
// them). Buffers start as garbage too. Every buffer (each leaf of each rank's input and output, each
// scratch) is a separate allocation, so a range outside its buffer is an error, not a neighbour.
//   inputs[r]: nelems elements of dtype for rank r (the leaves' concatenation, p.leaf_elems);
//   *outputs: the captured outputs (bytes, the leaves concatenated).
// Returns "" or an error (deadlock: some stream can never proceed; bad sizes).
std::string EmulateGpuProgram(const GpuProgram& p, Dtype dtype, int64_t nelems,
                              const std::vector<const void*>& inputs, uint64_t seed,
                              std::vector<std::vector<uint8_t>>* outputs);

}  // namespace jax_blink
