// See blink_core.h.
#include "blink_core.h"

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <tuple>

namespace jax_blink {

size_t DtypeSize(Dtype t) {
  switch (t) {
    case Dtype::kS8: case Dtype::kU8: return 1;
    case Dtype::kF16: case Dtype::kBF16: case Dtype::kS16: case Dtype::kU16: return 2;
    case Dtype::kF32: case Dtype::kS32: case Dtype::kU32: return 4;
    case Dtype::kF64: case Dtype::kS64: case Dtype::kU64: case Dtype::kC64: return 8;
    case Dtype::kC128: return 16;
  }
  return 0;
}

const char* DtypeName(Dtype t) {
  static const char* names[] = {"float16", "bfloat16", "float32", "float64", "int8", "int16", "int32",
                                "int64", "uint8", "uint16", "uint32", "uint64", "complex64", "complex128"};
  return names[static_cast<int>(t)];
}

std::optional<Dtype> DtypeFromName(const std::string& name) {
  for (int i = 0; i <= static_cast<int>(Dtype::kC128); ++i)
    if (name == DtypeName(static_cast<Dtype>(i))) return static_cast<Dtype>(i);
  return std::nullopt;
}

const CollectiveRow* CollectiveRowOf(int64_t id) {
  static const CollectiveRow rows[] = {
      {"allreduce", true, true, false, false},     {"broadcast", false, true, false, false},
      {"reduce", true, false, false, true},        {"allgather", false, true, true, false},
      {"reducescatter", true, false, true, false},
  };
  return id >= 0 && id < 5 ? &rows[id] : nullptr;
}

namespace {
std::string Err(const std::string& what) {
  return "jax_blink: invalid schedule: " + what +
         " (rebuild it with jax_blink.schedule.build_schedule(...).to_array())";
}
}  // namespace

std::string DecodeSchedule(const int64_t* d, size_t n, Schedule* s, size_t* consumed) {
  constexpr size_t kHeader = 8;
  if (n < kHeader) return Err("array has " + std::to_string(n) + " words, the header needs 8");
  if (d[0] != kScheduleMagic) return Err("bad magic word (expected 0x424C4E4B 'BLNK')");
  if (d[1] != 1 && d[1] != kScheduleVersion)
    return Err("version " + std::to_string(d[1]) + " is not supported (this build reads versions 1 and 2)");
  const int64_t version = d[1];
  const CollectiveRow* row = CollectiveRowOf(d[2]);
  if (!row || (version == 1 && d[2] > 2))
    return Err("collective code " + std::to_string(d[2]) + " is not a known wire id (0-4; version 1: 0-2)");
  const int64_t nr = d[3], ne = d[4], S = d[5], C = d[6], T = d[7];
  if (nr < 1 || ne < 0 || S < 0 || C < 0 || T < 0)
    return Err("negative size in header (nranks, nelems, S, C, T) = (" + std::to_string(nr) + ", " +
               std::to_string(ne) + ", " + std::to_string(S) + ", " + std::to_string(C) + ", " +
               std::to_string(T) + ")");
  // Bound every count by the array length first, so the size arithmetic cannot overflow.
  const int64_t lim = static_cast<int64_t>(n);
  if (nr > lim || S > lim || C > lim || T > lim) return Err("header sizes exceed the array length");
  const int64_t nphase = version >= 2 ? S : 0;
  const int64_t need = kHeader + 3 * S + nphase + 2 * S * nr + 3 * C + 5 * T;
  if (need > lim)
    return Err("array has " + std::to_string(n) + " words, the header announces " + std::to_string(need));
  s->collective = static_cast<Collective>(d[2]);
  s->nranks = nr;
  s->nelems = ne;
  const int64_t* p = d + kHeader;
  auto take = [&](std::vector<int64_t>& v, int64_t k) { v.assign(p, p + k); p += k; };
  take(s->seg_root, S); take(s->seg_offset, S); take(s->seg_length, S);
  const int64_t phases = (row->reduces ? 1 : 0) | (row->broadcasts ? 2 : 0);
  if (version >= 2) take(s->seg_phases, S);
  else s->seg_phases.assign(S, phases);
  take(s->reduce_parent, S * nr); take(s->bcast_parent, S * nr);
  take(s->chunk_seg, C); take(s->chunk_offset, C); take(s->chunk_length, C);
  s->transfers.resize(T);
  for (int64_t t = 0; t < T; ++t, p += 5) s->transfers[t] = Transfer{p[0], p[1], p[2], p[3], p[4]};
  *consumed = static_cast<size_t>(need);

  for (int64_t i = 0; i < S; ++i) {
    if (s->seg_root[i] < 0 || s->seg_root[i] >= nr) return Err("segment root out of range");
    if (s->seg_offset[i] < 0 || s->seg_length[i] < 0 || s->seg_offset[i] > ne ||
        s->seg_length[i] > ne - s->seg_offset[i])
      return Err("segment " + std::to_string(i) + " lies outside [0, nelems)");
    if (s->seg_phases[i] != phases)
      return Err("segment " + std::to_string(i) + " has phases " + std::to_string(s->seg_phases[i]) + ", the " +
                 row->name + " row says " + std::to_string(phases));
  }
  if (row->sharded && S > 0) {
    if (ne % nr != 0)
      return Err(std::string(row->name) + " needs nelems divisible by nranks, got " + std::to_string(ne) +
                 " over " + std::to_string(nr));
    const int64_t m = ne / nr;
    for (int64_t i = 0; i < S; ++i)
      if (s->seg_offset[i] < s->seg_root[i] * m || s->seg_offset[i] + s->seg_length[i] > (s->seg_root[i] + 1) * m)
        return Err("segment " + std::to_string(i) + " leaves the shard of its root");
  }
  for (int64_t i = 0; i < 2 * S * nr; ++i) {
    int64_t v = i < S * nr ? s->reduce_parent[i] : s->bcast_parent[i - S * nr];
    if (v < -1 || v >= nr) return Err("parent rank out of range");
  }
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (int64_t c = 0; c < C; ++c) {
    int64_t sg = s->chunk_seg[c], off = s->chunk_offset[c], len = s->chunk_length[c];
    if (sg < 0 || sg >= S) return Err("chunk " + std::to_string(c) + " names segment out of range");
    if (len <= 0 || off < s->seg_offset[sg] || off > s->seg_offset[sg] + s->seg_length[sg] - len)
      return Err("chunk " + std::to_string(c) + " lies outside its segment");
    spans.emplace_back(off, len);
  }
  std::sort(spans.begin(), spans.end());
  int64_t covered = 0;
  for (auto& [off, len] : spans) {
    if (off != covered) return Err("chunks overlap or leave a gap at element " + std::to_string(covered));
    covered += len;
  }
  if (C > 0 && covered != ne) return Err("chunks do not cover [0, nelems)");
  if (C == 0 && ne > 0 && nr > 1) return Err("no chunks for a non-empty operand over several ranks");
  for (int64_t t = 0; t < T; ++t) {
    const Transfer& x = s->transfers[t];
    if (x.op != 0 && x.op != 1) return Err("transfer " + std::to_string(t) + " has op " + std::to_string(x.op));
    if (x.src < 0 || x.src >= nr || x.dst < 0 || x.dst >= nr || x.src == x.dst)
      return Err("transfer " + std::to_string(t) + " has a bad src/dst rank");
    if (x.chunk < 0 || x.chunk >= C) return Err("transfer " + std::to_string(t) + " names a chunk out of range");
  }
  return "";
}

std::string DecodeSchedules(const int64_t* data, size_t n, std::vector<Schedule>* out) {
  out->clear();
  size_t pos = 0;
  while (pos < n) {
    Schedule s;
    size_t used = 0;
    std::string e = DecodeSchedule(data + pos, n - pos, &s, &used);
    if (!e.empty()) return e + " [schedule #" + std::to_string(out->size()) + "]";
    out->push_back(std::move(s));
    pos += used;
  }
  if (out->empty()) return Err("empty schedule attribute");
  return "";
}

namespace {
// True when op (reading src, writing out[dst]) cannot move past step g: g writes what the op reads
// or writes, or g reads the op's destination. A rank's input and output count as one buffer: XLA may
// alias them (Leaf), so reading in[r] cannot move past a write of out[r], nor the reverse.
bool Conflicts(const Step& g, const Operand& src, int32_t dst) {
  for (int32_t w : g.writes)
    if (w == dst || w == src.rank) return true;
  for (const Operand& r : g.reads)
    if (r.rank == dst) return true;
  return false;
}

// The second pass of FuseOps: a reduce step into dst joins the next step that touches out[dst] when
// that step is a reduce into dst reading out[dst] first and no step in between writes what the first
// reads (a rank's input and output count as one buffer, as in Conflicts). The first pass only joins an
// op to an earlier step, so a parent whose children finish at different times keeps several reduce
// steps, each a pass over the chunk; merged, they are one step at the last of them. The adds into dst
// keep their order and every source is read where its value is the same.
void MergeReduces(std::vector<Step>* steps_io) {
  std::vector<Step>& steps = *steps_io;
  auto touches_out = [](const Step& st, int32_t r) {
    for (auto& o : st.reads) if (o.rank == r && !o.input) return true;
    for (int32_t w : st.writes) if (w == r) return true;
    return false;
  };
  bool changed = true;
  while (changed) {
    changed = false;
    for (size_t i = 0; i < steps.size() && !changed; ++i) {
      if (steps[i].kind != 0) continue;
      const int32_t dst = steps[i].writes[0];
      for (size_t j = i + 1; j < steps.size(); ++j) {
        if (!touches_out(steps[j], dst)) {
          bool clobbers = false;  // does step j write something step i reads?
          for (int32_t w : steps[j].writes)
            for (auto& o : steps[i].reads)
              if (o.rank == w) clobbers = true;
          if (clobbers) break;
          continue;
        }
        if (steps[j].kind == 0 && steps[j].writes[0] == dst && steps[j].reads[0].rank == dst && !steps[j].reads[0].input) {
          std::vector<Operand> reads = steps[i].reads;
          reads.insert(reads.end(), steps[j].reads.begin() + 1, steps[j].reads.end());
          steps[j].reads = std::move(reads);
          steps.erase(steps.begin() + static_cast<std::ptrdiff_t>(i));
          changed = true;
        }
        break;
      }
    }
  }
}
}  // namespace

std::vector<Step> FuseOps(const std::vector<Op>& ops) {
  std::vector<Step> steps;
  for (const Op& op : ops) {
    const Operand src{op.src, op.src_from_input};
    bool merged = false;
    for (size_t i = steps.size(); i-- > 0;) {
      Step& g = steps[i];
      if (g.kind == op.kind) {
        if (op.kind == 0 && g.writes[0] == op.dst) {  // dst already materialised by g
          g.reads.push_back(src);
          merged = true;
          break;
        }
        if (op.kind == 1 && g.reads[0].rank == src.rank && g.reads[0].input == src.input) {
          g.writes.push_back(op.dst);
          merged = true;
          break;
        }
      }
      if (Conflicts(g, src, op.dst)) break;
    }
    if (merged) continue;
    Step st;
    st.kind = op.kind;
    if (op.kind == 0) st.reads.push_back(Operand{op.dst, op.dst_from_input});
    st.reads.push_back(src);
    st.writes.push_back(op.dst);
    steps.push_back(std::move(st));
  }
  MergeReduces(&steps);
  return steps;
}

std::string BuildExecPlan(const Schedule& s, ExecPlan* out) {
  out->schedule = s;
  const int64_t nr = s.nranks, C = static_cast<int64_t>(s.chunk_offset.size());
  std::vector<ChunkPlan> byc(C);
  for (int64_t c = 0; c < C; ++c) {
    byc[c].offset = s.chunk_offset[c];
    byc[c].length = s.chunk_length[c];
    byc[c].segment = s.chunk_seg[c];
  }
  // Materialisation state per (chunk, rank), simulated in row order.
  std::vector<std::vector<char>> mat(C, std::vector<char>(nr, 0));
  for (const Transfer& t : s.transfers) {
    Op op;
    op.kind = static_cast<int32_t>(t.op);
    op.src = static_cast<int32_t>(t.src);
    op.dst = static_cast<int32_t>(t.dst);
    op.src_from_input = !mat[t.chunk][t.src];
    op.dst_from_input = !mat[t.chunk][t.dst];
    mat[t.chunk][t.dst] = 1;
    byc[t.chunk].ops.push_back(op);
  }
  out->owner_writes_only = true;
  for (int64_t c = 0; c < C; ++c) {
    byc[c].steps = FuseOps(byc[c].ops);
    int64_t root = s.seg_root[byc[c].segment];
    for (const Op& op : byc[c].ops) out->owner_writes_only &= op.dst == root;
    for (int32_t r = 0; r < nr; ++r) {
      if (CollectiveRowOf(static_cast<int64_t>(s.collective))->zero_non_root && r != root) byc[c].zero.push_back(r);
      else if (!mat[c][r]) byc[c].copy_in.push_back(r);
    }
    out->owner_writes_only &= byc[c].zero.empty();
  }
  if (C == 0 && s.nelems > 0) {  // one rank: the result is the input
    ChunkPlan cp;
    cp.offset = 0;
    cp.length = s.nelems;
    cp.copy_in.push_back(0);
    byc.push_back(cp);
  }
  std::sort(byc.begin(), byc.end(), [](const ChunkPlan& a, const ChunkPlan& b) { return a.offset < b.offset; });
  out->chunks = std::move(byc);
  out->max_chunk = 0;
  for (auto& c : out->chunks) out->max_chunk = std::max(out->max_chunk, c.length);
  return "";
}

std::string DeviceTable::Decode(const int64_t* d, size_t n) {
  entries.clear();
  group_devices.clear();
  if (n == 0 || n % 3 != 0)
    return "jax_blink: device_table must hold rows (device_id, group, rank); got " + std::to_string(n) + " words";
  for (size_t i = 0; i < n; i += 3) {
    Entry e{d[i], d[i + 1], d[i + 2]};
    if (e.group < 0 || e.rank < 0 || e.group > static_cast<int64_t>(n) || e.rank > static_cast<int64_t>(n))
      return "jax_blink: device_table row has a negative or out-of-range group/rank";
    if (Find(e.device)) return "jax_blink: device " + std::to_string(e.device) + " appears twice in device_table";
    entries.push_back(e);
    if (static_cast<int64_t>(group_devices.size()) <= e.group) group_devices.resize(e.group + 1);
    auto& g = group_devices[e.group];
    if (static_cast<int64_t>(g.size()) <= e.rank) g.resize(e.rank + 1, -1);
    if (g[e.rank] != -1) return "jax_blink: two devices share group " + std::to_string(e.group) + " rank " + std::to_string(e.rank);
    g[e.rank] = e.device;
  }
  for (size_t gi = 0; gi < group_devices.size(); ++gi)
    for (size_t r = 0; r < group_devices[gi].size(); ++r)
      if (group_devices[gi][r] == -1)
        return "jax_blink: device_table group " + std::to_string(gi) + " has no device for rank " + std::to_string(r);
  return "";
}

const DeviceTable::Entry* DeviceTable::Find(int64_t device) const {
  for (const auto& e : entries)
    if (e.device == device) return &e;
  return nullptr;
}

std::string GetCallSiteInfo(int64_t call_site, const int64_t* sched, size_t nsched, const int64_t* table,
                            size_t ntable, std::shared_ptr<const CallSiteInfo>* out) {
  static std::mutex mu;
  static std::map<int64_t, std::shared_ptr<const CallSiteInfo>> cache;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(call_site);
    if (it != cache.end()) {
      const auto& ci = *it->second;
      if (ci.raw_schedule.size() == nsched && ci.raw_table.size() == ntable &&
          std::memcmp(ci.raw_schedule.data(), sched, nsched * 8) == 0 &&
          std::memcmp(ci.raw_table.data(), table, ntable * 8) == 0) {
        *out = it->second;
        return "";
      }
    }
  }
  auto ci = std::make_shared<CallSiteInfo>();
  ci->raw_schedule.assign(sched, sched + nsched);
  ci->raw_table.assign(table, table + ntable);
  std::string e = ci->table.Decode(table, ntable);
  if (!e.empty()) return e;
  std::vector<Schedule> scheds;
  e = DecodeSchedules(sched, nsched, &scheds);
  if (!e.empty()) return e;
  size_t ng = ci->table.group_devices.size();
  if (scheds.size() != 1 && scheds.size() != ng)
    return "jax_blink: " + std::to_string(scheds.size()) + " schedules for " + std::to_string(ng) +
           " groups (give one per group, or one shared by all)";
  std::vector<std::shared_ptr<const ExecPlan>> plans;
  for (size_t i = 0; i < scheds.size(); ++i) {
    auto p = std::make_shared<ExecPlan>();
    e = BuildExecPlan(scheds[i], p.get());
    if (!e.empty()) return e;
    plans.push_back(p);
  }
  for (size_t g = 0; g < ng; ++g) {
    const auto& p = plans[scheds.size() == 1 ? 0 : g];
    if (p->schedule.nranks != static_cast<int64_t>(ci->table.group_devices[g].size()))
      return "jax_blink: group " + std::to_string(g) + " has " + std::to_string(ci->table.group_devices[g].size()) +
             " devices but its schedule has " + std::to_string(p->schedule.nranks) + " ranks";
    ci->plans.push_back(p);
  }
  std::lock_guard<std::mutex> lock(mu);
  if (cache.size() > 4096) cache.clear();  // bound memory across many compiled programs
  cache[call_site] = ci;
  *out = ci;
  return "";
}

// ---------------------------------------------------------------------------------------------

bool MeetingKey::operator<(const MeetingKey& o) const {
  return std::tie(run_id, call_site, group, generation) < std::tie(o.run_id, o.call_site, o.group, o.generation);
}

namespace {

class CompletionPool {
 public:
  static CompletionPool& Get() {
    static CompletionPool* p = new CompletionPool();  // leaked: threads may outlive static destruction
    return *p;
  }
  // Queues the tasks; every queued task must have a thread that is free for it: an idle one (woken
  // here) or a new one. The wake-ups go out after the lock is released, so a woken thread does not
  // block on it at once (one thread switch less per task).
  void Post(std::vector<std::function<void()>> fs) {
    int64_t wake = 0, start = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& f : fs) {
        q_.push_back(std::move(f));
        if (idle_ + starting_ >= static_cast<int64_t>(q_.size())) {
          ++wake;
        } else {
          ++starting_;
          ++threads_;
          ++start;
        }
      }
    }
    for (int64_t i = 0; i < wake; ++i) cv_.notify_one();
    for (int64_t i = 0; i < start; ++i) std::thread([this] { Loop(); }).detach();
  }
  int64_t Threads() {
    std::lock_guard<std::mutex> lock(mu_);
    return threads_;
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    --starting_;
    for (;;) {
      while (!q_.empty()) {
        std::function<void()> f = std::move(q_.front());
        q_.pop_front();
        lock.unlock();
        f();
        f = nullptr;
        lock.lock();
      }
      ++idle_;
      bool work = cv_.wait_for(lock, std::chrono::seconds(30), [this] { return !q_.empty(); });
      --idle_;
      if (!work) {
        --threads_;
        return;
      }
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  int64_t idle_ = 0, starting_ = 0, threads_ = 0;
};

// Completes each arrival's `done` on its own thread; arrivals[inline_rank]'s (if any) on this one, last.
void CompleteAll(std::vector<Arrival>& arrivals, const std::string& err, int64_t inline_rank) {
  std::function<void(const std::string&)> mine;
  std::vector<std::function<void()>> tasks;
  for (size_t r = 0; r < arrivals.size(); ++r) {
    if (!arrivals[r].done) continue;
    auto done = std::move(arrivals[r].done);
    arrivals[r].done = nullptr;
    if (static_cast<int64_t>(r) == inline_rank) {
      mine = std::move(done);
      continue;
    }
    tasks.push_back([done = std::move(done), err]() { done(err); });
  }
  if (!tasks.empty()) CompletionPool::Get().Post(std::move(tasks));  // one lock for all
  if (mine) mine(err);
}

}  // namespace

void PostCompletion(std::function<void()> task) {
  std::vector<std::function<void()>> one;
  one.push_back(std::move(task));
  CompletionPool::Get().Post(std::move(one));
}
int64_t CompletionThreads() { return CompletionPool::Get().Threads(); }

void Meeting::Finish(const std::string& err, int64_t inline_rank) { CompleteAll(arrivals, err, inline_rank); }

int64_t NextGeneration(int64_t run_id, int64_t call_site, int64_t device) {
  // Recent runs per (call site, device); runs are few at a time, so keep the last 64.
  static std::mutex mu;
  static std::map<std::pair<int64_t, int64_t>, std::deque<std::pair<int64_t, int64_t>>> gens;
  std::lock_guard<std::mutex> lock(mu);
  auto& q = gens[{call_site, device}];
  for (auto& [rid, g] : q)
    if (rid == run_id) return g++;
  q.emplace_back(run_id, 1);
  if (q.size() > 64) q.pop_front();
  return 0;
}

namespace {

using Clock = std::chrono::steady_clock;

bool SameLeafSizes(const std::vector<Leaf>& a, const std::vector<Leaf>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].nelems != b[i].nelems) return false;
  return true;
}
constexpr int64_t kAnyGroup = -1;  // a failure remembered for every group of a call

struct Pending {
  std::shared_ptr<Meeting> meeting;
  int arrived = 0;
  Clock::time_point deadline;
  int64_t timeout_ms = 0;
};

class Registry {
 public:
  static Registry& Get() {
    static Registry* r = new Registry();  // leaked on purpose: the watchdog thread outlives statics
    return *r;
  }

  std::shared_ptr<Meeting> Arrive(const MeetingKey& key, std::shared_ptr<const CallSiteInfo> info, Arrival a,
                                  int64_t timeout_ms) {
    std::vector<Arrival> to_fail;
    std::string err;
    std::shared_ptr<Meeting> complete;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto f = failed_.find(key);
      if (f == failed_.end()) f = failed_.find(MeetingKey{key.run_id, key.call_site, kAnyGroup, key.generation});
      if (f != failed_.end()) {
        err = f->second + " (this device arrived after the meeting had failed)";
      } else {
        auto& p = pending_[key];
        if (!p.meeting) {
          p.meeting = std::make_shared<Meeting>();
          p.meeting->key = key;
          p.meeting->info = info;
          const auto& plans = info->plans;
          p.meeting->plan = plans[key.group < static_cast<int64_t>(plans.size()) ? key.group : 0];
          p.meeting->arrivals.resize(info->table.group_devices[key.group].size());
          p.deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
          p.timeout_ms = timeout_ms;
          // Wake the watchdog only when it would sleep past this deadline: a call usually completes
          // long before its timeout, and a wake-up per call costs a thread switch on a busy machine.
          if (p.deadline < watch_until_) cv_.notify_all();
        }
        Meeting& m = *p.meeting;
        const Arrival* first = nullptr;
        for (auto& b : m.arrivals)
          if (b.device >= 0) { first = &b; break; }
        if (m.arrivals[a.rank].device >= 0) {
          err = "jax_blink: device " + std::to_string(a.device) + " (rank " + std::to_string(a.rank) +
                ") arrived twice at one meeting (call site " + std::to_string(key.call_site) + ")";
        } else if (first && (first->dtype != a.dtype || first->nelems != a.nelems ||
                             !SameLeafSizes(first->leaves, a.leaves))) {
          err = std::string("jax_blink: participants disagree: device ") + std::to_string(first->device) +
                " brought " + std::to_string(first->nelems) + " x " + DtypeName(first->dtype) + ", device " +
                std::to_string(a.device) + " brought " + std::to_string(a.nelems) + " x " + DtypeName(a.dtype) +
                " in " + std::to_string(first->leaves.size()) + " vs " + std::to_string(a.leaves.size()) +
                " leaves (every device must call the collective with the same shapes and dtype)";
        } else if (a.nelems != m.plan->schedule.nelems) {
          err = "jax_blink: operand has " + std::to_string(a.nelems) + " elements but the schedule was built for " +
                std::to_string(m.plan->schedule.nelems);
        }
        if (err.empty()) {
          m.arrivals[a.rank] = std::move(a);
          if (++p.arrived == static_cast<int>(m.arrivals.size())) {
            complete = p.meeting;
            pending_.erase(key);
          }
          return complete;
        }
        // Fail the whole meeting: everyone who arrived, and whoever comes later.
        for (auto& b : m.arrivals)
          if (b.device >= 0) to_fail.push_back(std::move(b));
        pending_.erase(key);
        RememberFailure(key, err);
      }
    }
    // Others each on a thread of their own; a inline: this is a's handler thread and a's future has
    // not been returned yet, so no continuation of a's can run here.
    CompleteAll(to_fail, err, -1);
    if (a.done) a.done(err);
    return nullptr;
  }

  void FailCall(int64_t run_id, int64_t call_site, int64_t generation, const std::string& err) {
    std::vector<std::shared_ptr<Meeting>> failed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = pending_.begin(); it != pending_.end();) {
        const MeetingKey& k = it->first;
        if (k.run_id == run_id && k.call_site == call_site && k.generation == generation) {
          failed.push_back(it->second.meeting);
          RememberFailure(k, err);
          it = pending_.erase(it);
        } else {
          ++it;
        }
      }
      RememberFailure(MeetingKey{run_id, call_site, kAnyGroup, generation}, err);
    }
    for (auto& m : failed) m->Finish(err);
  }

 private:
  Registry() { std::thread([this] { Watch(); }).detach(); }

  void RememberFailure(const MeetingKey& key, const std::string& err) {
    failed_[key] = err;
    failed_order_.push_back(key);
    if (failed_order_.size() > 1024) {
      failed_.erase(failed_order_.front());
      failed_order_.pop_front();
    }
  }

  void Watch() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      auto now = Clock::now();
      auto next = now + std::chrono::seconds(3600);
      std::vector<std::pair<std::shared_ptr<Meeting>, std::string>> expired;
      for (auto it = pending_.begin(); it != pending_.end();) {
        if (it->second.deadline <= now) {
          expired.emplace_back(it->second.meeting, TimeoutMessage(it->first, it->second));
          RememberFailure(it->first, expired.back().second);
          it = pending_.erase(it);
        } else {
          next = std::min(next, it->second.deadline);
          ++it;
        }
      }
      if (!expired.empty()) {
        watch_until_ = Clock::time_point::min();  // meetings added meanwhile are seen by the rescan
        lock.unlock();
        for (auto& [m, msg] : expired) m->Finish(msg);
        lock.lock();
        continue;
      }
      watch_until_ = next;
      cv_.wait_until(lock, next);
      watch_until_ = Clock::time_point::min();  // scanning (under the lock) before it sleeps again
    }
  }

  std::string TimeoutMessage(const MeetingKey& key, const Pending& p) {
    const Meeting& m = *p.meeting;
    const auto& devs = m.info->table.group_devices[key.group];
    std::ostringstream os;
    os << "jax_blink: collective timed out after " << p.timeout_ms / 1000.0 << " s: device(s) ";
    bool first = true;
    for (size_t r = 0; r < m.arrivals.size(); ++r)
      if (m.arrivals[r].device < 0) {
        os << (first ? "" : ", ") << devs[r] << " (rank " << r << ")";
        first = false;
      }
    std::string where;
    for (const auto& a : m.arrivals)
      if (a.device >= 0 && !a.where.empty()) where = a.where;
    os << " never arrived (group " << key.group << ", call site ";
    if (!where.empty()) os << where << ", id ";
    os << key.call_site << ", generation " << key.generation << "); arrived: ";
    first = true;
    for (size_t r = 0; r < m.arrivals.size(); ++r)
      if (m.arrivals[r].device >= 0) {
        os << (first ? "" : ", ") << devs[r] << " (rank " << r << ")";
        first = false;
      }
    os << ". Every device of the axis must run the same collectives in the same order; raise "
          "JAX_BLINK_TIMEOUT_S if a device is only slow.";
    return os.str();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  // When the watchdog wakes next (it waits for the earliest deadline); min() while it is scanning.
  Clock::time_point watch_until_ = Clock::time_point::min();
  std::map<MeetingKey, Pending> pending_;
  std::map<MeetingKey, std::string> failed_;
  std::deque<MeetingKey> failed_order_;
};

}  // namespace

std::shared_ptr<Meeting> Arrive(const MeetingKey& key, std::shared_ptr<const CallSiteInfo> info, Arrival a,
                                int64_t timeout_ms) {
  return Registry::Get().Arrive(key, std::move(info), std::move(a), timeout_ms);
}

void FailCall(int64_t run_id, int64_t call_site, int64_t generation, const std::string& err) {
  Registry::Get().FailCall(run_id, call_site, generation, err);
}

int64_t EffectiveTimeoutMs(int64_t attr_ms) {
  if (const char* env = std::getenv("JAX_BLINK_TIMEOUT_S")) {
    char* end = nullptr;
    double s = std::strtod(env, &end);
    // Only finite values in (0, 1e6] s: anything else (inf, nan, huge) would overflow the ms count.
    // The lowering (jax_blink/lowering/ffi.py) already refuses such values with a clear error.
    if (end != env && s > 0 && s <= 1e6) return static_cast<int64_t>(s * 1000.0);
  }
  return attr_ms > 0 ? attr_ms : 60000;
}

int ErrorClassOf(const std::string& msg) {
  if (msg.rfind("jax_blink: collective timed out", 0) == 0) return 2;
  if (msg.find("jax_blink CUDA error") != std::string::npos) return 1;
  return 0;
}

bool IsTestAbsentDevice(int64_t device) {
  const char* env = std::getenv("JAX_BLINK_TEST_ABSENT_DEVICE");
  if (!env || !*env) return false;
  char* end = nullptr;
  long v = std::strtol(env, &end, 10);
  return end != env && v == device;
}

}  // namespace jax_blink
