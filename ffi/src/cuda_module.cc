// Python module jax_blink._native._cuda: the XLA FFI handler "jax_blink_cuda" (platform "CUDA").
#include <nanobind/nanobind.h>

#include "cuda_executor.h"

namespace nb = nanobind;

NB_MODULE(_cuda, m) {
  m.doc() = "jax_blink native CUDA executor (XLA FFI target jax_blink_cuda)";
  m.def("handler", []() { return nb::capsule(jax_blink::CudaHandlerAddress()); },
        "PyCapsule of the XLA FFI handler for platform 'CUDA'.");
}
