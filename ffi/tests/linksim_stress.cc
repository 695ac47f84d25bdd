// The link-level event model (ffi/src/linksim.cc) on random message graphs, for the sanitizer builds
// (tests/native/test_sanitizers.py): every message finishes, each link's busy time and bytes are the sums of
// what crosses it, the end is no earlier than any message's own path, a cycle leaves messages undone,
// bad input is refused. Prints "<trials> trials, <failures> check failures".
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "linksim.h"

using jax_blink::LinkSimInput;
using jax_blink::LinkSimResult;
using jax_blink::RunLinkSim;

static int failures = 0;
#define CHECK(c)                                                   \
  do {                                                             \
    if (!(c)) {                                                    \
      ++failures;                                                  \
      std::printf("check failed: %s (line %d)\n", #c, __LINE__); \
    }                                                              \
  } while (0)

struct Graph {
  std::vector<double> nbytes, extra, bw;
  std::vector<int64_t> hop_ptr{0}, dep_ptr{0}, dep, rank;
  std::vector<int32_t> hop_edge;
  LinkSimInput Input(double latency) const {  // fields in linksim.h's order
    return {static_cast<int64_t>(nbytes.size()), nbytes.data(), extra.data(), hop_ptr.data(), hop_edge.data(),
            dep_ptr.data(), dep.data(), rank.data(), static_cast<int64_t>(bw.size()), bw.data(), latency};
  }
};

static Graph Random(std::mt19937_64& rng, int n, int links) {
  Graph g;
  std::uniform_real_distribution<double> u(0.5, 2.0);
  for (int e = 0; e < links; ++e) g.bw.push_back(u(rng) * 1e9);
  for (int i = 0; i < n; ++i) {
    g.nbytes.push_back(rng() % 4 == 0 ? 0.0 : u(rng) * 1e5);  // zero-byte sends too
    g.extra.push_back(rng() % 3 == 0 ? 0.0 : u(rng) * 1e-6);
    const int hops = 1 + static_cast<int>(rng() % 4);
    for (int h = 0; h < hops; ++h) g.hop_edge.push_back(static_cast<int32_t>(rng() % links));
    g.hop_ptr.push_back(static_cast<int64_t>(g.hop_edge.size()));
    const int deps = i == 0 ? 0 : static_cast<int>(rng() % 3);
    for (int d = 0; d < deps; ++d) g.dep.push_back(static_cast<int64_t>(rng() % i));  // earlier: acyclic
    g.dep_ptr.push_back(static_cast<int64_t>(g.dep.size()));
  }
  g.rank.resize(n);
  std::iota(g.rank.begin(), g.rank.end(), 0);
  std::shuffle(g.rank.begin(), g.rank.end(), rng);
  return g;
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 5;
  std::mt19937_64 rng(12345);
  int trials = 0;
  for (int r = 0; r < rounds * 20; ++r, ++trials) {
    const int n = 1 + static_cast<int>(rng() % 3000), links = 1 + static_cast<int>(rng() % 40);
    const double latency = r % 2 ? 0.0 : 2e-6;
    Graph g = Random(rng, n, links);
    LinkSimResult out;
    CHECK(RunLinkSim(g.Input(latency), &out).empty());
    CHECK(out.done == n);
    std::vector<double> busy(links, 0.0), carried(links, 0.0);
    double longest = 0.0;
    for (int i = 0; i < n; ++i) {
      double own = latency + g.extra[i];
      for (int64_t k = g.hop_ptr[i]; k < g.hop_ptr[i + 1]; ++k) {
        busy[g.hop_edge[k]] += g.nbytes[i] / g.bw[g.hop_edge[k]];
        carried[g.hop_edge[k]] += g.nbytes[i];
        own += g.nbytes[i] / g.bw[g.hop_edge[k]];
      }
      longest = std::max(longest, own);
    }
    for (int e = 0; e < links; ++e) {
      CHECK(std::fabs(out.busy_s[e] - busy[e]) <= 1e-9 * busy[e] + 1e-18);
      CHECK(std::fabs(out.carried[e] - carried[e]) <= 1e-9 * carried[e]);
    }
    CHECK(out.end_s >= longest * (1 - 1e-12));
    // every link that carried a message is listed once, in first-service order
    std::vector<int32_t> first = out.first;
    std::sort(first.begin(), first.end());
    CHECK(std::adjacent_find(first.begin(), first.end()) == first.end());
    // a cycle: messages 0 and 1 wait for each other; neither, nor what waits on them, finishes
    if (n >= 2) {
      std::vector<std::vector<int64_t>> deps(n);
      for (int i = 0; i < n; ++i) deps[i].assign(g.dep.begin() + g.dep_ptr[i], g.dep.begin() + g.dep_ptr[i + 1]);
      deps[0].push_back(1);
      deps[1].push_back(0);
      Graph c = g;
      c.dep.clear();
      c.dep_ptr.assign(1, 0);
      for (const auto& d : deps) {
        c.dep.insert(c.dep.end(), d.begin(), d.end());
        c.dep_ptr.push_back(static_cast<int64_t>(c.dep.size()));
      }
      LinkSimResult cyc;
      CHECK(RunLinkSim(c.Input(latency), &cyc).empty());
      CHECK(cyc.done <= n - 2);
    }
    // refused input
    Graph bad = g;
    bad.rank[0] = n > 1 ? bad.rank[n - 1] : n;  // a duplicate, or out of range
    LinkSimResult ignored;
    CHECK(!RunLinkSim(bad.Input(latency), &ignored).empty());
    Graph edge = g;
    edge.hop_edge[0] = links;
    CHECK(!RunLinkSim(edge.Input(latency), &ignored).empty());
  }
  std::printf("%d trials, %d check failures\n", trials, failures);
  return failures == 0 ? 0 : 1;
}
