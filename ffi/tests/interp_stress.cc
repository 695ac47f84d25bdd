// The device interpreter's host build (interp_host.cc: a thread per rank block, acquire/release
// flags) without Python, for ThreadSanitizer: each argument is a case directory written by
// jax_blink.lowering.gpu_program_check.write_tsan_cases (meta.txt, sched.bin, in.bin, want.bin).
// A case either must give every rank's expected output bit for bit over `calls` calls, or (absent
// rank >= 0) must fail in every other rank naming the absent one. Prints
//   interp_stress: N cases, F check failures
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "interp_host.h"
#include "interp_plan.h"

using namespace jax_blink;

static std::vector<char> ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(f), {});
}

int main(int argc, char** argv) {
  int failures = 0, cases = 0;
  for (int a = 1; a < argc; ++a) {
    const std::string dir = argv[a];
    std::ifstream meta(dir + "/meta.txt");
    std::string dtype_name;
    int64_t nleaves = 0, max_blocks = 0, absent = -1, calls = 1, timeout_ms = 2000, seeds = 1, npeer = 0;
    meta >> dtype_name >> max_blocks >> absent >> calls >> timeout_ms >> seeds >> nleaves;
    std::vector<int64_t> leaves(nleaves);
    std::vector<uint8_t> aliased(nleaves);
    for (auto& x : leaves) meta >> x;
    for (auto& x : aliased) { int v; meta >> v; x = static_cast<uint8_t>(v); }
    meta >> npeer;
    std::vector<uint8_t> peer(npeer);
    for (auto& x : peer) { int v; meta >> v; x = static_cast<uint8_t>(v); }
    const auto dt = DtypeFromName(dtype_name);
    std::vector<char> sb = ReadAll(dir + "/sched.bin"), in = ReadAll(dir + "/in.bin"), want = ReadAll(dir + "/want.bin");
    std::vector<Schedule> scheds;
    std::string err = dt ? DecodeSchedules(reinterpret_cast<const int64_t*>(sb.data()), sb.size() / 8, &scheds)
                         : "unknown dtype " + dtype_name;
    ExecPlan plan;
    if (err.empty()) err = BuildExecPlan(scheds[0], &plan);
    InterpPlan ip;
    InterpOptions opt;
    opt.peer_ok = peer;
    opt.max_blocks = static_cast<int>(max_blocks);
    opt.leaf_elems = leaves;
    if (err.empty()) err = BuildInterpPlan(plan, *dt, opt, &ip);
    if (!err.empty()) {
      std::printf("%s: %s\n", dir.c_str(), err.c_str());
      ++failures;
      continue;
    }
    const int64_t n = plan.schedule.nranks, bytes = plan.schedule.nelems * static_cast<int64_t>(DtypeSize(*dt));
    std::vector<const void*> ins;
    for (int64_t r = 0; r < n; ++r) ins.push_back(in.data() + r * bytes);
    for (int64_t s = 0; s < seeds; ++s) {
      ++cases;
      HostRunOptions ho;
      ho.seed = static_cast<uint64_t>(s);
      ho.absent_rank = static_cast<int32_t>(absent);
      ho.calls = calls;
      ho.timeout_ms = timeout_ms;
      ho.watch = true;  // the non-blocking error path polls the records while the blocks run
      HostRunResult res;
      err = RunInterpOnHost(ip, ins, plan.schedule.nelems, aliased, ho, &res);
      bool ok = err.empty();
      if (ok && absent < 0) {
        ok = res.error.empty() && res.watch_error.empty();
        for (int64_t r = 0; r < n && ok; ++r)
          ok = std::memcmp(res.outputs[r].data(), want.data() + r * bytes, static_cast<size_t>(bytes)) == 0;
      } else if (ok) {
        ok = res.error.find("rank " + std::to_string(absent) + " never arrived") != std::string::npos &&
             res.watch_error.find("rank " + std::to_string(absent) + " never arrived") != std::string::npos;
        for (int64_t r = 0; r < n && ok; ++r)
          if (r != absent) ok = res.records[r].missing_rank == absent;
      }
      if (!ok) {
        ++failures;
        std::printf("%s seed %lld: check failed: %s %s\n", dir.c_str(), static_cast<long long>(s), err.c_str(),
                    res.error.c_str());
      }
    }
  }
  std::printf("interp_stress: %d cases, %d check failures\n", cases, failures);
  return failures ? 1 : 0;
}
