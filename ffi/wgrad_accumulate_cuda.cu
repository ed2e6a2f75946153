// CUDA handler of the jax_wgrad_wgrad_accumulate FFI target:
//   main_grad[out, in] += dy[T, out]^T @ x[T, in]
// One cublasGemmStridedBatchedEx with beta = 1 on the stream XLA passes in (the GEMM
// epilogue does the accumulation: no temporary dW); grouped (expert) blocks
// [G, out, in] back to back in a flat bucket are one strided-batched call over G. Compute
// type: fp32 accumulation; float32 inputs use TF32 tensor cores unless the precision is
// HIGHEST (XLA:GPU's rule for a float32 dot), 16-bit inputs are multiplied exactly.
//
// Workspace: the custom call's second result, a uint8 buffer that XLA allocates from its
// own memory with the program's other temporaries (sized at lowering time; no allocation
// in the handler, no dependence on XLA's ScratchAllocator, which hands out nothing on
// some jax versions). The handler aligns it to the 256 bytes cublasSetWorkspace needs.
//
// Two execution stages (registered as a handler bundle):
// * initialize (once per executable and device, before any run or CUDA-graph capture):
//   creates the cuBLAS handle of the stream's device, with that device current.
// * execute: only enqueues work on XLA's stream (a copy when XLA did not alias, the
//   GEMM), so it may be captured into a CUDA graph: the handler declares the
//   command-buffer trait and XLA records it into its command buffers instead of launching
//   it on its own. cuBLAS is given its workspace explicitly, so it allocates nothing while
//   captured.
// cuBLAS handles are kept per device for the process lifetime (like XLA's own), guarded
// by a mutex because the stream and workspace are set per call (cublasSetStream resets
// the workspace, so it is set after). Every error is returned as an FFI error, never
// thrown.
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

// One cuBLAS handle per device, created by the initialize stage (or, should a runtime
// skip that stage, by the first execute) and never destroyed (process lifetime, like
// XLA's own handles).
struct HandleEntry {
  cublasHandle_t handle = nullptr;
  std::mutex mu;
};

std::mutex& RegistryMutex() {
  static auto* mu = new std::mutex();
  return *mu;
}
std::unordered_map<int, HandleEntry*>& Registry() {
  static auto* registry = new std::unordered_map<int, HandleEntry*>();
  return *registry;
}

// The device that owns XLA's stream (not whatever device is current on this thread).
ffi::ErrorOr<int> StreamDevice(cudaStream_t stream) {
  int device = 0;
  if (cudaError_t e = cudaStreamGetDevice(stream, &device); e != cudaSuccess) {
    return ffi::Unexpected(CudaError("cudaStreamGetDevice", e));
  }
  return device;
}

// Creates `device`'s handle with `device` current (a cuBLAS handle belongs to the device
// that is current when it is created), then restores the thread's current device.
ffi::ErrorOr<HandleEntry*> CreateHandle(int device) {
  int previous = 0;
  if (cudaError_t e = cudaGetDevice(&previous); e != cudaSuccess) {
    return ffi::Unexpected(CudaError("cudaGetDevice", e));
  }
  if (previous != device) {
    if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
      return ffi::Unexpected(CudaError("cudaSetDevice", e));
    }
  }
  auto* entry = new HandleEntry();
  const cublasStatus_t s = cublasCreate(&entry->handle);
  if (previous != device) cudaSetDevice(previous);
  if (s != CUBLAS_STATUS_SUCCESS) {
    delete entry;
    return ffi::Unexpected(CublasError("cublasCreate", s));
  }
  return entry;
}

// The handle of `device`, created if `create` and missing; nullptr if missing otherwise.
ffi::ErrorOr<HandleEntry*> GetHandle(int device, bool create) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(device);
  if (it != Registry().end()) return it->second;
  if (!create) return static_cast<HandleEntry*>(nullptr);
  auto entry = CreateHandle(device);
  if (entry.has_error()) return entry;
  Registry()[device] = *entry;
  return *entry;
}

// Execute-stage fallback when no initialize stage ran: create the handle with this
// thread's stream capture relaxed, so that cuBLAS's own allocations are legal even if
// XLA is capturing the call into a CUDA graph right now (they are not stream work).
ffi::ErrorOr<HandleEntry*> GetHandleInExecute(int device) {
  auto found = GetHandle(device, /*create=*/false);
  if (found.has_error() || *found != nullptr) return found;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (cudaError_t e = cudaThreadExchangeStreamCaptureMode(&mode); e != cudaSuccess) {
    return ffi::Unexpected(CudaError("cudaThreadExchangeStreamCaptureMode", e));
  }
  auto created = GetHandle(device, /*create=*/true);
  cudaThreadExchangeStreamCaptureMode(&mode);  // restores the caller's mode
  return created;
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
  auto device = StreamDevice(stream);
  if (device.has_error()) return device.error();
  auto entry = GetHandleInExecute(*device);
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

// Initialize stage: the cuBLAS handle of the stream's device, outside any capture.
ffi::Error WgradAccumulateCudaInitializeImpl(cudaStream_t stream) {
  return Guarded("wgrad_accumulate", [&]() -> ffi::Error {
    auto device = StreamDevice(stream);
    if (device.has_error()) return device.error();
    auto entry = GetHandle(*device, /*create=*/true);
    if (entry.has_error()) return entry.error();
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WgradAccumulateCudaInitialize,
                              WgradAccumulateCudaInitializeImpl,
                              ffi::Ffi::BindInitialize()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(WgradAccumulateCuda, WgradAccumulateCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // x          [..., T, in]
                                  .Arg<ffi::AnyBuffer>()   // dy         [..., T, out]
                                  .Arg<ffi::AnyBuffer>()   // main_grad  [..., out, in]
                                  .Ret<ffi::AnyBuffer>()   // main_grad  (aliased)
                                  .Ret<ffi::AnyBuffer>()   // cuBLAS workspace, uint8
                                  .Attr<int64_t>("offset")       // block start (flat)
                                  .Attr<int32_t>("precision"),   // 0/1/2: TF32 unless 2
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_wgrad
