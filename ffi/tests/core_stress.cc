// Stress driver for the native rendezvous (blink_core.cc) and the CPU executor (cpu_executor.cc),
// without XLA or Python, so they can be built with ThreadSanitizer and with Address +
// UndefinedBehaviorSanitizer (tests/test_sanitizers.py builds and runs all three variants).
//
// Each trial is one collective on a device table of 1-2 groups, every device a thread of its own
// that arrives the way the XLA handler does (cpu_module.cc: NextGeneration, Arrive, the last
// arrival runs ExecuteOnCpu with its rank inline). Trials run many at once: concurrent meetings,
// several call sites of one run id at once, repeated run ids (one call site called many times per
// device: generations), late participants, and faults: an absent device (short timeout), a device
// arriving after the timeout, mismatched dtype or size, a duplicate rank, FailCall (a device that
// cannot join), an executor error. Results are checked against a plain reference sum.
//
// Successful completions wait in a barrier for every participant of their meeting, as a device's
// program does when it enters an XLA collective right after the jax_blink one: if one thread
// completed several devices in turn, the barrier would never fill (a deadlock: every device of a
// meeting must complete on its own thread).
//
// Usage: core_stress [rounds]   exit 0 when every check passed, 1 otherwise, 3 on the global watchdog.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "blink_core.h"
#include "cpu_executor.h"

using namespace jax_blink;
using Clock = std::chrono::steady_clock;

namespace {

std::atomic<int> g_failures{0};
std::atomic<int64_t> g_meetings_ok{0}, g_errors_seen{0};
std::mutex g_print_mu;

void Fail(const std::string& trial, const std::string& what) {
  std::lock_guard<std::mutex> l(g_print_mu);
  std::fprintf(stderr, "CHECK FAILED [%s]: %s\n", trial.c_str(), what.c_str());
  g_failures++;
}

// ---- schedules in the wire format (docs/architecture.md "Schedule") ----------------------------
// S segments, each cut into k chunks; even segments use a chain tree from their root, odd ones a
// star (`stars`: every segment a star). Allreduce roots rotate over the ranks; broadcast/reduce
// segments all root at `root`; sharded collectives (all-gather, reduce-scatter) have one segment per
// shard, rooted at its owner.
std::vector<int64_t> MakeSchedule(Collective coll, int nr, int64_t ne, int root, int S, int k, bool stars) {
  const CollectiveRow& row = *CollectiveRowOf(static_cast<int64_t>(coll));
  if (row.sharded) S = nr;  // ne is a multiple of nr
  std::vector<int64_t> seg_root, seg_off, seg_len, seg_ph, rp(S * nr, -1), bp(S * nr, -1), cseg, coff, clen, tr;
  int64_t off = 0;
  for (int s = 0; s < S; ++s) {
    const int64_t len = ne / S + (s < ne % S ? 1 : 0);
    const int r0 = coll == Collective::kAllReduce || row.sharded ? s % nr : root;
    seg_ph.push_back((row.reduces ? 1 : 0) | (row.broadcasts ? 2 : 0));
    seg_root.push_back(r0);
    seg_off.push_back(off);
    seg_len.push_back(len);
    std::vector<int> order(nr);
    for (int i = 0; i < nr; ++i) order[i] = (r0 + i) % nr;
    const bool chain = !stars && s % 2 == 0;
    auto parent = [&](int i) { return chain ? order[i - 1] : r0; };
    for (int i = 1; i < nr; ++i) {
      if (row.reduces) rp[s * nr + order[i]] = parent(i);
      if (row.broadcasts) bp[s * nr + order[i]] = parent(i);
    }
    for (int c = 0; c < k; ++c) {
      const int64_t clen_ = len / k + (c < len % k ? 1 : 0), cstart = off + c * (len / k) + std::min<int64_t>(c, len % k);
      const int64_t chunk = static_cast<int64_t>(coff.size());
      cseg.push_back(s);
      coff.push_back(cstart);
      clen.push_back(clen_);
      int64_t round = c;
      auto add = [&](int64_t op, int src, int dst) { tr.insert(tr.end(), {round++, op, src, dst, chunk}); };
      if (row.reduces)
        for (int i = nr - 1; i >= 1; --i) add(0, order[i], parent(i));  // reduce up, leaves first
      if (row.broadcasts)
        for (int i = 1; i < nr; ++i) add(1, parent(i), order[i]);       // copy down
    }
    off += len;
  }
  std::vector<int64_t> w = {kScheduleMagic, kScheduleVersion, static_cast<int64_t>(coll), nr, ne, S,
                            static_cast<int64_t>(coff.size()), static_cast<int64_t>(tr.size() / 5)};
  for (auto* v : {&seg_root, &seg_off, &seg_len, &seg_ph, &rp, &bp, &cseg, &coff, &clen, &tr}) w.insert(w.end(), v->begin(), v->end());
  return w;
}

// ---- element values: small integers, so every summation order gives the same bits ------------
int64_t Value(int group, int rank, int iter, int64_t i) { return ((rank + 1) * 7 + i * 3 + iter + group * 5) % 17 - 8; }

template <typename T>
void Fill(void* p, int g, int r, int it, int64_t n) {
  for (int64_t i = 0; i < n; ++i) static_cast<T*>(p)[i] = static_cast<T>(Value(g, r, it, i));
}
template <typename T>
int64_t Get(const void* p, int64_t i) { return static_cast<int64_t>(static_cast<const T*>(p)[i]); }

void FillAny(Dtype t, void* p, int g, int r, int it, int64_t n) {
  if (t == Dtype::kF32) Fill<float>(p, g, r, it, n);
  else if (t == Dtype::kF64) Fill<double>(p, g, r, it, n);
  else Fill<int32_t>(p, g, r, it, n);
}
int64_t GetAny(Dtype t, const void* p, int64_t i) {
  if (t == Dtype::kF32) return Get<float>(p, i);
  if (t == Dtype::kF64) return Get<double>(p, i);
  return Get<int32_t>(p, i);
}

// Barrier with a deadline: the continuation of every successful participant waits here.
struct Barrier {
  explicit Barrier(int n) : n(n) {}
  bool Wait(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> l(mu);
    if (++arrived == n) cv.notify_all();
    return cv.wait_for(l, limit, [&] { return arrived >= n; });
  }
  int n, arrived = 0;
  std::mutex mu;
  std::condition_variable cv;
};

// One device's completion, set by its `done` and awaited by the device's own thread.
struct Slot {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::string err;
  void Set(const std::string& e) {
    std::lock_guard<std::mutex> l(mu);
    err = e;
    done = true;
    cv.notify_all();
  }
  bool WaitFor(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> l(mu);
    return cv.wait_for(l, limit, [&] { return done; });
  }
};

enum class Fault { kNone, kAbsent, kLate, kDtype, kSize, kDuplicate, kFailCall, kExecError };
const char* FaultName(Fault f) {
  static const char* n[] = {"none", "absent", "late", "dtype", "size", "duplicate", "failcall", "exec_error"};
  return n[static_cast<int>(f)];
}

struct Trial {
  std::string name;
  Collective coll = Collective::kAllReduce;
  int nr = 4, groups = 1, root = 0, segments = 2, chunks = 3, iters = 1;
  int64_t nelems = 1000, run_id = 0, call_site = 0, timeout_ms = 20000;
  Dtype dtype = Dtype::kF32;
  Fault fault = Fault::kNone;
  int fault_group = 0, fault_rank = 0;
  int max_delay_us = 0;
  uint64_t seed = 0;
  // Reduce-scatter into the rank's shard alone (Leaf::out_shard; star schedules): the output buffer
  // holds one shard, so a write anywhere else is out of bounds (AddressSanitizer reports it).
  bool shard_out = false;
};

constexpr auto kWaitLimit = std::chrono::milliseconds(30000);  // a completion that never comes
constexpr auto kBarrierLimit = std::chrono::milliseconds(10000);

void RunTrial(const Trial& t) {
  const int G = t.groups, nr = t.nr;
  // Device ids: a permutation per trial (device id != rank), distinct across groups.
  std::vector<int64_t> table;
  std::vector<std::vector<int64_t>> dev(G, std::vector<int64_t>(nr));
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < nr; ++r) {
      dev[g][r] = 100 + g * nr + (nr - r) % nr;
      table.insert(table.end(), {dev[g][r], g, r});
    }
  std::vector<int64_t> sched;
  for (int g = 0; g < G; ++g) {  // one schedule per group; rooted collectives root differently per group
    auto s = MakeSchedule(t.coll, nr, t.nelems, (t.root + g) % nr, t.segments, t.chunks, t.shard_out);
    sched.insert(sched.end(), s.begin(), s.end());
  }
  std::shared_ptr<const CallSiteInfo> info;
  std::string e = GetCallSiteInfo(t.call_site, sched.data(), sched.size(), table.data(), table.size(), &info);
  if (!e.empty()) return Fail(t.name, "GetCallSiteInfo: " + e);

  const size_t esize = DtypeSize(t.dtype);
  // Per (iteration, group): a barrier for the continuations of one meeting.
  // Shared with the continuations: one may still wait in it after its device moved on.
  std::vector<std::shared_ptr<Barrier>> barriers;
  for (int i = 0; i < t.iters * G; ++i) barriers.push_back(std::make_shared<Barrier>(nr));
  // Errors every participant saw, per (group, rank) of the last iteration (fault trials have one).
  std::vector<std::string> errs(G * nr);
  std::vector<char> got_done(G * nr, 0);
  std::atomic<bool> duplicate_done{false};
  const bool faulty = t.fault != Fault::kNone;
  const auto t0 = Clock::now();

  auto device = [&](int g, int r) {
    std::mt19937_64 rng(t.seed * 1315423911u + g * 64 + r);
    const int64_t id = dev[g][r];
    const bool is_fault = faulty && g == t.fault_group && r == t.fault_rank;
    for (int it = 0; it < t.iters; ++it) {
      if (t.max_delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % t.max_delay_us));
      if (t.fault == Fault::kDuplicate && !is_fault)  // others come only after the duplicate failed
        while (!duplicate_done.load()) std::this_thread::sleep_for(std::chrono::microseconds(200));
      if (is_fault && t.fault == Fault::kAbsent) return;  // never arrives (test hook of the handler)
      if (is_fault && t.fault == Fault::kLate)
        std::this_thread::sleep_for(std::chrono::milliseconds(3 * t.timeout_ms));
      const int64_t gen = NextGeneration(t.run_id, t.call_site, id);
      if (is_fault && t.fault == Fault::kFailCall) {  // as the handler does for a device that cannot join
        FailCall(t.run_id, t.call_site, gen, "jax_blink: device " + std::to_string(id) + " cannot join: injected");
        return;
      }
      Dtype dt = t.dtype;
      int64_t n = t.nelems;
      if (is_fault && t.fault == Fault::kDtype) dt = t.dtype == Dtype::kF64 ? Dtype::kF32 : Dtype::kF64;
      if (is_fault && t.fault == Fault::kSize) n -= 1;
      const int64_t shard = n / nr;
      std::vector<char> in(n * DtypeSize(dt)), out((t.shard_out ? shard : n) * DtypeSize(dt), 0x5a);
      // shard_out: the output as the handler passes it, `rank` shards before the one-shard buffer
      char* out_base = out.data() - (t.shard_out ? r * shard * static_cast<int64_t>(DtypeSize(dt)) : 0);
      FillAny(dt, in.data(), g, r, it, n);
      auto slot = std::make_shared<Slot>();
      std::shared_ptr<Barrier> bar = barriers[it * G + g];
      const std::string tname = t.name;
      auto make_arrival = [&](std::shared_ptr<Slot> s) {
        Arrival a;
        a.device = id;
        a.rank = r;
        a.dtype = dt;
        a.nelems = n;
        a.leaves = {Leaf{in.data(), out_base, n, t.shard_out}};
        a.done = [s, bar, tname, faulty](const std::string& msg) {
          s->Set(msg);
          // As a device entering an XLA collective: wait for every peer's continuation.
          if (msg.empty() && !faulty && !bar->Wait(kBarrierLimit))
            Fail(tname, "continuation barrier timed out: one thread completed several devices in turn");
        };
        return a;
      };
      MeetingKey key{t.run_id, t.call_site, g, gen};
      // A short timeout only where the fault is: a device slowed down by a sanitizer must not time
      // out the healthy group of the trial.
      const int64_t timeout = EffectiveTimeoutMs(g == t.fault_group ? t.timeout_ms : 20000);
      auto m = Arrive(key, info, make_arrival(slot), timeout);
      if (m) {
        if (t.fault == Fault::kExecError && g == t.fault_group) m->Finish("jax_blink: injected executor error", r);
        else ExecuteOnCpu(std::move(m), r);
      }
      if (is_fault && t.fault == Fault::kDuplicate) {  // the same device again, same key and rank
        auto dup = std::make_shared<Slot>();
        auto m2 = Arrive(key, info, make_arrival(dup), timeout);
        if (m2) Fail(t.name, "a duplicate arrival completed a meeting");
        if (!dup->WaitFor(kWaitLimit) || dup->err.find("arrived twice") == std::string::npos)
          Fail(t.name, "duplicate arrival: expected 'arrived twice', got '" + dup->err + "'");
        duplicate_done = true;
      }
      if (!slot->WaitFor(kWaitLimit)) {
        Fail(t.name, "device " + std::to_string(id) + " was never completed (iteration " + std::to_string(it) + ")");
        std::_Exit(1);  // its buffers must outlive a completion that may still come
      }
      errs[g * nr + r] = slot->err;
      got_done[g * nr + r] = 1;
      if (!slot->err.empty()) {
        g_errors_seen++;
        if (!faulty) Fail(t.name, "unexpected error: " + slot->err);
        return;
      }
      // Reference: plain sums over the group's ranks.
      const CollectiveRow& crow = *CollectiveRowOf(static_cast<int64_t>(t.coll));
      for (int64_t i = 0; i < n; ++i) {
        int64_t want = 0;
        const int root = (t.root + g) % nr;
        if (crow.sharded && crow.reduces && i / shard != r) continue;  // reduce-scatter: other shards are scratch
        if (t.coll == Collective::kAllGather) want = Value(g, static_cast<int>(i / shard), it, i);
        else if (t.coll == Collective::kBroadcast) want = Value(g, root, it, i);
        else if (t.coll == Collective::kReduce && r != root) want = 0;
        else for (int q = 0; q < nr; ++q) want += Value(g, q, it, i);
        const int64_t have = GetAny(dt, out_base, i);
        if (have != want) {
          Fail(t.name, "device " + std::to_string(id) + " rank " + std::to_string(r) + " iteration " +
                           std::to_string(it) + " element " + std::to_string(i) + ": " + std::to_string(have) +
                           " != " + std::to_string(want));
          return;
        }
      }
      g_meetings_ok++;
    }
  };

  std::vector<std::thread> threads;
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < nr; ++r) threads.emplace_back(device, g, r);
  for (auto& th : threads) th.join();
  const double took_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();

  // Fault trials: what each participant must have seen.
  const int fg = t.fault_group, fr = t.fault_rank;
  const std::string fid = std::to_string(dev[fg][fr]);
  for (int g = 0; g < G && faulty; ++g)
    for (int r = 0; r < nr; ++r) {
      const bool is_fault = g == fg && r == fr;
      const std::string& err = errs[g * nr + r];
      auto expect = [&](bool ok, const std::string& what) {
        if (!ok) Fail(t.name, "rank " + std::to_string(r) + " group " + std::to_string(g) + ": expected " + what + ", got '" + err + "'");
      };
      auto has = [&](const char* s) { return err.find(s) != std::string::npos; };
      if (g != fg) {  // other groups: unaffected, except FailCall (fails the call in every group)
        if (t.fault == Fault::kFailCall) expect(err.empty() || has("cannot join: injected"), "success or the FailCall error");
        else expect(err.empty(), "success");
        continue;
      }
      switch (t.fault) {
        case Fault::kAbsent:
          if (is_fault) break;
          // (a device slowed down by the sanitizers may be named too)
          expect(has("timed out") && has("never arrived") && has((fid + " (rank " + std::to_string(fr) + ")").c_str()),
                 "the timeout naming device " + fid);
          break;
        case Fault::kLate:
          if (is_fault) expect(has("after the meeting had failed") && has("timed out"), "'arrived after the meeting had failed'");
          else expect(has("timed out") && has("never arrived"), "the timeout");
          break;
        case Fault::kDtype:
          expect(has("participants disagree"), "'participants disagree'");
          break;
        case Fault::kSize:
          expect(has("participants disagree") || has("but the schedule was built for"), "a size mismatch error");
          break;
        case Fault::kDuplicate:
          expect(has("arrived twice"), "'arrived twice'");
          break;
        case Fault::kFailCall:
          if (!is_fault) expect(has(("device " + fid + " cannot join: injected").c_str()), "the FailCall error of device " + fid);
          break;
        case Fault::kExecError:
          expect(has("injected executor error"), "the executor error");
          break;
        case Fault::kNone:
          break;
      }
    }
  // Faults other than timeouts fail at once: well before the (long) timeout of those trials.
  if (t.fault == Fault::kDtype || t.fault == Fault::kSize || t.fault == Fault::kDuplicate ||
      t.fault == Fault::kFailCall || t.fault == Fault::kExecError) {
    if (took_ms > t.timeout_ms / 2.0)
      Fail(t.name, "took " + std::to_string(took_ms) + " ms: the fault did not fail the call at once");
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 3;
  setenv("JAX_BLINK_CPU_THREADS", "4", 0);  // executor helpers even on a 2-core machine
  unsetenv("JAX_BLINK_TIMEOUT_S");          // the trials choose their timeouts
  unsetenv("JAX_BLINK_TEST_ABSENT_DEVICE");
  std::thread([] {  // global watchdog: a hang must fail, not stall CI
    std::this_thread::sleep_for(std::chrono::seconds(240));
    std::fprintf(stderr, "core_stress: global watchdog (240 s) fired: something hangs\n");
    std::_Exit(3);
  }).detach();

  const auto t0 = Clock::now();
  int64_t next_site = 1000;
  int ntrials = 0;
  for (int round = 0; round < rounds; ++round) {
    std::vector<Trial> trials;
    std::mt19937_64 rng(round + 1);
    const Collective colls[] = {Collective::kAllReduce, Collective::kBroadcast, Collective::kReduce,
                                Collective::kAllGather, Collective::kReduceScatter};
    const Dtype dtypes[] = {Dtype::kF32, Dtype::kF64, Dtype::kS32};
    // Several call sites of one run at once (same devices), each called `iters` times (generations);
    // round 1 reuses round 0's run id and call sites: generations continue.
    const int64_t shared_run = 7 + (round == 1 ? 0 : round);
    for (int i = 0; i < 6; ++i) {
      Trial t;
      t.coll = colls[(i + round) % 5];
      t.dtype = dtypes[(i + round) % 3];
      t.nr = 2 + (i % 4) * 2;  // 2, 4, 6, 8
      t.groups = 1 + i % 2;
      t.root = i % t.nr;
      t.segments = 1 + i % 3;
      t.chunks = 1 + (i * 2) % 5;
      t.nelems = i == 5 ? 100000 : 257 + 97 * i;  // one large enough for the executor's helpers
      if (CollectiveRowOf(static_cast<int64_t>(t.coll))->sharded) t.nelems -= t.nelems % t.nr;
      t.iters = i == 0 ? 24 : 4;
      t.run_id = shared_run;
      t.call_site = 100 + i;  // the same sites every round
      t.max_delay_us = i % 2 ? 2000 : 0;  // late participants
      t.seed = round * 100 + i;
      trials.push_back(t);
    }
    for (int i = 0; i < 2; ++i) {  // reduce-scatter into the shard alone, with and without helpers
      Trial t;
      t.coll = Collective::kReduceScatter;
      t.dtype = dtypes[(i + round) % 3];
      t.nr = 4 + 4 * i;
      t.chunks = 1 + 2 * i;
      t.nelems = i == 1 ? 100000 : 1000;
      t.nelems -= t.nelems % t.nr;
      t.iters = 4;
      t.run_id = shared_run;
      t.call_site = 200 + i;
      t.max_delay_us = 1000;
      t.seed = round * 100 + 50 + i;
      t.shard_out = true;
      trials.push_back(t);
    }
    // Fault trials, each on its own call site (a device that never arrived leaves its generation behind).
    const Fault faults[] = {Fault::kAbsent, Fault::kLate, Fault::kDtype, Fault::kSize, Fault::kDuplicate,
                            Fault::kFailCall, Fault::kExecError};
    for (Fault f : faults)
      for (int groups = 1; groups <= 2; ++groups) {
        Trial t;
        t.fault = f;
        t.coll = colls[(static_cast<int>(f) + groups) % 5];
        t.dtype = f == Fault::kDtype ? Dtype::kF32 : dtypes[groups % 3];
        t.nr = 3 + groups;
        if (CollectiveRowOf(static_cast<int64_t>(t.coll))->sharded) t.nelems -= t.nelems % t.nr;
        t.groups = groups;
        t.root = 1;
        t.fault_group = groups - 1;
        t.fault_rank = (static_cast<int>(f) + round) % t.nr;
        t.timeout_ms = (f == Fault::kAbsent || f == Fault::kLate) ? 300 : 20000;
        t.run_id = 1000 + round * 10 + groups;  // repeated across faults: call sites keep them apart
        t.call_site = next_site++;
        t.max_delay_us = 1000;
        t.seed = rng();
        trials.push_back(t);
      }
    for (auto& t : trials) {
      t.name = "round " + std::to_string(round) + " site " + std::to_string(t.call_site) + " fault " +
               FaultName(t.fault) + " n=" + std::to_string(t.nr) + "x" + std::to_string(t.groups) + " " +
               DtypeName(t.dtype) + (t.shard_out ? " shard_out" : "");
    }
    std::vector<std::thread> th;
    for (const auto& t : trials) th.emplace_back([&t] { RunTrial(t); });
    for (auto& x : th) x.join();
    ntrials += static_cast<int>(trials.size());
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("core_stress: %d trials, %lld participants completed, %lld errors delivered, %d check failures, "
              "completion threads now %lld, %.2f s\n",
              ntrials, static_cast<long long>(g_meetings_ok.load()), static_cast<long long>(g_errors_seen.load()),
              g_failures.load(), static_cast<long long>(CompletionThreads()), secs);
  return g_failures.load() == 0 ? 0 : 1;
}
