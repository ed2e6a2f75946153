// CUDA handler of the jax_wgrad_wgrad_accumulate FFI target:
//   main_grad[out, in] += dy[T, out]^T @ x[T, in]
// One cublasGemmEx with beta = 1 and fp32 compute on the stream XLA passes in (the GEMM
// epilogue does the accumulation: no temporary dW). cuBLAS handles are created once per
// device and reused; the cuBLAS workspace comes from XLA's scratch allocator, so no
// cudaMalloc happens per call. The handler is not marked command-buffer compatible, so
// XLA never captures it into a CUDA graph.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>

#include "wgrad_accumulate.h"
#include "xla/ffi/api/ffi.h"

namespace jax_wgrad {
namespace {

constexpr size_t kCublasWorkspaceBytes = 32u << 20;  // cuBLAS recommendation for Hopper

ffi::Error CublasError(const char* what, cublasStatus_t s) {
  return ffi::Error::Internal(std::string("wgrad_accumulate: ") + what +
                              " failed: " + cublasGetStatusString(s));
}
ffi::Error CudaError(const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string("wgrad_accumulate: ") + what +
                              " failed: " + cudaGetErrorString(e));
}

// One cuBLAS handle per device, created on first use and never destroyed (process
// lifetime), guarded by a mutex because stream and workspace are set per call.
struct HandleEntry {
  cublasHandle_t handle = nullptr;
  std::mutex mu;
};

ffi::ErrorOr<HandleEntry*> GetHandle(int device) {
  static std::mutex registry_mu;
  static auto* registry = new std::unordered_map<int, HandleEntry*>();
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry->find(device);
  if (it != registry->end()) return it->second;
  auto* entry = new HandleEntry();
  if (cublasStatus_t s = cublasCreate(&entry->handle); s != CUBLAS_STATUS_SUCCESS) {
    delete entry;
    return ffi::Unexpected(CublasError("cublasCreate", s));
  }
  (*registry)[device] = entry;
  return entry;
}

cudaDataType_t CudaType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return CUDA_R_16BF;
    case ffi::DataType::F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

ffi::Error WgradAccumulateCudaImpl(cudaStream_t stream, ffi::ScratchAllocator scratch,
                                   ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::AnyBuffer acc,
                                   ffi::Result<ffi::AnyBuffer> result, int64_t offset) {
  WgradDims d;
  if (ffi::Error err = CheckWgradArgs(x, dy, acc, *result, offset, &d); err.failure()) {
    return err;
  }
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  if (d.tokens > kMaxInt || d.in > kMaxInt || d.out > kMaxInt || d.batch > kMaxInt) {
    return ffi::Error::InvalidArgument(
        "wgrad_accumulate: a dimension exceeds cuBLAS's 32-bit index range");
  }
  if (result->untyped_data() != acc.untyped_data()) {
    if (cudaError_t e = cudaMemcpyAsync(result->untyped_data(), acc.untyped_data(),
                                        acc.size_bytes(), cudaMemcpyDeviceToDevice, stream);
        e != cudaSuccess) {
      return CudaError("cudaMemcpyAsync", e);
    }
  }
  if (d.batch == 0 || d.tokens == 0 || d.in == 0 || d.out == 0) {
    return ffi::Error::Success();
  }
  int device = 0;
  // The device that owns XLA's stream (not whatever device is current on this thread).
  if (cudaError_t e = cudaStreamGetDevice(stream, &device); e != cudaSuccess) {
    return CudaError("cudaStreamGetDevice", e);
  }
  auto entry = GetHandle(device);
  if (entry.has_error()) return entry.error();
  std::optional<void*> workspace = scratch.Allocate(kCublasWorkspaceBytes, 256);
  if (!workspace.has_value()) {
    return ffi::Error::Internal("wgrad_accumulate: could not allocate cuBLAS workspace");
  }

  std::lock_guard<std::mutex> lock((*entry)->mu);
  cublasHandle_t h = (*entry)->handle;
  if (cublasStatus_t s = cublasSetStream(h, stream); s != CUBLAS_STATUS_SUCCESS) {
    return CublasError("cublasSetStream", s);
  }
  if (cublasStatus_t s = cublasSetWorkspace(h, *workspace, kCublasWorkspaceBytes);
      s != CUBLAS_STATUS_SUCCESS) {
    return CublasError("cublasSetWorkspace", s);
  }
  // Row-major C[out, in] is column-major C^T[in, out] = x^T[in, T] @ dy[T, out]:
  // A = x as column-major [in, T] (no transpose), B = dy as column-major [out, T]
  // (transposed), ldc = in.
  const float alpha = 1.0f, beta = 1.0f;
  const cudaDataType_t in_t = CudaType(x.element_type());
  const cudaDataType_t acc_t = CudaType(acc.element_type());
  const int m = static_cast<int>(d.in), n = static_cast<int>(d.out),
            k = static_cast<int>(d.tokens);
  char* c = static_cast<char*>(result->untyped_data()) +
            d.offset * static_cast<int64_t>(ffi::ByteWidth(acc.element_type()));
  cublasStatus_t s = cublasGemmStridedBatchedEx(
      h, CUBLAS_OP_N, CUBLAS_OP_T, m, n, k, &alpha, x.untyped_data(), in_t, m,
      d.tokens * d.in, dy.untyped_data(), in_t, n, d.tokens * d.out, &beta,
      c, acc_t, m, d.acc_stride, static_cast<int>(d.batch),
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS) return CublasError("cublasGemmStridedBatchedEx", s);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WgradAccumulateCuda, WgradAccumulateCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()  // cuBLAS workspace
                                  .Arg<ffi::AnyBuffer>()   // x          [..., T, in]
                                  .Arg<ffi::AnyBuffer>()   // dy         [..., T, out]
                                  .Arg<ffi::AnyBuffer>()   // main_grad  [..., out, in]
                                  .Ret<ffi::AnyBuffer>()   // main_grad  (aliased)
                                  .Attr<int64_t>("offset"));  // block start (flat)

}  // namespace jax_wgrad
