// gpu_check: runs the jax_blink CUDA executor on a real GPU for one schedule, rank r's buffers and
// stream on GPU r % ndev (several ranks share a GPU when there are fewer GPUs than ranks), checks every
// rank's output bitwise against a host execution of the schedule rows, then times it.
//   blink_gpu_check <schedule.int64 file> [float32|int32] [iterations=20]
// JAX_BLINK_CUDA_FORCE_STAGING=1 forces the no-peer path (reduce sources staged by the copy engine).
// The interpreter executor is checked and timed (one kernel launch per rank and call, counted), then a
// pointer change (the pointer table uploaded once, then found again in its cache).
// Prints "gpu_check: PASS ..." / "gpu_check: FAIL ..." lines; exit 0 on pass, 1 on mismatch, 2 on a
// setup or CUDA error, 3 without a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <cstring>
#include <fstream>
#include <random>
#include <vector>

#include "cuda_executor.h"
#include "element_add.h"

using namespace jax_blink;

// out = a + b with the executors' adds (element_add.h), one scalar per thread and step: the reference
// rate for the interpreter's numbers (3 x bytes moved per call).
template <class A>
__global__ void AddKernel(typename A::V* out, const typename A::V* a, const typename A::V* b, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = A::Add(a[i], b[i]);
}

void LaunchAdd(Dtype dt, void* out, const void* a, const void* b, int64_t n, cudaStream_t st) {
  const ScalarLayout l = ScalarOf(dt);
  const int64_t scalars = n * l.lanes;
  const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((scalars + 255) / 256, 4096)));
  arith::WithAdd(l.scalar, [&](auto add) {
    using A = decltype(add);
    using V = typename A::V;
    AddKernel<A><<<blocks, 256, 0, st>>>(static_cast<V*>(out), static_cast<const V*>(a), static_cast<const V*>(b),
                                         scalars);
  });
}

#define CHECK(expr)                                                                          \
  do {                                                                                       \
    cudaError_t e_ = (expr);                                                                 \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "gpu_check: FAIL %s: %s\n", #expr, cudaGetErrorString(e_));       \
      return 2;                                                                              \
    }                                                                                        \
  } while (0)

template <typename T>
int Run(const ExecPlan& plan, Dtype dt, const char* dname, int iters) {
  const Schedule& s = plan.schedule;
  const int64_t n = s.nranks, ne = s.nelems;
  int ndev = 0;
  CHECK(cudaGetDeviceCount(&ndev));
  const bool staging = std::getenv("JAX_BLINK_CUDA_FORCE_STAGING") && std::strcmp(std::getenv("JAX_BLINK_CUDA_FORCE_STAGING"), "0");
  const char* coll = s.collective == Collective::kAllReduce ? "allreduce" : s.collective == Collective::kBroadcast ? "broadcast" : "reduce";
  std::mt19937 rng(7);
  std::vector<std::vector<T>> host(n, std::vector<T>(ne));
  for (auto& v : host)
    for (auto& x : v) x = static_cast<T>(static_cast<int>(rng() % 2001) - 1000);  // exact float sums
  std::vector<CudaRank> ranks(n);
  for (int64_t r = 0; r < n; ++r) {
    const int dev = static_cast<int>(r % ndev);
    CHECK(cudaSetDevice(dev));
    cudaStream_t st;
    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    void *in, *out;
    CHECK(cudaMalloc(&in, ne * sizeof(T) + 16));
    CHECK(cudaMalloc(&out, ne * sizeof(T) + 16));
    CHECK(cudaMemcpy(in, host[r].data(), ne * sizeof(T), cudaMemcpyHostToDevice));
    CHECK(cudaMemset(out, 0x7f, ne * sizeof(T)));
    ranks[r] = CudaRank{dev, st, {in}, {out}};
  }
  std::vector<std::vector<T>> ref = host;
  for (const Transfer& t : s.transfers) {
    const int64_t lo = s.chunk_offset[t.chunk], hi = lo + s.chunk_length[t.chunk];
    for (int64_t i = lo; i < hi; ++i) ref[t.dst][i] = t.op == 0 ? static_cast<T>(ref[t.dst][i] + ref[t.src][i]) : ref[t.src][i];
  }
  if (s.collective == Collective::kReduce && !s.seg_root.empty())
    for (int64_t r = 0; r < n; ++r)
      if (r != s.seg_root[0]) std::fill(ref[r].begin(), ref[r].end(), T(0));
  auto sync = [&] { for (int d = 0; d < ndev; ++d) { cudaSetDevice(d); cudaDeviceSynchronize(); } };
  const double bytes = ne * static_cast<double>(sizeof(T));
  // One checked call: outputs scribbled, enqueue, wait, every rank's output bitwise against the host.
  // Returns 0, 1 (mismatch) or 2 (error); *us gets the host time of the enqueue.
  auto checked = [&](const char* what, double* us) -> int {
    for (auto& r : ranks) {
      cudaSetDevice(r.device);
      if (cudaMemset(r.out[0], 0x7f, ne * sizeof(T)) != cudaSuccess) return 2;
    }
    sync();
    auto t0 = std::chrono::steady_clock::now();
    CudaStatus st = EnqueueOnCuda(plan, dt, ranks, /*cache_key=*/12345, /*group=*/0);
    if (us) *us = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e6;
    if (!st.ok()) { std::fprintf(stderr, "gpu_check: FAIL enqueue (%s): %s\n", what, st.message.c_str()); return 2; }
    sync();
    if (cudaGetLastError() != cudaSuccess) { std::fprintf(stderr, "gpu_check: FAIL %s: CUDA error after the call\n", what); return 2; }
    {  // the call did not wait for its kernels: read their error records now
      const std::string rec = PollCudaErrors();
      if (!rec.empty()) { std::fprintf(stderr, "gpu_check: FAIL %s: %s\n", what, rec.c_str()); return 2; }
    }
    int bad = 0;
    std::vector<T> got(ne);
    for (int64_t r = 0; r < n; ++r) {
      if (cudaMemcpy(got.data(), ranks[r].out[0], ne * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess) return 2;
      if (std::memcmp(got.data(), ref[r].data(), ne * sizeof(T)) != 0) {
        int64_t i = 0;
        while (i < ne && std::memcmp(&got[i], &ref[r][i], sizeof(T)) == 0) ++i;
        if (bad++ < 3)
          std::fprintf(stderr, "gpu_check: %s: rank %lld differs from the host reference first at element %lld (%g vs %g)\n",
                       what, (long long)r, (long long)i, (double)got[i], (double)ref[r][i]);
      }
    }
    if (bad) {
      std::printf("gpu_check: FAIL %s %s ranks=%lld gpus=%d staging=%s %s: %d ranks differ\n", coll, dname, (long long)n,
                  ndev, staging ? "forced" : "auto", what, bad);
      return 1;
    }
    return 0;
  };
  // The interpreter: one launch per rank and call, checked bitwise then timed (the same call
  // repeatedly, program cached; wall clock with all devices synchronised).
  {
    const CudaStats before = GetCudaStats();
    double first_us = 0;
    int rc = checked("interp", &first_us);
    if (rc) return rc;
    const int warm = iters > 1 ? 1 : 0;  // sanitizer runs (1 iteration) skip the warm-up call
    if (warm) EnqueueOnCuda(plan, dt, ranks, 12345, 0);
    sync();
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) {
      CudaStatus st = EnqueueOnCuda(plan, dt, ranks, 12345, 0);
      if (!st.ok()) { std::fprintf(stderr, "gpu_check: FAIL enqueue: %s\n", st.message.c_str()); return 2; }
    }
    auto t1 = std::chrono::steady_clock::now();
    sync();
    auto t2 = std::chrono::steady_clock::now();
    {
      const std::string rec = PollCudaErrors();
      if (!rec.empty()) { std::fprintf(stderr, "gpu_check: FAIL timed calls: %s\n", rec.c_str()); return 2; }
    }
    const CudaStats after = GetCudaStats();
    const int64_t launches = after.launches - before.launches, calls = iters + 1 + warm;
    if (launches != n * calls) {
      std::printf("gpu_check: FAIL %s %s %lld kernel launches for %lld calls of %lld ranks (want one per rank)\n", coll,
                  dname, (long long)launches, (long long)calls, (long long)n);
      return 1;
    }
    const double t = std::chrono::duration<double>(t2 - t0).count() / iters;
    const double host_us = std::chrono::duration<double>(t1 - t0).count() / iters * 1e6;
    const double algbw = bytes / t / 1e9;
    const double busbw = s.collective == Collective::kAllReduce ? algbw * 2.0 * (n - 1) / n : algbw;
    std::printf("gpu_check: PASS %s %s ranks=%lld gpus=%d staging=%s path=interp size=%.1fMiB time=%.3fms algbw=%.1fGB/s "
                "busbw=%.1fGB/s enqueue=%.0fus first=%.0fus launches/call=%lld table_uploads=%lld\n", coll, dname,
                (long long)n, ndev, staging ? "forced" : "auto", bytes / 1048576.0, t * 1e3, algbw, busbw, host_us,
                first_us, (long long)(launches / calls), (long long)(after.table_uploads - before.table_uploads));
  }
  // New buffer pointers: the pointer table is uploaded once per rank, checked bitwise; back to the
  // first pointers: found among the cached tables (no upload).
  {
    std::vector<void*> first_out(n), alt(n, nullptr);
    const CudaStats before = GetCudaStats();
    for (int64_t r = 0; r < n; ++r) {
      CHECK(cudaSetDevice(ranks[r].device));
      CHECK(cudaMalloc(&alt[r], ne * sizeof(T) + 16));
      first_out[r] = ranks[r].out[0];
      ranks[r].out[0] = alt[r];
    }
    int rc = checked("new pointers", nullptr);
    const CudaStats mid = GetCudaStats();
    for (int64_t r = 0; r < n; ++r) ranks[r].out[0] = first_out[r];
    if (!rc) rc = checked("first pointers again", nullptr);
    sync();
    for (int64_t r = 0; r < n; ++r) { cudaSetDevice(ranks[r].device); cudaFree(alt[r]); }
    if (rc) return rc;
    const CudaStats after = GetCudaStats();
    const long long up_new = mid.table_uploads - before.table_uploads, up_old = after.table_uploads - mid.table_uploads;
    if (up_new != n || up_old != 0) {
      std::printf("gpu_check: FAIL %s %s pointer change: %lld table uploads for new pointers (want %lld), %lld for "
                  "the first pointers again (want 0)\n", coll, dname, up_new, (long long)n, up_old);
      return 1;
    }
    std::printf("gpu_check: PASS %s %s pointer change: %lld table uploads, 0 when the first pointers come back\n",
                coll, dname, up_new);
  }
  // Kernel rates on rank 0's GPU (reference for the numbers above).
  if (n >= 2 && ranks[1].device == ranks[0].device) {
    cudaSetDevice(ranks[0].device);
    cudaStream_t s0 = static_cast<cudaStream_t>(ranks[0].stream);
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    auto timeit = [&](auto&& body) {
      body();
      cudaEventRecord(e0, s0);
      for (int i = 0; i < iters; ++i) body();
      cudaEventRecord(e1, s0);
      cudaEventSynchronize(e1);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      return ms / 1e3 / iters;
    };
    double ta = timeit([&] { LaunchAdd(dt, ranks[0].out[0], ranks[0].in[0], ranks[1].in[0], ne, s0); });
    double tc = timeit([&] { cudaMemcpyAsync(ranks[0].out[0], ranks[0].in[0], ne * sizeof(T), cudaMemcpyDeviceToDevice, s0); });
    std::printf("gpu_check: kernel out=a+b %.1f GB/s (r+w), device copy %.1f GB/s (r+w)\n", 3 * bytes / ta / 1e9,
                2 * bytes / tc / 1e9);
  }
  return 0;
}

int main(int argc, char** argv) {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::fprintf(stderr, "gpu_check: no CUDA device visible\n");
    return 3;
  }
  if (argc < 2) {
    std::fprintf(stderr, "usage: blink_gpu_check <schedule.int64> [float32|int32] [iterations]\n");
    return 2;
  }
  std::ifstream f(argv[1], std::ios::binary);
  if (!f) { std::fprintf(stderr, "gpu_check: cannot read %s\n", argv[1]); return 2; }
  f.seekg(0, std::ios::end);
  std::vector<int64_t> words(static_cast<size_t>(f.tellg()) / 8);
  f.seekg(0);
  f.read(reinterpret_cast<char*>(words.data()), words.size() * 8);
  std::vector<Schedule> scheds;
  std::string err = DecodeSchedules(words.data(), words.size(), &scheds);
  ExecPlan plan;
  if (err.empty()) err = BuildExecPlan(scheds[0], &plan);
  if (!err.empty()) { std::fprintf(stderr, "gpu_check: %s\n", err.c_str()); return 2; }
  const std::string dt = argc > 2 ? argv[2] : "float32";
  const int iters = argc > 3 ? std::atoi(argv[3]) : 20;
  if (dt == "int32") return Run<int32_t>(plan, Dtype::kS32, "int32", iters);
  return Run<float>(plan, Dtype::kF32, "float32", iters);
}
