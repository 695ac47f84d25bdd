// Sum kernels, compiled once per instruction set with JAX_BLINK_SUM_NS naming the namespace
// (sum_baseline, sum_avx2, sum_avx512; see ffi/CMakeLists.txt). This file holds kernels and nothing
// that runs before the CPU check: no tables, no static initialisers. Everything lives in that
// namespace (the templates in an unnamed one: internal linkage) and uses no inline function from
// outside it (only builtins): an inline function shared by two builds would be merged by the linker,
// and the AVX-512 copy could then run on a CPU without it. tests/native/test_cpu_portability.py checks the
// built modules' disassembly for exactly that.
#include "cpu_sum.h"

#ifndef JAX_BLINK_SUM_NS
#define JAX_BLINK_SUM_NS sum_baseline
#endif

namespace jax_blink {
namespace JAX_BLINK_SUM_NS {
namespace {

// Element adds. Integers add as unsigned (wrapping, bitwise what XLA's signed add gives); fp16/bf16
// add in fp32 and round after every add (as the CUDA kernels do).
template <typename T>
struct PlainAdd {
  using V = T;
  static V Add(V a, V b) { return static_cast<V>(a + b); }
};
struct F16Add {
#if defined(__FLT16_MAX__)
  using V = _Float16;
  static V Add(V a, V b) { return static_cast<V>(static_cast<float>(a) + static_cast<float>(b)); }
#else
#error "jax_blink needs a compiler with _Float16 (GCC >= 12 or Clang >= 15 on x86-64/aarch64)"
#endif
};
struct BF16Add {
  using V = uint16_t;
  static V Add(V a, V b) {  // round to nearest even, NaN stays NaN
    uint32_t ua = static_cast<uint32_t>(a) << 16, ub = static_cast<uint32_t>(b) << 16, u;
    float fa, fb;
    __builtin_memcpy(&fa, &ua, 4);
    __builtin_memcpy(&fb, &ub, 4);
    const float f = fa + fb;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<V>((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<V>(u >> 16);
  }
};

// K sources in one pass: the partial sum stays in a register, so the destination is written once.
// Each source is prefetched 2 KiB ahead: K+1 concurrent read streams outrun the hardware prefetcher
// (measured ~5-10% less time at 16-64 MiB per rank on the 2-core EPYC VM). The inner loop over one
// cache line is what the compiler vectorises, at this build's width.
template <class A, int K>
void SumK(typename A::V* out, const typename A::V* first, const void* const* s, int64_t n) {
  using V = typename A::V;
  const V* __restrict__ p[K];
  for (int k = 0; k < K; ++k) p[k] = static_cast<const V*>(s[k]);
  constexpr int64_t kLine = 64 / sizeof(V) > 0 ? 64 / sizeof(V) : 1;
  constexpr uintptr_t kAheadBytes = 2048;
  int64_t i = 0;
  for (; i + kLine <= n; i += kLine) {
    for (int k = 0; k < K; ++k)  // an address hint (may lie past the buffer; prefetches never fault)
      __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p[k] + i) + kAheadBytes), 0, 0);
    for (int64_t j = i; j < i + kLine; ++j) {
      V a = first[j];
      for (int k = 0; k < K; ++k) a = A::Add(a, p[k][j]);
      out[j] = a;
    }
  }
  for (; i < n; ++i) {
    V a = first[i];
    for (int k = 0; k < K; ++k) a = A::Add(a, p[k][i]);
    out[i] = a;
  }
}

template <class A>
void Sum(void* out, const void* first, const void* const* s, int k, int64_t n) {
  using V = typename A::V;
  V* o = static_cast<V*>(out);
  const V* f = static_cast<const V*>(first);
  while (k > 0) {  // more than 8 sources: 8 at a time, continuing from the partial sum in out
    const int m = k < 8 ? k : 8;
    switch (m) {
      case 1: SumK<A, 1>(o, f, s, n); break;
      case 2: SumK<A, 2>(o, f, s, n); break;
      case 3: SumK<A, 3>(o, f, s, n); break;
      case 4: SumK<A, 4>(o, f, s, n); break;
      case 5: SumK<A, 5>(o, f, s, n); break;
      case 6: SumK<A, 6>(o, f, s, n); break;
      case 7: SumK<A, 7>(o, f, s, n); break;
      default: SumK<A, 8>(o, f, s, n); break;
    }
    s += m;
    k -= m;
    f = o;
  }
}

}  // namespace

// The exported kernels (cpu_sum.h): thin named entries, the only external symbols of this build.
void SumF16(void* o, const void* f, const void* const* s, int k, int64_t n) { Sum<F16Add>(o, f, s, k, n); }
void SumBF16(void* o, const void* f, const void* const* s, int k, int64_t n) { Sum<BF16Add>(o, f, s, k, n); }
void SumF32(void* o, const void* f, const void* const* s, int k, int64_t n) { Sum<PlainAdd<float>>(o, f, s, k, n); }
void SumF64(void* o, const void* f, const void* const* s, int k, int64_t n) { Sum<PlainAdd<double>>(o, f, s, k, n); }
void SumU8(void* o, const void* f, const void* const* s, int k, int64_t n) { Sum<PlainAdd<uint8_t>>(o, f, s, k, n); }
void SumU16(void* o, const void* f, const void* const* s, int k, int64_t n) {
  Sum<PlainAdd<uint16_t>>(o, f, s, k, n);
}
void SumU32(void* o, const void* f, const void* const* s, int k, int64_t n) {
  Sum<PlainAdd<uint32_t>>(o, f, s, k, n);
}
void SumU64(void* o, const void* f, const void* const* s, int k, int64_t n) {
  Sum<PlainAdd<uint64_t>>(o, f, s, k, n);
}

}  // namespace JAX_BLINK_SUM_NS
}  // namespace jax_blink
