// Python module jax_blink._native._cuda: the XLA FFI handler "jax_blink_cuda" (platform "CUDA"), the
// build/compatibility facts jax_blink.lowering.ffi checks before registering it, and `execute`, which
// runs the executor outside XLA (rank r on GPU r % ndev) for jax_blink.selftest and scripts/gpu_check.sh.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstring>
#include <stdexcept>

#include "cuda_executor.h"
#include "nb_arrays.h"

namespace nb = nanobind;

namespace jax_blink {
namespace {

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("jax_blink CUDA error at ") + what + ": " + cudaGetErrorString(e));
}

// Runs the first group's schedule over `inputs` (one array per rank, host memory) with rank r's buffers
// and stream on GPU r % ndev, `iters` + 1 times (the first checked, the rest timed), writing the first
// run's results into `outputs`. Returns (seconds per call, wall clock, all GPUs synchronised; "" or the
// executor's error). cache_key: the program cache key (distinct per schedule). leaf_sizes: each rank's
// array is cut into leaves of these sizes (elements, summing to nelems; empty: one leaf), each a
// separate device allocation, as a bucket's operands; in_place: each leaf's result is its operand.
std::pair<double, std::string> Execute(I64Array schedule, std::string dtype, std::vector<AnyArray> inputs,
                                       std::vector<AnyArray> outputs, int iters, int64_t cache_key,
                                       std::vector<int64_t> leaf_sizes, bool in_place) {
  Dtype dt = DtypeByName(dtype);
  std::vector<Schedule> scheds;
  std::string err = DecodeSchedules(schedule.data(), schedule.shape(0), &scheds);
  auto plan = std::make_shared<ExecPlan>();
  if (err.empty()) err = BuildExecPlan(scheds[0], plan.get());
  if (!err.empty()) throw std::invalid_argument(err);
  const int64_t n = plan->schedule.nranks;
  const size_t bytes = static_cast<size_t>(plan->schedule.nelems) * DtypeSize(dt);
  if (static_cast<int64_t>(inputs.size()) != n || static_cast<int64_t>(outputs.size()) != n)
    throw std::invalid_argument("need one input and one output array per rank");
  for (int64_t r = 0; r < n; ++r)
    if (inputs[r].nbytes() != bytes || outputs[r].nbytes() != bytes)
      throw std::invalid_argument("array sizes differ from the schedule's nelems x dtype size");
  if (leaf_sizes.empty()) leaf_sizes = {plan->schedule.nelems};
  int64_t total = 0;
  for (int64_t l : leaf_sizes) {
    if (l <= 0) throw std::invalid_argument("leaf sizes must be positive");
    total += l;
  }
  if (total != plan->schedule.nelems) throw std::invalid_argument("leaf sizes must sum to the schedule's nelems");
  const size_t es = DtypeSize(dt);
  int ndev = 0;
  Check(cudaGetDeviceCount(&ndev), "cudaGetDeviceCount");
  if (ndev == 0) throw std::runtime_error("no CUDA device visible");
  std::vector<CudaRank> ranks(n);
  auto sync = [&] {
    for (int d = 0; d < ndev; ++d) {
      Check(cudaSetDevice(d), "cudaSetDevice");
      Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    }
  };
  auto release = [&] {
    for (auto& r : ranks) {
      cudaSetDevice(r.device);
      for (size_t l = 0; l < r.in.size(); ++l)
        if (r.in[l] != r.out[l]) cudaFree(const_cast<void*>(r.in[l]));
      for (void* p : r.out) cudaFree(p);
      if (r.stream) cudaStreamDestroy(static_cast<cudaStream_t>(r.stream));
    }
  };
  // Copies between a rank's host array and its leaves (to_device: host -> inputs, else outputs -> host).
  auto transfer = [&](int64_t r, bool to_device) {
    size_t pos = 0;
    for (size_t l = 0; l < leaf_sizes.size(); ++l) {
      const size_t b = static_cast<size_t>(leaf_sizes[l]) * es;
      if (to_device)
        Check(cudaMemcpy(const_cast<void*>(ranks[r].in[l]), static_cast<const char*>(inputs[r].data()) + pos, b,
                         cudaMemcpyHostToDevice), "cudaMemcpy H2D");
      else
        Check(cudaMemcpy(static_cast<char*>(outputs[r].data()) + pos, ranks[r].out[l], b, cudaMemcpyDeviceToHost),
              "cudaMemcpy D2H");
      pos += b;
    }
  };
  double per_call = 0;
  std::string run_err;
  try {
    for (int64_t r = 0; r < n; ++r) {
      ranks[r].device = static_cast<int>(r % ndev);
      Check(cudaSetDevice(ranks[r].device), "cudaSetDevice");
      cudaStream_t st;
      Check(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
      ranks[r].stream = st;
      for (int64_t l : leaf_sizes) {
        const size_t b = static_cast<size_t>(l) * es;
        void *in = nullptr, *out = nullptr;
        Check(cudaMalloc(&out, b + 16), "cudaMalloc");
        ranks[r].out.push_back(out);
        if (in_place) {
          in = out;
        } else {
          Check(cudaMalloc(&in, b + 16), "cudaMalloc");
          Check(cudaMemset(out, 0x5a, b), "cudaMemset");
        }
        ranks[r].in.push_back(in);
      }
      transfer(r, true);
    }
    sync();
    {
      nb::gil_scoped_release unlock;
      CudaStatus st = EnqueueOnCuda(*plan, dt, ranks, cache_key, 0, leaf_sizes);
      if (!st.ok()) run_err = st.message;
      sync();
      if (run_err.empty()) run_err = PollCudaErrors();  // the call's own records (it did not wait)
      if (run_err.empty()) {
        for (int64_t r = 0; r < n; ++r) transfer(r, false);
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters && run_err.empty(); ++i) {
          st = EnqueueOnCuda(*plan, dt, ranks, cache_key, 0, leaf_sizes);
          if (!st.ok()) run_err = st.message;
        }
        sync();
        if (run_err.empty()) run_err = PollCudaErrors();
        per_call = iters > 0 ? std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters : 0;
      }
    }
  } catch (...) {
    release();
    throw;
  }
  release();
  return {per_call, run_err};
}

int DriverVersion() {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) { cudaGetLastError(); return 0; }
  return v;
}

std::vector<std::string> DeviceNames() {
  std::vector<std::string> out;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) { cudaGetLastError(); return out; }
  for (int d = 0; d < n; ++d) {
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, d) == cudaSuccess)
      out.push_back(std::string(p.name) + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) + ")");
  }
  return out;
}

}  // namespace
}  // namespace jax_blink

NB_MODULE(_cuda, m) {
  m.doc() = "jax_blink native CUDA executor (XLA FFI target jax_blink_cuda)";
  m.def("handler", []() { return nb::capsule(jax_blink::CudaHandlerAddress()); },
        "PyCapsule of the XLA FFI handler for platform 'CUDA'.");
  m.def("check_compatibility", &jax_blink::CheckCudaCompatibility,
        "'' when this build runs on every visible GPU with the installed driver, else why not.");
  m.def("built_cuda_version", &jax_blink::BuiltCudaVersion, "CUDA runtime version compiled in (e.g. 13000).");
  m.def("built_architectures", []() { return std::string(jax_blink::BuiltCudaArchitectures()); },
        "CUDA architectures compiled in (CMake syntax, ',' separated, e.g. '75-real,80-real,90').");
  m.def("poll_errors", []() {
    nb::gil_scoped_release unlock;
    return jax_blink::PollCudaErrors();
  }, "The first failed collective not reported yet (its kernels' error records), or ''; never waits.");
  m.def("driver_version", &jax_blink::DriverVersion, "cudaDriverGetVersion (0 without a driver).");
  m.def("device_names", &jax_blink::DeviceNames, "Names and architectures of the visible CUDA devices.");
  m.def("execute", &jax_blink::Execute, nb::arg("schedule"), nb::arg("dtype"), nb::arg("inputs"), nb::arg("outputs"),
        nb::arg("iters"), nb::arg("cache_key"), nb::arg("leaf_sizes") = std::vector<int64_t>{},
        nb::arg("in_place") = false,
        "Run the executor outside XLA (rank r on GPU r % ndev; each rank's array cut into leaves of leaf_sizes "
        "elements, separate allocations; in_place: results alias the operands); (seconds per call, error or '').");
}
