// gpu_check: runs the jax_blink CUDA executor for N ranks whose buffers all live on one GPU, checks the
// result bitwise against a host execution of the same schedule rows, and prints the reduction kernel's
// GB/s beside a device-to-device copy's GB/s.
//   blink_gpu_check <schedule.int64 file | -> [nranks-for-builtin]
// With "-", a built-in binary-tree all-reduce schedule (rank r's parent (r-1)/2, 8 chunks) is used.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <vector>

#include "cuda_executor.h"

using namespace jax_blink;

#define CHECK(expr)                                                                          \
  do {                                                                                       \
    cudaError_t e_ = (expr);                                                                 \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "gpu_check: %s failed: %s\n", #expr, cudaGetErrorString(e_));     \
      return 2;                                                                              \
    }                                                                                        \
  } while (0)

static std::vector<int64_t> BuiltinSchedule(int64_t n, int64_t nelems, int64_t chunks) {
  std::vector<int64_t> parent(n);
  for (int64_t r = 0; r < n; ++r) parent[r] = r == 0 ? -1 : (r - 1) / 2;
  std::vector<int64_t> depth(n, 0);
  for (int64_t r = 1; r < n; ++r) depth[r] = depth[parent[r]] + 1;
  std::vector<int64_t> a = {kScheduleMagic, kScheduleVersion, 0, n, nelems, 1, chunks, 0};
  a.push_back(0); a.push_back(0); a.push_back(nelems);                 // segment
  for (int k = 0; k < 2; ++k) for (int64_t r = 0; r < n; ++r) a.push_back(parent[r]);
  std::vector<int64_t> rows;
  int64_t maxd = 0;
  for (auto d : depth) maxd = std::max(maxd, d);
  for (int64_t c = 0; c < chunks; ++c) a.push_back(0);
  for (int64_t c = 0; c < chunks; ++c) a.push_back(nelems * c / chunks);
  for (int64_t c = 0; c < chunks; ++c) a.push_back(nelems * (c + 1) / chunks - nelems * c / chunks);
  int64_t round = 0, T = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t d = maxd; d >= 1; --d)  // reduce, deepest first
      for (int64_t r = 1; r < n; ++r)
        if (depth[r] == d) { rows.insert(rows.end(), {round++, 0, r, parent[r], c}); ++T; }
    for (int64_t d = 1; d <= maxd; ++d)  // broadcast
      for (int64_t r = 1; r < n; ++r)
        if (depth[r] == d) { rows.insert(rows.end(), {round++, 1, parent[r], r, c}); ++T; }
  }
  a[7] = T;
  a.insert(a.end(), rows.begin(), rows.end());
  return a;
}

int main(int argc, char** argv) {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::fprintf(stderr, "gpu_check: no CUDA device visible (cudaGetDeviceCount failed or returned 0); "
                         "run this on a machine with an NVIDIA GPU and driver\n");
    return 3;
  }
  std::vector<int64_t> words;
  if (argc > 1 && std::strcmp(argv[1], "-") != 0) {
    std::ifstream f(argv[1], std::ios::binary);
    if (!f) { std::fprintf(stderr, "gpu_check: cannot read %s\n", argv[1]); return 2; }
    f.seekg(0, std::ios::end);
    words.resize(static_cast<size_t>(f.tellg()) / 8);
    f.seekg(0);
    f.read(reinterpret_cast<char*>(words.data()), words.size() * 8);
  } else {
    int64_t n = argc > 2 ? std::atoll(argv[2]) : 8;
    words = BuiltinSchedule(n, (64ll << 20) / 4, 8);
  }
  std::vector<Schedule> scheds;
  std::string err = DecodeSchedules(words.data(), words.size(), &scheds);
  if (!err.empty()) { std::fprintf(stderr, "gpu_check: %s\n", err.c_str()); return 2; }
  ExecPlan plan;
  BuildExecPlan(scheds[0], &plan);
  const Schedule& s = plan.schedule;
  const int64_t n = s.nranks, ne = s.nelems;
  std::printf("gpu_check: %lld ranks on GPU 0, %lld float32 elements (%.1f MiB) per rank, %zu transfers\n",
              (long long)n, (long long)ne, ne * 4 / 1048576.0, s.transfers.size());
  // Integer-valued inputs: every float32 sum is exact, and the host runs the same rows anyway.
  std::mt19937 rng(1);
  std::vector<std::vector<float>> host(n, std::vector<float>(ne));
  for (auto& v : host) for (auto& x : v) x = static_cast<float>(static_cast<int>(rng() % 201) - 100);
  std::vector<CudaRank> ranks(n);
  CHECK(cudaSetDevice(0));
  for (int64_t r = 0; r < n; ++r) {
    cudaStream_t st;
    CHECK(cudaStreamCreate(&st));
    void *in, *out;
    CHECK(cudaMalloc(&in, ne * 4));
    CHECK(cudaMalloc(&out, ne * 4));
    CHECK(cudaMemcpy(in, host[r].data(), ne * 4, cudaMemcpyHostToDevice));
    ranks[r] = CudaRank{0, st, in, out};
  }
  // Host reference: the rows in order (docs/architecture.md semantics).
  std::vector<std::vector<float>> ref = host;
  for (const Transfer& t : s.transfers) {
    int64_t lo = s.chunk_offset[t.chunk], hi = lo + s.chunk_length[t.chunk];
    for (int64_t i = lo; i < hi; ++i) ref[t.dst][i] = t.op == 0 ? ref[t.dst][i] + ref[t.src][i] : ref[t.src][i];
  }
  err = EnqueueOnCuda(plan, Dtype::kF32, ranks);
  if (!err.empty()) { std::fprintf(stderr, "gpu_check: %s\n", err.c_str()); return 1; }
  CHECK(cudaDeviceSynchronize());
  int bad = 0;
  std::vector<float> got(ne);
  for (int64_t r = 0; r < n; ++r) {
    CHECK(cudaMemcpy(got.data(), ranks[r].out, ne * 4, cudaMemcpyDeviceToHost));
    if (std::memcmp(got.data(), ref[r].data(), ne * 4) != 0) {
      ++bad;
      std::fprintf(stderr, "gpu_check: rank %lld differs from the host reference\n", (long long)r);
    }
  }
  if (bad) return 1;
  std::printf("gpu_check: results match the host reference bitwise on all %lld ranks\n", (long long)n);

  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  cudaStream_t st = static_cast<cudaStream_t>(ranks[0].stream);
  const int iters = 20;
  auto timeit = [&](auto&& body) -> double {
    body();
    cudaEventRecord(e0, st);
    for (int i = 0; i < iters; ++i) body();
    cudaEventRecord(e1, st);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    return ms / 1e3 / iters;
  };
  const double bytes = ne * 4.0;
  double t_add = timeit([&] { LaunchAdd(Dtype::kF32, ranks[0].in, ranks[1 % n].in, ranks[0].out, ne, st); });
  double t_copy = timeit([&] { cudaMemcpyAsync(ranks[0].out, ranks[0].in, ne * 4, cudaMemcpyDeviceToDevice, st); });
  double t_ar = timeit([&] {
    EnqueueOnCuda(plan, Dtype::kF32, ranks);
  });
  CHECK(cudaDeviceSynchronize());
  std::printf("%-34s %10s %12s\n", "kernel", "time (ms)", "GB/s (r+w)");
  std::printf("%-34s %10.3f %12.1f\n", "reduction kernel out=a+b (f32)", t_add * 1e3, 3 * bytes / t_add / 1e9);
  std::printf("%-34s %10.3f %12.1f\n", "device-to-device copy", t_copy * 1e3, 2 * bytes / t_copy / 1e9);
  std::printf("%-34s %10.3f %12.1f  (algbw = bytes per rank / time)\n", "executor all-reduce", t_ar * 1e3,
              bytes / t_ar / 1e9);
  return 0;
}
