// Python module jax_blink._native._cuda: the XLA FFI handler "jax_blink_cuda" (platform "CUDA") and
// the build/compatibility facts jax_blink.lowering.ffi checks before registering it.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "cuda_executor.h"

namespace nb = nanobind;

NB_MODULE(_cuda, m) {
  m.doc() = "jax_blink native CUDA executor (XLA FFI target jax_blink_cuda)";
  m.def("handler", []() { return nb::capsule(jax_blink::CudaHandlerAddress()); },
        "PyCapsule of the XLA FFI handler for platform 'CUDA'.");
  m.def("check_compatibility", &jax_blink::CheckCudaCompatibility,
        "'' when this build runs on every visible GPU with the installed driver, else why not.");
  m.def("built_cuda_version", &jax_blink::BuiltCudaVersion, "CUDA runtime version compiled in (e.g. 13000).");
  m.def("built_architectures", []() { return std::string(jax_blink::BuiltCudaArchitectures()); },
        "CUDA architectures compiled in (CMake syntax, e.g. '75-real;80-real;90').");
}
