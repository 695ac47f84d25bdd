// What the CPU and CUDA XLA FFI handlers (cpu_module.cc, cuda_handler.cc) share: XLA FFI element
// types mapped to jax_blink's Dtype, the checks of a call's bucket of leaves (operand i -> result i,
// one dtype), the error code of an executor's message, and the binding of the bucket and the
// attributes every lowering passes (jax_blink/lowering/ffi.py).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "blink_core.h"
#include "xla/ffi/api/ffi.h"

namespace jax_blink {

inline std::optional<Dtype> DtypeFromXla(xla::ffi::DataType t) {
  using T = xla::ffi::DataType;
  switch (t) {
    case T::F16: return Dtype::kF16;
    case T::BF16: return Dtype::kBF16;
    case T::F32: return Dtype::kF32;
    case T::F64: return Dtype::kF64;
    case T::S8: return Dtype::kS8;
    case T::S16: return Dtype::kS16;
    case T::S32: return Dtype::kS32;
    case T::S64: return Dtype::kS64;
    case T::U8: return Dtype::kU8;
    case T::U16: return Dtype::kU16;
    case T::U32: return Dtype::kU32;
    case T::U64: return Dtype::kU64;
    case T::C64: return Dtype::kC64;
    case T::C128: return Dtype::kC128;
    default: return std::nullopt;
  }
}

// "" when a call has as many results as operands, at least one; else the error.
inline std::string BucketArityError(size_t nargs, size_t nrets) {
  if (nargs == nrets && nargs != 0) return "";
  return "the custom call has " + std::to_string(nargs) + " operands and " + std::to_string(nrets) +
         " results (expected as many of each, at least one)";
}

// Operand i of a bucket and its result: data pointers and element counts (which backend may take
// counts that differ is the handler's choice).
struct BucketOperand {
  const void* in = nullptr;
  void* out = nullptr;
  int64_t in_count = 0, out_count = 0;
};

// Reads operand/result i of a bucket into *op: both must be buffers, the operand's dtype supported and
// equal to *dt (the earlier operands' dtype; set here on the first), the result of the operand's type.
// Returns "" or the error.
inline std::string ReadBucketOperand(const xla::ffi::RemainingArgs& args, const xla::ffi::RemainingRets& rets,
                                     size_t i, std::optional<Dtype>* dt, BucketOperand* op) {
  auto x = args.get<xla::ffi::AnyBuffer>(i);
  auto y = rets.get<xla::ffi::AnyBuffer>(i);
  if (!x.has_value() || !y.has_value()) return "operand/result " + std::to_string(i) + " is not a buffer";
  auto t = DtypeFromXla(x->element_type());
  if (!t || (*dt && *t != **dt) || (*y)->element_type() != x->element_type())
    return "operand " + std::to_string(i) + " has an unsupported dtype, another dtype than operand 0, or a "
           "result of another type";
  *dt = t;
  *op = BucketOperand{x->untyped_data(), (*y)->untyped_data(), static_cast<int64_t>(x->element_count()),
                      static_cast<int64_t>((*y)->element_count())};
  return "";
}

// XLA's error code for an executor message (ErrorClassOf, blink_core.h): a timeout
// kDeadlineExceeded, a failure inside the executor (a CUDA call) kInternal, everything else (bad
// attributes, mismatched participants, a peer that could not join) kInvalidArgument.
inline xla::ffi::ErrorCode ErrorCodeOf(const std::string& msg) {
  switch (ErrorClassOf(msg)) {
    case 2: return xla::ffi::ErrorCode::kDeadlineExceeded;
    case 1: return xla::ffi::ErrorCode::kInternal;
    default: return xla::ffi::ErrorCode::kInvalidArgument;
  }
}

// The binding after a handler's context arguments: the bucket (RemainingArgs, RemainingRets) and the
// attributes schedule (Schedule.to_array() words), device_table ((device, group, rank) rows),
// call_site and timeout_ms. A handler adds its own attributes after these.
template <typename Binding>
auto BindCollective(Binding b) {
  using Words = xla::ffi::Span<const int64_t>;
  return std::move(b)
      .RemainingArgs()
      .RemainingRets()
      .template Attr<Words>("schedule")
      .template Attr<Words>("device_table")
      .template Attr<int64_t>("call_site")
      .template Attr<int64_t>("timeout_ms");
}

}  // namespace jax_blink
