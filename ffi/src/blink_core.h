// jax_blink native core: schedule decoding, execution plans, device tables and the rendezvous
// (meeting point) shared by the CPU and CUDA backends. No XLA or CUDA headers here.
//
// Format: docs/architecture.md "Schedule" (Schedule.to_array()). Method: Blink (Wang et al.,
// MLSys 2020, Sec. 4): reduce up / broadcast down spanning trees, chunks pipelined.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtype.h"

namespace jax_blink {

constexpr int64_t kScheduleMagic = 0x424C4E4B;  // "BLNK"
constexpr int64_t kScheduleVersion = 2;  // version 1 (no seg_phases, collectives 0-2) is still read

// Wire ids of jax_blink/collectives.py (stable, never reused).
enum class Collective : int64_t { kAllReduce = 0, kBroadcast = 1, kReduce = 2, kAllGather = 3, kReduceScatter = 4 };

// A collective's row (jax_blink/collectives.py): what the executors need instead of comparing ids.
struct CollectiveRow {
  const char* name;
  bool reduces, broadcasts;  // phases its trees run
  bool sharded;              // buffer = nranks equal shards, segments inside their root's shard
  bool zero_non_root;        // non-root ranks end with zeros (reduce)
};
// The row of wire id `id`, or nullptr for an unknown id.
const CollectiveRow* CollectiveRowOf(int64_t id);

// Element types: dtype.h (Dtype, and ScalarOf: how each one adds).
size_t DtypeSize(Dtype t);
const char* DtypeName(Dtype t);
// The Dtype whose DtypeName (numpy's name) is `name`, or nullopt.
std::optional<Dtype> DtypeFromName(const std::string& name);

struct Transfer {
  int64_t round, op, src, dst, chunk;  // op 0 = REDUCE (dst += src), 1 = COPY (dst = src)
};

// A decoded, validated schedule (see docs/architecture.md).
struct Schedule {
  Collective collective = Collective::kAllReduce;
  int64_t nranks = 0, nelems = 0;
  std::vector<int64_t> seg_root, seg_offset, seg_length;
  std::vector<int64_t> seg_phases;                   // [S]: bit 0 reduce phase, bit 1 broadcast phase
  std::vector<int64_t> reduce_parent, bcast_parent;  // [S * nranks]
  std::vector<int64_t> chunk_seg, chunk_offset, chunk_length;
  std::vector<Transfer> transfers;
};

// Decodes one schedule starting at data[0]; sets *consumed to the number of int64 words used.
// Returns "" or an error message (bad magic, version, sizes, out-of-range ranks/chunks, overlapping
// chunks). Never reads past data[n - 1].
std::string DecodeSchedule(const int64_t* data, size_t n, Schedule* out, size_t* consumed);
// Decodes schedules stored back to back (one per group) until the array ends.
std::string DecodeSchedules(const int64_t* data, size_t n, std::vector<Schedule>* out);

// One executable step of a chunk. Buffers: each rank has an input (read-only) and an output. A rank's
// output slice holds its current value once "materialised"; before that its current value is its input.
struct Op {
  int32_t kind;          // 0 reduce (dst = dst_cur + src_cur), 1 copy (dst = src_cur)
  int32_t src, dst;
  bool src_from_input;   // src not yet materialised: read src's input
  bool dst_from_input;   // reduce into a not yet materialised dst: first operand is dst's input
};

// Ops fused into one pass: a reduce step computes out[writes[0]] = reads[0] + reads[1] + ... (adds
// left to right: the schedule's summation order); a copy step sets out[w] = reads[0] for every w.
struct Operand {
  int32_t rank;
  bool input;  // read the rank's input (not yet materialised) rather than its output
};
struct Step {
  int32_t kind;                 // 0 reduce, 1 copy (as Op::kind)
  std::vector<Operand> reads;   // reduce: first operand, then the sources in row order; copy: source
  std::vector<int32_t> writes;  // reduce: the destination; copy: every destination
};

struct ChunkPlan {
  int64_t offset = 0, length = 0;   // elements
  int64_t segment = -1;
  std::vector<Op> ops;              // in transfer-row order (deterministic summation order)
  std::vector<Step> steps;          // ops fused (FuseOps); same results bit for bit
  std::vector<int32_t> copy_in;     // ranks whose output = input at the end (never materialised)
  std::vector<int32_t> zero;        // ranks whose output is zeroed at the end (reduce, non-root)
};

// Execution plan: the schedule's rows grouped per chunk (rows on different chunks touch disjoint
// elements, so any interleaving across chunks gives the same bits as row order).
struct ExecPlan {
  Schedule schedule;
  std::vector<ChunkPlan> chunks;    // covers [0, nelems) in offset order
  int64_t max_chunk = 0;
  // Every transfer writes into its segment's root (stars into the owners): a rank's output is
  // written only inside the segments it roots.
  bool owner_writes_only = true;
};
std::string BuildExecPlan(const Schedule& s, ExecPlan* out);

// Fuses a chunk's ops into steps, the one fusion pass every executor runs (the CPU executor's tiles,
// the device interpreter's tasks). First each op joins the latest earlier step of its kind with the
// same destination (reduce) or the same source (copy) when no step in between touches what it reads
// or writes, else it starts a new step; then a reduce step joins a later reduce into the same
// destination that continues from it, when nothing in between touches that destination or writes what
// it reads. Moving an op only past independent steps keeps every value and the order of the adds into
// each destination, so the results are those of the ops in row order, bit for bit.
std::vector<Step> FuseOps(const std::vector<Op>& ops);

// Device table: rows (device_id, group, rank).
struct DeviceTable {
  struct Entry { int64_t device, group, rank; };
  std::vector<Entry> entries;
  std::vector<std::vector<int64_t>> group_devices;  // group -> device id by rank
  // Returns "" or an error message.
  std::string Decode(const int64_t* data, size_t n);
  const Entry* Find(int64_t device) const;
};

// Cached decode of (schedule attribute, device table) per call site: decoding validates everything
// once; later calls compare the raw words (memcmp) and reuse the plan.
struct CallSiteInfo {
  std::vector<int64_t> raw_schedule, raw_table;
  std::vector<std::shared_ptr<const ExecPlan>> plans;  // per group
  DeviceTable table;
};
std::string GetCallSiteInfo(int64_t call_site, const int64_t* sched, size_t nsched, const int64_t* table,
                            size_t ntable, std::shared_ptr<const CallSiteInfo>* out);

// ---------------------------------------------------------------------------------------------
// Rendezvous. Each participant (one device's call) arrives with its buffers; the arrival that
// completes the meeting gets the Meeting back and drives execution. Nobody blocks: a watchdog thread
// fails meetings whose deadline passed, naming the devices (ids and ranks) that never arrived.

// One operand of a call: a leaf of the bucket. The leaves of a call are one virtual concatenation
// (the schedule runs over their total element count); `out` may equal `in` (XLA aliased the result to
// the operand), so the executors read a rank's input only before they first write its output.
struct Leaf {
  const void* in = nullptr;
  void* out = nullptr;
  int64_t nelems = 0;
  // Reduce-scatter from a one-leaf call whose result is the rank's shard alone: `out` points
  // rank * nelems / nranks elements before that result, so the shard sits at its place in the
  // virtual full buffer; the plan writes a rank's output only inside the shard it owns
  // (ExecPlan::owner_writes_only), so no other output address is used.
  bool out_shard = false;
  // False where `out` is an address formed for the schedule's bookkeeping, not memory of this rank
  // (a block of a reduce-scatter's shard result that the rank does not own, BlockOrderLeaves):
  // the executor never writes there, nor advises the kernel about it.
  bool out_memory = true;
};

struct Arrival {
  int64_t device = -1, rank = -1;
  Dtype dtype = Dtype::kF32;
  int64_t nelems = 0;         // total over the leaves
  std::vector<Leaf> leaves;   // every participant brings the same leaf sizes, in the same order
  std::string where;                              // the call site's label and source line ("" unknown)
  void* backend = nullptr;                        // backend data (CUDA: stream, events)
  std::function<void(const std::string&)> done;   // "" on success, else the error message
};

struct MeetingKey {
  int64_t run_id, call_site, group, generation;
  bool operator<(const MeetingKey& o) const;
};

struct Meeting {
  MeetingKey key;
  std::shared_ptr<const CallSiteInfo> info;
  std::shared_ptr<const ExecPlan> plan;
  std::vector<Arrival> arrivals;  // by rank
  // Completes every participant (success when err is empty). Each participant's `done` runs on a
  // thread of its own (Completions), except `inline_rank`'s, which runs on the calling thread last;
  // pass it only when the caller is that rank's own handler thread (its continuation cannot start
  // before the handler returns) or a thread with nothing left to do. Why: completing an XLA future
  // may run that device's program inline, and it may then wait in an XLA collective for the other
  // devices, which this thread would never release (docs/architecture.md, "Rendezvous").
  void Finish(const std::string& err, int64_t inline_rank = -1);
};

// Runs completions so that no participant's continuation can delay another's release: each task
// goes to an idle thread, and a new thread starts when none is idle (a cached thread pool; threads
// idle for 30 s exit). So whatever the core count, a continuation that blocks (in an XLA collective
// waiting for peers) holds only its own thread.
void PostCompletion(std::function<void()> task);
// Threads the completion pool holds now (started and not yet exited); for tests.
int64_t CompletionThreads();

// Per-device generation: how many calls this device made before at (run_id, call_site).
int64_t NextGeneration(int64_t run_id, int64_t call_site, int64_t device);

// Registers `a` at the meeting for key. Returns the complete meeting if `a` was the last to arrive
// (the caller executes it and calls Finish); nullptr otherwise (a.done is called later). On an
// immediate error (mismatched dtype/size, duplicate rank, meeting already failed) a.done is called with
// the error (and the other arrivals too) and nullptr is returned.
std::shared_ptr<Meeting> Arrive(const MeetingKey& key, std::shared_ptr<const CallSiteInfo> info,
                                Arrival a, int64_t timeout_ms);

// Fails the call of (run_id, call_site, generation) in every group: a device that cannot join (bad
// attribute, not in the device table, unsupported dtype) brings its error to the meeting, so its
// peers fail at once with that error instead of waiting for the timeout; later arrivals fail at once.
void FailCall(int64_t run_id, int64_t call_site, int64_t generation, const std::string& err);

// Timeout in ms: JAX_BLINK_TIMEOUT_S when set (seconds, may be fractional), else attr_ms when > 0,
// else 60 s.
int64_t EffectiveTimeoutMs(int64_t attr_ms);

// Error class of a message the core or a backend produced, for the FFI error code: timeouts
// ("jax_blink: collective timed out ...") -> 2 (kDeadlineExceeded), CUDA failures (messages containing
// "jax_blink CUDA error") -> 1 (kInternal), everything else (bad attributes, mismatched participants,
// a peer that could not join) -> 0 (kInvalidArgument).
int ErrorClassOf(const std::string& msg);

// Test hook (documented in docs): JAX_BLINK_TEST_ABSENT_DEVICE=<device id> makes that device's calls
// skip the meeting (its output is left unwritten), to test the timeout path.
bool IsTestAbsentDevice(int64_t device);

}  // namespace jax_blink
