// CUDA handler of the jax_wgrad_wgrad_accumulate FFI target:
//   main_grad[out, in] += dy[T, out]^T @ x[T, in]
// One cublasGemmStridedBatchedEx with beta = 1 on the stream XLA passes in (the GEMM
// epilogue does the accumulation: no temporary dW); grouped (expert) blocks
// [G, out, in] back to back in a flat bucket are one strided-batched call over G. Compute type: fp32 accumulation;
// float32 inputs use TF32 tensor cores unless the precision is HIGHEST (XLA:GPU's rule
// for a float32 dot), 16-bit inputs are multiplied exactly.
//
// Workspace: the custom call's second result, a uint8 buffer that XLA allocates from its
// own memory with the program's other temporaries (sized at lowering time; no allocation
// in the handler, no dependence on XLA's ScratchAllocator, which hands out nothing on
// some jax versions). The handler aligns it to the 256 bytes cublasSetWorkspace needs.
//
// cuBLAS handles are created once per device and reused, guarded by a mutex because the
// stream and workspace are set per call (cublasSetStream resets the workspace, so it is
// set after). The handler is not marked command-buffer compatible, so XLA never captures
// it into a CUDA graph. Every error is returned as an FFI error, never thrown.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>

#include "common.h"
#include "wgrad_accumulate.h"
#include "xla/ffi/api/ffi.h"

namespace jax_wgrad {
namespace {

constexpr size_t kWorkspaceAlignment = 256;  // cublasSetWorkspace's requirement

ffi::Error CublasError(const char* what, cublasStatus_t s) {
  return ffi::Error::Internal(std::string("wgrad_accumulate: ") + what +
                              " failed: " + cublasGetStatusString(s));
}
ffi::Error CudaError(const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string("wgrad_accumulate: ") + what +
                              " failed: " + cudaGetErrorString(e));
}

// One cuBLAS handle per device, created on first use and never destroyed (process
// lifetime, like XLA's own handles).
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

cublasComputeType_t ComputeType(ffi::DataType in_t, Precision precision) {
  if (in_t == ffi::DataType::F32 && precision != Precision::kHighest) {
    return CUBLAS_COMPUTE_32F_FAST_TF32;
  }
  return CUBLAS_COMPUTE_32F;
}

ffi::Error WgradAccumulateCudaBody(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                                   ffi::AnyBuffer acc, ffi::Result<ffi::AnyBuffer> result,
                                   ffi::Result<ffi::AnyBuffer> workspace, int64_t offset,
                                   int32_t precision) {
  WgradDims d;
  if (ffi::Error err = CheckWgradArgs(x, dy, acc, *result, offset, precision, &d);
      err.failure()) {
    return err;
  }
  if (workspace->element_type() != ffi::DataType::U8 ||
      workspace->size_bytes() <= kWorkspaceAlignment) {
    return ffi::Error::InvalidArgument(
        "wgrad_accumulate: the workspace result must be a uint8 buffer of more than 256 "
        "bytes, got " + ShapeString(*workspace));
  }
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  if (d.tokens > kMaxInt || d.in > kMaxInt || d.out > kMaxInt || d.batch > kMaxInt ||
      d.groups > kMaxInt) {
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
  if (d.batch == 0 || d.groups == 0 || d.tokens == 0 || d.in == 0 || d.out == 0) {
    return ffi::Error::Success();
  }
  int device = 0;
  // The device that owns XLA's stream (not whatever device is current on this thread).
  if (cudaError_t e = cudaStreamGetDevice(stream, &device); e != cudaSuccess) {
    return CudaError("cudaStreamGetDevice", e);
  }
  auto entry = GetHandle(device);
  if (entry.has_error()) return entry.error();

  // Align the workspace start up to 256 bytes; the result has 256 bytes of slack.
  const auto base = reinterpret_cast<uintptr_t>(workspace->untyped_data());
  const uintptr_t aligned = (base + kWorkspaceAlignment - 1) & ~(kWorkspaceAlignment - 1);
  const size_t workspace_bytes = workspace->size_bytes() - (aligned - base);

  std::lock_guard<std::mutex> lock((*entry)->mu);
  cublasHandle_t h = (*entry)->handle;
  if (cublasStatus_t s = cublasSetStream(h, stream); s != CUBLAS_STATUS_SUCCESS) {
    return CublasError("cublasSetStream", s);
  }
  if (cublasStatus_t s = cublasSetWorkspace(h, reinterpret_cast<void*>(aligned),
                                            workspace_bytes);
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
  const int64_t in_bytes = ffi::ByteWidth(x.element_type());
  const int64_t acc_bytes = ffi::ByteWidth(acc.element_type());
  // One strided-batched GEMM over `count` problems from element index `first` of x / dy
  // (problems are [T, in] / [T, out] back to back), accumulators `stride_c` elements apart.
  auto gemm = [&](int64_t first, int64_t acc_offset, int64_t count, int64_t stride_c) {
    return cublasGemmStridedBatchedEx(
        h, CUBLAS_OP_N, CUBLAS_OP_T, m, n, k, &alpha,
        static_cast<const char*>(x.untyped_data()) + first * d.tokens * d.in * in_bytes, in_t,
        m, d.tokens * d.in,
        static_cast<const char*>(dy.untyped_data()) + first * d.tokens * d.out * in_bytes,
        in_t, n, d.tokens * d.out, &beta,
        static_cast<char*>(result->untyped_data()) + acc_offset * acc_bytes, acc_t, m,
        stride_c, static_cast<int>(count), ComputeType(x.element_type(), d.precision),
        CUBLAS_GEMM_DEFAULT);
  };
  if (d.groups == 1) {  // batch elements' blocks are acc_stride apart: one call
    if (cublasStatus_t s = gemm(0, d.offset, d.batch, d.acc_stride);
        s != CUBLAS_STATUS_SUCCESS) {
      return CublasError("cublasGemmStridedBatchedEx", s);
    }
    return ffi::Error::Success();
  }
  // Grouped (experts): one call per batch element over its G back-to-back blocks.
  for (int64_t b = 0; b < d.batch; ++b) {
    if (cublasStatus_t s = gemm(b * d.groups, d.AccOffset(b, 0), d.groups, d.out * d.in);
        s != CUBLAS_STATUS_SUCCESS) {
      return CublasError("cublasGemmStridedBatchedEx", s);
    }
  }
  return ffi::Error::Success();
}

ffi::Error WgradAccumulateCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                                   ffi::AnyBuffer acc, ffi::Result<ffi::AnyBuffer> result,
                                   ffi::Result<ffi::AnyBuffer> workspace, int64_t offset,
                                   int32_t precision) {
  return Guarded("wgrad_accumulate", [&] {
    return WgradAccumulateCudaBody(stream, x, dy, acc, result, workspace, offset,
                                   precision);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WgradAccumulateCuda, WgradAccumulateCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // x          [..., T, in]
                                  .Arg<ffi::AnyBuffer>()   // dy         [..., T, out]
                                  .Arg<ffi::AnyBuffer>()   // main_grad  [..., out, in]
                                  .Ret<ffi::AnyBuffer>()   // main_grad  (aliased)
                                  .Ret<ffi::AnyBuffer>()   // cuBLAS workspace, uint8
                                  .Attr<int64_t>("offset")       // block start (flat)
                                  .Attr<int32_t>("precision"));  // 0/1/2: TF32 unless 2

}  // namespace jax_wgrad
