// Python extension exporting the CUDA handlers of the jax_wgrad FFI targets.
#include <pybind11/pybind11.h>

#include <cstdlib>
#include <string>

#include "metadata.h"
#include "ragged_gemm_cutlass.h"
#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* WgradAccumulateCudaInitialize(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* WgradAccumulateCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* WgradAccumulateAtCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* BucketAddCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* RaggedGemmCudaInitialize(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* RaggedMatmulCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* RaggedWgradAccumulateCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* Fp8WgradAccumulateCudaInitialize(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* Fp8WgradAccumulateCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* Fp8WgradAccumulateAtCuda(XLA_FFI_CallFrame* call_frame);

namespace py = pybind11;

namespace {

py::capsule Capsule(XLA_FFI_Handler* handler) {
  return py::capsule(reinterpret_cast<void*>(handler));
}

}  // namespace

PYBIND11_MODULE(_wgrad_ffi_cuda, m) {
  m.doc() = "jax_wgrad CUDA FFI handlers (cuBLAS; CUTLASS and own kernels for the ragged GEMMs)";
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
    // The ragged grouped GEMMs: their initialize stage queries the device (compute
    // capability, SM count) and readies the CUTLASS kernels before any capture.
    auto ragged = [](XLA_FFI_Handler* execute) {
      py::dict b;
      b["initialize"] = Capsule(&RaggedGemmCudaInitialize);
      b["execute"] = Capsule(execute);
      return b;
    };
    d["jax_wgrad_ragged_matmul"] = ragged(&RaggedMatmulCuda);
    d["jax_wgrad_ragged_wgrad_accumulate"] = ragged(&RaggedWgradAccumulateCuda);
    // The FP8 wgrad GEMMs (cuBLASLt): their initialize stage creates the device's cuBLASLt
    // handle before any capture.
    auto fp8 = [](XLA_FFI_Handler* execute) {
      py::dict b;
      b["initialize"] = Capsule(&Fp8WgradAccumulateCudaInitialize);
      b["execute"] = Capsule(execute);
      return b;
    };
    d["jax_wgrad_fp8_wgrad_accumulate"] = fp8(&Fp8WgradAccumulateCuda);
    d["jax_wgrad_fp8_wgrad_accumulate_at"] = fp8(&Fp8WgradAccumulateAtCuda);
    return d;
  });
  // Which kernels the ragged handlers run (ffi/ragged_gemm_cutlass.h): "auto" (CUTLASS on
  // Hopper where the shapes allow, else WMMA) or "wmma"; initially JAX_WGRAD_RAGGED_KERNEL,
  // "auto" when unset.
  if (const char* env = std::getenv("JAX_WGRAD_RAGGED_KERNEL");
      env != nullptr && *env != '\0' && std::string(env) != "auto" &&
      std::string(env) != "wmma") {
    throw py::value_error("JAX_WGRAD_RAGGED_KERNEL must be 'auto' or 'wmma', got '" +
                          std::string(env) + "'");
  }
  m.def("ragged_kernel", []() {
    return jax_wgrad::GetRaggedKernel() == jax_wgrad::RaggedKernel::kWmma ? "wmma" : "auto";
  });
  m.def("set_ragged_kernel", [](const std::string& kernel) {
    if (kernel != "auto" && kernel != "wmma") {
      throw py::value_error("ragged kernel must be 'auto' or 'wmma', got '" + kernel + "'");
    }
    jax_wgrad::SetRaggedKernel(kernel == "wmma" ? jax_wgrad::RaggedKernel::kWmma
                                                : jax_wgrad::RaggedKernel::kAuto);
  });
  m.def("ragged_kernel_launches", []() {
    const jax_wgrad::RaggedLaunches n = jax_wgrad::GetRaggedLaunches();
    py::dict d;
    d["cutlass"] = n.cutlass;
    d["wmma"] = n.wmma;
    return d;
  });
  m.def("ragged_cutlass_built", &jax_wgrad::RaggedCutlassBuilt);
  jax_wgrad::DefineHandlerFacts(m, {{"jax_wgrad_wgrad_accumulate", &WgradAccumulateCuda},
                                    {"jax_wgrad_wgrad_accumulate_at", &WgradAccumulateAtCuda},
                                    {"jax_wgrad_bucket_add", &BucketAddCuda},
                                    {"jax_wgrad_ragged_matmul", &RaggedMatmulCuda},
                                    {"jax_wgrad_ragged_wgrad_accumulate",
                                     &RaggedWgradAccumulateCuda},
                                    {"jax_wgrad_fp8_wgrad_accumulate", &Fp8WgradAccumulateCuda},
                                    {"jax_wgrad_fp8_wgrad_accumulate_at",
                                     &Fp8WgradAccumulateAtCuda}});
}
