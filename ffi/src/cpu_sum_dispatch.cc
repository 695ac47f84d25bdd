// Picks the sum kernels' instruction set at run time (cpu_sum.h). JAX_BLINK_SUM_AVX2 / _AVX512 are
// defined by CMake where those builds of cpu_sum.cc are linked in (x86-64 with GCC or Clang).
#include <cstdlib>
#include <cstring>
#include <string>

#include "blink_core.h"
#include "cpu_sum.h"

namespace jax_blink {
namespace {

bool CpuRuns(SumIsa isa) {
  switch (isa) {
    case SumIsa::kBaseline: return true;
#if defined(JAX_BLINK_SUM_AVX2)
    case SumIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
#if defined(JAX_BLINK_SUM_AVX512)
    case SumIsa::kAvx512:
      return CpuRuns(SumIsa::kAvx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
    default: return false;
  }
}

// Constant tables of the kernels' addresses, one row per SumIsa (a null row where that build is not
// linked in): data filled by the loader, so picking a kernel runs no code of any instruction set.
#define JAX_BLINK_SUM_ROW(ns) {JAX_BLINK_SCALARS(JAX_BLINK_SUM_ENTRY_##ns)}
#define JAX_BLINK_SUM_ENTRY_sum_baseline(kind) &sum_baseline::Sum##kind,
#define JAX_BLINK_SUM_ENTRY_sum_avx2(kind) &sum_avx2::Sum##kind,
#define JAX_BLINK_SUM_ENTRY_sum_avx512(kind) &sum_avx512::Sum##kind,
constexpr SumFn kTables[][static_cast<int>(Scalar::kCount)] = {
    JAX_BLINK_SUM_ROW(sum_baseline),
#if defined(JAX_BLINK_SUM_AVX2)
    JAX_BLINK_SUM_ROW(sum_avx2),
#else
    {},
#endif
#if defined(JAX_BLINK_SUM_AVX512)
    JAX_BLINK_SUM_ROW(sum_avx512),
#else
    {},
#endif
};
static_assert(sizeof(kTables) / sizeof(kTables[0]) == sizeof(kSumIsas) / sizeof(kSumIsas[0]),
              "one kernel table per SumIsa");

}  // namespace

const char* SumIsaName(SumIsa isa) {
  switch (isa) {
    case SumIsa::kBaseline: return "baseline";
    case SumIsa::kAvx2: return "avx2";
    case SumIsa::kAvx512: return "avx512";
  }
  return "?";
}

bool SumIsaFromName(const char* name, SumIsa* isa) {
  for (SumIsa i : kSumIsas)
    if (std::strcmp(name, SumIsaName(i)) == 0) {
      *isa = i;
      return true;
    }
  return false;
}

bool SumIsaUsable(SumIsa isa) { return CpuRuns(isa); }

SumIsa ActiveSumIsa() {
  static const SumIsa active = [] {
    // The cap (checked by the Python side at lowering; an unknown name here means no cap).
    SumIsa cap = SumIsa::kAvx512;
    if (const char* env = std::getenv("JAX_BLINK_CPU_ISA")) {
      std::string v(env);
      const char* blanks = " \t\n\v\f\r";  // the lowering's check trims the same
      const size_t a = v.find_first_not_of(blanks), b = v.find_last_not_of(blanks);
      SumIsaFromName(a == std::string::npos ? "" : v.substr(a, b - a + 1).c_str(), &cap);
    }
    SumIsa best = SumIsa::kBaseline;
    for (SumIsa i : kSumIsas)
      if (static_cast<int>(i) <= static_cast<int>(cap) && CpuRuns(i)) best = i;
    return best;
  }();
  return active;
}

Adder AdderFor(Dtype t, SumIsa isa) {
  const ScalarLayout l = ScalarOf(t);
  if (l.scalar == Scalar::kCount) return {};
  return Adder{kTables[static_cast<int>(isa)][static_cast<int>(l.scalar)], l.lanes};
}

Adder AdderFor(Dtype t) { return AdderFor(t, ActiveSumIsa()); }

}  // namespace jax_blink
