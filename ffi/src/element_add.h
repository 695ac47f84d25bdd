// The element arithmetic of every executor and kernel set: the CPU sum kernels (cpu_sum.cc, once per
// instruction set), the device interpreter on the GPU and on the host (device_interp.h), the GPU
// harness's reduce kernel (ffi/tests/gpu_check.cu). One add per Scalar (dtype.h):
//   - integers add as unsigned of their width (wrapping: bitwise what XLA's signed add gives);
//   - float / double: the IEEE add;
//   - fp16 and bf16: both operands widened to fp32, added, rounded to nearest even after every add
//     (NaN stays NaN). Exact for fp16: fp32 has 24 >= 2 * 11 + 2 significand bits, so rounding twice
//     (fp32, then fp16) gives the once-rounded sum (Figueroa, "When is double rounding innocuous?",
//     SIGNUM 1995).
// fp16 converts in software (bit operations, the same on GPU and host, so the host build checks the
// GPU's code) unless the including file defines JAX_BLINK_ARITH_HW_HALF: the CPU kernels then use
// the compiler's _Float16 (F16C / AVX-512 conversions where the build targets them); same bits.
//
// Namespace: jax_blink::<JAX_BLINK_ARITH_NS>::(anonymous), arith by default. Each instruction-set
// build of cpu_sum.cc sets JAX_BLINK_ARITH_NS to its own namespace (sum_avx2, ...): the adds then
// have internal linkage in a namespace of that build, so the linker never merges an AVX-512 copy with
// one that runs before the CPU check (tests/native/test_cpu_portability.py checks the disassembly).
// Only builtins are used here (no inline function from another header) for the same reason.
#pragma once

#include <cstdint>

#include "dtype.h"

#if defined(__CUDACC__)
#define BLINK_HD __host__ __device__
#else
#define BLINK_HD
#endif

#ifndef JAX_BLINK_ARITH_NS
#define JAX_BLINK_ARITH_NS arith
#endif

namespace jax_blink {
namespace JAX_BLINK_ARITH_NS {
namespace {

BLINK_HD inline uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
#endif
}
BLINK_HD inline float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
#endif
}

// IEEE half <-> float, round to nearest even (what _Float16 and CUDA's __float2half_rn give).
BLINK_HD inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  if (exp == 0x1f) return BitsFloat(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return BitsFloat(sign);
    int e = -1;
    do { man <<= 1; ++e; } while ((man & 0x400u) == 0);
    return BitsFloat(sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13));
  }
  return BitsFloat(sign | ((exp + 112) << 23) | (man << 13));
}
BLINK_HD inline uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow (rounds to) inf
  if (a < 0x38800000u) {  // subnormal half (or zero): round the value scaled by 2^24
    const uint32_t exp = a >> 23;
    if (exp < 102) return sign;  // below half the smallest subnormal
    const uint32_t man = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14 + (113 - exp) - 1
    uint32_t r = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = a - 0x38000000u;  // rebias exponent (127 - 15) << 23
  const uint32_t rem = r & 0x1fffu;
  r >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

// ScalarAdd<S>: V, the stored scalar type, and Add(a, b).
template <Scalar S> struct ScalarAdd;

template <typename T>
struct PlainAdd {
  using V = T;
  BLINK_HD static V Add(V a, V b) { return static_cast<V>(a + b); }
};
template <> struct ScalarAdd<Scalar::kF32> : PlainAdd<float> {};
template <> struct ScalarAdd<Scalar::kF64> : PlainAdd<double> {};
template <> struct ScalarAdd<Scalar::kU8> : PlainAdd<uint8_t> {};
template <> struct ScalarAdd<Scalar::kU16> : PlainAdd<uint16_t> {};
template <> struct ScalarAdd<Scalar::kU32> : PlainAdd<uint32_t> {};
template <> struct ScalarAdd<Scalar::kU64> : PlainAdd<uint64_t> {};

template <> struct ScalarAdd<Scalar::kBF16> {
  using V = uint16_t;
  BLINK_HD static V Add(V a, V b) {
    const float f = BitsFloat(static_cast<uint32_t>(a) << 16) + BitsFloat(static_cast<uint32_t>(b) << 16);
    uint32_t u = FloatBits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<V>((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<V>(u >> 16);
  }
};

#if defined(JAX_BLINK_ARITH_HW_HALF) && !defined(__CUDACC__)
#if !defined(__FLT16_MAX__)
#error "jax_blink needs a compiler with _Float16 (GCC >= 12 or Clang >= 15 on x86-64/aarch64)"
#endif
template <> struct ScalarAdd<Scalar::kF16> {
  using V = _Float16;
  static V Add(V a, V b) { return static_cast<V>(static_cast<float>(a) + static_cast<float>(b)); }
};
#else
template <> struct ScalarAdd<Scalar::kF16> {
  using V = uint16_t;
  BLINK_HD static V Add(V a, V b) { return FloatToHalf(HalfToFloat(a) + HalfToFloat(b)); }
};
#endif

// Calls f(ScalarAdd<s>{}) for the run-time scalar kind s (nothing for an unknown one). Host and
// device: f decides where it runs (nvcc's check of the call is left to f's own instantiation).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class F>
BLINK_HD inline void WithAdd(Scalar s, F&& f) {
  switch (s) {
#define JAX_BLINK_WITH_ADD_CASE(kind) \
    case Scalar::k##kind: f(ScalarAdd<Scalar::k##kind>{}); break;
    JAX_BLINK_SCALARS(JAX_BLINK_WITH_ADD_CASE)
#undef JAX_BLINK_WITH_ADD_CASE
    default: break;
  }
}

}  // namespace
}  // namespace JAX_BLINK_ARITH_NS
}  // namespace jax_blink
