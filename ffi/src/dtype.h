// Element types: the dtypes the executors take (jax_blink/collectives.py's names) and the one mapping
// of a dtype to the scalar its adds run on (element_add.h). Enums and constexpr only, no code that
// runs: the per-instruction-set sum kernels include it too (cpu_sum.cc).
#pragma once

#include <cstdint>

namespace jax_blink {

// Element types the executors add. Complex types add as pairs of reals.
enum class Dtype : int {
  kF16, kBF16, kF32, kF64, kS8, kS16, kS32, kS64, kU8, kU16, kU32, kU64, kC64, kC128,
};

// Scalar kinds of the adds, in this order everywhere (X-macro: cpu_sum.h's kernel names, the kernel
// tables, element_add.h's dispatch). Signed integers add as unsigned of their width (wrapping: bitwise
// XLA's signed add); complex numbers add their real and imaginary parts.
#define JAX_BLINK_SCALARS(X) X(F16) X(BF16) X(F32) X(F64) X(U8) X(U16) X(U32) X(U64)
#define JAX_BLINK_SCALAR_ENUM(kind) k##kind,
enum class Scalar : int32_t { JAX_BLINK_SCALARS(JAX_BLINK_SCALAR_ENUM) kCount };
#undef JAX_BLINK_SCALAR_ENUM

// How a dtype's elements are added: `lanes` scalars of kind `scalar` per element.
struct ScalarLayout {
  Scalar scalar;
  int64_t lanes;
};

constexpr ScalarLayout ScalarOf(Dtype t) {
  switch (t) {
    case Dtype::kF16: return {Scalar::kF16, 1};
    case Dtype::kBF16: return {Scalar::kBF16, 1};
    case Dtype::kF32: return {Scalar::kF32, 1};
    case Dtype::kF64: return {Scalar::kF64, 1};
    case Dtype::kC64: return {Scalar::kF32, 2};
    case Dtype::kC128: return {Scalar::kF64, 2};
    case Dtype::kS8: case Dtype::kU8: return {Scalar::kU8, 1};
    case Dtype::kS16: case Dtype::kU16: return {Scalar::kU16, 1};
    case Dtype::kS32: case Dtype::kU32: return {Scalar::kU32, 1};
    case Dtype::kS64: case Dtype::kU64: return {Scalar::kU64, 1};
  }
  return {Scalar::kCount, 0};
}

}  // namespace jax_blink
