// Python extension exporting the CUDA handlers of the jax_wgrad FFI targets.
#include <pybind11/pybind11.h>

#include "metadata.h"
#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* WgradAccumulateCudaInitialize(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* WgradAccumulateCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* BucketAddCuda(XLA_FFI_CallFrame* call_frame);

namespace py = pybind11;

namespace {

py::capsule Capsule(XLA_FFI_Handler* handler) {
  return py::capsule(reinterpret_cast<void*>(handler));
}

}  // namespace

PYBIND11_MODULE(_wgrad_ffi_cuda, m) {
  m.doc() = "jax_wgrad CUDA FFI handlers (cuBLAS)";
  m.def("registrations", []() {
    py::dict d;
    // A handler bundle: the initialize stage creates the device's cuBLAS handle before
    // any run, so the execute stage may be captured into a CUDA graph.
    py::dict wgrad;
    wgrad["initialize"] = Capsule(&WgradAccumulateCudaInitialize);
    wgrad["execute"] = Capsule(&WgradAccumulateCuda);
    d["jax_wgrad_wgrad_accumulate"] = wgrad;
    d["jax_wgrad_bucket_add"] = Capsule(&BucketAddCuda);
    return d;
  });
  jax_wgrad::DefineHandlerFacts(m, &WgradAccumulateCuda, &BucketAddCuda);
}
