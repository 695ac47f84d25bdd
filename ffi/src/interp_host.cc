// Host runner of the device interpreter (see interp_host.h).
#include "interp_host.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

namespace jax_blink {
namespace {

thread_local std::mt19937_64* t_rng = nullptr;  // per block thread: its random delays
thread_local int64_t* t_wide = nullptr;         // per block thread: scalars moved in 16-byte words

// The host's memory primitives: GCC/Clang __atomic builtins (what std::atomic compiles to, and what
// ThreadSanitizer models), one thread per block.
// JAX_BLINK_INTERP_RELAXED_FLAGS (a mutation build for the TSan check's own test) drops the
// ordering: the flag protocol then races and ThreadSanitizer must say so.
#ifdef JAX_BLINK_INTERP_RELAXED_FLAGS
constexpr int kAcquire = __ATOMIC_RELAXED, kRelease = __ATOMIC_RELAXED;
#else
constexpr int kAcquire = __ATOMIC_ACQUIRE, kRelease = __ATOMIC_RELEASE;
#endif
struct HostMem {
  static uint64_t LoadAcquire(const uint64_t* p) { return __atomic_load_n(p, kAcquire); }
  static void StoreRelease(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, kRelease); }
  static uint64_t Exchange(uint64_t* p, uint64_t v) { return __atomic_exchange_n(p, v, __ATOMIC_ACQ_REL); }
  static uint64_t NowNs() {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
  }
  static int64_t Tid() { return 0; }
  static int64_t Threads() { return 1; }
  static void Sync() {}
  static void Pause(uint32_t spins) {  // yield, then sleep (hundreds of threads may share two cores)
    if (spins < 256) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(spins < 4096 ? 20 : 200));
  }
  static void CountWide(int64_t n) {
    if (t_wide) *t_wide += n;
  }
  static void Jitter() {
    if (!t_rng) return;
    const uint64_t r = (*t_rng)();
    if (r % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(r % 200));
    else if (r % 4 == 1) std::this_thread::yield();
  }
};

}  // namespace

std::string RunInterpOnHost(const InterpPlan& p, const std::vector<const void*>& inputs, int64_t nelems,
                            const std::vector<uint8_t>& aliased_in, const HostRunOptions& opt, HostRunResult* res) {
  const int32_t n = p.nranks, L = p.nleaves;
  if (static_cast<int32_t>(inputs.size()) != n) return "host interpreter: need one input per rank";
  if (p.leaf_start.back() != nelems) return "host interpreter: nelems differs from the plan's leaves";
  std::vector<uint8_t> aliased = aliased_in.empty() ? std::vector<uint8_t>(L, 0) : aliased_in;
  if (static_cast<int32_t>(aliased.size()) != L) return "host interpreter: aliased must have one entry per leaf";
  const int64_t es = p.elem_size;
  std::mt19937_64 rng(opt.seed * 0x9E3779B97F4A7C15ull + 7);
  auto garbage = [&](std::vector<uint8_t>& v) {
    for (auto& b : v) b = static_cast<uint8_t>(rng() | 1);
  };
  // every buffer its own allocation
  std::vector<std::vector<uint8_t>> in(static_cast<size_t>(n) * L), out(static_cast<size_t>(n) * L);
  std::vector<const void*> in_ptr(in.size());
  std::vector<void*> out_ptr(in.size());
  std::vector<std::vector<uint64_t>> flags(n);
  for (int32_t r = 0; r < n; ++r) flags[r].assign(static_cast<size_t>(p.flags_per_rank[r]), 0);
  std::vector<uint64_t*> flag_ptr(n);
  for (int32_t r = 0; r < n; ++r) flag_ptr[r] = flags[r].data();
  std::vector<interp::ErrorRecord> records(n, interp::ErrorRecord{0, -1, -1, -1});
  std::vector<interp::ErrorRecord*> err_ptr(n);
  for (int32_t r = 0; r < n; ++r) err_ptr[r] = &records[r];
  std::vector<uint8_t> staging(static_cast<size_t>(std::max<int64_t>(p.staging_elems * es, 1)));
  garbage(staging);
  int64_t nthreads = 0;
  res->error.clear();
  res->watch_error.clear();
  res->watch_early = false;
  res->wide_scalars = 0;
  ErrorWatch watch;
  watch.Reset(records.data(), n);
  for (int64_t call = 1; call <= opt.calls; ++call) {
    // XLA's part before the call: operands written, result buffers hold whatever they held
    for (int32_t r = 0; r < n; ++r)
      for (int32_t l = 0; l < L; ++l) {
        const size_t i = static_cast<size_t>(r) * L + l;
        const size_t bytes = static_cast<size_t>((p.leaf_start[l + 1] - p.leaf_start[l]) * es);
        const uint8_t* src = static_cast<const uint8_t*>(inputs[r]) + p.leaf_start[l] * es;
        out[i].resize(bytes);
        garbage(out[i]);
        if (aliased[l]) {
          std::memcpy(out[i].data(), src, bytes);
          in_ptr[i] = out[i].data();
        } else {
          in[i].assign(src, src + bytes);
          in_ptr[i] = in[i].data();
        }
        out_ptr[i] = out[i].data();
      }
    interp::Ptrs ptrs;
    ptrs.in = in_ptr.data();
    ptrs.out = out_ptr.data();
    ptrs.flags = flag_ptr.data();
    ptrs.errors = err_ptr.data();
    ptrs.staging = reinterpret_cast<char*>(staging.data());
    const interp::View v = p.view();
    std::vector<std::thread> threads;
    std::vector<int64_t> wide(static_cast<size_t>(n) * std::max<int32_t>(p.max_blocks, 1), 0);  // per thread
    // Start gate: every block thread blocks (no spinning) until all exist, then starts its clock.
    // Without it the threads created first spin while the creator, starved by them, is still
    // starting the last ranks' blocks (minutes under qemu on 2 cores: a false "never arrived").
    std::mutex gate_mu;
    std::condition_variable gate_cv;
    bool gate_open = false;
    for (int32_t r = 0; r < n; ++r) {
      if (r == opt.absent_rank) continue;
      const int32_t blocks = std::max(1, p.blocks_used[r]);
      for (int32_t b = 0; b < blocks; ++b) {
        const uint64_t seed = opt.seed ? rng() : 0;
        const int64_t late = r == opt.late_rank ? opt.late_ms : 0;
        int64_t* wide_slot = &wide[static_cast<size_t>(r) * std::max<int32_t>(p.max_blocks, 1) + b];
        threads.emplace_back([&v, &ptrs, r, b, call, seed, late, &opt, &gate_mu, &gate_cv, &gate_open, wide_slot] {
          {
            std::unique_lock<std::mutex> lk(gate_mu);
            gate_cv.wait(lk, [&] { return gate_open; });
          }
          std::unique_ptr<std::mt19937_64> g;
          if (seed) {
            g = std::make_unique<std::mt19937_64>(seed);
            t_rng = g.get();
          }
          t_wide = wide_slot;
          if (late > 0) std::this_thread::sleep_for(std::chrono::milliseconds(late));
          volatile int shared_ok = 0;
          interp::RunBlock<HostMem>(v, ptrs, r, b, static_cast<uint64_t>(call),
                                    static_cast<uint64_t>(opt.timeout_ms) * 1000000ull, &shared_ok);
          t_rng = nullptr;
          t_wide = nullptr;
        });
      }
    }
    nthreads = static_cast<int64_t>(threads.size());
    // the watch: polls the records while the blocks run (never waits for them); `running` is
    // cleared once every block thread joined
    std::thread poller;
    bool running = true;  // __atomic: written by this thread, read by the poller
    std::string polled;
    bool early = false;
    if (opt.watch) {
      watch.Launched(static_cast<uint64_t>(call), opt.timeout_ms);
      poller = std::thread([&] {
        while (__atomic_load_n(&running, __ATOMIC_ACQUIRE)) {
          std::string m = watch.Poll();
          if (!m.empty()) {
            polled = m;
            early = true;
            return;
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      });
    }
    {
      std::lock_guard<std::mutex> lk(gate_mu);
      gate_open = true;
    }
    gate_cv.notify_all();
    for (auto& t : threads) t.join();
    for (int64_t w : wide) res->wide_scalars += w;
    if (opt.watch) {
      __atomic_store_n(&running, false, __ATOMIC_RELEASE);
      poller.join();
      if (polled.empty()) polled = watch.Poll();  // what the next call's entry would find
      if (!polled.empty() && res->watch_error.empty()) {
        res->watch_error = polled;
        res->watch_early = early;
      }
    }
    res->error = InterpErrorMessage(records, static_cast<uint64_t>(call), opt.timeout_ms);
    if (!res->error.empty()) break;
  }
  res->threads = nthreads;
  res->records = records;
  res->outputs.assign(n, {});
  for (int32_t r = 0; r < n; ++r)
    for (int32_t l = 0; l < L; ++l) {
      const auto& o = out[static_cast<size_t>(r) * L + l];
      res->outputs[r].insert(res->outputs[r].end(), o.begin(), o.end());
    }
  return "";
}

}  // namespace jax_blink
