// Python module jax_blink._native._gpusim: CI entries for the CUDA executor's plain C++ parts, no GPU
// needed: the GPU program of a schedule over a bucket of leaves, race-checked and emulated
// (tests/test_gpu_program.py, jax_blink.lowering.gpu_program_check), and the program cache's
// eviction (program_cache.h).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <stdexcept>
#include <tuple>

#include "blink_core.h"
#include "gpu_emulator.h"
#include "gpu_program.h"
#include "interp_host.h"
#include "interp_plan.h"
#include "nb_arrays.h"
#include "program_cache.h"

namespace nb = nanobind;

namespace jax_blink {
namespace {

// The first group's schedule of a schedule array, its plan, and the program over the given leaves.
GpuProgram Build(I64Array schedule, Dtype dt, std::vector<int32_t> rank_device, std::vector<uint8_t> peer_ok,
                 int max_streams, std::vector<int64_t> leaf_sizes, std::vector<uint8_t> aliased, ExecPlan* plan) {
  std::vector<Schedule> scheds;
  std::string err = DecodeSchedules(schedule.data(), schedule.shape(0), &scheds);
  if (err.empty()) err = BuildExecPlan(scheds[0], plan);
  if (!err.empty()) throw std::invalid_argument(err);
  GpuProgramOptions opt;
  opt.rank_device = std::move(rank_device);
  opt.peer_ok = std::move(peer_ok);
  opt.max_streams_per_device = max_streams;
  opt.leaf_elems = std::move(leaf_sizes);
  opt.leaf_aliased = std::move(aliased);
  const bool cplx = dt == Dtype::kC64 || dt == Dtype::kC128;
  GpuProgram prog;
  err = BuildGpuProgram(*plan, static_cast<int64_t>(DtypeSize(dt)), cplx ? 2 : 1, opt, &prog);
  if (!err.empty()) throw std::invalid_argument(err);
  return prog;
}

// Builds the GPU program of the first group's schedule over leaves of `leaf_sizes` elements (empty:
// one leaf; `aliased`: per leaf, result = operand buffer), race-checks it, computes its critical path,
// and runs the CPU emulator of CUDA streams/events for `seeds` random timings on `inputs` (one array
// per rank: the leaves concatenated), comparing every rank's captured output with `expected` bit for
// bit. mutate = ("wait" | "record", i) drops the i-th wait / record first (mutation tests); ("", 0)
// changes nothing. rank_device: device of each rank; peer_ok: nranks * nranks flags (empty: all peers
// loadable); max_streams: work streams per device (0: no cap). Bad options raise ValueError.
nb::dict GpuProgramCheck(I64Array schedule, std::string dtype, std::vector<AnyArray> inputs,
                         std::vector<AnyArray> expected, std::vector<int32_t> rank_device,
                         std::vector<uint8_t> peer_ok, int max_streams, int seeds,
                         std::pair<std::string, int64_t> mutate, std::vector<int64_t> leaf_sizes,
                         std::vector<uint8_t> aliased) {
  const Dtype dt = DtypeByName(dtype);
  ExecPlan plan;
  GpuProgram prog = Build(schedule, dt, rank_device, peer_ok, max_streams, leaf_sizes, aliased, &plan);
  const int64_t nelems = plan.schedule.nelems;
  const size_t bytes = static_cast<size_t>(nelems) * DtypeSize(dt);
  if (static_cast<int64_t>(inputs.size()) != plan.schedule.nranks || expected.size() != inputs.size())
    throw std::invalid_argument("need one input and one expected array per rank");
  for (size_t r = 0; r < inputs.size(); ++r)
    if (inputs[r].nbytes() != bytes || expected[r].nbytes() != bytes)
      throw std::invalid_argument("array sizes differ from the schedule's nelems x dtype size");
  if (!mutate.first.empty()) {
    GpuOpKind k = mutate.first == "wait" ? GpuOpKind::kWait : GpuOpKind::kRecord;
    int64_t seen = 0;
    bool dropped = false;
    for (size_t i = 0; i < prog.ops.size(); ++i)
      if (prog.ops[i].kind == k && seen++ == mutate.second) {
        prog.ops.erase(prog.ops.begin() + static_cast<std::ptrdiff_t>(i));
        dropped = true;
        break;
      }
    if (!dropped) throw std::invalid_argument("mutation index out of range");
  }
  std::string race_info, emu_error;
  GpuProgramStats st = Stats(prog);
  int64_t races, crit, mismatched_seeds = 0, pieces = 0;
  for (auto& op : prog.ops) pieces += op.continued;
  {
    nb::gil_scoped_release release;
    races = CheckRaces(prog, &race_info);
    crit = CriticalPath(prog);
    std::vector<const void*> ins;
    for (auto& a : inputs) ins.push_back(a.data());
    for (int s = 0; s < seeds && emu_error.empty(); ++s) {
      std::vector<std::vector<uint8_t>> got;
      emu_error = EmulateGpuProgram(prog, dt, nelems, ins, static_cast<uint64_t>(s), &got);
      if (!emu_error.empty()) break;
      bool same = true;
      for (size_t r = 0; r < got.size() && same; ++r)
        same = got[r].size() == bytes && (bytes == 0 || std::memcmp(got[r].data(), expected[r].data(), bytes) == 0);
      if (!same) ++mismatched_seeds;
    }
  }
  nb::dict out;
  out["races"] = races;
  out["race_info"] = race_info;
  out["critical_path"] = crit;
  out["chunk_depth"] = prog.chunk_depth;
  out["segment_chunks"] = prog.max_segment_chunks;
  out["memory_ops"] = st.memory_ops;
  out["continued_pieces"] = pieces;
  out["records"] = st.records;
  out["waits"] = st.waits;
  out["streams"] = st.streams;
  out["scratch_buffers"] = static_cast<int64_t>(prog.scratch.size());
  out["leaves"] = static_cast<int64_t>(prog.leaf_elems.size());
  out["mismatched_seeds"] = mismatched_seeds;
  out["emulator_error"] = emu_error;
  return out;
}

// The device interpreter's program of the first group's schedule (interp_plan.h), run on the host
// with one thread per (rank, block) (interp_host.h) for `seeds` seeds of random delays (seed 0: none)
// and `calls` successive calls each, every rank's output compared with `expected` bit for bit.
// absent_rank: that rank never starts (every peer must time out naming it); late_rank starts late_ms
// late. Returns the program's figures, the mismatches, and the first run's error / records.
nb::dict InterpCheck(I64Array schedule, std::string dtype, std::vector<AnyArray> inputs, std::vector<AnyArray> expected,
                     std::vector<uint8_t> peer_ok, int max_blocks, int seeds, std::vector<int64_t> leaf_sizes,
                     std::vector<uint8_t> aliased, int absent_rank, int late_rank, int64_t late_ms,
                     int64_t timeout_ms, int64_t calls) {
  const Dtype dt = DtypeByName(dtype);
  std::vector<Schedule> scheds;
  std::string err = DecodeSchedules(schedule.data(), schedule.shape(0), &scheds);
  ExecPlan plan;
  if (err.empty()) err = BuildExecPlan(scheds[0], &plan);
  if (!err.empty()) throw std::invalid_argument(err);
  InterpOptions opt;
  opt.peer_ok = std::move(peer_ok);
  opt.max_blocks = max_blocks;
  opt.leaf_elems = std::move(leaf_sizes);
  InterpPlan ip;
  err = BuildInterpPlan(plan, dt, opt, &ip);
  if (!err.empty()) throw std::invalid_argument(err);
  const int64_t nelems = plan.schedule.nelems;
  const size_t bytes = static_cast<size_t>(nelems) * DtypeSize(dt);
  if (static_cast<int64_t>(inputs.size()) != plan.schedule.nranks || expected.size() != inputs.size())
    throw std::invalid_argument("need one input and one expected array per rank");
  for (size_t r = 0; r < inputs.size(); ++r)
    if (inputs[r].nbytes() != bytes || expected[r].nbytes() != bytes)
      throw std::invalid_argument("array sizes differ from the schedule's nelems x dtype size");
  if (!aliased.empty() && static_cast<int32_t>(aliased.size()) != ip.nleaves)
    throw std::invalid_argument("aliased must have one entry per leaf");
  int64_t mismatched = 0, crit = 0, threads = 0;
  std::string run_error, first_error;
  std::vector<interp::ErrorRecord> records;
  std::vector<int64_t> bad_ranks;
  {
    nb::gil_scoped_release release;
    crit = CriticalPath(ip);
    std::vector<const void*> ins;
    for (auto& a : inputs) ins.push_back(a.data());
    for (int s = 0; s < std::max(seeds, 1) && run_error.empty(); ++s) {
      HostRunOptions ho;
      ho.seed = static_cast<uint64_t>(s);
      ho.absent_rank = absent_rank;
      ho.late_rank = late_rank;
      ho.late_ms = late_ms;
      ho.timeout_ms = timeout_ms;
      ho.calls = calls;
      HostRunResult res;
      run_error = RunInterpOnHost(ip, ins, nelems, aliased, ho, &res);
      if (!run_error.empty()) break;
      threads = res.threads;
      if (s == 0) {
        first_error = res.error;
        records = res.records;
      }
      if (!res.error.empty()) continue;
      bool same = true;
      for (size_t r = 0; r < res.outputs.size(); ++r)
        if (res.outputs[r].size() != bytes || (bytes && std::memcmp(res.outputs[r].data(), expected[r].data(), bytes))) {
          same = false;
          if (s == 0) bad_ranks.push_back(static_cast<int64_t>(r));
        }
      if (!same) ++mismatched;
    }
  }
  if (!run_error.empty()) throw std::invalid_argument(run_error);
  int64_t flags = 0, deps = 0;
  for (int32_t f : ip.flags_per_rank) flags += f;
  for (const auto& t : ip.tasks) deps += t.dep_count;
  nb::list recs;
  for (const auto& r : records)
    recs.append(nb::make_tuple(static_cast<int64_t>(r.epoch), r.missing_rank, r.waiting_rank, r.task));
  nb::dict out;
  out["critical_path"] = crit;
  out["segment_chunks"] = ip.max_segment_chunks;
  out["chunk_depth"] = ip.chunk_depth;
  out["pipeline_ideal"] = ip.pipeline_ideal;
  out["tasks"] = static_cast<int64_t>(ip.tasks.size());
  out["flags"] = flags;
  out["dep_waits"] = deps;
  out["blocks"] = static_cast<int64_t>(ip.max_blocks);
  out["staging_elems"] = ip.staging_elems;
  out["leaves"] = static_cast<int64_t>(ip.nleaves);
  out["threads"] = threads;
  out["mismatched_seeds"] = mismatched;
  out["mismatched_ranks"] = bad_ranks;
  out["error"] = first_error;
  out["records"] = recs;
  return out;
}

// The GPU program's listing (debugging): gpu_program_check's options, no data.
std::string GpuProgramDescribe(I64Array schedule, std::string dtype, std::vector<int32_t> rank_device,
                               std::vector<uint8_t> peer_ok, int max_streams, std::vector<int64_t> leaf_sizes,
                               std::vector<uint8_t> aliased) {
  ExecPlan plan;
  return Describe(Build(schedule, DtypeByName(dtype), rank_device, peer_ok, max_streams, leaf_sizes, aliased, &plan));
}

// Replays the CUDA executor's use of its program cache (cuda_executor.cu, EnqueueLocked) on fake
// programs. events: ("call", site, key): collect finished retired programs, then find or build
// (site, key) and enqueue its work (in flight until finished); ("finish", site, key): the work of
// every call so far of that program completed (its events report done). Returns the log: "build
// site/key", "release site/key" (freed after its work completed), and at the end "sites N",
// "retired N". Never releases a program with work in flight.
std::vector<std::string> ProgramCacheTrace(int64_t max_sites, std::vector<std::tuple<std::string, int64_t, std::string>> events) {
  struct Fake {
    std::string name;
    bool in_flight = false;
  };
  ProgramCache<Fake> cache(static_cast<size_t>(max_sites));
  std::map<std::string, std::vector<std::shared_ptr<Fake>>> all;  // every program built, by name
  std::vector<std::string> log;
  for (auto& [what, site, key] : events) {
    const std::string name = std::to_string(site) + "/" + key;
    if (what == "call") {
      cache.Collect([](const Fake& f) { return !f.in_flight; }, [&](Fake& f) { log.push_back("release " + f.name); });
      auto p = cache.Find(site, key);
      if (!p) {
        p = std::make_shared<Fake>();
        p->name = name;
        all[name].push_back(p);
        cache.Insert(site, key, p);
        log.push_back("build " + name);
      }
      p->in_flight = true;
    } else if (what == "finish") {
      for (auto& p : all[name]) p->in_flight = false;
    } else {
      throw std::invalid_argument("event must be 'call' or 'finish', got " + what);
    }
  }
  log.push_back("sites " + std::to_string(cache.sites()));
  log.push_back("retired " + std::to_string(cache.retired()));
  return log;
}

}  // namespace
}  // namespace jax_blink

NB_MODULE(_gpusim, m) {
  m.doc() = "jax_blink CUDA executor checks without a GPU: GPU programs over leaves, emulator, program cache";
  m.def("gpu_program_check", &jax_blink::GpuProgramCheck, nb::arg("schedule"), nb::arg("dtype"), nb::arg("inputs"),
        nb::arg("expected"), nb::arg("rank_device"), nb::arg("peer_ok"), nb::arg("max_streams"), nb::arg("seeds"),
        nb::arg("mutate"), nb::arg("leaf_sizes") = std::vector<int64_t>{},
        nb::arg("aliased") = std::vector<uint8_t>{},
        "Build, race-check and emulate the CUDA executor's GPU program over a bucket of leaves.");
  m.def("interp_check", &jax_blink::InterpCheck, nb::arg("schedule"), nb::arg("dtype"), nb::arg("inputs"),
        nb::arg("expected"), nb::arg("peer_ok"), nb::arg("max_blocks"), nb::arg("seeds"),
        nb::arg("leaf_sizes") = std::vector<int64_t>{}, nb::arg("aliased") = std::vector<uint8_t>{},
        nb::arg("absent_rank") = -1, nb::arg("late_rank") = -1, nb::arg("late_ms") = 0,
        nb::arg("timeout_ms") = 2000, nb::arg("calls") = 1,
        "Run the device interpreter on the host (a thread per rank block) and compare with expected bit for bit.");
  m.def("gpu_program_describe", &jax_blink::GpuProgramDescribe, nb::arg("schedule"), nb::arg("dtype"),
        nb::arg("rank_device"), nb::arg("peer_ok"), nb::arg("max_streams"),
        nb::arg("leaf_sizes") = std::vector<int64_t>{}, nb::arg("aliased") = std::vector<uint8_t>{},
        "The GPU program's listing.");
  m.def("program_cache_trace", &jax_blink::ProgramCacheTrace, nb::arg("max_sites"), nb::arg("events"),
        "Replay the CUDA executor's program-cache use on fake programs; the build/release log.");
  m.def("program_cache_capacity", [](std::string v) { return jax_blink::ProgramCacheCapacity(v.c_str()); },
        nb::arg("env_value"), "Call sites the program cache keeps for this JAX_BLINK_CUDA_CACHE_PROGRAMS value.");
}
