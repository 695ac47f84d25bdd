// Python module jax_blink._native._linksim: the link-level event model (linksim.h) for
// jax_blink.simulate, which passes its messages as arrays.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "linksim.h"

namespace nb = nanobind;

namespace jax_blink {
namespace {

template <typename T>
using Vec = nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

std::tuple<double, std::vector<double>, std::vector<double>, std::vector<int32_t>, int64_t> Run(
    Vec<double> nbytes, Vec<double> extra_s, Vec<int64_t> hop_ptr, Vec<int32_t> hop_edge, Vec<int64_t> dep_ptr,
    Vec<int64_t> dep, Vec<int64_t> rank, Vec<double> bw, double latency_s) {
  const int64_t n = static_cast<int64_t>(nbytes.shape(0));
  if (static_cast<int64_t>(extra_s.shape(0)) != n || static_cast<int64_t>(rank.shape(0)) != n ||
      static_cast<int64_t>(hop_ptr.shape(0)) != n + 1 || static_cast<int64_t>(dep_ptr.shape(0)) != n + 1)
    throw std::invalid_argument("linksim.run: nbytes, extra_s and rank need n entries, hop_ptr and dep_ptr n + 1");
  if (hop_ptr.data()[n] != static_cast<int64_t>(hop_edge.shape(0)) ||
      dep_ptr.data()[n] != static_cast<int64_t>(dep.shape(0)))
    throw std::invalid_argument("linksim.run: hop_ptr / dep_ptr must end at the length of hop_edge / dep");
  const LinkSimInput in{n, nbytes.data(), extra_s.data(), hop_ptr.data(), hop_edge.data(), dep_ptr.data(),
                        dep.data(), rank.data(), static_cast<int64_t>(bw.shape(0)), bw.data(), latency_s};  // linksim.h order
  LinkSimResult out;
  std::string err;
  {
    nb::gil_scoped_release release;
    err = RunLinkSim(in, &out);
  }
  if (!err.empty()) throw std::invalid_argument("linksim.run: " + err);
  return {out.end_s, std::move(out.busy_s), std::move(out.carried), std::move(out.first), out.done};
}

}  // namespace
}  // namespace jax_blink

NB_MODULE(_linksim, m) {
  m.doc() = "The link-level event model of jax_blink.simulate (ffi/src/linksim.h).";
  m.def("run", &jax_blink::Run, nb::arg("nbytes"), nb::arg("extra_s"), nb::arg("hop_ptr"), nb::arg("hop_edge"),
        nb::arg("dep_ptr"), nb::arg("dep"), nb::arg("rank"), nb::arg("bw"), nb::arg("latency_s"),
        "(end s, busy s per link, bytes per link, links in order of first service, messages done) of the "
        "messages given as arrays (linksim.h).");
}
