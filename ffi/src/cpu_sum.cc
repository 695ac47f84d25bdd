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
// The adds (element_add.h) in this build's namespace, fp16 through the compiler's _Float16.
#define JAX_BLINK_ARITH_NS JAX_BLINK_SUM_NS
#define JAX_BLINK_ARITH_HW_HALF 1
#include "element_add.h"

namespace jax_blink {
namespace JAX_BLINK_SUM_NS {
namespace {

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
#define JAX_BLINK_SUM_DEFINE(kind)                                                     \
  void Sum##kind(void* o, const void* f, const void* const* s, int k, int64_t n) { \
    Sum<ScalarAdd<Scalar::k##kind>>(o, f, s, k, n);                                \
  }
JAX_BLINK_SCALARS(JAX_BLINK_SUM_DEFINE)
#undef JAX_BLINK_SUM_DEFINE

}  // namespace JAX_BLINK_SUM_NS
}  // namespace jax_blink
