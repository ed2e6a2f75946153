// Python extension exporting the CUDA handlers of the jax_wgrad FFI targets.
#include <pybind11/pybind11.h>

#include "metadata.h"
#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* WgradAccumulateCudaInitialize(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* WgradAccumulateCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* WgradAccumulateAtCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* BucketAddCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* RaggedMatmulCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* RaggedWgradAccumulateCuda(XLA_FFI_CallFrame* call_frame);

namespace py = pybind11;

namespace {

py::capsule Capsule(XLA_FFI_Handler* handler) {
  return py::capsule(reinterpret_cast<void*>(handler));
}

}  // namespace

PYBIND11_MODULE(_wgrad_ffi_cuda, m) {
  m.doc() = "jax_wgrad CUDA FFI handlers (cuBLAS, and own kernels for the ragged GEMMs)";
  m.def("registrations", []() {
    py::dict d;
    // Handler bundles: the initialize stage creates the device's cuBLAS handle before
    // any run, so the execute stage may be captured into a CUDA graph. Both wgrad
    // targets (static and operand offset) share it.
    auto bundle = [](XLA_FFI_Handler* execute) {
      py::dict b;
      b["initialize"] = Capsule(&WgradAccumulateCudaInitialize);
      b["execute"] = Capsule(execute);
      return b;
    };
    d["jax_wgrad_wgrad_accumulate"] = bundle(&WgradAccumulateCuda);
    d["jax_wgrad_wgrad_accumulate_at"] = bundle(&WgradAccumulateAtCuda);
    d["jax_wgrad_bucket_add"] = Capsule(&BucketAddCuda);
    // The ragged grouped GEMMs are kernels of their own (no cuBLAS handle): execute only.
    d["jax_wgrad_ragged_matmul"] = Capsule(&RaggedMatmulCuda);
    d["jax_wgrad_ragged_wgrad_accumulate"] = Capsule(&RaggedWgradAccumulateCuda);
    return d;
  });
  jax_wgrad::DefineHandlerFacts(m, {{"jax_wgrad_wgrad_accumulate", &WgradAccumulateCuda},
                                    {"jax_wgrad_wgrad_accumulate_at", &WgradAccumulateAtCuda},
                                    {"jax_wgrad_bucket_add", &BucketAddCuda},
                                    {"jax_wgrad_ragged_matmul", &RaggedMatmulCuda},
                                    {"jax_wgrad_ragged_wgrad_accumulate",
                                     &RaggedWgradAccumulateCuda}});
}
