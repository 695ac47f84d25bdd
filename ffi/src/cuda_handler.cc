// The XLA FFI handler "jax_blink_cuda" (platform "CUDA"): checks a device's bucket of leaves, meets
// the call's other devices on the host to exchange buffer pointers, and has the last to arrive enqueue
// the interpreter launches for everyone (EnqueueOnCuda, cuda_executor.cu). The meeting blocks
// (XLA:GPU runs each device on its own thread), bounded by the timeout; a device that cannot join fails
// the whole call at once (FailCall). Not marked command-buffer compatible: the host meeting cannot be
// replayed in a graph. Host code only (CUDA runtime types, no kernels): the CPU handler's twin
// (cpu_module.cc), sharing its checks and binding (ffi_handler.h).
#include <cuda_runtime_api.h>

#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "blink_core.h"
#include "cuda_executor.h"
#include "ffi_handler.h"
#include "xla/ffi/api/ffi.h"

namespace jax_blink {

namespace ffi = xla::ffi;

namespace {

// XLA:GPU runs each device's program on its own host thread, so the host meeting may block (bounded by
// the timeout, enforced by the shared watchdog). Identity: the device table of the CUDA lowering is
// keyed by each device's local hardware id (its CUDA ordinal in this process, jax's
// Device.local_hardware_id); the handler finds its own from its first non-empty operand's pointer,
// falling back to the FFI device ordinal only when the pointer query fails. Operands: a bucket of
// leaves, as the CPU handler takes (the schedule runs over their concatenation; interp_plan.h).
ffi::Error BlinkCudaImpl(cudaStream_t stream, ffi::RunId run, int32_t ordinal, ffi::RemainingArgs args,
                         ffi::RemainingRets rets, ffi::Span<const int64_t> schedule,
                         ffi::Span<const int64_t> device_table, int64_t call_site, int64_t timeout_ms) {
  // The bucket: operand i -> result i, one dtype, equal element counts (XLA may alias result i to
  // operand i); zero-size leaves take no part (the same shapes on every device).
  CudaRank me{-1, stream, {}, {}};
  std::vector<Leaf> leaves;
  std::optional<Dtype> dt;
  // A malformed call: reported to the peers below, once the generation is known.
  std::string bad = BucketArityError(args.size(), rets.size());
  int64_t nelems = 0;
  const void* any_ptr = nullptr;  // identifies the device
  for (size_t i = 0; bad.empty() && i < args.size(); ++i) {
    BucketOperand op;
    bad = ReadBucketOperand(args, rets, i, &dt, &op);
    if (!bad.empty()) break;
    const int64_t n = op.in_count;
    if (op.out_count != n) {
      bad = "operand " + std::to_string(i) + " has " + std::to_string(n) + " elements and its result " +
            std::to_string(op.out_count) + " (the CUDA target takes full buffers, not shards)";
      break;
    }
    if (n == 0) continue;
    if (!any_ptr) any_ptr = op.in;
    leaves.push_back(Leaf{op.in, op.out, n});
    me.in.push_back(op.in);
    me.out.push_back(op.out);
    nelems += n;
  }
  if (bad.empty() && nelems == 0) return ffi::Error::Success();
  // the CUDA ordinal of this executor: asked once per FFI ordinal (no per-call pointer queries)
  static std::mutex hw_mu;
  static std::map<int32_t, int> hw_of;
  int hw = -1;
  {
    std::lock_guard<std::mutex> lock(hw_mu);
    auto it = hw_of.find(ordinal);
    if (it != hw_of.end()) {
      hw = it->second;
    } else if (any_ptr) {
      hw = DeviceOfPointer(any_ptr);
      if (hw >= 0) hw_of[ordinal] = hw;
    }
  }
  if (hw < 0) hw = ordinal;
  me.device = hw;
  if (IsTestAbsentDevice(hw)) return ffi::Error::Success();
  const int64_t generation = NextGeneration(run.run_id, call_site, hw);
  auto cannot_join = [&](ffi::ErrorCode code, const std::string& why) {
    std::string msg = "jax_blink: device " + std::to_string(hw) + " cannot join the collective: " + why;
    FailCall(run.run_id, call_site, generation, msg);
    return ffi::Error(code, msg);
  };
  if (!bad.empty()) return cannot_join(ffi::ErrorCode::kInvalidArgument, bad);
  std::shared_ptr<const CallSiteInfo> info;
  std::string err = GetCallSiteInfo(call_site, schedule.begin(), schedule.size(), device_table.begin(),
                                    device_table.size(), &info);
  if (!err.empty()) return cannot_join(ffi::ErrorCode::kInvalidArgument, err);
  const DeviceTable::Entry* e = info->table.Find(hw);
  if (!e)
    return cannot_join(ffi::ErrorCode::kInvalidArgument,
                       "CUDA device " + std::to_string(hw) + " is not in the device table (keyed by local hardware id)");
  auto result = std::make_shared<std::promise<std::string>>();
  std::future<std::string> fut = result->get_future();
  // backend = &me: valid, this thread waits below until the meeting finished
  Arrival a{hw, e->rank, *dt, nelems, std::move(leaves), /*where=*/"", /*backend=*/&me,
            [result](const std::string& msg) { result->set_value(msg); }};
  MeetingKey key{run.run_id, call_site, e->group, generation};
  auto meeting = Arrive(key, info, std::move(a), CudaTimeoutMs(timeout_ms));
  if (meeting) {
    std::vector<CudaRank> ranks;
    for (auto& arr : meeting->arrivals) ranks.push_back(*static_cast<CudaRank*>(arr.backend));
    std::vector<int64_t> leaf_elems;  // Arrive checked that every participant brings these sizes
    for (auto& l : meeting->arrivals[0].leaves) leaf_elems.push_back(l.nelems);
    CudaStatus st = EnqueueOnCuda(*meeting->plan, *dt, ranks, call_site, e->group, leaf_elems);
    meeting->Finish(st.message, e->rank);
  }
  std::string msg = fut.get();
  if (!msg.empty()) return ffi::Error(ErrorCodeOf(msg), msg);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(BlinkCuda, BlinkCudaImpl,
                       BindCollective(ffi::Ffi::Bind()
                                          .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                          .Ctx<ffi::RunId>()
                                          .Ctx<ffi::DeviceOrdinal>()));

void* CudaHandlerAddress() { return reinterpret_cast<void*>(BlinkCuda); }

}  // namespace jax_blink
