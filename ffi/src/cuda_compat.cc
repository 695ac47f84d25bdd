// See cuda_compat.h.
#include "cuda_compat.h"

#include <sstream>
#include <vector>

namespace jax_blink {

std::string ArchSupportReason(const std::string& archs, int major, int minor) {
  const int cc = major * 10 + minor;
  std::string list = archs;
  for (char& c : list)
    if (c == ',') c = ';';
  std::stringstream ss(list);
  std::string item;
  std::vector<std::string> seen;
  while (std::getline(ss, item, ';')) {
    if (item.empty()) continue;
    seen.push_back(item);
    std::string num = item, kind = "both";
    size_t dash = item.find('-');
    if (dash != std::string::npos) {
      num = item.substr(0, dash);
      kind = item.substr(dash + 1);
    }
    int a = 0;
    try {
      a = std::stoi(num);
    } catch (...) {
      continue;
    }
    const bool cubin = kind == "both" || kind == "real";
    const bool ptx = kind == "both" || kind == "virtual";
    if (cubin && a / 10 == major && a % 10 <= minor) return "";
    if (ptx && a <= cc) return "";
  }
  std::ostringstream os;
  os << "this jax_blink CUDA module carries code for architectures [";
  for (size_t i = 0; i < seen.size(); ++i) os << (i ? ", " : "") << seen[i];
  os << "], none of which runs on a GPU of compute capability " << major << "." << minor;
  if (cc < 75) {
    // nvcc 13 has no target below sm_75: V100 (sm_70) needs an older toolkit.
    os << "; nvcc 13 cannot target sm_" << cc << ": build with CUDA 11.8 (bash scripts/build_cuda118.sh: cubins "
       << "sm_70..sm_90, drivers from R450) or a CUDA 12 toolkit with JAX_BLINK_CUDA_ARCH including " << cc;
  } else {
    os << "; rebuild with JAX_BLINK_CUDA_ARCH including " << cc << " (pip install -e . with CMAKE_ARGS="
       << "-DJAX_BLINK_CUDA_ARCH=" << cc << ")";
  }
  return os.str();
}

std::string DriverSupportReason(int driver_version, int runtime_version) {
  if (driver_version <= 0) return "no NVIDIA driver found (cudaDriverGetVersion reported " +
                                  std::to_string(driver_version) + ")";
  if (driver_version / 1000 < runtime_version / 1000) {
    std::ostringstream os;
    os << "the NVIDIA driver supports CUDA " << driver_version / 1000 << "." << (driver_version % 1000) / 10
       << " but this jax_blink CUDA module was built with CUDA " << runtime_version / 1000 << "."
       << (runtime_version % 1000) / 10 << " (a CUDA " << runtime_version / 1000 << " runtime needs a driver of "
       << "CUDA " << runtime_version / 1000 << ".0 or later: minor-version compatibility); update the driver or "
       << "rebuild with a CUDA " << driver_version / 1000 << " toolkit";
    if (driver_version >= 11000) os << " (CUDA 11.8, any driver from R450: bash scripts/build_cuda118.sh)";
    os << " (docs/cuda.md, Build)";
    return os.str();
  }
  return "";
}

}  // namespace jax_blink
