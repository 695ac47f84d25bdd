// Map XLA FFI element types to jax_blink's Dtype (shared by the CPU and CUDA handlers).
#pragma once

#include <optional>

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

}  // namespace jax_blink
