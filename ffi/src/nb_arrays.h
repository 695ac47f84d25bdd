// What the nanobind modules (_cpu, _gpusim, _cuda) share: the numpy array types their test entries
// take and the dtype lookup by numpy name.
#pragma once

#include <nanobind/ndarray.h>

#include <stdexcept>
#include <string>

#include "blink_core.h"

namespace jax_blink {

// A schedule (or device table) array: 1-D int64, C-contiguous, host memory.
using I64Array = nanobind::ndarray<const int64_t, nanobind::ndim<1>, nanobind::c_contig, nanobind::device::cpu>;
// Any C-contiguous host array (its dtype is passed by name alongside).
using AnyArray = nanobind::ndarray<nanobind::c_contig, nanobind::device::cpu>;

// The Dtype of numpy name `name`; std::invalid_argument (ValueError in Python) for an unknown one.
inline Dtype DtypeByName(const std::string& name) {
  auto t = DtypeFromName(name);
  if (!t) throw std::invalid_argument("unknown dtype " + name);
  return *t;
}

}  // namespace jax_blink
