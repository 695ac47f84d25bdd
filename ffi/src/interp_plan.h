// Builds the device interpreter's program (device_interp.h) from an ExecPlan, once per call site:
// tasks per (rank, block), their dependency flags, arrival waits, exit waits and staging slots.
// Plain C++ (host only); the CUDA executor copies the arrays to each device, the host runner
// (interp_host.cc) uses them in place.
//
// Construction:
//  * Tasks, in a global order that is a topological order of the data flow: per chunk, the plan's
//    fused steps (FuseOps) in order, a copy step split into one pull copy per destination, then the
//    chunk's copy-ins and zeroing. A reduce source whose owner the reader cannot load (peer_ok false:
//    no P2P, decided once per device pair) becomes a stage task on the owner (owner's value -> a
//    staging slot of its own, host-pinned on the GPU) that the reduce then reads.
//  * Dependencies from (buffer, chunk) regions: read-after-write, write-after-read, write-after-
//    write, as in any dependence analysis; a rank's input and output chunk count as one region (an
//    aliased leaf's are one buffer; the extra edges cost nothing: the plans read an input before
//    the output is written). Edges to an earlier task of the same block are dropped (block order).
//  * Blocks: each task goes to a queue per (rank, segment, phase) (phase: reduce, broadcast/copy,
//    stage), as the streams of the old op-by-op program did, so a rank reduces chunk c+1 of a tree
//    while it forwards chunk c of it and every tree (hence every link of the packing) is busy at once.
//    Within a block, tasks run by (data-flow level, global order): a topological order, so no block
//    ever waits for a task queued behind itself (no deadlock while all blocks of all ranks are
//    resident). With max_blocks > 0 (fewer blocks than queues fit), a list schedule in unit steps
//    assigns each rank's tasks to its blocks, longest remaining path first.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "blink_core.h"
#include "device_interp.h"

namespace jax_blink {

struct InterpOptions {
  // peer_ok[reader * nranks + owner]: the reader may load the owner's buffers. Empty: all true.
  std::vector<uint8_t> peer_ok;
  int max_blocks = 0;                 // blocks per rank; 0: one per queue (no cap)
  std::vector<int64_t> leaf_elems;    // elements per leaf (empty: one leaf of nelems)
};

struct InterpPlan {
  int32_t nranks = 0, nleaves = 0, max_blocks = 0;
  Scalar scalar = Scalar::kF32;
  int64_t lanes = 1, elem_size = 0;
  std::vector<interp::Task> tasks;      // grouped by (rank, block), each block in run order
  std::vector<int32_t> block_begin;     // [nranks * max_blocks + 1]
  std::vector<interp::Src> srcs;
  std::vector<interp::FlagRef> deps;
  std::vector<int32_t> arrives;
  std::vector<int64_t> leaf_start;
  std::vector<interp::FlagRef> tail;   // per rank: the other ranks' arrivals, then the peer tasks
  std::vector<int32_t> tail_begin;     // that read its buffers (its exit waits)
  std::vector<int32_t> flags_per_rank;  // entries of each rank's flag array (arrival included)
  int64_t staging_elems = 0;            // size of the staging area
  std::vector<int32_t> blocks_used;     // per rank: blocks with at least one task
  // Pipelining (unit cost per task): see CriticalPath.
  int64_t max_segment_chunks = 0;       // most chunks of one segment
  int64_t chunk_depth = 0;              // longest dependency chain of one chunk's tasks
  // max over segments of (its chunks + its chunks' longest chain - 1): the critical path of perfect
  // pipelining (each chunk starts one step after the previous one of its tree)
  int64_t pipeline_ideal = 0;
  interp::View view() const;            // pointers into this plan's vectors
};

// Returns "" or an error (bad options).
std::string BuildInterpPlan(const ExecPlan& plan, Dtype dtype, const InterpOptions& opt, InterpPlan* out);

// Steps of the longest path when every task costs one step and waits are free, blocks running their
// tasks in order and all blocks at once: the kernel's critical path. The pipelining ideal is
// max_segment_chunks + chunk_depth - 1.
int64_t CriticalPath(const InterpPlan& p);

// The error message for the records of a call of `epoch` that failed (empty when none names this
// epoch): "jax_blink: collective timed out: rank M never arrived ..." naming the missing ranks and
// those that gave up. Shared by the host runner and the CUDA executor.
std::string InterpErrorMessage(const std::vector<interp::ErrorRecord>& records, uint64_t epoch, int64_t timeout_ms);

// Non-blocking error reporting (the CUDA executor's default): the kernels write their ranks' error
// records into host-visible memory (pinned, mapped) while they run; the host reads them without
// waiting for the kernels, at the entry of every later call (and wherever else it polls), and turns
// the first failed call it finds into that call's message. Reading a record: an acquire load of its
// epoch (the kernel stores the epoch last, with release), then its fields, then the epoch again (a
// later call's record may be written meanwhile: read again). Each failed call is reported once: a
// report covers every call launched so far (the executor rebuilds the program after a failure).
// Not thread-safe (the executor holds its lock); the records may be written concurrently.
class ErrorWatch {
 public:
  // The program's records (one per rank); forgets earlier calls.
  void Reset(const interp::ErrorRecord* records, int32_t nranks);
  // Call `epoch` (1, 2, ...: the program's call count) was launched, its waits bounded by timeout_ms.
  void Launched(uint64_t epoch, int64_t timeout_ms);
  // "" or the message (InterpErrorMessage) of the earliest unreported call whose records some rank
  // wrote; never waits.
  std::string Poll();
  uint64_t launched() const { return launched_; }
  uint64_t reported() const { return reported_; }

 private:
  const interp::ErrorRecord* records_ = nullptr;
  int32_t nranks_ = 0;
  uint64_t reported_ = 0, launched_ = 0;
  int64_t timeout_ms_ = 0;
};

}  // namespace jax_blink
