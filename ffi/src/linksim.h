// The link-level event model of jax_blink.simulate (`_run` there is the Python reference): per-link
// queues that serve one message at a time, store-and-forward over each message's hops, an alpha and
// protocol latency once per message after its last hop, dependencies between messages. Plain C++, no
// Python, so the sanitizer builds (tests/native/test_sanitizers.py) and the nanobind module share it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace jax_blink {

// Messages as arrays (struct of arrays, n messages, E links).
//   nbytes[i], extra_s[i]: bytes of message i and its protocol latency (s);
//   hop_ptr[n + 1], hop_edge[...]: message i crosses links hop_edge[hop_ptr[i] .. hop_ptr[i + 1]) in order;
//   dep_ptr[n + 1], dep[...]: message i becomes ready when messages dep[dep_ptr[i] .. dep_ptr[i + 1]) finished;
//   rank[i]: service priority, smaller first; distinct per message (a link that falls free serves the
//            waiting message of least rank, once every arrival at that instant is queued);
//   bw[e]: bytes / s of link e (> 0).
struct LinkSimInput {
  int64_t n = 0;
  const double* nbytes = nullptr;
  const double* extra_s = nullptr;
  const int64_t* hop_ptr = nullptr;
  const int32_t* hop_edge = nullptr;
  const int64_t* dep_ptr = nullptr;
  const int64_t* dep = nullptr;
  const int64_t* rank = nullptr;
  int64_t nedges = 0;
  const double* bw = nullptr;
  double latency_s = 0.0;
};

struct LinkSimResult {
  double end_s = 0.0;             // finish of the last message (its latencies included)
  std::vector<double> busy_s;     // per link: seconds serving
  std::vector<double> carried;    // per link: bytes carried
  std::vector<int32_t> first;     // links in the order they first served a message
  int64_t done = 0;               // messages finished (n unless the dependencies have a cycle)
};

// Runs the event model. Returns "" or what is wrong with the input (an index out of range, a link of
// no positive bandwidth); the event order, and so every float, is the Python reference's:
// events by (time, arrival before service, creation order).
std::string RunLinkSim(const LinkSimInput& in, LinkSimResult* out);

}  // namespace jax_blink
