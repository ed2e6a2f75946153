// Python extension exporting the CUDA handlers of the jax_wgrad FFI targets.
#include <pybind11/pybind11.h>

#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* WgradAccumulateCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* BucketAddCuda(XLA_FFI_CallFrame* call_frame);

namespace py = pybind11;

PYBIND11_MODULE(_wgrad_ffi_cuda, m) {
  m.doc() = "jax_wgrad CUDA FFI handlers (cuBLAS)";
  m.def("registrations", []() {
    py::dict d;
    d["jax_wgrad_wgrad_accumulate"] =
        py::capsule(reinterpret_cast<void*>(&WgradAccumulateCuda));
    d["jax_wgrad_bucket_add"] = py::capsule(reinterpret_cast<void*>(&BucketAddCuda));
    return d;
  });
}
