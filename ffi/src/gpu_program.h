// GPU program: the whole ordering logic of the CUDA executor, in plain C++ (no CUDA headers), so CI
// can build, emulate and race-check it without a GPU (gpu_emulator.cc, tests/test_gpu_program.py).
//
// An ExecPlan (blink_core.h) becomes a list of operations in host issue order, each on one stream:
// memory operations (peer or local copy, k-source fused reduce, zero), event records and event waits,
// plus two pseudo operations per rank on that rank's XLA stream (kXlaBefore: XLA wrote the rank's
// input and may have written its output buffer before the call; kXlaAfter: XLA reads the output and
// may reuse both buffers once the call's stream work is done). The CUDA layer (cuda_executor.cu)
// issues the ops one by one and skips the pseudo operations; it decides nothing.
//
// CUDA semantics assumed (and emulated): ops of one stream run in issue order; streams run
// concurrently; a wait makes its stream wait for the most recent record of that event issued before
// the wait (a wait on an event never recorded is a no-op).
//
// Construction (BuildGpuProgram):
//  * Streams. Each rank has its XLA stream, and per segment (tree) two work streams: "R" runs the
//    rank's reduce steps, "B" its broadcast copies (and copy-in / zero). Separate streams let an
//    interior node reduce chunk c+1 while it still receives chunk c (pipelining). Ops run on the
//    stream of the rank they WRITE (pull model: a reduce or copy reads the peer's buffer).
//    With max_streams_per_device > 0, the work streams of one device share that many physical
//    streams (round robin); merging streams only adds order, so results stay correct.
//  * Dependencies are derived from byte ranges: each op's reads and writes are tracked per (buffer,
//    chunk) (the chunks of a schedule are disjoint; the pseudo ops touch every chunk), giving
//    read-after-write, write-after-write and write-after-read edges to earlier ops on other streams.
//  * Waits: an edge needs a wait unless the stream already knows the dependency is done (vector
//    clocks over the waits issued so far) or another edge of the same op implies it; only ops that
//    some wait needs get an event record, issued right after the op.
//  * Staging: a reduce source the reader cannot load (peer_ok false) is first copied by the copy
//    engine (cudaMemcpyPeerAsync works without peer access) into the reader's scratch, slot j for the
//    j-th staged source, on the same stream.
//  * Leaves: a call's operands (a bucket's leaves) are one virtual concatenation the schedule runs
//    over; each leaf is a separate buffer per rank (input and output). A chunk that spans leaves
//    becomes one memory op per piece, issued back to back on the op's stream (waits before the first
//    piece, the record after the last). A leaf whose result XLA aliased to its operand (in == out)
//    has one buffer: its input ranges are its output's, so the dependencies and the race checker see
//    the reuse, and its copy-in (out = in) is dropped.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "blink_core.h"

namespace jax_blink {

enum class BufKind : int8_t { kIn = 0, kOut = 1, kScratch = 2 };

// A buffer: leaf `leaf` of a rank's input or output (owner = rank), or a scratch buffer (owner =
// scratch index, leaf 0). Every buffer is a separate allocation.
struct BufRef {
  BufKind kind = BufKind::kOut;
  int32_t owner = 0;
  int32_t leaf = 0;
  bool operator==(const BufRef& o) const { return kind == o.kind && owner == o.owner && leaf == o.leaf; }
};

struct ByteRange {
  BufRef buf;
  int64_t offset = 0, bytes = 0;  // bytes from the start of the buffer
};

enum class GpuOpKind : int8_t {
  kCopy = 0,       // dst = src[0] (bytes); cudaMemcpyAsync / cudaMemcpyPeerAsync
  kReduce = 1,     // dst = src[0] + src[1] + ... (elems), added left to right; the fused kernel
  kZero = 2,       // dst = 0 (bytes); cudaMemsetAsync
  kRecord = 3,     // cudaEventRecord(event, stream)
  kWait = 4,       // cudaStreamWaitEvent(stream, event)
  kXlaBefore = 5,  // pseudo: XLA's writes before the call (not issued)
  kXlaAfter = 6,   // pseudo: XLA's reads and buffer reuse after the call (not issued)
};
const char* GpuOpKindName(GpuOpKind k);

struct GpuOp {
  GpuOpKind kind = GpuOpKind::kCopy;
  int32_t stream = 0;
  int32_t event = -1;               // kRecord / kWait
  int32_t rank = -1;                // kXlaBefore / kXlaAfter: the rank
  int64_t chunk = -1;               // memory ops: the plan chunk (index into ExecPlan::chunks)
  int64_t elems = 0;                // kReduce: elements; kCopy / kZero: bytes / elem size
  ByteRange dst;                    // kCopy / kReduce / kZero
  std::vector<ByteRange> src;       // kCopy: one; kReduce: first operand, then sources in order
  std::vector<ByteRange> reads, writes;  // every byte range the op reads / writes (race checker)
  bool continued = false;           // a later piece of the previous op (its chunk spans leaves)
  bool IsMemory() const { return kind != GpuOpKind::kRecord && kind != GpuOpKind::kWait; }
};

struct GpuStream {
  int32_t device = 0;  // device (CUDA ordinal as given in rank_device)
  int32_t rank = -1;   // XLA stream: its rank; work stream: the first rank that uses it
  bool xla = false;    // the rank's XLA stream (given by XLA, not created)
  int32_t slot = 0;    // work stream: its index among the device's work streams
  std::string role;    // "xla", "R s<seg>", "B s<seg>" (or "dev<d>/<slot>" when merged)
};

struct ScratchBuf {
  int32_t rank = 0;    // whose device holds it
  int64_t bytes = 0;
};

struct GpuProgram {
  int32_t nranks = 0;
  int64_t elem_size = 0;             // bytes per element (complex: the whole complex number)
  int64_t lanes = 1;                 // scalars per element (complex: 2)
  std::vector<GpuStream> streams;
  std::vector<ScratchBuf> scratch;
  int32_t nevents = 0;
  std::vector<int64_t> leaf_elems;   // elements per leaf (the schedule's nelems in all)
  std::vector<uint8_t> leaf_aliased; // per leaf: output buffer = input buffer (no kIn refs to it)
  std::vector<GpuOp> ops;            // host issue order
  // Pipelining figures (unit cost per memory op, pseudo ops free): see CriticalPath().
  int64_t max_segment_chunks = 0;    // most chunks of one segment
  int64_t chunk_depth = 0;           // longest dependency chain of one chunk's memory ops
};

struct GpuProgramOptions {
  std::vector<int32_t> rank_device;  // device of each rank (ranks may share a device)
  // peer_ok[reader * nranks + owner]: the reader's kernels may load the owner's buffers. Empty: all
  // true. Entries with reader == owner are ignored (a rank's own buffers are always loadable).
  std::vector<uint8_t> peer_ok;
  int max_streams_per_device = 0;    // 0: no cap
  // Elements per leaf, each > 0, summing to the schedule's nelems. Empty: one leaf of nelems.
  std::vector<int64_t> leaf_elems;
  // Per leaf: XLA aliased the result to the operand (one buffer). Empty: no leaf aliased.
  std::vector<uint8_t> leaf_aliased;
};

// Builds the program for `plan` with elements of `elem_size` bytes (`lanes` scalars each).
// Returns "" or an error (bad options: rank_device / peer_ok / leaf sizes).
std::string BuildGpuProgram(const ExecPlan& plan, int64_t elem_size, int64_t lanes, const GpuProgramOptions& opt,
                            GpuProgram* out);

// Happens-before race check over byte ranges, from the program alone (issue order + stream order +
// record/wait pairs, CUDA semantics). Reports every pair of memory ops (pseudo ops included) on
// different streams whose ranges overlap, at least one writing, with neither ordered before the
// other (an aliased leaf's input and output are one buffer, p.leaf_aliased). Returns the number of
// races; `first` (if not null) gets a description of the first few.
int64_t CheckRaces(const GpuProgram& p, std::string* first);

// Longest path in steps when every memory op costs one step (the pieces of an op whose chunk spans
// leaves one step together) and records, waits and pseudo ops cost nothing (an as-soon-as-possible execution with unlimited hardware). With perfect pipelining it is
// max_segment_chunks + chunk_depth - 1. Returns -1 if the program deadlocks (cannot happen with
// CUDA events, whose waits only see earlier records; kept as a check).
int64_t CriticalPath(const GpuProgram& p);

// Counts: {memory ops (pieces counted one by one), records, waits, streams}.
struct GpuProgramStats {
  int64_t memory_ops = 0, records = 0, waits = 0, streams = 0;
};
GpuProgramStats Stats(const GpuProgram& p);

// A readable listing (one op per line), for debugging and the gpu_check harness.
std::string Describe(const GpuProgram& p);

}  // namespace jax_blink
