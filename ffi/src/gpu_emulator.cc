// CPU emulator of GPU programs (see gpu_emulator.h).
#include "gpu_emulator.h"

#include <cstring>
#include <queue>
#include <random>

#include "cpu_executor.h"

namespace jax_blink {

std::string EmulateGpuProgram(const GpuProgram& p, Dtype dtype, int64_t nelems,
                              const std::vector<const void*>& inputs, uint64_t seed,
                              std::vector<std::vector<uint8_t>>* outputs) {
  const int32_t n = p.nranks;
  if (static_cast<int32_t>(inputs.size()) != n) return "emulator: need one input per rank";
  if (static_cast<int64_t>(DtypeSize(dtype)) != p.elem_size) return "emulator: dtype size differs from the program's";
  const size_t bytes = static_cast<size_t>(nelems) * p.elem_size;
  const size_t nleaves = p.leaf_elems.size();
  if (p.leaf_aliased.size() != nleaves) return "emulator: leaf_aliased size differs from the leaves'";
  std::vector<size_t> leaf_off(nleaves + 1, 0);  // byte offset of each leaf in the concatenation
  for (size_t l = 0; l < nleaves; ++l) leaf_off[l + 1] = leaf_off[l] + static_cast<size_t>(p.leaf_elems[l] * p.elem_size);
  if (leaf_off[nleaves] != bytes) return "emulator: the leaves' sizes differ from nelems";
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 1);
  auto garbage = [&](std::vector<uint8_t>& v) {
    for (auto& b : v) b = static_cast<uint8_t>(rng() | 1);  // never all-zero bytes
  };
  // Every buffer its own allocation: in[r][leaf], out[r][leaf] (an aliased leaf's input is its
  // output), scratch[i].
  std::vector<std::vector<std::vector<uint8_t>>> in(n), out(n);
  for (int32_t r = 0; r < n; ++r)
    for (size_t l = 0; l < nleaves; ++l) {
      in[r].emplace_back(p.leaf_aliased[l] ? 0 : leaf_off[l + 1] - leaf_off[l]);
      out[r].emplace_back(leaf_off[l + 1] - leaf_off[l]);
      garbage(in[r].back());
      garbage(out[r].back());
    }
  std::vector<std::vector<uint8_t>> scratch;
  for (auto& s : p.scratch) scratch.emplace_back(static_cast<size_t>(s.bytes));
  for (auto& v : scratch) garbage(v);
  outputs->assign(n, std::vector<uint8_t>());
  std::vector<uint8_t> none;
  auto mem = [&](const BufRef& b) -> std::vector<uint8_t>& {
    if (b.kind == BufKind::kScratch) return static_cast<size_t>(b.owner) < scratch.size() ? scratch[b.owner] : none;
    if (b.owner < 0 || b.owner >= n || b.leaf < 0 || static_cast<size_t>(b.leaf) >= nleaves) return none;
    return b.kind == BufKind::kIn && !p.leaf_aliased[b.leaf] ? in[b.owner][b.leaf] : out[b.owner][b.leaf];
  };
  auto check = [&](const ByteRange& r) {
    return r.offset >= 0 && r.bytes >= 0 && static_cast<size_t>(r.offset + r.bytes) <= mem(r.buf).size();
  };

  // Static: each stream's op list, and each wait's target record (latest record of the event before it).
  const size_t ns = p.streams.size();
  std::vector<std::vector<size_t>> queue(ns);
  std::vector<int64_t> target(p.ops.size(), -1);
  {
    std::vector<int64_t> last(static_cast<size_t>(std::max(p.nevents, 0)) + 1, -1);
    for (size_t i = 0; i < p.ops.size(); ++i) {
      const GpuOp& op = p.ops[i];
      if (op.stream < 0 || static_cast<size_t>(op.stream) >= ns) return "emulator: bad stream id";
      queue[op.stream].push_back(i);
      if (op.kind == GpuOpKind::kRecord || op.kind == GpuOpKind::kWait) {
        if (op.event < 0) return "emulator: bad event id";
        if (static_cast<size_t>(op.event) >= last.size()) last.resize(op.event + 1, -1);
        if (op.kind == GpuOpKind::kRecord) last[op.event] = static_cast<int64_t>(i);
        else target[i] = last[op.event];
      }
      for (auto& r : op.reads) if (!check(r)) return "emulator: read out of bounds";
      for (auto& r : op.writes) if (!check(r)) return "emulator: write out of bounds";
    }
  }
  std::vector<size_t> head(ns, 0);
  std::vector<uint8_t> busy(ns, 0), done(p.ops.size(), 0);
  std::vector<std::vector<uint8_t>> pending(p.ops.size());  // result computed at start, written at end
  using Ev = std::pair<uint64_t, size_t>;                   // (end time, op)
  std::priority_queue<Ev, std::vector<Ev>, std::greater<Ev>> running;
  uint64_t now = 0;
  size_t remaining = p.ops.size();
  std::vector<const void*> srcs;

  auto start = [&](size_t i) {
    const GpuOp& op = p.ops[i];
    std::vector<uint8_t>& res = pending[i];
    switch (op.kind) {
      case GpuOpKind::kCopy: {
        const auto& s = op.src[0];
        res.assign(mem(s.buf).begin() + s.offset, mem(s.buf).begin() + s.offset + s.bytes);
        break;
      }
      case GpuOpKind::kReduce: {
        res.resize(static_cast<size_t>(op.dst.bytes));
        srcs.clear();
        for (size_t k = 1; k < op.src.size(); ++k) srcs.push_back(mem(op.src[k].buf).data() + op.src[k].offset);
        SumInto(dtype, res.data(), mem(op.src[0].buf).data() + op.src[0].offset, srcs.data(),
                static_cast<int>(srcs.size()), op.elems);
        break;
      }
      case GpuOpKind::kZero: res.assign(static_cast<size_t>(op.dst.bytes), 0); break;
      case GpuOpKind::kXlaAfter: {
        auto& o = (*outputs)[op.rank];
        o.clear();
        for (auto& leaf : out[op.rank]) o.insert(o.end(), leaf.begin(), leaf.end());
        break;
      }
      default: break;
    }
  };
  auto finish = [&](size_t i) {
    const GpuOp& op = p.ops[i];
    if (op.kind == GpuOpKind::kCopy || op.kind == GpuOpKind::kReduce || op.kind == GpuOpKind::kZero) {
      std::memcpy(mem(op.dst.buf).data() + op.dst.offset, pending[i].data(), pending[i].size());
    } else if (op.kind == GpuOpKind::kXlaBefore) {
      for (size_t l = 0; l < nleaves; ++l) {
        const bool alias = p.leaf_aliased[l];
        auto& dst = alias ? out[op.rank][l] : in[op.rank][l];
        if (!dst.empty()) std::memcpy(dst.data(), static_cast<const uint8_t*>(inputs[op.rank]) + leaf_off[l], dst.size());
        if (!alias) garbage(out[op.rank][l]);
      }
    } else if (op.kind == GpuOpKind::kXlaAfter) {
      for (size_t l = 0; l < nleaves; ++l) {
        garbage(in[op.rank][l]);
        garbage(out[op.rank][l]);
      }
    }
    pending[i].clear();
    pending[i].shrink_to_fit();
    done[i] = 1;
    --remaining;
  };
  std::vector<size_t> order(ns);
  for (size_t s = 0; s < ns; ++s) order[s] = s;
  while (remaining > 0) {
    // Start whatever can start now (records and waits take no time), streams in random order.
    bool progress = true;
    while (progress) {
      progress = false;
      std::shuffle(order.begin(), order.end(), rng);
      for (size_t s : order) {
        while (!busy[s] && head[s] < queue[s].size()) {
          size_t i = queue[s][head[s]];
          const GpuOp& op = p.ops[i];
          if (op.kind == GpuOpKind::kWait) {
            if (target[i] >= 0 && !done[target[i]]) break;
            done[i] = 1;
            --remaining;
            ++head[s];
            progress = true;
          } else if (op.kind == GpuOpKind::kRecord) {
            done[i] = 1;
            --remaining;
            ++head[s];
            progress = true;
          } else {
            start(i);
            busy[s] = 1;
            running.push({now + 1 + rng() % 1000, i});
            progress = true;
          }
        }
      }
    }
    if (running.empty()) {
      if (remaining == 0) break;
      return "emulator: deadlock (a stream waits on an event that can never complete)";
    }
    auto [t, i] = running.top();
    running.pop();
    now = t;
    finish(i);
    const int32_t s = p.ops[i].stream;
    busy[s] = 0;
    ++head[s];
  }
  return "";
}

}  // namespace jax_blink
