// The device interpreter (device_interp.h) on the host: one std::thread per (rank, block) over host
// memory, flags with acquire/release atomics (the C++ memory model, which libcu++'s system-scope
// atomics follow on the GPU). What CI runs (jax_blink._native._gpusim.interp_check, and
// ffi/tests/interp_stress.cc under ThreadSanitizer).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "device_interp.h"
#include "interp_plan.h"

namespace jax_blink {

struct HostRunOptions {
  uint64_t seed = 0;          // random delays before and after every task (0: none)
  int32_t absent_rank = -1;   // this rank's blocks never start (the never-arriving rank)
  int32_t late_rank = -1;     // this rank's blocks start late_ms late
  int64_t late_ms = 0;
  int64_t timeout_ms = 2000;  // every wait's bound
  int64_t calls = 1;          // successive calls on the same flags (epochs 1..calls), fresh data each
  // The CUDA executor's non-blocking error path: a host thread polls the records (ErrorWatch) while
  // the blocks run, as the executor's next call does while a failed call's kernels still run.
  bool watch = false;
};

struct HostRunResult {
  std::vector<std::vector<uint8_t>> outputs;     // per rank, the leaves concatenated (last call)
  std::vector<interp::ErrorRecord> records;      // per rank (epoch == the failed call's, else stale)
  std::string error;                             // "" or the host's error message (names the rank)
  int64_t threads = 0;                           // threads per call (rank blocks)
  std::string watch_error;   // watch: the ErrorWatch's message ("" when it found none)
  bool watch_early = false;  // watch: found while some block thread still ran (not after the join)
  int64_t wide_scalars = 0;  // scalars the data loops moved in 16-byte words (all calls and blocks)
};

// Runs `p` on inputs[r] (nelems elements of the plan's dtype per rank, the leaves concatenated);
// aliased[l]: leaf l's result is its operand's buffer (empty: none). Every buffer (a leaf of a rank's
// input / output, the staging area, the flag arrays) is its own allocation; outputs start as garbage.
// Returns "" or a set-up error; the collective's own failure is in result->error.
std::string RunInterpOnHost(const InterpPlan& p, const std::vector<const void*>& inputs, int64_t nelems,
                            const std::vector<uint8_t>& aliased, const HostRunOptions& opt, HostRunResult* result);

}  // namespace jax_blink
