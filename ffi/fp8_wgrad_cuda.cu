// CUDA handlers of the jax_wgrad_fp8_wgrad_accumulate(_at) FFI targets (fp8_wgrad.h):
//   main_grad[out, in] += (dy_scale_inv * dy[T, out])^T @ (x_scale_inv * x[T, in])
// ONE cuBLASLt FP8 matmul with beta = 1 on the stream XLA passes in: the GEMM epilogue does
// the accumulation into the fp32 accumulator (C = D), no temporary dW.
//
// cuBLASLt configuration (column-major terms, D = alpha * scaleA * scaleB * op(A) op(B) +
// beta * C):
//   compute type CUBLAS_COMPUTE_32F, scale type CUDA_R_32F, alpha = beta = 1 (host values);
//   m = in, n = out, k = T;
//   A = x^T   (CUDA_R_8F_E4M3), stored [k, m] = [T, in] column-major, lda = T, TRANSA = T;
//   B = dy^T  (CUDA_R_8F_E4M3 or CUDA_R_8F_E5M2), stored [k, n] = [T, out] column-major,
//             ldb = T, TRANSB = N;
//   C = D = the accumulator block (CUDA_R_32F), [m, n] = [in, out] column-major, ldc = in:
//             the row-major [out, in] block itself;
//   CUBLASLT_MATMUL_DESC_A_SCALE_POINTER = x_scale_inv, B_SCALE_POINTER = dy_scale_inv
//   (device float32 scalars, the compute type's type as cublasLt.h requires);
//   CUBLASLT_MATMUL_DESC_FAST_ACCUM = 0 (FP8 partial sums promoted to fp32 periodically, as
//   TransformerEngine's wgrad GEMM runs it).
// Why the transposed copies: Hopper's FP8 kernels need the "TN" layout (A transposed, B not,
// both with K contiguous). x [T, in] and dy [T, out] arrive token-major: as column-major
// matrices they are [in, T] and [out, T] with K = T the OUTER dimension, i.e. the "NT"
// layout, for any assignment of the operands (the product contracts over the slow axis of
// both). So the handler first transposes both fp8 operands into the `scratch` result (one
// byte per element: T * (in + out) bytes, ~1/4 of the fp32 accumulator traffic for
// T ~ in), as TransformerEngine keeps "column-wise" fp8 copies for its Hopper wgrad GEMM.
// Shape requirements, refused with an error: T, in and out multiples of 16 (FP8 kernels
// need 16-byte aligned pointers and leading dimensions: lda = ldb = T bytes, ldc = in * 4
// bytes; every dimension a multiple of 16 as the tensor-core FP8 tiles and TransformerEngine
// require). FP8 tensor-core GEMMs need compute capability 8.9 (Ada) or 9.0 (Hopper) and
// newer; elsewhere cuBLASLt finds no algorithm and the call fails with that message.
//
// The accumulator block: for jax_wgrad_fp8_wgrad_accumulate at a static `offset`, updated
// in place when its start is 16-byte aligned (offset % 4 == 0: bucket layouts); otherwise
// (the lowering then sizes a staging slot into `scratch`) and always for
// jax_wgrad_fp8_wgrad_accumulate_at (the position base + index * stride is read on the
// DEVICE, never copied to the host: cublasLtMatmul takes C and D as pointer values, so the
// block's address is not known where the GEMM is enqueued) the block is copied into a
// 256-byte aligned staging slot by a kernel that computes the clamped position
// (BlockPosition::Clamped, XLA DynamicUpdateSlice's rule), accumulated there by the same
// GEMM (C = D = slot, beta = 1) and copied back by a second kernel.
//
// Workspace: the custom call's second result, as the bf16 handler's (WORKSPACE_BYTES of
// jax_wgrad/ops/wgrad.py plus 256 bytes to align it), passed to cublasLtMatmul and as the
// heuristic's CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES.
//
// CUDA graphs: the execute stage only enqueues work on XLA's stream (an async copy when XLA
// did not alias, the transpose / staging kernels, the matmul) and uses no stream queries,
// synchronization or allocation, so it declares the command-buffer trait. The cuBLASLt
// handle of the call's device (XLA's device ordinal) is created by the initialize stage,
// before any capture (or, should a runtime skip that stage, by the first execute with the
// thread's capture mode relaxed), and kept for the process lifetime. cuBLASLt takes the
// stream and workspace per call, so the handle needs no lock.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "common.h"
#include "fp8_wgrad.h"
#include "wgrad_accumulate.h"
#include "xla/ffi/api/ffi.h"

namespace jax_wgrad {
namespace {

constexpr const char* kOp = "fp8_wgrad_accumulate";
constexpr int64_t kScratchAlignment = 256;  // cuBLASLt's default preferred pointer alignment
constexpr int64_t kFp8Multiple = 16;        // T, in, out: multiples of 16 (file comment)
constexpr uintptr_t kMinPointerAlignment = 16;
constexpr int kThreads = 256;

ffi::Error LtError(const char* what, cublasStatus_t s) {
  return ffi::Error::Internal(std::string(kOp) + ": " + what +
                              " failed: " + cublasLtGetStatusString(s));
}
ffi::Error CudaError(const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string(kOp) + ": " + what +
                              " failed: " + cudaGetErrorString(e));
}

// ---- cuBLASLt handles, one per device ------------------------------------------------
std::mutex& HandleMutex() {
  static auto* mu = new std::mutex();
  return *mu;
}
std::unordered_map<int, cublasLtHandle_t>& Handles() {
  static auto* handles = new std::unordered_map<int, cublasLtHandle_t>();
  return *handles;
}

// The handle of `device`, created (with `device` current) if `create` and missing;
// nullptr if missing otherwise.
ffi::ErrorOr<cublasLtHandle_t> GetLtHandle(int device, bool create) {
  std::lock_guard<std::mutex> lock(HandleMutex());
  auto it = Handles().find(device);
  if (it != Handles().end()) return it->second;
  if (!create) return static_cast<cublasLtHandle_t>(nullptr);
  int previous = 0;
  if (cudaError_t e = cudaGetDevice(&previous); e != cudaSuccess) {
    return ffi::Unexpected(CudaError("cudaGetDevice", e));
  }
  if (previous != device) {
    if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
      return ffi::Unexpected(CudaError("cudaSetDevice", e));
    }
  }
  cublasLtHandle_t handle = nullptr;
  const cublasStatus_t s = cublasLtCreate(&handle);
  if (previous != device) cudaSetDevice(previous);
  if (s != CUBLAS_STATUS_SUCCESS) return ffi::Unexpected(LtError("cublasLtCreate", s));
  Handles()[device] = handle;
  return handle;
}

// Execute-stage fallback when no initialize stage ran: create the handle with this
// thread's stream capture relaxed (its allocations are not stream work).
ffi::ErrorOr<cublasLtHandle_t> GetLtHandleInExecute(int device) {
  auto found = GetLtHandle(device, /*create=*/false);
  if (found.has_error() || *found != nullptr) return found;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (cudaError_t e = cudaThreadExchangeStreamCaptureMode(&mode); e != cudaSuccess) {
    return ffi::Unexpected(CudaError("cudaThreadExchangeStreamCaptureMode", e));
  }
  auto created = GetLtHandle(device, /*create=*/true);
  cudaThreadExchangeStreamCaptureMode(&mode);  // restores the caller's mode
  return created;
}

// ---- the scratch result ---------------------------------------------------------------
int64_t RoundUp(int64_t bytes) {
  return (bytes + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
}

// Byte offsets, from the scratch result's first 256-byte aligned address, of x^T [in, T],
// dy^T [out, T] and (if staged) the fp32 staging slot [out * in]. The lowering sizes the
// result as `bytes` + 256 (jax_wgrad/ops/fp8.py: cuda_scratch_bytes, the same rule).
struct ScratchLayout {
  int64_t xt = 0, dyt = 0, staging = 0, bytes = 0;
};
ScratchLayout LayoutOf(const WgradDims& d, bool staged) {
  ScratchLayout l;
  l.dyt = RoundUp(d.tokens * d.in);
  l.staging = l.dyt + RoundUp(d.tokens * d.out);
  l.bytes = l.staging + (staged ? RoundUp(d.out * d.in * 4) : 0);
  return l;
}

char* AlignedStart(void* p) {
  const auto base = reinterpret_cast<uintptr_t>(p);
  constexpr auto kMask = static_cast<uintptr_t>(kScratchAlignment - 1);
  return reinterpret_cast<char*>((base + kMask) & ~kMask);
}

// The largest power of two up to 256 dividing the address (the heuristic's
// CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES: its default, 256, would exclude every
// algorithm for a block that starts 16 bytes into a bucket).
uint32_t AlignmentOf(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto alignment = static_cast<uint32_t>(kScratchAlignment);
  while (alignment > 1 && a % alignment != 0) alignment /= 2;
  return alignment;
}

// ---- kernels --------------------------------------------------------------------------
// dst [cols, rows] = src [rows, cols]^T, bytes, row-major; 32 x 32 tiles through shared
// memory, blockDim (32, 8), a grid-stride loop over the tiles.
__global__ void TransposeBytesKernel(const uint8_t* src, uint8_t* dst, int64_t rows,
                                     int64_t cols) {
  __shared__ uint8_t tile[32][33];
  const int64_t tiles_c = (cols + 31) / 32, tiles = (rows + 31) / 32 * tiles_c;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = t / tiles_c * 32, c0 = t % tiles_c * 32;
    for (int j = threadIdx.y; j < 32; j += blockDim.y) {
      const int64_t r = r0 + j, c = c0 + threadIdx.x;
      if (r < rows && c < cols) tile[j][threadIdx.x] = src[r * cols + c];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < 32; j += blockDim.y) {
      const int64_t c = c0 + j, r = r0 + threadIdx.x;
      if (r < rows && c < cols) dst[c * rows + r] = tile[threadIdx.x][j];
    }
    __syncthreads();
  }
}

// Staging slot <- block (kIn) or block <- slot, the block at `position` clamped into
// [0, max_offset] with the index read from device memory (`index`), or at position.base
// when `index` is null (a static offset).
template <bool kIn>
__global__ void StageBlockKernel(const int32_t* index, BlockPosition position,
                                 int64_t max_offset, float* acc, float* slot, int64_t n) {
  const int64_t offset = index != nullptr ? position.Clamped(*index, max_offset) : position.base;
  float* block = acc + offset;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (kIn) {
      slot[i] = block[i];
    } else {
      block[i] = slot[i];
    }
  }
}

unsigned GridFor(int64_t items, int64_t per_block) {
  return static_cast<unsigned>(std::clamp<int64_t>((items + per_block - 1) / per_block, 1, 4096));
}

// ---- the matmul -----------------------------------------------------------------------
// Descriptors of one call, destroyed on every path.
struct LtDescriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~LtDescriptors() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

struct Fp8Gemm {
  const void* xt;        // x^T [in, T] row-major = A, column-major [T, in]
  const void* dyt;       // dy^T [out, T] row-major = B, column-major [T, out]
  cudaDataType_t dy_type;
  const float* x_scale;  // device scalars: A and B scale pointers
  const float* dy_scale;
  float* c;              // the [out, in] block (C = D)
  void* workspace;
  size_t workspace_bytes;
};

ffi::Error RunFp8Gemm(cudaStream_t stream, cublasLtHandle_t h, const WgradDims& d,
                      const Fp8Gemm& g) {
  LtDescriptors desc;
  const char* failed = nullptr;
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  auto step = [&](cublasStatus_t s, const char* what) {
    if (s != CUBLAS_STATUS_SUCCESS) {
      status = s;
      failed = what;
    }
    return s == CUBLAS_STATUS_SUCCESS;
  };
  const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  const int8_t fast_accum = 0;
  const uint64_t m = d.in, n = d.out, k = d.tokens;
  const uint64_t workspace_bytes = g.workspace_bytes;
  const uint32_t align_a = AlignmentOf(g.xt), align_b = AlignmentOf(g.dyt),
                 align_c = AlignmentOf(g.c);
  const void* a_scale = g.x_scale;
  const void* b_scale = g.dy_scale;
  using Attr = cublasLtMatmulDescAttributes_t;
  auto set = [&](Attr attr, const void* value, size_t size) {
    return step(cublasLtMatmulDescSetAttribute(desc.op, attr, value, size),
                "cublasLtMatmulDescSetAttribute");
  };
  auto prefer = [&](cublasLtMatmulPreferenceAttributes_t attr, const void* value, size_t size) {
    return step(cublasLtMatmulPreferenceSetAttribute(desc.preference, attr, value, size),
                "cublasLtMatmulPreferenceSetAttribute");
  };
  const bool described =
      step(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
           "cublasLtMatmulDescCreate") &&
      set(CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)) &&
      set(CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)) &&
      set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale)) &&
      set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale)) &&
      set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum)) &&
      step(cublasLtMatrixLayoutCreate(&desc.a, CUDA_R_8F_E4M3, k, m, static_cast<int64_t>(k)),
           "cublasLtMatrixLayoutCreate(A)") &&
      step(cublasLtMatrixLayoutCreate(&desc.b, g.dy_type, k, n, static_cast<int64_t>(k)),
           "cublasLtMatrixLayoutCreate(B)") &&
      step(cublasLtMatrixLayoutCreate(&desc.c, CUDA_R_32F, m, n, static_cast<int64_t>(m)),
           "cublasLtMatrixLayoutCreate(C, D)") &&
      step(cublasLtMatmulPreferenceCreate(&desc.preference), "cublasLtMatmulPreferenceCreate") &&
      prefer(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
             sizeof(workspace_bytes)) &&
      prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)) &&
      prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)) &&
      prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c)) &&
      prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof(align_c));
  if (!described) return LtError(failed, status);
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(
      h, desc.op, desc.a, desc.b, desc.c, desc.c, desc.preference, 1, &heuristic, &found);
  if (hs != CUBLAS_STATUS_SUCCESS || found == 0) {
    return ffi::Error::Internal(
        std::string(kOp) + ": cuBLASLt has no FP8 matmul algorithm for this call (" +
        (hs != CUBLAS_STATUS_SUCCESS ? std::string(cublasLtGetStatusString(hs))
                                     : std::string("no heuristic result")) +
        "; FP8 GEMMs need a GPU of compute capability 8.9 or newer): T=" +
        std::to_string(d.tokens) + ", in=" + std::to_string(d.in) +
        ", out=" + std::to_string(d.out));
  }
  const float alpha = 1.0f, beta = 1.0f;
  if (cublasStatus_t s = cublasLtMatmul(h, desc.op, &alpha, g.xt, desc.a, g.dyt, desc.b, &beta,
                                        g.c, desc.c, g.c, desc.c, &heuristic.algo, g.workspace,
                                        g.workspace_bytes, stream);
      s != CUBLAS_STATUS_SUCCESS) {
    return LtError("cublasLtMatmul", s);
  }
  return ffi::Error::Success();
}

// ---- one call of either target ----------------------------------------------------------
// `index`: the position's index in device memory (the _at target), or nullptr: the block
// at d.offset. The operands are validated.
ffi::Error Fp8WgradCudaRun(cudaStream_t stream, int32_t device, const WgradDims& d,
                           const int32_t* index, const BlockPosition& position,
                           const ffi::AnyBuffer& x, const ffi::AnyBuffer& dy,
                           const ffi::AnyBuffer& acc, const ffi::AnyBuffer& x_scale_inv,
                           const ffi::AnyBuffer& dy_scale_inv,
                           ffi::Result<ffi::AnyBuffer>& result,
                           ffi::Result<ffi::AnyBuffer>& workspace,
                           ffi::Result<ffi::AnyBuffer>& scratch) {
  if (d.tokens % kFp8Multiple || d.in % kFp8Multiple || d.out % kFp8Multiple) {
    return ffi::Error::InvalidArgument(
        std::string(kOp) + ": the CUDA handler's FP8 GEMM (cuBLASLt, TN layout) needs T, in "
        "and out to be multiples of 16, got T=" + std::to_string(d.tokens) + ", in=" +
        std::to_string(d.in) + ", out=" + std::to_string(d.out) + " (x=" + ShapeString(x) +
        ", dy=" + ShapeString(dy) + ")");
  }
  if (workspace->element_type() != ffi::DataType::U8 ||
      static_cast<int64_t>(workspace->size_bytes()) <= kScratchAlignment) {
    return ffi::Error::InvalidArgument(
        std::string(kOp) + ": the workspace result must be a uint8 buffer of more than 256 "
        "bytes, got " + ShapeString(*workspace));
  }
  float* acc_out = static_cast<float*>(result->untyped_data());
  const bool staged =
      index != nullptr ||
      reinterpret_cast<uintptr_t>(acc_out + d.offset) % kMinPointerAlignment != 0;
  const ScratchLayout layout = LayoutOf(d, staged);
  if (scratch->element_type() != ffi::DataType::U8 ||
      static_cast<int64_t>(scratch->size_bytes()) < layout.bytes + kScratchAlignment) {
    return ffi::Error::InvalidArgument(
        std::string(kOp) + ": the scratch result must be uint8 of at least " +
        std::to_string(layout.bytes + kScratchAlignment) + " bytes (transposed operands" +
        (staged ? ", staging of a block not 16-byte aligned" : "") + "), got " +
        ShapeString(*scratch));
  }
  if (result->untyped_data() != acc.untyped_data()) {
    if (cudaError_t e = cudaMemcpyAsync(result->untyped_data(), acc.untyped_data(),
                                        acc.size_bytes(), cudaMemcpyDeviceToDevice, stream);
        e != cudaSuccess) {
      return CudaError("cudaMemcpyAsync", e);
    }
  }
  if (d.tokens == 0 || d.in == 0 || d.out == 0) return ffi::Error::Success();
  auto handle = GetLtHandleInExecute(device);
  if (handle.has_error()) return handle.error();

  char* base = AlignedStart(scratch->untyped_data());
  auto* xt = reinterpret_cast<uint8_t*>(base + layout.xt);
  auto* dyt = reinterpret_cast<uint8_t*>(base + layout.dyt);
  float* slot = reinterpret_cast<float*>(base + layout.staging);
  const int64_t block = d.out * d.in;
  const dim3 tile_threads(32, 8);
  TransposeBytesKernel<<<GridFor(d.tokens * d.in, 32 * 32), tile_threads, 0, stream>>>(
      static_cast<const uint8_t*>(x.untyped_data()), xt, d.tokens, d.in);
  TransposeBytesKernel<<<GridFor(d.tokens * d.out, 32 * 32), tile_threads, 0, stream>>>(
      static_cast<const uint8_t*>(dy.untyped_data()), dyt, d.tokens, d.out);
  const BlockPosition at = index != nullptr ? position : BlockPosition{d.offset, 0};
  if (staged) {
    StageBlockKernel<true><<<GridFor(block, kThreads), kThreads, 0, stream>>>(
        index, at, d.max_offset, acc_out, slot, block);
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return CudaError("launching the transpose / staging kernels", e);
  }
  const auto workspace_base = reinterpret_cast<uintptr_t>(workspace->untyped_data());
  char* workspace_start = AlignedStart(workspace->untyped_data());
  const Fp8Gemm gemm{xt,
                     dyt,
                     dy.element_type() == ffi::DataType::F8E5M2 ? CUDA_R_8F_E5M2
                                                                : CUDA_R_8F_E4M3,
                     static_cast<const float*>(x_scale_inv.untyped_data()),
                     static_cast<const float*>(dy_scale_inv.untyped_data()),
                     staged ? slot : acc_out + d.offset,
                     workspace_start,
                     workspace->size_bytes() -
                         (reinterpret_cast<uintptr_t>(workspace_start) - workspace_base)};
  if (ffi::Error err = RunFp8Gemm(stream, *handle, d, gemm); err.failure()) return err;
  if (staged) {
    StageBlockKernel<false><<<GridFor(block, kThreads), kThreads, 0, stream>>>(
        index, at, d.max_offset, acc_out, slot, block);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
      return CudaError("launching the staging copy-back kernel", e);
    }
  }
  return ffi::Error::Success();
}

ffi::Error Fp8WgradCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                            ffi::AnyBuffer dy, ffi::AnyBuffer acc, ffi::AnyBuffer x_scale_inv,
                            ffi::AnyBuffer dy_scale_inv, ffi::Result<ffi::AnyBuffer> result,
                            ffi::Result<ffi::AnyBuffer> workspace,
                            ffi::Result<ffi::AnyBuffer> scratch, int64_t offset) {
  return Guarded(kOp, [&] {
    WgradDims d;
    if (ffi::Error err = CheckFp8WgradArgs(x, dy, acc, x_scale_inv, dy_scale_inv, *result,
                                           offset, /*flat_only=*/false, &d);
        err.failure()) {
      return err;
    }
    return Fp8WgradCudaRun(stream, device, d, nullptr, BlockPosition{}, x, dy, acc,
                           x_scale_inv, dy_scale_inv, result, workspace, scratch);
  });
}

ffi::Error Fp8WgradAtCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                              ffi::AnyBuffer dy, ffi::AnyBuffer acc,
                              ffi::AnyBuffer x_scale_inv, ffi::AnyBuffer dy_scale_inv,
                              ffi::AnyBuffer index, ffi::Result<ffi::AnyBuffer> result,
                              ffi::Result<ffi::AnyBuffer> workspace,
                              ffi::Result<ffi::AnyBuffer> scratch, int64_t base,
                              int64_t stride) {
  return Guarded(kOp, [&] {
    WgradDims d;
    BlockPosition position;
    if (ffi::Error err = CheckFp8WgradAtArgs(x, dy, acc, x_scale_inv, dy_scale_inv, index,
                                             *result, base, stride, &d, &position);
        err.failure()) {
      return err;
    }
    return Fp8WgradCudaRun(stream, device, d, static_cast<const int32_t*>(index.untyped_data()),
                           position, x, dy, acc, x_scale_inv, dy_scale_inv, result, workspace,
                           scratch);
  });
}

// Initialize stage: the cuBLASLt handle of the call's device, outside any capture.
ffi::Error Fp8WgradCudaInitializeImpl(int32_t device) {
  return Guarded(kOp, [&]() -> ffi::Error {
    auto handle = GetLtHandle(device, /*create=*/true);
    if (handle.has_error()) return handle.error();
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8WgradAccumulateCudaInitialize, Fp8WgradCudaInitializeImpl,
                              ffi::Ffi::BindInitialize()
                                  .Ctx<ffi::DeviceOrdinal>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8WgradAccumulateCuda, Fp8WgradCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()  // XLA's device of the call
                                  .Arg<ffi::AnyBuffer>()   // x            f8e4m3fn [T, in]
                                  .Arg<ffi::AnyBuffer>()   // dy           f8e4m3fn/e5m2 [T, out]
                                  .Arg<ffi::AnyBuffer>()   // main_grad    f32 [out, in] / [N]
                                  .Arg<ffi::AnyBuffer>()   // x_scale_inv  f32 [] or [1]
                                  .Arg<ffi::AnyBuffer>()   // dy_scale_inv f32 [] or [1]
                                  .Ret<ffi::AnyBuffer>()   // main_grad    (aliased)
                                  .Ret<ffi::AnyBuffer>()   // cuBLASLt workspace, uint8
                                  .Ret<ffi::AnyBuffer>()   // x^T, dy^T (, staging), uint8
                                  .Attr<int64_t>("offset"),  // block start (flat)
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8WgradAccumulateAtCuda, Fp8WgradAtCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()  // XLA's device of the call
                                  .Arg<ffi::AnyBuffer>()   // x            f8e4m3fn [T, in]
                                  .Arg<ffi::AnyBuffer>()   // dy           f8e4m3fn/e5m2 [T, out]
                                  .Arg<ffi::AnyBuffer>()   // main_grad    f32 [N] (flat)
                                  .Arg<ffi::AnyBuffer>()   // x_scale_inv  f32 [] or [1]
                                  .Arg<ffi::AnyBuffer>()   // dy_scale_inv f32 [] or [1]
                                  .Arg<ffi::AnyBuffer>()   // index        int32 [], device
                                  .Ret<ffi::AnyBuffer>()   // main_grad    (aliased)
                                  .Ret<ffi::AnyBuffer>()   // cuBLASLt workspace, uint8
                                  .Ret<ffi::AnyBuffer>()   // x^T, dy^T, staging, uint8
                                  .Attr<int64_t>("base")     // block at base + index *
                                  .Attr<int64_t>("stride"),  // stride, int64, clamped
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_wgrad
