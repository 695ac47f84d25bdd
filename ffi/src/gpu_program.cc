// GPU program builder, race checker and critical path (see gpu_program.h).
#include "gpu_program.h"

#include <algorithm>
#include <array>
#include <map>
#include <sstream>

namespace jax_blink {

const char* GpuOpKindName(GpuOpKind k) {
  switch (k) {
    case GpuOpKind::kCopy: return "copy";
    case GpuOpKind::kReduce: return "reduce";
    case GpuOpKind::kZero: return "zero";
    case GpuOpKind::kRecord: return "record";
    case GpuOpKind::kWait: return "wait";
    case GpuOpKind::kXlaBefore: return "xla-before";
    case GpuOpKind::kXlaAfter: return "xla-after";
  }
  return "?";
}

namespace {

std::string BufName(const BufRef& b) {
  const std::string leaf = b.leaf ? ".leaf" + std::to_string(b.leaf) : "";
  switch (b.kind) {
    case BufKind::kIn: return "in[" + std::to_string(b.owner) + "]" + leaf;
    case BufKind::kOut: return "out[" + std::to_string(b.owner) + "]" + leaf;
    case BufKind::kScratch: return "scratch[" + std::to_string(b.owner) + "]";
  }
  return "?";
}

// Per (buffer, region) access history while building: the last writer and the readers since.
struct Track {
  int64_t last_writer = -1;
  std::vector<int64_t> readers;
};
// (kind, owner, region, piece): region = chunk and piece = its piece (one per leaf it spans) for
// inputs and outputs; region = slot, piece 0 for scratch.
using RegionKey = std::array<int64_t, 4>;

// A chunk's part inside one leaf: virtual elements [begin, end) of the leaves' concatenation.
struct Piece {
  int32_t leaf;
  int64_t begin, end;
};

// Merges a chunk's reduce steps into the same destination into one fused step placed at the LAST of
// them (FuseOps only joins a step to an earlier one, so a parent whose children finish at different
// times gets several steps, which serialises chunks on its reduce stream). Step i joins the next step
// j that touches out[dst] when j is a reduce into dst reading out[dst] first and no step in between
// writes what i reads: the adds into dst keep their order, every source is read at a point where its
// value is the same, so the bits are those of the rows in order.
std::vector<Step> MergeReduces(std::vector<Step> steps) {
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
              if (!o.input && o.rank == w) clobbers = true;
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
  return steps;
}

}  // namespace

std::string BuildGpuProgram(const ExecPlan& plan, int64_t elem_size, int64_t lanes, const GpuProgramOptions& opt,
                            GpuProgram* out) {
  const Schedule& s = plan.schedule;
  const int32_t n = static_cast<int32_t>(s.nranks);
  if (static_cast<int64_t>(opt.rank_device.size()) != n)
    return "jax_blink: gpu program: rank_device has " + std::to_string(opt.rank_device.size()) + " entries for " +
           std::to_string(n) + " ranks";
  if (!opt.peer_ok.empty() && static_cast<int64_t>(opt.peer_ok.size()) != int64_t{n} * n)
    return "jax_blink: gpu program: peer_ok must have nranks * nranks entries";
  if (elem_size <= 0 || lanes <= 0) return "jax_blink: gpu program: bad element size";
  GpuProgram p;
  p.nranks = n;
  p.elem_size = elem_size;
  p.lanes = lanes;
  p.leaf_elems = opt.leaf_elems.empty() ? std::vector<int64_t>{s.nelems} : opt.leaf_elems;
  const int32_t nleaves = static_cast<int32_t>(p.leaf_elems.size());
  p.leaf_aliased = opt.leaf_aliased.empty() ? std::vector<uint8_t>(nleaves, 0) : opt.leaf_aliased;
  if (static_cast<int32_t>(p.leaf_aliased.size()) != nleaves)
    return "jax_blink: gpu program: leaf_aliased must have one entry per leaf";
  std::vector<int64_t> leaf_start(nleaves + 1, 0);
  for (int32_t l = 0; l < nleaves; ++l) {
    if (!opt.leaf_elems.empty() && p.leaf_elems[l] <= 0) return "jax_blink: gpu program: a leaf has no elements";
    leaf_start[l + 1] = leaf_start[l] + p.leaf_elems[l];
  }
  if (leaf_start[nleaves] != s.nelems)
    return "jax_blink: gpu program: the leaves hold " + std::to_string(leaf_start[nleaves]) +
           " elements, the schedule " + std::to_string(s.nelems);
  const int64_t nchunks = static_cast<int64_t>(plan.chunks.size());
  const int64_t slot_bytes = plan.max_chunk * elem_size;
  // Each chunk's pieces, one per leaf it touches (every rank has the same leaves).
  std::vector<std::vector<Piece>> pieces(nchunks);
  for (int64_t c = 0; c < nchunks; ++c) {
    int64_t a = plan.chunks[c].offset;
    const int64_t b = a + plan.chunks[c].length;
    int32_t l = static_cast<int32_t>(std::upper_bound(leaf_start.begin(), leaf_start.end(), a) - leaf_start.begin()) - 1;
    l = std::min(std::max(l, 0), nleaves - 1);
    do {
      const int64_t e = std::min(b, leaf_start[l + 1]);
      pieces[c].push_back(Piece{l, a, e});
      a = e;
      ++l;
    } while (a < b && l < nleaves);
  }
  // An aliased leaf's input is its output buffer.
  auto resolve = [&](BufKind k, int32_t leaf) {
    return k == BufKind::kIn && p.leaf_aliased[leaf] ? BufKind::kOut : k;
  };

  // ---- streams
  for (int32_t r = 0; r < n; ++r) {
    GpuStream st;
    st.device = opt.rank_device[r];
    st.rank = r;
    st.xla = true;
    st.role = "xla";
    p.streams.push_back(st);
  }
  std::map<std::array<int64_t, 3>, int32_t> logical;   // (rank, segment, phase) -> stream
  std::map<std::pair<int32_t, int32_t>, int32_t> physical;  // (device, slot) -> stream (capped)
  std::map<int32_t, int32_t> device_streams;            // device -> logical streams so far
  auto work_stream = [&](int32_t rank, int64_t seg, int phase) -> int32_t {
    auto key = std::array<int64_t, 3>{rank, seg, phase};
    auto it = logical.find(key);
    if (it != logical.end()) return it->second;
    const int32_t dev = opt.rank_device[rank];
    int32_t idx = device_streams[dev]++;
    int32_t id;
    if (opt.max_streams_per_device > 0) {
      const int32_t slot = idx % opt.max_streams_per_device;
      auto pit = physical.find({dev, slot});
      if (pit != physical.end()) {
        id = pit->second;
      } else {
        GpuStream st;
        st.device = dev;
        st.rank = rank;
        st.slot = slot;
        st.role = "dev" + std::to_string(dev) + "/" + std::to_string(slot);
        id = static_cast<int32_t>(p.streams.size());
        p.streams.push_back(st);
        physical[{dev, slot}] = id;
      }
    } else {
      GpuStream st;
      st.device = dev;
      st.rank = rank;
      st.slot = idx;
      st.role = std::string(phase == 0 ? "R" : "B") + " s" + std::to_string(seg);
      id = static_cast<int32_t>(p.streams.size());
      p.streams.push_back(st);
    }
    logical[key] = id;
    return id;
  };
  std::map<std::pair<int32_t, int64_t>, int32_t> scratch_of;  // (rank, segment) -> scratch index
  auto scratch = [&](int32_t rank, int64_t seg, int64_t slots) -> int32_t {
    auto it = scratch_of.find({rank, seg});
    int32_t id;
    if (it == scratch_of.end()) {
      id = static_cast<int32_t>(p.scratch.size());
      p.scratch.push_back(ScratchBuf{rank, 0});
      scratch_of[{rank, seg}] = id;
    } else {
      id = it->second;
    }
    p.scratch[id].bytes = std::max(p.scratch[id].bytes, slots * slot_bytes);
    return id;
  };
  auto peer_ok = [&](int32_t reader, int32_t owner) {
    return reader == owner || opt.peer_ok.empty() || opt.peer_ok[static_cast<size_t>(reader) * n + owner] != 0;
  };

  // ---- pass 1: memory ops in issue order, with their dependencies
  std::vector<GpuOp> mem;
  std::vector<std::vector<int64_t>> deps;
  std::map<RegionKey, Track> tracks;
  // (buffer, region) -> the tracked keys: a chunk of an input or output, one per piece (aliased
  // inputs resolved to the output); a scratch slot as is.
  auto keys = [&](const std::vector<std::pair<BufRef, int64_t>>& acc) {
    std::vector<RegionKey> out;
    for (auto& [b, reg] : acc) {
      if (b.kind == BufKind::kScratch) {
        out.push_back({static_cast<int64_t>(b.kind), b.owner, reg, 0});
        continue;
      }
      for (size_t k = 0; k < pieces[reg].size(); ++k)
        out.push_back({static_cast<int64_t>(resolve(b.kind, pieces[reg][k].leaf)), b.owner, reg,
                       static_cast<int64_t>(k)});
    }
    return out;
  };
  auto add = [&](GpuOp op, const std::vector<std::pair<BufRef, int64_t>>& rd_acc,
                 const std::vector<std::pair<BufRef, int64_t>>& wr_acc) {
    const int64_t id = static_cast<int64_t>(mem.size());
    const std::vector<RegionKey> rd = keys(rd_acc), wr = keys(wr_acc);
    std::vector<int64_t> d;
    for (auto& k : rd) {
      Track& t = tracks[k];
      if (t.last_writer >= 0) d.push_back(t.last_writer);
    }
    for (auto& k : wr) {
      Track& t = tracks[k];
      if (t.last_writer >= 0) d.push_back(t.last_writer);
      d.insert(d.end(), t.readers.begin(), t.readers.end());
    }
    for (auto& k : rd) tracks[k].readers.push_back(id);
    for (auto& k : wr) {
      Track& t = tracks[k];
      t.last_writer = id;
      t.readers.clear();
    }
    std::sort(d.begin(), d.end());
    d.erase(std::unique(d.begin(), d.end()), d.end());
    d.erase(std::remove_if(d.begin(), d.end(), [&](int64_t x) { return mem[x].stream == op.stream; }), d.end());
    mem.push_back(std::move(op));
    deps.push_back(std::move(d));
  };
  auto chunk_range = [&](BufKind k, int32_t rank, int64_t c) {
    const ChunkPlan& cp = plan.chunks[c];
    return ByteRange{BufRef{k, rank}, cp.offset * elem_size, cp.length * elem_size};
  };
  // A rank's whole buffers, leaf by leaf (the pseudo ops' ranges): its output's, and its input's
  // unless aliased to the output.
  auto whole = [&](int32_t r, bool with_input) {
    std::vector<ByteRange> v;
    for (int32_t l = 0; l < nleaves; ++l) {
      if (with_input && !p.leaf_aliased[l]) v.push_back(ByteRange{BufRef{BufKind::kIn, r, l}, 0, p.leaf_elems[l] * elem_size});
      v.push_back(ByteRange{BufRef{BufKind::kOut, r, l}, 0, p.leaf_elems[l] * elem_size});
    }
    return v;
  };
  // XLA wrote every rank's input (and may have used its output buffer) before the call.
  for (int32_t r = 0; r < n; ++r) {
    GpuOp op;
    op.kind = GpuOpKind::kXlaBefore;
    op.stream = r;
    op.rank = r;
    op.writes = whole(r, true);
    std::vector<std::pair<BufRef, int64_t>> wr;
    for (int64_t c = 0; c < nchunks; ++c)
      for (BufKind k : {BufKind::kIn, BufKind::kOut}) wr.push_back({BufRef{k, r}, c});
    add(std::move(op), {}, wr);
  }
  for (int64_t c = 0; c < nchunks; ++c) {
    const ChunkPlan& cp = plan.chunks[c];
    const int64_t bytes = cp.length * elem_size;
    auto operand = [&](const Operand& o) { return BufRef{o.input ? BufKind::kIn : BufKind::kOut, o.rank}; };
    for (const Step& st : MergeReduces(cp.steps)) {
      if (st.kind == 0) {  // reduce into writes[0] on its R stream
        const int32_t dst = st.writes[0];
        const int32_t sid = work_stream(dst, cp.segment, 0);
        GpuOp red;
        red.kind = GpuOpKind::kReduce;
        red.stream = sid;
        red.chunk = c;
        red.elems = cp.length;
        red.dst = chunk_range(BufKind::kOut, dst, c);
        std::vector<std::pair<BufRef, int64_t>> rd;
        int64_t staged = 0;
        for (size_t i = 0; i < st.reads.size(); ++i) {
          BufRef b = operand(st.reads[i]);
          if (st.reads[i].rank != dst && !peer_ok(dst, st.reads[i].rank)) {
            // copy engine: peer buffer -> scratch slot, then the kernel reads the scratch
            const int32_t sc = scratch(dst, cp.segment, staged + 1);
            GpuOp cp_op;
            cp_op.kind = GpuOpKind::kCopy;
            cp_op.stream = sid;
            cp_op.chunk = c;
            cp_op.elems = cp.length;
            cp_op.dst = ByteRange{BufRef{BufKind::kScratch, sc}, staged * slot_bytes, bytes};
            cp_op.src = {chunk_range(b.kind, b.owner, c)};
            cp_op.reads = cp_op.src;
            cp_op.writes = {cp_op.dst};
            add(cp_op, {{b, c}}, {{cp_op.dst.buf, staged}});
            red.src.push_back(cp_op.dst);
            rd.push_back({cp_op.dst.buf, staged});
            ++staged;
          } else {
            red.src.push_back(chunk_range(b.kind, b.owner, c));
            rd.push_back({b, c});
          }
        }
        red.reads = red.src;
        red.writes = {red.dst};
        add(std::move(red), rd, {{BufRef{BufKind::kOut, dst}, c}});
      } else {  // copy to every destination, each on its own B stream
        const BufRef src = operand(st.reads[0]);
        for (int32_t w : st.writes) {
          GpuOp op;
          op.kind = GpuOpKind::kCopy;
          op.stream = work_stream(w, cp.segment, 1);
          op.chunk = c;
          op.elems = cp.length;
          op.dst = chunk_range(BufKind::kOut, w, c);
          op.src = {chunk_range(src.kind, src.owner, c)};
          op.reads = op.src;
          op.writes = {op.dst};
          add(std::move(op), {{src, c}}, {{BufRef{BufKind::kOut, w}, c}});
        }
      }
    }
    for (int32_t r : cp.copy_in) {
      bool all_aliased = true;  // out = in is then already true
      for (const Piece& pc : pieces[c]) all_aliased = all_aliased && p.leaf_aliased[pc.leaf];
      if (all_aliased) continue;
      GpuOp op;
      op.kind = GpuOpKind::kCopy;
      op.stream = work_stream(r, cp.segment, 1);
      op.chunk = c;
      op.elems = cp.length;
      op.dst = chunk_range(BufKind::kOut, r, c);
      op.src = {chunk_range(BufKind::kIn, r, c)};
      op.reads = op.src;
      op.writes = {op.dst};
      add(std::move(op), {{BufRef{BufKind::kIn, r}, c}}, {{BufRef{BufKind::kOut, r}, c}});
    }
    for (int32_t r : cp.zero) {
      GpuOp op;
      op.kind = GpuOpKind::kZero;
      op.stream = work_stream(r, cp.segment, 1);
      op.chunk = c;
      op.elems = cp.length;
      op.dst = chunk_range(BufKind::kOut, r, c);
      op.writes = {op.dst};
      add(std::move(op), {}, {{BufRef{BufKind::kOut, r}, c}});
    }
  }
  // XLA reads every output and may reuse both buffers once the call's work on its stream is done.
  for (int32_t r = 0; r < n; ++r) {
    GpuOp op;
    op.kind = GpuOpKind::kXlaAfter;
    op.stream = r;
    op.rank = r;
    op.reads = whole(r, false);
    op.writes = whole(r, true);
    std::vector<std::pair<BufRef, int64_t>> rd, wr;
    for (int64_t c = 0; c < nchunks; ++c) {
      for (BufKind k : {BufKind::kIn, BufKind::kOut}) wr.push_back({BufRef{k, r}, c});
      rd.push_back({BufRef{BufKind::kOut, r}, c});
    }
    add(std::move(op), rd, wr);
  }

  // ---- waits needed (vector clocks), and which ops need a record
  const size_t ns = p.streams.size();
  std::vector<std::vector<int32_t>> stream_vc(ns, std::vector<int32_t>(ns, 0));
  std::vector<std::vector<int32_t>> after_vc(mem.size());
  std::vector<int32_t> pos(mem.size(), 0);
  std::vector<std::vector<int64_t>> waits(mem.size());
  std::vector<uint8_t> needs_record(mem.size(), 0);
  for (size_t i = 0; i < mem.size(); ++i) {
    const int32_t sid = mem[i].stream;
    auto& vc = stream_vc[sid];
    std::vector<int64_t> cand;
    for (int64_t d : deps[i])
      if (vc[mem[d].stream] < pos[d]) cand.push_back(d);
    std::vector<int64_t> keep;
    for (int64_t d : cand) {
      bool implied = false;
      for (int64_t e : cand)
        if (e != d && after_vc[e][mem[d].stream] >= pos[d] && !(mem[e].stream == mem[d].stream && pos[e] == pos[d])) {
          implied = true;
          break;
        }
      if (!implied) keep.push_back(d);
    }
    for (int64_t d : keep) {
      for (size_t t = 0; t < ns; ++t) vc[t] = std::max(vc[t], after_vc[d][t]);
      needs_record[d] = 1;
    }
    pos[i] = ++vc[sid];
    after_vc[i] = vc;
    waits[i] = std::move(keep);
  }

  // A chunk op's range (whole chunk, in the leaves' concatenation; scratch: its slot) cut to piece pc.
  auto piece_range = [&](const ByteRange& r, const Piece& pc, int64_t chunk_offset) {
    const int64_t len = (pc.end - pc.begin) * elem_size;
    if (r.buf.kind == BufKind::kScratch) return ByteRange{r.buf, r.offset + (pc.begin - chunk_offset) * elem_size, len};
    return ByteRange{BufRef{resolve(r.buf.kind, pc.leaf), r.buf.owner, pc.leaf},
                     (pc.begin - leaf_start[pc.leaf]) * elem_size, len};
  };

  // ---- pass 2: emit waits, the op (one per piece of its chunk), its record
  std::vector<int32_t> event_of(mem.size(), -1);
  for (size_t i = 0; i < mem.size(); ++i) {
    for (int64_t d : waits[i]) {
      GpuOp w;
      w.kind = GpuOpKind::kWait;
      w.stream = mem[i].stream;
      w.event = event_of[d];
      p.ops.push_back(std::move(w));
    }
    if (mem[i].chunk < 0) {
      p.ops.push_back(mem[i]);
    } else {
      bool first = true;
      const int64_t off = plan.chunks[mem[i].chunk].offset;
      for (const Piece& pc : pieces[mem[i].chunk]) {
        GpuOp q = mem[i];
        q.dst = piece_range(mem[i].dst, pc, off);
        for (auto& r : q.src) r = piece_range(r, pc, off);
        if (q.kind == GpuOpKind::kCopy && q.src[0].buf == q.dst.buf && q.src[0].offset == q.dst.offset)
          continue;  // copy-in of an aliased leaf: nothing to do
        q.elems = pc.end - pc.begin;
        q.reads = q.src;
        q.writes = {q.dst};
        q.continued = !first;
        first = false;
        p.ops.push_back(std::move(q));
      }
    }
    if (needs_record[i]) {
      GpuOp rec;
      rec.kind = GpuOpKind::kRecord;
      rec.stream = mem[i].stream;
      rec.event = event_of[i] = p.nevents++;
      p.ops.push_back(std::move(rec));
    }
  }

  // ---- pipelining figures: chunks per segment, and one chunk's longest dependency chain
  std::map<int64_t, int64_t> seg_chunks;
  for (const ChunkPlan& cp : plan.chunks) ++seg_chunks[cp.segment];
  for (auto& [seg, k] : seg_chunks) p.max_segment_chunks = std::max(p.max_segment_chunks, k);
  std::vector<int64_t> chain(mem.size(), 0);
  for (size_t i = 0; i < mem.size(); ++i) {
    if (mem[i].chunk < 0) continue;
    int64_t best = 0;
    for (int64_t d : deps[i])
      if (mem[d].chunk == mem[i].chunk) best = std::max(best, chain[d]);
    // same-stream predecessors of the same chunk are dependencies too (deps lists other streams)
    for (int64_t j = static_cast<int64_t>(i) - 1; j >= 0; --j)
      if (mem[j].stream == mem[i].stream && mem[j].chunk == mem[i].chunk) { best = std::max(best, chain[j]); break; }
    chain[i] = best + 1;
    p.chunk_depth = std::max(p.chunk_depth, chain[i]);
  }
  *out = std::move(p);
  return "";
}

int64_t CheckRaces(const GpuProgram& p, std::string* first) {
  const size_t ns = p.streams.size();
  std::vector<std::vector<int32_t>> vc(ns, std::vector<int32_t>(ns, 0));
  std::vector<std::vector<int32_t>> rec_vc(p.ops.size());
  std::vector<int64_t> last_record(static_cast<size_t>(std::max(p.nevents, 0)), -1);
  std::vector<std::vector<int32_t>> op_vc(p.ops.size());
  std::vector<int32_t> op_pos(p.ops.size(), 0);
  for (size_t i = 0; i < p.ops.size(); ++i) {
    const GpuOp& op = p.ops[i];
    auto& v = vc[op.stream];
    if (op.kind == GpuOpKind::kRecord) {
      if (op.event >= static_cast<int32_t>(last_record.size())) last_record.resize(op.event + 1, -1);
      rec_vc[i] = v;
      last_record[op.event] = static_cast<int64_t>(i);
    } else if (op.kind == GpuOpKind::kWait) {
      int64_t t = op.event >= 0 && op.event < static_cast<int32_t>(last_record.size()) ? last_record[op.event] : -1;
      if (t >= 0)
        for (size_t k = 0; k < ns; ++k) v[k] = std::max(v[k], rec_vc[t][k]);
    } else {
      op_pos[i] = ++v[op.stream];
      op_vc[i] = v;
    }
  }
  struct Access {
    size_t op;
    int64_t lo, hi;
    bool write;
  };
  // (kind, owner, leaf); an aliased leaf's input is its output buffer, whatever the builder wrote
  std::map<std::array<int32_t, 3>, std::vector<Access>> by_buf;
  auto buf_key = [&](const BufRef& b) {
    const bool alias = b.kind == BufKind::kIn && b.leaf >= 0 && static_cast<size_t>(b.leaf) < p.leaf_aliased.size() &&
                       p.leaf_aliased[b.leaf];
    return std::array<int32_t, 3>{static_cast<int32_t>(alias ? BufKind::kOut : b.kind), b.owner, b.leaf};
  };
  for (size_t i = 0; i < p.ops.size(); ++i) {
    const GpuOp& op = p.ops[i];
    if (!op.IsMemory()) continue;
    for (auto& r : op.reads) by_buf[buf_key(r.buf)].push_back({i, r.offset, r.offset + r.bytes, false});
    for (auto& w : op.writes) by_buf[buf_key(w.buf)].push_back({i, w.offset, w.offset + w.bytes, true});
  }
  int64_t races = 0;
  std::ostringstream os;
  for (auto& [buf, acc] : by_buf) {
    for (size_t a = 0; a < acc.size(); ++a) {
      for (size_t b = a + 1; b < acc.size(); ++b) {
        const Access& x = acc[a];
        const Access& y = acc[b];
        if (!(x.write || y.write) || x.op == y.op) continue;
        if (x.hi <= y.lo || y.hi <= x.lo) continue;
        size_t i = std::min(x.op, y.op), j = std::max(x.op, y.op);
        const int32_t si = p.ops[i].stream;
        if (si == p.ops[j].stream) continue;
        if (op_vc[j][si] >= op_pos[i]) continue;  // i happens before j
        ++races;
        if (races <= 3) {
          BufRef br{static_cast<BufKind>(buf[0]), buf[1], buf[2]};
          os << (races > 1 ? "; " : "") << "race on " << BufName(br) << " bytes [" << std::max(x.lo, y.lo) << ", "
             << std::min(x.hi, y.hi) << "): op " << i << " (" << GpuOpKindName(p.ops[i].kind) << ", stream " << si
             << " " << p.streams[si].role << ", chunk " << p.ops[i].chunk << ") and op " << j << " ("
             << GpuOpKindName(p.ops[j].kind) << ", stream " << p.ops[j].stream << " "
             << p.streams[p.ops[j].stream].role << ", chunk " << p.ops[j].chunk << ") are unordered";
        }
      }
    }
  }
  if (first) *first = os.str();
  return races;
}

int64_t CriticalPath(const GpuProgram& p) {
  std::vector<int64_t> cursor(p.streams.size(), 0);
  std::vector<int64_t> rec_time(p.ops.size(), 0);
  std::vector<int64_t> last_record(static_cast<size_t>(std::max(p.nevents, 0)), -1);
  int64_t end = 0;
  for (size_t i = 0; i < p.ops.size(); ++i) {
    const GpuOp& op = p.ops[i];
    int64_t& t = cursor[op.stream];
    if (op.kind == GpuOpKind::kRecord) {
      if (op.event >= static_cast<int32_t>(last_record.size())) last_record.resize(op.event + 1, -1);
      rec_time[i] = t;
      last_record[op.event] = static_cast<int64_t>(i);
    } else if (op.kind == GpuOpKind::kWait) {
      int64_t r = op.event >= 0 && op.event < static_cast<int32_t>(last_record.size()) ? last_record[op.event] : -1;
      if (r >= 0) t = std::max(t, rec_time[r]);
    } else if ((op.kind == GpuOpKind::kCopy || op.kind == GpuOpKind::kReduce || op.kind == GpuOpKind::kZero) &&
               !op.continued) {
      t += 1;
    }
    end = std::max(end, t);
  }
  return end;
}

GpuProgramStats Stats(const GpuProgram& p) {
  GpuProgramStats s;
  s.streams = static_cast<int64_t>(p.streams.size());
  for (auto& op : p.ops) {
    if (op.kind == GpuOpKind::kRecord) ++s.records;
    else if (op.kind == GpuOpKind::kWait) ++s.waits;
    else if (op.kind != GpuOpKind::kXlaBefore && op.kind != GpuOpKind::kXlaAfter) ++s.memory_ops;
  }
  return s;
}

std::string Describe(const GpuProgram& p) {
  std::ostringstream os;
  for (size_t i = 0; i < p.ops.size(); ++i) {
    const GpuOp& op = p.ops[i];
    os << i << ": [" << op.stream << " " << p.streams[op.stream].role << " r" << p.streams[op.stream].rank << "] "
       << GpuOpKindName(op.kind);
    if (op.event >= 0) os << " e" << op.event;
    if (op.rank >= 0) os << " rank " << op.rank;
    if (op.kind == GpuOpKind::kCopy || op.kind == GpuOpKind::kReduce || op.kind == GpuOpKind::kZero) {
      os << " chunk " << op.chunk << (op.continued ? " (cont.)" : "") << " " << BufName(op.dst.buf) << "@" << op.dst.offset << "+" << op.dst.bytes;
      for (size_t k = 0; k < op.src.size(); ++k) os << (k ? " + " : " <- ") << BufName(op.src[k].buf) << "@" << op.src[k].offset;
    }
    os << "\n";
  }
  return os.str();
}

}  // namespace jax_blink
