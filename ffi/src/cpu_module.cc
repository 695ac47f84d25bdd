// Python module jax_blink._native._cpu: the XLA FFI handler "jax_blink_cpu" (platform "cpu") and
// test entry points that drive the same rendezvous + executor without XLA.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/pair.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

#include "blink_core.h"
#include "cpu_executor.h"
#include "gpu_emulator.h"
#include "gpu_program.h"
#include "cuda_compat.h"
#include "xla/ffi/api/ffi.h"
#include "xla_dtype.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace jax_blink {
namespace {

ffi::Future Failed(ffi::ErrorCode code, const std::string& msg) {
  ffi::Promise p;
  ffi::Future f(p);
  p.SetError(ffi::Error(code, msg));
  return f;
}

ffi::Future Ready() {
  ffi::Promise p;
  ffi::Future f(p);
  p.SetAvailable();
  return f;
}

// Operands equal to their results, or one of two shard forms of a one-leaf sharded collective:
// - all-gather, operand = the rank's shard (result = nranks x operand): the leaf's input pointer is
//   set as if it pointed at the full buffer. The executor reads an all-gather rank's input only inside
//   its own shard (the only segments it roots), so no other address is formed for reading.
// - reduce-scatter, result = the rank's shard (operand = nranks x result): the output pointer likewise
//   (Leaf::out_shard); needs a plan whose transfers write only into their segment's root (the star
//   per owner the CPU lowering builds), else no other rank's partial sums would have a place.
// in_counts / out_counts: per leaf, the operand's and the result's element count; leaf.nelems is the
// larger. Returns "" or the error.
std::string ShardBuffers(const ExecPlan& plan, int64_t rank, const std::vector<int64_t>& in_counts,
                         const std::vector<int64_t>& out_counts, size_t esize, std::vector<Leaf>* leaves) {
  const Schedule& s = plan.schedule;
  const CollectiveRow& row = *CollectiveRowOf(static_cast<int64_t>(s.collective));
  for (size_t i = 0; i < leaves->size(); ++i) {
    Leaf& l = (*leaves)[i];
    if (in_counts[i] == out_counts[i]) continue;
    const bool gather = row.sharded && !row.reduces && in_counts[i] * s.nranks == out_counts[i];
    const bool scatter = row.sharded && row.reduces && out_counts[i] * s.nranks == in_counts[i];
    if (leaves->size() != 1 || !(gather || scatter))
      return "operand " + std::to_string(i) + " has " + std::to_string(in_counts[i]) + " elements and its result " +
             std::to_string(out_counts[i]) + " (only a one-operand all-gather takes its shard, result = nranks x "
             "operand, and only a one-operand reduce-scatter returns its shard, operand = nranks x result)";
    if (scatter && !plan.owner_writes_only)
      return "a reduce-scatter that returns the rank's shard needs a schedule whose transfers all write into "
             "their segment's root (one star per owner); this one keeps partial sums at other ranks";
    if (gather) {
      l.in = static_cast<const char*>(l.in) - static_cast<ptrdiff_t>(rank * in_counts[i] * esize);
    } else {
      l.out = static_cast<char*>(l.out) - static_cast<ptrdiff_t>(rank * out_counts[i] * esize);
      l.out_shard = true;
    }
  }
  return "";
}

// One device's call over a bucket of leaves (operands i and results i of one dtype, same shapes;
// XLA may alias result i to operand i). Registers the buffers at the meeting and returns a future; the
// last arrival runs the schedule over the leaves' virtual concatenation for everyone (cpu_executor.cc)
// and completes every future. No thread waits.
ffi::Future BlinkCpuImpl(ffi::RunId run, int32_t device, ffi::RemainingArgs args, ffi::RemainingRets rets,
                         ffi::Span<const int64_t> schedule, ffi::Span<const int64_t> device_table,
                         int64_t call_site, int64_t timeout_ms) {
  std::vector<Leaf> leaves;
  std::optional<Dtype> dt;
  std::string bad;  // a malformed call: reported to the peers below, once the generation is known
  if (args.size() != rets.size() || args.size() == 0) {
    bad = "the custom call has " + std::to_string(args.size()) + " operands and " + std::to_string(rets.size()) +
          " results (expected as many of each, at least one)";
  }
  int64_t nelems = 0;
  std::vector<int64_t> in_counts, out_counts;  // per leaf: the operand's and the result's element count
  for (size_t i = 0; bad.empty() && i < args.size(); ++i) {
    auto x = args.get<ffi::AnyBuffer>(i);
    auto y = rets.get<ffi::AnyBuffer>(i);
    if (!x.has_value() || !y.has_value()) {
      bad = "operand/result " + std::to_string(i) + " is not a buffer";
      break;
    }
    auto t = DtypeFromXla(x->element_type());
    if (!t || (dt && *t != *dt) || (*y)->element_type() != x->element_type()) {
      bad = "operand " + std::to_string(i) + " has an unsupported dtype, another dtype than operand 0, or a "
            "result of another type";
      break;
    }
    dt = t;
    // Operand and result differ only for a sharded collective's shard forms (checked below).
    const int64_t n_in = static_cast<int64_t>(x->element_count()), n_out = static_cast<int64_t>((*y)->element_count());
    const int64_t n = std::max(n_in, n_out);
    if (n == 0) continue;  // the same shapes on every device: zero-size leaves take no part
    leaves.push_back(Leaf{x->untyped_data(), (*y)->untyped_data(), n});
    in_counts.push_back(n_in);
    out_counts.push_back(n_out);
    nelems += n;
  }
  if (bad.empty() && nelems == 0) return Ready();  // nobody meets
  if (IsTestAbsentDevice(device)) return Ready();  // test hook: this device never arrives
  const int64_t generation = NextGeneration(run.run_id, call_site, device);
  // A device that cannot join fails the whole call at once: its peers get its error now, not at the
  // timeout (and never wait on a participant that will not come).
  auto cannot_join = [&](const std::string& why) {
    std::string msg = "jax_blink: device " + std::to_string(device) + " cannot join the collective: " + why;
    FailCall(run.run_id, call_site, generation, msg);
    return Failed(ffi::ErrorCode::kInvalidArgument, msg);
  };
  if (!bad.empty()) return cannot_join(bad);
  std::shared_ptr<const CallSiteInfo> info;
  std::string err = GetCallSiteInfo(call_site, schedule.begin(), schedule.size(), device_table.begin(),
                                    device_table.size(), &info);
  if (!err.empty()) return cannot_join(err);
  const DeviceTable::Entry* e = info->table.Find(device);
  if (!e) return cannot_join("it is not in the collective's device table");
  err = ShardBuffers(*info->plans[e->group], e->rank, in_counts, out_counts, DtypeSize(*dt), &leaves);
  if (!err.empty()) return cannot_join(err);
  ffi::Promise promise;
  ffi::Future future(promise);
  Arrival a;
  a.device = device;
  a.rank = e->rank;
  a.dtype = *dt;
  a.nelems = nelems;
  a.leaves = std::move(leaves);
  a.done = [promise](const std::string& msg) mutable {
    if (msg.empty()) promise.SetAvailable();
    else promise.SetError(ffi::Error(ErrorClassOf(msg) == 2   ? ffi::ErrorCode::kDeadlineExceeded
                                     : ErrorClassOf(msg) == 1 ? ffi::ErrorCode::kInternal
                                                              : ffi::ErrorCode::kInvalidArgument,
                                     msg));
  };
  MeetingKey key{run.run_id, call_site, e->group, generation};
  auto meeting = Arrive(key, info, std::move(a), EffectiveTimeoutMs(timeout_ms));
  if (meeting) ExecuteOnCpu(std::move(meeting), e->rank);
  return future;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlinkCpu, BlinkCpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("schedule")
                                  .Attr<ffi::Span<const int64_t>>("device_table")
                                  .Attr<int64_t>("call_site")
                                  .Attr<int64_t>("timeout_ms"));

namespace {

std::optional<Dtype> FromName(const std::string& s) {
  for (int i = 0; i <= static_cast<int>(Dtype::kC128); ++i)
    if (s == DtypeName(static_cast<Dtype>(i))) return static_cast<Dtype>(i);
  return std::nullopt;
}

using I64Array = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using AnyArray = nb::ndarray<nb::c_contig, nb::device::cpu>;

// Test entry: every listed device arrives from its own thread at one meeting (run id, call site fixed);
// devices in `absent` do not. Returns "" on success or the error message every arrival got.
// dtypes[i] names the numpy dtype of inputs[i] (so mismatches can be exercised).
std::string Simulate(I64Array schedule, I64Array device_table, std::vector<int64_t> devices,
                     std::vector<AnyArray> inputs, std::vector<AnyArray> outputs, std::vector<std::string> dtypes,
                     int64_t timeout_ms, int64_t call_site, std::vector<int64_t> leaf_sizes, bool in_place) {
  static std::atomic<int64_t> run_counter{1 << 30};
  const int64_t run = run_counter++;
  std::shared_ptr<const CallSiteInfo> info;
  std::string err;
  {
    nb::gil_scoped_release release;
    err = GetCallSiteInfo(call_site, schedule.data(), schedule.shape(0), device_table.data(),
                          device_table.shape(0), &info);
  }
  if (!err.empty()) return err;
  std::mutex mu;
  std::condition_variable cv;
  size_t pending = devices.size();
  std::vector<std::string> errors(devices.size());
  {
    nb::gil_scoped_release release;
    std::vector<std::thread> threads;
    for (size_t i = 0; i < devices.size(); ++i) {
      auto dt = FromName(dtypes[i]);
      const DeviceTable::Entry* e = info->table.Find(devices[i]);
      if (!dt || !e) {
        errors[i] = !dt ? "unknown dtype " + dtypes[i] : "device not in table";
        std::lock_guard<std::mutex> l(mu);
        --pending;
        continue;
      }
      Arrival a;
      a.device = devices[i];
      a.rank = e->rank;
      a.dtype = *dt;
      const size_t es = DtypeSize(*dt);
      const int64_t n_in = static_cast<int64_t>(inputs[i].size()), n_out = static_cast<int64_t>(outputs[i].size());
      a.nelems = std::max(n_in, n_out);
      if (n_in != n_out) {  // a shard form (one leaf): as the XLA handler takes it (ShardBuffers)
        a.leaves.push_back(Leaf{inputs[i].data(), outputs[i].data(), a.nelems});
        std::string why = ShardBuffers(*info->plans[e->group], e->rank, {n_in}, {n_out}, es, &a.leaves);
        if (!why.empty()) {
          std::lock_guard<std::mutex> l(mu);
          errors[i] = why;
          --pending;
          continue;
        }
      } else {
        // The device's array cut into leaves of leaf_sizes elements (the rest: one more leaf), as
        // separate operands of one call; in_place: each result aliases its operand (outputs unused).
        int64_t pos = 0;
        for (size_t j = 0; j <= leaf_sizes.size(); ++j) {
          int64_t n = j < leaf_sizes.size() ? std::min(leaf_sizes[j], a.nelems - pos) : a.nelems - pos;
          char* in = static_cast<char*>(inputs[i].data()) + pos * es;
          char* out = in_place ? in : static_cast<char*>(outputs[i].data()) + pos * es;
          if (n > 0) a.leaves.push_back(Leaf{in, out, n});
          pos += std::max<int64_t>(n, 0);
        }
      }
      a.done = [&, i](const std::string& msg) {
        std::lock_guard<std::mutex> l(mu);
        errors[i] = msg;
        if (--pending == 0) cv.notify_all();
      };
      MeetingKey key{run, call_site, e->group, NextGeneration(run, call_site, devices[i])};
      threads.emplace_back([key, info, a, timeout_ms]() mutable {
        auto m = Arrive(key, info, std::move(a), timeout_ms);
        if (m) ExecuteOnCpu(std::move(m), -1);
      });
    }
    for (auto& t : threads) t.join();
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return pending == 0; });
  }
  for (auto& e : errors)
    if (!e.empty()) return e;
  return "";
}

// Decodes and validates a schedule array; returns "" or the error message.
std::string Validate(I64Array schedule) {
  std::vector<Schedule> s;
  std::string e = DecodeSchedules(schedule.data(), schedule.shape(0), &s);
  if (!e.empty()) return e;
  ExecPlan p;
  return BuildExecPlan(s[0], &p);
}

// The execution plan of a schedule array's first schedule; invalid input raises ValueError.
ExecPlan FirstPlan(I64Array schedule) {
  std::vector<Schedule> scheds;
  std::string err = DecodeSchedules(schedule.data(), schedule.shape(0), &scheds);
  if (!err.empty()) throw std::invalid_argument(err);
  ExecPlan plan;
  err = BuildExecPlan(scheds[0], &plan);
  if (!err.empty()) throw std::invalid_argument(err);
  return plan;
}

// Test entry (tests/test_gpu_program.py, scripts/gpu_sim_check.sh): builds the GPU program of the
// first group's schedule, race-checks it, computes its critical path, and runs the CPU emulator of
// CUDA streams/events for `seeds` random timings on `inputs`, comparing every rank's captured output
// with `expected` bit for bit. mutate = ("wait" | "record", i) drops the i-th wait / record first
// (mutation tests); ("", 0) changes nothing. rank_device: device of each rank; peer_ok: nranks *
// nranks flags (empty: all peers loadable); max_streams: work streams per device (0: no cap).
nb::dict GpuProgramCheck(I64Array schedule, std::string dtype, std::vector<AnyArray> inputs,
                         std::vector<AnyArray> expected, std::vector<int32_t> rank_device,
                         std::vector<uint8_t> peer_ok, int max_streams, int seeds,
                         std::pair<std::string, int64_t> mutate) {
  nb::dict out;
  auto dt = FromName(dtype);
  if (!dt) throw std::invalid_argument("unknown dtype " + dtype);
  ExecPlan plan = FirstPlan(schedule);
  GpuProgramOptions opt;
  opt.rank_device = rank_device;
  opt.peer_ok = peer_ok;
  opt.max_streams_per_device = max_streams;
  const bool cplx = *dt == Dtype::kC64 || *dt == Dtype::kC128;
  GpuProgram prog;
  std::string err = BuildGpuProgram(plan, static_cast<int64_t>(DtypeSize(*dt)), cplx ? 2 : 1, opt, &prog);
  if (!err.empty()) throw std::invalid_argument(err);
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
  std::string race_info;
  GpuProgramStats st = Stats(prog);
  int64_t races, crit, mismatched_seeds = 0;
  std::string emu_error;
  const int64_t nelems = plan.schedule.nelems;
  {
    nb::gil_scoped_release release;
    races = CheckRaces(prog, &race_info);
    crit = CriticalPath(prog);
    std::vector<const void*> ins;
    for (auto& a : inputs) ins.push_back(a.data());
    const size_t bytes = static_cast<size_t>(nelems) * DtypeSize(*dt);
    for (int s = 0; s < seeds && emu_error.empty(); ++s) {
      std::vector<std::vector<uint8_t>> got;
      emu_error = EmulateGpuProgram(prog, *dt, nelems, ins, static_cast<uint64_t>(s), &got);
      if (!emu_error.empty()) break;
      bool same = true;
      for (size_t r = 0; r < got.size() && same; ++r)
        same = got[r].size() == bytes && (bytes == 0 || std::memcmp(got[r].data(), expected[r].data(), bytes) == 0);
      if (!same) ++mismatched_seeds;
    }
  }
  out["races"] = races;
  out["race_info"] = race_info;
  out["critical_path"] = crit;
  out["chunk_depth"] = prog.chunk_depth;
  out["segment_chunks"] = prog.max_segment_chunks;
  out["memory_ops"] = st.memory_ops;
  out["records"] = st.records;
  out["waits"] = st.waits;
  out["streams"] = st.streams;
  out["scratch_buffers"] = static_cast<int64_t>(prog.scratch.size());
  out["mismatched_seeds"] = mismatched_seeds;
  out["emulator_error"] = emu_error;
  return out;
}

// The GPU program's listing (debugging): same arguments as gpu_program_check's first ones.
std::string GpuProgramDescribe(I64Array schedule, int64_t elem_size, std::vector<int32_t> rank_device,
                               std::vector<uint8_t> peer_ok, int max_streams) {
  ExecPlan plan = FirstPlan(schedule);
  GpuProgramOptions opt{rank_device, peer_ok, max_streams};
  GpuProgram prog;
  std::string err = BuildGpuProgram(plan, elem_size, 1, opt, &prog);
  if (!err.empty()) throw std::invalid_argument(err);
  return Describe(prog);
}

}  // namespace
}  // namespace jax_blink

NB_MODULE(_cpu, m) {
  m.doc() = "jax_blink native CPU executor (XLA FFI target jax_blink_cpu)";
  m.def("handler", []() { return nb::capsule(reinterpret_cast<void*>(jax_blink::BlinkCpu)); },
        "PyCapsule of the XLA FFI handler for platform 'cpu'.");
  m.def("simulate", &jax_blink::Simulate, nb::arg("schedule"), nb::arg("device_table"), nb::arg("devices"),
        nb::arg("inputs"), nb::arg("outputs"), nb::arg("dtypes"), nb::arg("timeout_ms"), nb::arg("call_site"),
        nb::arg("leaf_sizes") = std::vector<int64_t>{}, nb::arg("in_place") = false,
        "Test entry: run one meeting with the given devices arriving from separate threads (each device's "
        "array cut into leaves of leaf_sizes elements; in_place: results alias the inputs). An input or "
        "output 1/nranks the size of the other is a shard form (all-gather input, reduce-scatter output).");
  m.def("validate", &jax_blink::Validate, nb::arg("schedule"), "Decode + validate a schedule; '' or the error.");
  m.def("gpu_program_check", &jax_blink::GpuProgramCheck, nb::arg("schedule"), nb::arg("dtype"), nb::arg("inputs"),
        nb::arg("expected"), nb::arg("rank_device"), nb::arg("peer_ok"), nb::arg("max_streams"), nb::arg("seeds"),
        nb::arg("mutate"), "Test entry: build, race-check and emulate the CUDA executor's GPU program.");
  m.def("arch_support_reason", &jax_blink::ArchSupportReason, nb::arg("archs"), nb::arg("major"), nb::arg("minor"),
        "'' when a CUDA binary with these architectures runs on compute capability major.minor, else why not.");
  m.def("driver_support_reason", &jax_blink::DriverSupportReason, nb::arg("driver_version"),
        nb::arg("runtime_version"), "'' when the driver can run a runtime of that version, else why not.");
  m.def("error_class", &jax_blink::ErrorClassOf, nb::arg("message"),
        "0 invalid argument, 1 internal (CUDA), 2 deadline exceeded: the FFI error code of a message.");
  m.def("gpu_program_describe", &jax_blink::GpuProgramDescribe, nb::arg("schedule"), nb::arg("elem_size"),
        nb::arg("rank_device"), nb::arg("peer_ok"), nb::arg("max_streams"), "The GPU program's listing.");
}
