// Python module jax_blink._native._gpusim: CI entries for the CUDA executor's plain C++ parts, no GPU
// needed: the device interpreter's program of a schedule over a bucket of leaves, run on the host with
// a thread per (rank, block) (tests/native/test_gpu_program.py, jax_blink.lowering.gpu_program_check), and the
// program cache's eviction (program_cache.h).
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
#include "interp_host.h"
#include "interp_plan.h"
#include "nb_arrays.h"
#include "program_cache.h"

namespace nb = nanobind;

namespace jax_blink {
namespace {

// The device interpreter's program of the first group's schedule (interp_plan.h), run on the host
// with one thread per (rank, block) (interp_host.h) for `seeds` seeds of random delays (seed 0: none)
// and `calls` successive calls each, every rank's output compared with `expected` bit for bit.
// absent_rank: that rank never starts (every peer must time out naming it); late_rank starts late_ms
// late. Returns the program's figures, the mismatches, and the first run's error / records.
nb::dict InterpCheck(I64Array schedule, std::string dtype, std::vector<AnyArray> inputs, std::vector<AnyArray> expected,
                     std::vector<uint8_t> peer_ok, int max_blocks, int seeds, std::vector<int64_t> leaf_sizes,
                     std::vector<uint8_t> aliased, int absent_rank, int late_rank, int64_t late_ms,
                     int64_t timeout_ms, int64_t calls, bool watch) {
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
  std::string run_error, first_error, watch_error;
  bool watch_early = false;
  int64_t wide_scalars = 0;
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
      ho.watch = watch;
      HostRunResult res;
      run_error = RunInterpOnHost(ip, ins, nelems, aliased, ho, &res);
      if (!run_error.empty()) break;
      threads = res.threads;
      if (s == 0) {
        first_error = res.error;
        records = res.records;
        watch_error = res.watch_error;
        watch_early = res.watch_early;
        wide_scalars = res.wide_scalars;
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
  out["watch_error"] = watch_error;
  out["watch_early"] = watch_early;
  out["wide_scalars"] = wide_scalars;
  return out;
}

// The interpreter program's figures alone (no data): critical path, pipelining ideal, tasks, blocks.
nb::dict InterpFigures(I64Array schedule, std::string dtype, std::vector<int64_t> leaf_sizes, int max_blocks) {
  std::vector<Schedule> scheds;
  std::string err = DecodeSchedules(schedule.data(), schedule.shape(0), &scheds);
  ExecPlan plan;
  if (err.empty()) err = BuildExecPlan(scheds[0], &plan);
  InterpOptions opt;
  opt.max_blocks = max_blocks;
  opt.leaf_elems = std::move(leaf_sizes);
  InterpPlan ip;
  if (err.empty()) err = BuildInterpPlan(plan, DtypeByName(dtype), opt, &ip);
  if (!err.empty()) throw std::invalid_argument(err);
  nb::dict out;
  out["critical_path"] = CriticalPath(ip);
  out["pipeline_ideal"] = ip.pipeline_ideal;
  out["tasks"] = static_cast<int64_t>(ip.tasks.size());
  out["blocks"] = static_cast<int64_t>(ip.max_blocks);
  return out;
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
  m.doc() = "jax_blink CUDA executor checks without a GPU: the device interpreter on the host, program cache";
  m.def("interp_check", &jax_blink::InterpCheck, nb::arg("schedule"), nb::arg("dtype"), nb::arg("inputs"),
        nb::arg("expected"), nb::arg("peer_ok"), nb::arg("max_blocks"), nb::arg("seeds"),
        nb::arg("leaf_sizes") = std::vector<int64_t>{}, nb::arg("aliased") = std::vector<uint8_t>{},
        nb::arg("absent_rank") = -1, nb::arg("late_rank") = -1, nb::arg("late_ms") = 0,
        nb::arg("timeout_ms") = 2000, nb::arg("calls") = 1, nb::arg("watch") = false,
        "Run the device interpreter on the host (a thread per rank block) and compare with expected bit for bit.");
  m.def("interp_figures", &jax_blink::InterpFigures, nb::arg("schedule"), nb::arg("dtype"), nb::arg("leaf_sizes"),
        nb::arg("max_blocks"), "The interpreter program's critical path and pipelining ideal (no data run).");
  m.def("program_cache_trace", &jax_blink::ProgramCacheTrace, nb::arg("max_sites"), nb::arg("events"),
        "Replay the CUDA executor's program-cache use on fake programs; the build/release log.");
  m.def("program_cache_capacity", [](std::string v) { return jax_blink::ProgramCacheCapacity(v.c_str()); },
        nb::arg("env_value"), "Call sites the program cache keeps for this JAX_BLINK_CUDA_CACHE_PROGRAMS value.");
}
