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
#include "cpu_sum.h"
#include "cuda_compat.h"
#include "nb_arrays.h"
#include "xla/ffi/api/ffi.h"
#include "ffi_handler.h"

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

// The hierarchical lowering's block order (jax_blink/lowering/hierarchical.py): the one leaf's
// full-size side (all-gather: the result; reduce-scatter: the operand) holds nblocks equal blocks in
// rank order, while the schedule runs over the phases' (local rank, process) order: virtual block k
// is the buffer's block order[k]. The leaf is cut into nblocks leaves whose full-side pointers are
// permuted (the shard side, and both sides of an in-place call, stay as the schedule sees them), so
// the blocks land in rank order with no reorder copy after the call. Runs after ShardBuffers (both
// pointers then address a full virtual buffer). An order of one block changes nothing. "" or the error.
std::string BlockOrderLeaves(ffi::Span<const int64_t> order, int64_t nranks, const std::vector<int64_t>& in_counts,
                             const std::vector<int64_t>& out_counts, size_t esize, std::vector<Leaf>* leaves) {
  const int64_t nblocks = static_cast<int64_t>(order.size());
  if (nblocks <= 1) return "";
  if (leaves->size() != 1)
    return "a block order needs one operand, got " + std::to_string(leaves->size());
  const Leaf whole = (*leaves)[0];
  const int64_t n = whole.nelems;
  if (n % nblocks != 0 || nblocks % nranks != 0)
    return "a block order of " + std::to_string(nblocks) + " blocks needs an element count (" + std::to_string(n) +
           ") it divides and a multiple of the group's " + std::to_string(nranks) + " ranks";
  std::vector<bool> seen(static_cast<size_t>(nblocks), false);
  for (int64_t k = 0; k < nblocks; ++k) {
    const int64_t b = order[k];
    if (b < 0 || b >= nblocks || seen[static_cast<size_t>(b)])
      return "the block order is not a permutation of 0.." + std::to_string(nblocks - 1);
    seen[static_cast<size_t>(b)] = true;
  }
  const bool in_full = in_counts[0] == n, out_full = out_counts[0] == n;
  const bool in_place = whole.in == whole.out;
  const int64_t bm = n / nblocks;
  const ptrdiff_t bbytes = static_cast<ptrdiff_t>(bm * static_cast<int64_t>(esize));
  leaves->clear();
  for (int64_t k = 0; k < nblocks; ++k) {
    Leaf l;
    l.nelems = bm;
    const ptrdiff_t own = k * bbytes, placed = order[k] * bbytes;
    l.in = static_cast<const char*>(whole.in) + (in_full && !in_place ? placed : own);
    l.out = static_cast<char*>(whole.out) + (out_full && !in_place ? placed : own);
    l.out_memory = out_full;  // a shard result: only the rank's own blocks are memory
    leaves->push_back(l);
  }
  return "";
}

// One device's call over a bucket of leaves (operands i and results i of one dtype, same shapes;
// XLA may alias result i to operand i). Registers the buffers at the meeting and returns a future; the
// last arrival runs the schedule over the leaves' virtual concatenation for everyone (cpu_executor.cc)
// and completes every future. No thread waits.
ffi::Future BlinkCpuImpl(ffi::RunId run, int32_t device, ffi::RemainingArgs args, ffi::RemainingRets rets,
                         ffi::Span<const int64_t> schedule, ffi::Span<const int64_t> device_table,
                         int64_t call_site, int64_t timeout_ms, ffi::Span<const int64_t> block_order,
                         std::string_view where) {
  std::vector<Leaf> leaves;
  std::optional<Dtype> dt;
  // A malformed call: reported to the peers below, once the generation is known.
  std::string bad = BucketArityError(args.size(), rets.size());
  int64_t nelems = 0;
  std::vector<int64_t> in_counts, out_counts;  // per leaf: the operand's and the result's element count
  for (size_t i = 0; bad.empty() && i < args.size(); ++i) {
    BucketOperand op;
    bad = ReadBucketOperand(args, rets, i, &dt, &op);
    if (!bad.empty()) break;
    // Operand and result differ only for a sharded collective's shard forms (checked below).
    const int64_t n = std::max(op.in_count, op.out_count);
    if (n == 0) continue;  // the same shapes on every device: zero-size leaves take no part
    leaves.push_back(Leaf{op.in, op.out, n});
    in_counts.push_back(op.in_count);
    out_counts.push_back(op.out_count);
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
  err = BlockOrderLeaves(block_order, info->plans[e->group]->schedule.nranks, in_counts, out_counts, DtypeSize(*dt),
                         &leaves);
  if (!err.empty()) return cannot_join(err);
  ffi::Promise promise;
  ffi::Future future(promise);
  Arrival a{device, e->rank, *dt, nelems, std::move(leaves), std::string(where), /*backend=*/nullptr,
            [promise](const std::string& msg) mutable {
              if (msg.empty()) promise.SetAvailable();
              else promise.SetError(ffi::Error(ErrorCodeOf(msg), msg));
            }};
  MeetingKey key{run.run_id, call_site, e->group, generation};
  auto meeting = Arrive(key, info, std::move(a), EffectiveTimeoutMs(timeout_ms));
  if (meeting) ExecuteOnCpu(std::move(meeting), e->rank);
  return future;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlinkCpu, BlinkCpuImpl,
                              BindCollective(ffi::Ffi::Bind().Ctx<ffi::RunId>().Ctx<ffi::DeviceOrdinal>())
                                  .Attr<ffi::Span<const int64_t>>("block_order")
                                  .Attr<std::string_view>("where"));

namespace {

// Test entry: every listed device arrives from its own thread at one meeting (run id, call site fixed);
// devices in `absent` do not. Returns "" on success or the error message every arrival got.
// dtypes[i] names the numpy dtype of inputs[i] (so mismatches can be exercised).
std::string Simulate(I64Array schedule, I64Array device_table, std::vector<int64_t> devices,
                     std::vector<AnyArray> inputs, std::vector<AnyArray> outputs, std::vector<std::string> dtypes,
                     int64_t timeout_ms, int64_t call_site, std::vector<int64_t> leaf_sizes, bool in_place,
                     std::vector<int64_t> block_order) {
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
      auto dt = DtypeFromName(dtypes[i]);
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
      if (n_in != n_out || block_order.size() > 1) {  // one leaf, as the XLA handler takes it
        a.leaves.push_back(Leaf{inputs[i].data(), in_place ? inputs[i].data() : outputs[i].data(), a.nelems});
        std::string why = ShardBuffers(*info->plans[e->group], e->rank, {n_in}, {n_out}, es, &a.leaves);
        if (why.empty())
          why = BlockOrderLeaves(ffi::Span<const int64_t>(block_order.data(), block_order.size()),
                                 info->plans[e->group]->schedule.nranks, {n_in}, {n_out}, es, &a.leaves);
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

// Test entry: out = first + srcs[0] + ... (one kernel call) with the kernels of instruction set `isa`
// (a SumIsaName); every array of `n` elements of dtype `dtype`, C-contiguous. Returns "" or why not.
std::string SumWith(const std::string& isa, const std::string& dtype, AnyArray out, AnyArray first,
                    std::vector<AnyArray> srcs, int64_t n) {
  const Dtype dt = DtypeByName(dtype);
  const size_t bytes = static_cast<size_t>(n) * DtypeSize(dt);
  if (out.nbytes() < bytes || first.nbytes() < bytes) return "out and first need n elements";
  std::vector<const void*> ptrs;
  for (auto& a : srcs) {
    if (a.nbytes() < bytes) return "every source needs n elements";
    ptrs.push_back(a.data());
  }
  SumIsa i;
  if (!SumIsaFromName(isa.c_str(), &i)) return "unknown instruction set " + isa;
  if (!SumIsaUsable(i)) return "instruction set " + isa + " is not built in or not supported by this CPU";
  const Adder a = AdderFor(dt, i);
  a.fn(out.data(), first.data(), ptrs.data(), static_cast<int>(ptrs.size()), n * a.lanes);
  return "";
}

// Instruction sets of the sum kernels this build and CPU run, lowest first.
std::vector<std::string> SumIsas() {
  std::vector<std::string> out;
  for (SumIsa i : kSumIsas)
    if (SumIsaUsable(i)) out.push_back(SumIsaName(i));
  return out;
}

// Decodes and validates a schedule array; returns "" or the error message.
std::string Validate(I64Array schedule) {
  std::vector<Schedule> s;
  std::string e = DecodeSchedules(schedule.data(), schedule.shape(0), &s);
  if (!e.empty()) return e;
  ExecPlan p;
  return BuildExecPlan(s[0], &p);
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
        nb::arg("block_order") = std::vector<int64_t>{},
        "Test entry: run one meeting with the given devices arriving from separate threads (each device's "
        "array cut into leaves of leaf_sizes elements; in_place: results alias the inputs). An input or "
        "output 1/nranks the size of the other is a shard form (all-gather input, reduce-scatter output). "
        "block_order: the full-size side's blocks (BlockOrderLeaves; one leaf).");
  m.def("env_int", [](const std::string& name, int lo, int hi, int fallback) {
          return jax_blink::EnvInt(name.c_str(), lo, hi, fallback); },
        nb::arg("name"), nb::arg("lo"), nb::arg("hi"), nb::arg("fallback"),
        "Test entry: the executor's reading of integer setting `name` now (its settings are read once, at "
        "their first use).");
  m.def("sum_isas", &jax_blink::SumIsas, "Instruction sets of the sum kernels that this build and CPU run.");
  m.def("sum_isa", []() { return std::string(jax_blink::SumIsaName(jax_blink::ActiveSumIsa())); },
        "The instruction set the executor's sum kernels use in this process (JAX_BLINK_CPU_ISA caps it).");
  m.def("sum_with", &jax_blink::SumWith, nb::arg("isa"), nb::arg("dtype"), nb::arg("out"), nb::arg("first"),
        nb::arg("srcs"), nb::arg("n"), "Test entry: out = first + srcs[0] + ... with one instruction set's kernel.");
  m.def("validate", &jax_blink::Validate, nb::arg("schedule"), "Decode + validate a schedule; '' or the error.");
  m.def("arch_support_reason", &jax_blink::ArchSupportReason, nb::arg("archs"), nb::arg("major"), nb::arg("minor"),
        "'' when a CUDA binary with these architectures runs on compute capability major.minor, else why not.");
  m.def("driver_support_reason", &jax_blink::DriverSupportReason, nb::arg("driver_version"),
        nb::arg("runtime_version"), "'' when the driver can run a runtime of that version, else why not.");
  m.def("error_class", &jax_blink::ErrorClassOf, nb::arg("message"),
        "0 invalid argument, 1 internal (CUDA), 2 deadline exceeded: the FFI error code of a message.");
}
