#include "linksim.h"

#include <algorithm>
#include <functional>

namespace jax_blink {
namespace {

struct Event {  // 24 bytes: the heaps' entries stay small
  double t;
  uint64_t seq;
  int64_t a;  // arrival: message << 16 | hop; service: link
};

struct Later {  // min-heap on (t, seq): seq is unique, so the order is total
  bool operator()(const Event& x, const Event& y) const { return x.t != y.t ? x.t > y.t : x.seq > y.seq; }
};

// A 4-ary min-heap: half the levels of a binary heap, and a node's children share a cache line or two;
// the event heap is the event model's hot loop.
template <typename T, typename Greater>
class QuadHeap {
 public:
  bool empty() const { return v_.empty(); }
  const T& top() const { return v_.front(); }
  void push(const T& x) {
    size_t i = v_.size();
    v_.push_back(x);
    while (i > 0) {
      const size_t p = (i - 1) / 4;
      if (!gt_(v_[p], x)) break;
      v_[i] = v_[p];
      i = p;
    }
    v_[i] = x;
  }
  void pop() {
    const T x = v_.back();
    v_.pop_back();
    const size_t n = v_.size();
    if (n == 0) return;
    size_t i = 0;
    for (;;) {
      const size_t c = 4 * i + 1;
      if (c >= n) break;
      size_t m = c;
      const size_t end = c + 4 < n ? c + 4 : n;
      for (size_t k = c + 1; k < end; ++k)
        if (gt_(v_[m], v_[k])) m = k;
      if (!gt_(x, v_[m])) break;
      v_[i] = v_[m];
      i = m;
    }
    v_[i] = x;
  }

 private:
  std::vector<T> v_;
  Greater gt_;
};


}  // namespace

std::string RunLinkSim(const LinkSimInput& in, LinkSimResult* out) {
  const int64_t n = in.n, E = in.nedges;
  if (n < 0 || E < 0) return "negative message or link count";
  for (int64_t e = 0; e < E; ++e)
    if (!(in.bw[e] > 0)) return "link " + std::to_string(e) + " has no positive bandwidth";
  if (n >= (int64_t{1} << 46)) return "too many messages";
  std::vector<char> ranked(n, 0);
  if (n > 0 && (in.hop_ptr[0] != 0 || in.dep_ptr[0] != 0)) return "hop_ptr and dep_ptr must start at 0";
  for (int64_t i = 0; i < n; ++i) {
    if (in.hop_ptr[i + 1] < in.hop_ptr[i] || in.dep_ptr[i + 1] < in.dep_ptr[i])
      return "hop_ptr / dep_ptr must not decrease (message " + std::to_string(i) + ")";
    if (in.hop_ptr[i + 1] - in.hop_ptr[i] >= (1 << 16)) return "message " + std::to_string(i) + " has 65536 hops or more";
    if (in.rank[i] < 0 || in.rank[i] >= n || ranked[in.rank[i]])
      return "rank must be a permutation of 0 .. n - 1 (message " + std::to_string(i) + ")";
    ranked[in.rank[i]] = 1;
    for (int64_t k = in.hop_ptr[i]; k < in.hop_ptr[i + 1]; ++k)
      if (in.hop_edge[k] < 0 || in.hop_edge[k] >= E) return "message " + std::to_string(i) + " crosses no link";
    for (int64_t k = in.dep_ptr[i]; k < in.dep_ptr[i + 1]; ++k)
      if (in.dep[k] < 0 || in.dep[k] >= n) return "message " + std::to_string(i) + " depends on no message";
  }
  out->busy_s.assign(E, 0.0);
  out->carried.assign(E, 0.0);
  out->first.clear();
  out->end_s = 0.0;
  out->done = 0;

  // Messages renumbered by rank (x = rank[i]): links serve them roughly in that order, so the hot
  // loop reads these arrays nearly in sequence. Orders the reference depends on (dependents in
  // message order, initial arrivals in message order) are kept.
  std::vector<double> nb(n), ex(n), ready_at(n, 0.0);
  std::vector<int64_t> hp(n + 1, 0), waiting(n), dep_of_ptr(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t x = in.rank[i];
    nb[x] = in.nbytes[i];
    ex[x] = in.extra_s[i];
    hp[x + 1] = in.hop_ptr[i + 1] - in.hop_ptr[i];
    waiting[x] = in.dep_ptr[i + 1] - in.dep_ptr[i];
    for (int64_t k = in.dep_ptr[i]; k < in.dep_ptr[i + 1]; ++k) ++dep_of_ptr[in.rank[in.dep[k]] + 1];
  }
  for (int64_t x = 0; x < n; ++x) {
    hp[x + 1] += hp[x];
    dep_of_ptr[x + 1] += dep_of_ptr[x];
  }
  std::vector<int32_t> he(static_cast<size_t>(hp[n]));
  for (int64_t i = 0; i < n; ++i)
    std::copy(in.hop_edge + in.hop_ptr[i], in.hop_edge + in.hop_ptr[i + 1], he.begin() + hp[in.rank[i]]);
  std::vector<int64_t> dependents(static_cast<size_t>(dep_of_ptr[n])), fill(dep_of_ptr.begin(), dep_of_ptr.end() - 1);
  for (int64_t i = 0; i < n; ++i)  // in message order, as the reference appends them
    for (int64_t k = in.dep_ptr[i]; k < in.dep_ptr[i + 1]; ++k) dependents[fill[in.rank[in.dep[k]]]++] = in.rank[i];

  // The reference's one event heap ordered by (t, arrival before service, seq) is kept as two:
  // arrivals (with the hop completions: a link that finishes a send at t has an arrival at t, seq s,
  // and its next service at t, seq s + 1) and services. A completion's service enters the service
  // heap when its arrival is handled, so that heap holds only services due now and each hop costs one
  // entry of the big heap instead of two; the next event is the earlier head, an arrival on a tie.
  QuadHeap<Event, Later> arrivals, services;
  std::vector<QuadHeap<uint64_t, std::greater<uint64_t>>> queue(E);
  std::vector<char> idle(E, 1), served(E, 0);
  // The reference queues an arrival at t = 0 for every message without dependencies (seq 0 .. m - 1)
  // and handles them before anything else; handling them here in that order, with the same seqs,
  // keeps its event order and the heaps small.
  std::vector<int64_t> initial;
  for (int64_t i = 0; i < n; ++i)
    if (in.dep_ptr[i + 1] == in.dep_ptr[i]) initial.push_back(in.rank[i]);
  int64_t seq = static_cast<int64_t>(initial.size());
  size_t next_initial = 0;
  while (next_initial < initial.size() || !arrivals.empty() || !services.empty()) {
    Event ev;
    bool arrive = true;
    if (next_initial < initial.size()) {
      ev = {0.0, static_cast<uint64_t>(next_initial), initial[next_initial] << 16};
      ++next_initial;
    } else if (!arrivals.empty() && (services.empty() || arrivals.top().t <= services.top().t)) {
      ev = arrivals.top();
      arrivals.pop();
    } else {
      ev = services.top();
      services.pop();
      arrive = false;
    }
    if (arrive) {
      const int64_t i = ev.a >> 16, h = ev.a & 0xffff;
      if (h > 0)  // a hop completion: its link's next service, seq + 1
        services.push({ev.t, ev.seq + 1, he[hp[i] + h - 1]});
      if (h < hp[i + 1] - hp[i]) {
        const int32_t e = he[hp[i] + h];
        queue[e].push(static_cast<uint64_t>(i) << 16 | static_cast<uint64_t>(h));
        if (idle[e]) {
          idle[e] = 0;  // claimed now; the choice is made at the service event, after every arrival at t
          services.push({ev.t, static_cast<uint64_t>(seq++), e});
        }
        continue;
      }
      const double finish = ev.t + in.latency_s + ex[i];
      ++out->done;
      out->end_s = std::max(out->end_s, finish);
      for (int64_t k = dep_of_ptr[i]; k < dep_of_ptr[i + 1]; ++k) {
        const int64_t d = dependents[k];
        ready_at[d] = std::max(ready_at[d], finish);
        if (--waiting[d] == 0) arrivals.push({ready_at[d], static_cast<uint64_t>(seq++), d << 16});
      }
      continue;
    }
    const int64_t e = ev.a;
    if (queue[e].empty()) {
      idle[e] = 1;
      continue;
    }
    const uint64_t top = queue[e].top();
    queue[e].pop();
    const int64_t i = static_cast<int64_t>(top >> 16), h = static_cast<int64_t>(top & 0xffff);
    const double dt = nb[i] / in.bw[e];
    if (!served[e]) {
      served[e] = 1;
      out->first.push_back(static_cast<int32_t>(e));
    }
    out->busy_s[e] += dt;
    out->carried[e] += nb[i];
    arrivals.push({ev.t + dt, static_cast<uint64_t>(seq), i << 16 | (h + 1)});  // seq + 1: its service
    seq += 2;
  }
  return "";
}

}  // namespace jax_blink
