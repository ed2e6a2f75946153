// Python extension exporting the CPU handlers of the jax_wgrad FFI targets.
#include <pybind11/pybind11.h>

#include "metadata.h"
#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* WgradAccumulateCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* WgradAccumulateAtCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* BucketAddCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* RaggedMatmulCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* RaggedWgradAccumulateCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* Fp8WgradAccumulateCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* Fp8WgradAccumulateAtCpu(XLA_FFI_CallFrame* call_frame);

namespace py = pybind11;

PYBIND11_MODULE(_wgrad_ffi_cpu, m) {
  m.doc() = "jax_wgrad CPU FFI handlers (BLAS: scipy-openblas32)";
  m.def("registrations", []() {
    py::dict d;
    d["jax_wgrad_wgrad_accumulate"] =
        py::capsule(reinterpret_cast<void*>(&WgradAccumulateCpu));
    d["jax_wgrad_wgrad_accumulate_at"] =
        py::capsule(reinterpret_cast<void*>(&WgradAccumulateAtCpu));
    d["jax_wgrad_bucket_add"] = py::capsule(reinterpret_cast<void*>(&BucketAddCpu));
    d["jax_wgrad_ragged_matmul"] = py::capsule(reinterpret_cast<void*>(&RaggedMatmulCpu));
    d["jax_wgrad_ragged_wgrad_accumulate"] =
        py::capsule(reinterpret_cast<void*>(&RaggedWgradAccumulateCpu));
    d["jax_wgrad_fp8_wgrad_accumulate"] =
        py::capsule(reinterpret_cast<void*>(&Fp8WgradAccumulateCpu));
    d["jax_wgrad_fp8_wgrad_accumulate_at"] =
        py::capsule(reinterpret_cast<void*>(&Fp8WgradAccumulateAtCpu));
    return d;
  });
  jax_wgrad::DefineHandlerFacts(m, {{"jax_wgrad_wgrad_accumulate", &WgradAccumulateCpu},
                                    {"jax_wgrad_wgrad_accumulate_at", &WgradAccumulateAtCpu},
                                    {"jax_wgrad_bucket_add", &BucketAddCpu},
                                    {"jax_wgrad_ragged_matmul", &RaggedMatmulCpu},
                                    {"jax_wgrad_ragged_wgrad_accumulate",
                                     &RaggedWgradAccumulateCpu},
                                    {"jax_wgrad_fp8_wgrad_accumulate", &Fp8WgradAccumulateCpu},
                                    {"jax_wgrad_fp8_wgrad_accumulate_at",
                                     &Fp8WgradAccumulateAtCpu}});
}
