// The device interpreter's program builder and critical path (see interp_plan.h).
#include "interp_plan.h"

#include <algorithm>
#include <array>
#include <map>
#include <set>

namespace jax_blink {

using interp::FlagRef;
using interp::Src;
using interp::Task;

interp::View InterpPlan::view() const {
  interp::View v;
  v.nranks = nranks;
  v.nleaves = nleaves;
  v.max_blocks = max_blocks;
  v.scalar = static_cast<int32_t>(scalar);
  v.lanes = lanes;
  v.elem_size = elem_size;
  v.tasks = tasks.data();
  v.block_begin = block_begin.data();
  v.srcs = srcs.data();
  v.deps = deps.data();
  v.arrives = arrives.data();
  v.leaf_start = leaf_start.data();
  v.tail = tail.data();
  v.tail_begin = tail_begin.data();
  return v;
}

namespace {

// A task before placement: global id order, its queue, sources, region accesses, dependencies.
struct Pending {
  Task t{};
  int64_t queue = 0;          // (rank, segment, phase) queue id
  int64_t chunk = 0;
  std::vector<Src> srcs;
  std::vector<int64_t> deps;  // global ids
  int64_t level = 0;          // data-flow level (1 + max over deps)
};

}  // namespace

std::string BuildInterpPlan(const ExecPlan& plan, Dtype dtype, const InterpOptions& opt, InterpPlan* out) {
  const Schedule& s = plan.schedule;
  const int32_t n = static_cast<int32_t>(s.nranks);
  if (!opt.peer_ok.empty() && static_cast<int64_t>(opt.peer_ok.size()) != int64_t{n} * n)
    return "jax_blink: interpreter: peer_ok must have nranks * nranks entries";
  if (opt.max_blocks < 0) return "jax_blink: interpreter: max_blocks must be >= 0";
  InterpPlan p;
  p.nranks = n;
  p.elem_size = static_cast<int64_t>(DtypeSize(dtype));
  const ScalarLayout layout = ScalarOf(dtype);
  p.scalar = layout.scalar;
  p.lanes = layout.lanes;
  std::vector<int64_t> leaves = opt.leaf_elems.empty() ? std::vector<int64_t>{s.nelems} : opt.leaf_elems;
  p.nleaves = static_cast<int32_t>(leaves.size());
  p.leaf_start.assign(leaves.size() + 1, 0);
  for (size_t l = 0; l < leaves.size(); ++l) {
    if (!opt.leaf_elems.empty() && leaves[l] <= 0) return "jax_blink: interpreter: a leaf has no elements";
    p.leaf_start[l + 1] = p.leaf_start[l] + leaves[l];
  }
  if (p.leaf_start.back() != s.nelems)
    return "jax_blink: interpreter: the leaves hold " + std::to_string(p.leaf_start.back()) +
           " elements, the schedule " + std::to_string(s.nelems);
  auto peer_ok = [&](int32_t reader, int32_t owner) {
    return reader == owner || opt.peer_ok.empty() || opt.peer_ok[static_cast<size_t>(reader) * n + owner] != 0;
  };

  // ---- tasks in global (topological) order, with region-derived dependencies
  std::vector<Pending> all;
  struct Track {
    int64_t last_writer = -1;
    std::vector<int64_t> readers;
  };
  std::map<std::array<int64_t, 3>, Track> tracks;  // (kind 0 rank buffers / 1 staging, rank|slot, chunk)
  std::map<std::array<int64_t, 3>, int64_t> queues;
  auto queue_of = [&](int32_t rank, int64_t seg, int phase) {
    auto key = std::array<int64_t, 3>{rank, seg, phase};
    auto it = queues.find(key);
    if (it != queues.end()) return it->second;
    const int64_t q = static_cast<int64_t>(queues.size());
    queues[key] = q;
    return q;
  };
  using Region = std::array<int64_t, 3>;
  auto add = [&](Pending pd, const std::vector<Region>& rd, const Region& wr) {
    const int64_t id = static_cast<int64_t>(all.size());
    std::vector<int64_t>& d = pd.deps;
    for (auto& k : rd) {
      Track& t = tracks[k];
      if (t.last_writer >= 0) d.push_back(t.last_writer);
    }
    {
      Track& t = tracks[wr];
      if (t.last_writer >= 0) d.push_back(t.last_writer);
      d.insert(d.end(), t.readers.begin(), t.readers.end());
    }
    for (auto& k : rd) tracks[k].readers.push_back(id);
    Track& t = tracks[wr];
    t.last_writer = id;
    t.readers.clear();
    std::sort(d.begin(), d.end());
    d.erase(std::unique(d.begin(), d.end()), d.end());
    for (int64_t x : d) pd.level = std::max(pd.level, all[x].level);
    ++pd.level;
    all.push_back(std::move(pd));
  };
  auto region = [](int32_t rank, int64_t c) { return Region{0, rank, c}; };
  int64_t staging = 0;
  const int64_t nchunks = static_cast<int64_t>(plan.chunks.size());
  for (int64_t c = 0; c < nchunks; ++c) {
    const ChunkPlan& cp = plan.chunks[c];
    auto make = [&](int32_t kind, int32_t rank, int64_t queue) {
      Pending pd;
      pd.t.kind = kind;
      pd.t.rank = rank;
      pd.t.offset = cp.offset;
      pd.t.length = cp.length;
      pd.t.flag = -1;
      pd.t.stage_slot = 0;
      pd.queue = queue;
      pd.chunk = c;
      return pd;
    };
    auto src_of = [](const Operand& o) { return Src{o.input ? interp::kIn : interp::kOut, o.rank, 0}; };
    for (const Step& st : cp.steps) {
      if (st.kind == 0) {
        const int32_t dst = st.writes[0];
        Pending red = make(interp::kReduce, dst, queue_of(dst, cp.segment, 0));
        std::vector<Region> rd;
        for (const Operand& o : st.reads) {
          if (o.rank != dst && !peer_ok(dst, o.rank)) {  // the owner stages its value for the reader
            Pending sg = make(interp::kStage, o.rank, queue_of(o.rank, cp.segment, 2));
            sg.t.stage_slot = staging;
            sg.srcs.push_back(src_of(o));
            const Region slot{1, staging, 0};
            add(std::move(sg), {region(o.rank, c)}, slot);
            red.srcs.push_back(Src{interp::kStaging, o.rank, staging});
            rd.push_back(slot);
            staging += cp.length;
          } else {
            red.srcs.push_back(src_of(o));
            rd.push_back(region(o.rank, c));
          }
        }
        add(std::move(red), rd, region(dst, c));
      } else {
        for (int32_t w : st.writes) {
          if (st.reads[0].rank != w && !peer_ok(w, st.reads[0].rank)) {
            Pending sg = make(interp::kStage, st.reads[0].rank, queue_of(st.reads[0].rank, cp.segment, 2));
            sg.t.stage_slot = staging;
            sg.srcs.push_back(src_of(st.reads[0]));
            const Region slot{1, staging, 0};
            add(std::move(sg), {region(st.reads[0].rank, c)}, slot);
            Pending cpy = make(interp::kCopy, w, queue_of(w, cp.segment, 1));
            cpy.srcs.push_back(Src{interp::kStaging, st.reads[0].rank, staging});
            staging += cp.length;
            add(std::move(cpy), {slot}, region(w, c));
          } else {
            Pending cpy = make(interp::kCopy, w, queue_of(w, cp.segment, 1));
            cpy.srcs.push_back(src_of(st.reads[0]));
            add(std::move(cpy), {region(st.reads[0].rank, c)}, region(w, c));
          }
        }
      }
    }
    for (int32_t r : cp.copy_in) {
      Pending cpy = make(interp::kCopy, r, queue_of(r, cp.segment, 1));
      cpy.srcs.push_back(Src{interp::kIn, r, 0});
      add(std::move(cpy), {region(r, c)}, region(r, c));
    }
    for (int32_t r : cp.zero) add(make(interp::kZero, r, queue_of(r, cp.segment, 1)), {}, region(r, c));
  }
  p.staging_elems = staging;

  // ---- blocks. No cap: one block per queue (rank, segment, phase), tasks by (level, global id).
  // A cap of B blocks per rank: list scheduling in unit steps (Graham): at each step every rank
  // starts up to B ready tasks, longest remaining path first, each block in the order it started
  // them (a topological order, as the uncapped one).
  std::vector<int32_t> per_rank(n, 0);
  std::vector<int64_t> run_key(all.size(), 0);  // order within a block
  if (opt.max_blocks <= 0) {
    std::map<int64_t, int32_t> qblock;
    std::vector<std::pair<int64_t, int64_t>> order;  // (queue id, rank) in creation order
    for (auto& [key, q] : queues) order.push_back({q, key[0]});
    std::sort(order.begin(), order.end());
    for (auto& [q, r] : order) qblock[q] = per_rank[r]++;
    for (size_t i = 0; i < all.size(); ++i) {
      all[i].t.block = qblock[all[i].queue];
      run_key[i] = all[i].level;
    }
  } else {
    const size_t nt = all.size();
    std::vector<std::vector<int64_t>> succ(nt);
    for (size_t i = 0; i < nt; ++i)
      for (int64_t d : all[i].deps) succ[d].push_back(static_cast<int64_t>(i));
    std::vector<int64_t> bottom(nt, 1);
    for (size_t i = nt; i-- > 0;)
      for (int64_t x : succ[i]) bottom[i] = std::max(bottom[i], bottom[x] + 1);
    std::vector<int64_t> finish(nt, -1), missing(nt, 0);
    for (size_t i = 0; i < nt; ++i) missing[i] = static_cast<int64_t>(all[i].deps.size());
    std::vector<std::vector<int64_t>> ready(n);  // per rank: tasks whose deps finished by now
    for (size_t i = 0; i < nt; ++i)
      if (missing[i] == 0) ready[all[i].t.rank].push_back(static_cast<int64_t>(i));
    size_t done = 0;
    for (int64_t step = 0; done < nt; ++step) {
      std::vector<int64_t> started;
      for (int32_t r = 0; r < n; ++r) {
        auto& rd = ready[r];
        std::sort(rd.begin(), rd.end(), [&](int64_t a, int64_t b) {
          return bottom[a] != bottom[b] ? bottom[a] > bottom[b] : a < b;
        });
        const size_t k = std::min(rd.size(), static_cast<size_t>(opt.max_blocks));
        for (size_t j = 0; j < k; ++j) {
          all[rd[j]].t.block = static_cast<int32_t>(j);
          run_key[rd[j]] = step;
          per_rank[r] = std::max(per_rank[r], static_cast<int32_t>(j) + 1);
          started.push_back(rd[j]);
        }
        rd.erase(rd.begin(), rd.begin() + static_cast<std::ptrdiff_t>(k));
      }
      for (int64_t x : started) {
        finish[x] = step + 1;
        ++done;
        for (int64_t y : succ[x])
          if (--missing[y] == 0) ready[all[y].t.rank].push_back(y);
      }
    }
  }
  int32_t B = 1;
  for (int32_t r = 0; r < n; ++r) B = std::max(B, per_rank[r]);
  p.max_blocks = B;
  p.blocks_used = per_rank;
  // run order: by (rank, block), then (level, global id)
  std::vector<int64_t> order(all.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const Task &x = all[a].t, &y = all[b].t;
    if (x.rank != y.rank) return x.rank < y.rank;
    if (x.block != y.block) return x.block < y.block;
    if (run_key[a] != run_key[b]) return run_key[a] < run_key[b];
    return a < b;
  });
  std::vector<int64_t> pos(all.size());
  for (size_t i = 0; i < order.size(); ++i) pos[order[i]] = static_cast<int64_t>(i);
  // flags: a task that some task of another block waits on gets one in its rank's array
  std::vector<int32_t> flag(all.size(), -1);
  p.flags_per_rank.assign(n, interp::kFirstTaskFlag);  // entries 0, 1: arrival, error-record claim
  auto flag_of = [&](int64_t id) {
    if (flag[id] < 0) flag[id] = p.flags_per_rank[all[id].t.rank]++;
    return FlagRef{all[id].t.rank, flag[id]};
  };
  // tail: per rank, the other ranks' tasks that read its buffers (or its staging slots' values)
  std::vector<std::vector<int64_t>> readers(n);
  for (size_t i = 0; i < all.size(); ++i)
    for (const Src& s2 : all[i].srcs)
      if (s2.rank != all[i].t.rank) readers[s2.rank].push_back(static_cast<int64_t>(i));  // staging: its writer
  p.block_begin.assign(static_cast<size_t>(n) * B + 1, 0);
  std::vector<std::vector<int32_t>> seen(static_cast<size_t>(n) * B);  // ranks whose arrival a block awaited
  for (int64_t id : order) {
    Pending& pd = all[id];
    Task t = pd.t;
    t.src_begin = static_cast<int32_t>(p.srcs.size());
    t.src_count = static_cast<int32_t>(pd.srcs.size());
    p.srcs.insert(p.srcs.end(), pd.srcs.begin(), pd.srcs.end());
    t.dep_begin = static_cast<int32_t>(p.deps.size());
    for (int64_t d : pd.deps)
      if (!(all[d].t.rank == t.rank && all[d].t.block == t.block)) p.deps.push_back(flag_of(d));
    t.dep_count = static_cast<int32_t>(p.deps.size()) - t.dep_begin;
    t.arrive_begin = static_cast<int32_t>(p.arrives.size());
    auto& sn = seen[static_cast<size_t>(t.rank) * B + t.block];
    for (const Src& s2 : pd.srcs)
      if (s2.where != interp::kStaging && s2.rank != t.rank &&
          std::find(sn.begin(), sn.end(), s2.rank) == sn.end()) {
        sn.push_back(s2.rank);
        p.arrives.push_back(s2.rank);
      }
    t.arrive_count = static_cast<int32_t>(p.arrives.size()) - t.arrive_begin;
    p.tasks.push_back(t);
    p.block_begin[static_cast<size_t>(t.rank) * B + t.block + 1] = static_cast<int32_t>(p.tasks.size());
  }
  for (size_t i = 1; i < p.block_begin.size(); ++i) p.block_begin[i] = std::max(p.block_begin[i], p.block_begin[i - 1]);
  p.tail_begin.assign(n + 1, 0);
  for (int32_t r = 0; r < n; ++r) {
    std::sort(readers[r].begin(), readers[r].end());
    readers[r].erase(std::unique(readers[r].begin(), readers[r].end()), readers[r].end());
    for (int32_t q = 0; q < n; ++q)  // every rank arrived: a rank that never does fails every peer
      if (q != r) p.tail.push_back(FlagRef{q, interp::kArrivalFlag});
    for (int64_t id : readers[r]) p.tail.push_back(flag_of(id));
    p.tail_begin[r + 1] = static_cast<int32_t>(p.tail.size());
  }
  // flags assigned after the tasks were emitted: write them into the tasks
  for (size_t i = 0; i < order.size(); ++i) p.tasks[i].flag = flag[order[i]];

  // ---- pipelining figures
  std::map<int64_t, int64_t> seg_chunks;
  for (const ChunkPlan& cp : plan.chunks) ++seg_chunks[cp.segment];
  for (auto& [seg, k] : seg_chunks) p.max_segment_chunks = std::max(p.max_segment_chunks, k);
  std::vector<int64_t> chain(all.size(), 0);
  std::map<int64_t, int64_t> seg_depth;
  for (size_t i = 0; i < all.size(); ++i) {
    int64_t best = 0;
    for (int64_t d : all[i].deps)
      if (all[d].chunk == all[i].chunk) best = std::max(best, chain[d]);
    chain[i] = best + 1;
    p.chunk_depth = std::max(p.chunk_depth, chain[i]);
    int64_t& sd = seg_depth[plan.chunks[all[i].chunk].segment];
    sd = std::max(sd, chain[i]);
  }
  for (auto& [seg, k] : seg_chunks) p.pipeline_ideal = std::max(p.pipeline_ideal, k + seg_depth[seg] - 1);
  *out = std::move(p);
  return "";
}

std::string InterpErrorMessage(const std::vector<interp::ErrorRecord>& records, uint64_t epoch, int64_t timeout_ms) {
  std::set<int64_t> missing, waiting;
  for (const auto& r : records)
    if (r.epoch == epoch && epoch != 0) {
      missing.insert(r.missing_rank);
      waiting.insert(r.waiting_rank);
    }
  if (missing.empty()) return "";
  auto list = [](const std::set<int64_t>& s) {
    std::string o;
    for (int64_t x : s) o += (o.empty() ? "" : ", ") + std::to_string(x);
    return o;
  };
  return "jax_blink: collective timed out: rank" + std::string(missing.size() > 1 ? "s " : " ") + list(missing) +
         " never arrived on the device within " + std::to_string(timeout_ms) + " ms (ranks " + list(waiting) +
         " gave up waiting; JAX_BLINK_TIMEOUT_S sets the bound)";
}

void ErrorWatch::Reset(const interp::ErrorRecord* records, int32_t nranks) {
  records_ = records;
  nranks_ = nranks;
  reported_ = launched_ = 0;
}

void ErrorWatch::Launched(uint64_t epoch, int64_t timeout_ms) {
  if (epoch > launched_) launched_ = epoch;
  timeout_ms_ = timeout_ms;
}

std::string ErrorWatch::Poll() {
  if (!records_ || launched_ <= reported_) return "";
  std::vector<interp::ErrorRecord> recs;
  uint64_t first = 0;
  for (int32_t r = 0; r < nranks_; ++r) {
    const interp::ErrorRecord* src = &records_[r];
    for (int attempt = 0; attempt < 4; ++attempt) {
      const uint64_t e = __atomic_load_n(&src->epoch, __ATOMIC_ACQUIRE);
      if (e <= reported_ || e > launched_) break;  // stale, or not a call this watch knows
      interp::ErrorRecord c{e, __atomic_load_n(&src->missing_rank, __ATOMIC_RELAXED),
                            __atomic_load_n(&src->waiting_rank, __ATOMIC_RELAXED),
                            __atomic_load_n(&src->task, __ATOMIC_RELAXED)};
      if (__atomic_load_n(&src->epoch, __ATOMIC_ACQUIRE) != e) continue;  // rewritten meanwhile
      recs.push_back(c);
      if (first == 0 || e < first) first = e;
      break;
    }
  }
  if (first == 0) return "";
  std::string msg = InterpErrorMessage(recs, first, timeout_ms_);
  reported_ = launched_;
  return msg;
}

int64_t CriticalPath(const InterpPlan& p) {
  // Finish step of every task: 1 + max(previous task of its block, its dependency flags). Tasks are
  // stored block by block; a task's dependencies lie in other blocks, so iterate to a fixed point in
  // rounds (each round settles at least one more task of every chain; bounded by the task count).
  const size_t nt = p.tasks.size();
  std::vector<int64_t> fin(nt, 0);
  std::map<std::pair<int32_t, int32_t>, int64_t> by_flag;  // (rank, flag) -> task index
  for (size_t i = 0; i < nt; ++i)
    if (p.tasks[i].flag >= 0) by_flag[{p.tasks[i].rank, p.tasks[i].flag}] = static_cast<int64_t>(i);
  bool changed = true;
  size_t rounds = 0;
  while (changed && rounds++ <= nt + 1) {
    changed = false;
    for (size_t blk = 0; blk + 1 < p.block_begin.size(); ++blk) {
      int64_t prev = 0;
      for (int32_t i = p.block_begin[blk]; i < p.block_begin[blk + 1]; ++i) {
        const Task& t = p.tasks[i];
        int64_t start = prev;
        for (int32_t k = 0; k < t.dep_count; ++k) {
          const FlagRef& d = p.deps[t.dep_begin + k];
          start = std::max(start, fin[by_flag.at({d.rank, d.index})]);
        }
        const int64_t f = start + 1;
        if (f != fin[i]) {
          fin[i] = f;
          changed = true;
        }
        prev = f;
      }
    }
  }
  if (changed) return -1;  // no fixed point: a cycle (cannot happen: blocks run in topological order)
  int64_t end = 0;
  for (int64_t f : fin) end = std::max(end, f);
  return end;
}

}  // namespace jax_blink
