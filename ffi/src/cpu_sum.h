// The CPU executor's sum kernels: out = first + s[0] + ... + s[k-1], element by element, added left to
// right with element_add.h's adds. cpu_sum.cc is compiled once per instruction set (baseline, AVX2, AVX-512 on x86-64; CMake
// object libraries) into its own namespace, and AdderFor picks the widest one this CPU runs, once.
// The vector width changes only how many elements one instruction adds, never the order of the adds
// in an element, so every kernel gives the same bits.
#pragma once

#include <cstdint>

#include "dtype.h"

namespace jax_blink {

// out[i] = first[i] + s[0][i] + ... + s[k-1][i] over n scalars; `out` may alias `first`, not the s[j].
using SumFn = void (*)(void* out, const void* first, const void* const* s, int k, int64_t n);

// A dtype's kernel (one per Scalar, dtype.h) and how many scalars one element holds (2 for complex).
struct Adder {
  SumFn fn = nullptr;
  int64_t lanes = 0;
};

// Instruction sets with a kernel build, lowest first. kBaseline is what the compiler targets by
// default (SSE2 on x86-64).
enum class SumIsa : int { kBaseline, kAvx2, kAvx512 };
constexpr SumIsa kSumIsas[] = {SumIsa::kBaseline, SumIsa::kAvx2, SumIsa::kAvx512};
const char* SumIsaName(SumIsa isa);
// The instruction set named `name` (a SumIsaName), or false.
bool SumIsaFromName(const char* name, SumIsa* isa);

// The instruction set the kernels use in this process: the widest compiled in and supported by the
// CPU, capped by JAX_BLINK_CPU_ISA (baseline | avx2 | avx512) when set. Decided at the first call.
SumIsa ActiveSumIsa();
// True when `isa` was compiled in and this CPU runs it.
bool SumIsaUsable(SumIsa isa);

// The dtype's kernel for ActiveSumIsa(), or for `isa` (which must be usable).
Adder AdderFor(Dtype t);
Adder AdderFor(Dtype t, SumIsa isa);

// The kernels, one plain function per Scalar and instruction set (cpu_sum.cc, compiled once per
// instruction set into namespace sum_<isa>). Only these functions hold that set's instructions: the
// dispatcher (cpu_sum_dispatch.cc, baseline flags) takes their addresses into constant tables, so no
// code built for an instruction set runs before the CPU check (ActiveSumIsa / SumIsaUsable).
#define JAX_BLINK_SUM_DECLARE(kind) void Sum##kind(void* out, const void* first, const void* const* s, int k, int64_t n);
namespace sum_baseline { JAX_BLINK_SCALARS(JAX_BLINK_SUM_DECLARE) }
namespace sum_avx2 { JAX_BLINK_SCALARS(JAX_BLINK_SUM_DECLARE) }
namespace sum_avx512 { JAX_BLINK_SCALARS(JAX_BLINK_SUM_DECLARE) }
#undef JAX_BLINK_SUM_DECLARE

}  // namespace jax_blink
