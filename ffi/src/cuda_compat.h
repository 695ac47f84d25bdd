// Can a CUDA binary built for some architectures run on a given GPU and driver? Plain C++ (no CUDA
// headers) so CI tests it; the CUDA module feeds it what the runtime reports (cuda_executor.cu).
#pragma once

#include <string>

namespace jax_blink {

// archs: CMake CUDA_ARCHITECTURES syntax, ';' or ',' separated: "75-real" (cubin sm_75), "90-virtual" (PTX
// compute_90), "90" (both). A cubin sm_XY runs on compute capability X.Z with Z >= Y (same major); PTX
// compute_XY is compiled by the driver for any capability >= X.Y. Returns "" when the GPU of compute
// capability major.minor can run the binary, else a sentence saying why not and what to rebuild with.
std::string ArchSupportReason(const std::string& archs, int major, int minor);

// driver_version / runtime_version as CUDA reports them (12040 = 12.4). A runtime of major M needs a
// driver of major >= M (minor-version compatibility within a major). Returns "" or why not.
std::string DriverSupportReason(int driver_version, int runtime_version);

}  // namespace jax_blink
