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
//   creates the cuBLAS handle of the call's device (XLA's device ordinal), with that device
//   current.
// * execute: only enqueues work on XLA's stream (a copy when XLA did not alias, the
//   GEMM), so it may be captured into a CUDA graph: the handler declares the
//   command-buffer trait and XLA records it into its command buffers instead of launching
//   it on its own. cuBLAS is given its workspace explicitly, so it allocates nothing while
//   captured.
// cuBLAS handles are kept per device for the process lifetime (like XLA's own), guarded
// by a mutex because the stream and workspace are set per call (cublasSetStream resets
// the workspace, so it is set after). Every error is returned as an FFI error, never
// thrown.
//
// jax_wgrad_wgrad_accumulate_at: the block sits at the position base + index * stride,
// base and stride int64 attributes, the index an int32 operand in DEVICE memory (traced in
// JAX, e.g. the layer of a scan over stacked layers). The index is never copied to the
// host (that would be a synchronization per call and break CUDA-graph capture); instead,
// all on XLA's stream:
//   1. a set-up kernel reads the indices, computes each position in int64 and clamps it
//      into [0, N - G * out * in] (XLA DynamicUpdateSlice's rule: BlockPosition::Clamped)
//      and writes, per problem i (batch element x group), the pointers A[i] = x_i,
//      B[i] = dy_i, C[i] = its block of the accumulator into the `pointers` result (device
//      memory, as cublasGemmBatchedEx requires of its pointer arrays; the scalars
//      alpha = beta = 1 stay host values, the handle's default CUBLAS_POINTER_MODE_HOST);
//   2. cublasGemmBatchedEx over the P problems, beta = 1, the compute type and data types
//      of the strided handler (the same supported combinations).
// Alignment: with 16-bit inputs or TF32 the cuBLAS docs require the matrix pointers of a
// pointer-array GEMM to be "properly aligned" (ideally 16 bytes; at least 16 when
// k % 8 == 0, 4 when k % 2 == 0), because cuBLAS cannot see them when it picks a
// kernel. x_i and dy_i are checked on the host (XLA's buffers are aligned and
// x_i = x + i * T * in elements). A block at a traced offset may start anywhere, so the
// set-up kernel tests each C pointer: a block that is not 16-byte aligned is copied into
// the `staging` result (16-byte aligned slots), accumulated there and copied back by two
// small kernels that do nothing for an aligned block. An aligned block (offsets that are
// multiples of 4 fp32 elements, as bucket layouts give) is updated in place.
// Provably aligned positions: when base, stride, the block (out * in) and N are multiples
// of 16 bytes, every clamped position is (jax_wgrad/ops/position.py: provably_aligned, the
// same rule); the lowering then sizes `staging` to 0 elements, and the handler, after
// checking that rule and the accumulator's own 16-byte alignment on the host, launches no
// staging kernels at all.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
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

// Checks shared by both targets once the operands are validated: the workspace result,
// cuBLAS's 32-bit sizes. Then starts `result` from `acc` when XLA did not alias them.
ffi::Error Prologue(cudaStream_t stream, const WgradDims& d, const ffi::AnyBuffer& acc,
                    ffi::Result<ffi::AnyBuffer>& result,
                    ffi::Result<ffi::AnyBuffer>& workspace) {
  if (workspace->element_type() != ffi::DataType::U8 ||
      workspace->size_bytes() <= kWorkspaceAlignment) {
    return ffi::Error::InvalidArgument(
        "wgrad_accumulate: the workspace result must be a uint8 buffer of more than 256 "
        "bytes, got " + ShapeString(*workspace));
  }
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  if (d.tokens > kMaxInt || d.in > kMaxInt || d.out > kMaxInt || d.batch > kMaxInt ||
      d.groups > kMaxInt || d.batch * d.groups > kMaxInt) {
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
  return ffi::Error::Success();
}

bool Empty(const WgradDims& d) {
  return d.batch == 0 || d.groups == 0 || d.tokens == 0 || d.in == 0 || d.out == 0;
}

// Runs gemms(handle) with `device`'s cuBLAS handle (XLA's device ordinal of the call,
// from the execution context: cudaStreamGetDevice is not allowed while XLA captures the
// stream into a CUDA graph) set to XLA's stream and to
// the workspace result (aligned up to 256 bytes; the result has 256 bytes of slack),
// under the handle's mutex. `gemms` returns the status of its last cuBLAS call.
template <typename Gemms>
ffi::Error WithCublas(cudaStream_t stream, int device, ffi::Result<ffi::AnyBuffer>& workspace,
                      const char* what, Gemms gemms) {
  auto entry = GetHandleInExecute(device);
  if (entry.has_error()) return entry.error();
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
  if (cublasStatus_t s = gemms(h); s != CUBLAS_STATUS_SUCCESS) return CublasError(what, s);
  return ffi::Error::Success();
}

// The GEMM of every problem, in cuBLAS's column-major terms: row-major C[out, in] is
// column-major C^T[in, out] = x^T[in, T] @ dy[T, out]: A = x as column-major [in, T] (no
// transpose), B = dy as column-major [out, T] (transposed), ldc = in.
struct GemmShape {
  int m, n, k;
  cudaDataType_t in_t, acc_t;
  cublasComputeType_t compute;
};

GemmShape ShapeOf(const WgradDims& d, const ffi::AnyBuffer& x, const ffi::AnyBuffer& acc) {
  return GemmShape{static_cast<int>(d.in), static_cast<int>(d.out), static_cast<int>(d.tokens),
                   CudaType(x.element_type()), CudaType(acc.element_type()),
                   ComputeType(x.element_type(), d.precision)};
}

ffi::Error WgradAccumulateCudaBody(cudaStream_t stream, int32_t device,
    ffi::AnyBuffer x, ffi::AnyBuffer dy,
                                   ffi::AnyBuffer acc, ffi::Result<ffi::AnyBuffer> result,
                                   ffi::Result<ffi::AnyBuffer> workspace, int64_t offset,
                                   int32_t precision) {
  WgradDims d;
  if (ffi::Error err = CheckWgradArgs(x, dy, acc, *result, offset, precision, &d);
      err.failure()) {
    return err;
  }
  if (ffi::Error err = Prologue(stream, d, acc, result, workspace); err.failure()) return err;
  if (Empty(d)) return ffi::Error::Success();
  const float alpha = 1.0f, beta = 1.0f;
  const GemmShape g = ShapeOf(d, x, acc);
  const int64_t in_bytes = ffi::ByteWidth(x.element_type());
  const int64_t acc_bytes = ffi::ByteWidth(acc.element_type());
  // One strided-batched GEMM over `count` problems from element index `first` of x / dy
  // (problems are [T, in] / [T, out] back to back), accumulators `stride_c` elements apart.
  auto gemm = [&](cublasHandle_t h, int64_t first, int64_t acc_offset, int64_t count,
                  int64_t stride_c) {
    return cublasGemmStridedBatchedEx(
        h, CUBLAS_OP_N, CUBLAS_OP_T, g.m, g.n, g.k, &alpha,
        static_cast<const char*>(x.untyped_data()) + first * d.tokens * d.in * in_bytes,
        g.in_t, g.m, d.tokens * d.in,
        static_cast<const char*>(dy.untyped_data()) + first * d.tokens * d.out * in_bytes,
        g.in_t, g.n, d.tokens * d.out, &beta,
        static_cast<char*>(result->untyped_data()) + acc_offset * acc_bytes, g.acc_t, g.m,
        stride_c, static_cast<int>(count), g.compute, CUBLAS_GEMM_DEFAULT);
  };
  return WithCublas(stream, device, workspace, "cublasGemmStridedBatchedEx",
                    [&](cublasHandle_t h) {
    if (d.groups == 1) {  // batch elements' blocks are acc_stride apart: one call
      return gemm(h, 0, d.offset, d.batch, d.acc_stride);
    }
    // Grouped (experts): one call per batch element over its G back-to-back blocks.
    for (int64_t b = 0; b < d.batch; ++b) {
      if (cublasStatus_t s = gemm(h, b * d.groups, d.AccOffset(b, 0), d.groups, d.out * d.in);
          s != CUBLAS_STATUS_SUCCESS) {
        return s;
      }
    }
    return CUBLAS_STATUS_SUCCESS;
  });
}

// --- operand offset (jax_wgrad_wgrad_accumulate_at) ------------------------------------
constexpr uintptr_t kGemmPointerAlignment = 16;  // the cuBLAS docs' "ideally 16 bytes"
constexpr int kThreads = 256;

// Where the problems of one call live; P = batch * groups problems, problem i is batch
// element i / groups, group i % groups.
struct AtProblems {
  const int32_t* index;    // [batch] indices of the block positions (device memory)
  BlockPosition position;  // block of batch element b at position.Clamped(index[b], ...)
  int64_t problems, groups, max_offset, acc_stride, block;  // elements
  const char* x;           // problem i's x at x + i * x_step bytes
  const char* dy;          // problem i's dy at dy + i * dy_step bytes
  int64_t x_step, dy_step;
  char* acc;               // the result (aliased accumulator)
  char* staging;           // problem i's 16-byte aligned slot at staging + i * staging_step
  int64_t staging_step, acc_bytes;
};

// The pointers result, 4 arrays of P: A, B, C of cublasGemmBatchedEx, and the block to
// stage (nullptr: aligned, accumulated in place).
struct AtPointers {
  const void** a;
  const void** b;
  void** c;
  void** staged;
};

// Step 1: clamp every position, write the GEMM pointers, route unaligned blocks to staging
// (never taken when the positions are provably aligned: then p.staging may be empty).
__global__ void PrepareAtKernel(AtProblems p, AtPointers out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < p.problems; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t batch = i / p.groups, group = i % p.groups;
    const int64_t offset = p.position.Clamped(p.index[batch], p.max_offset);
    char* block = p.acc + (batch * p.acc_stride + offset + group * p.block) * p.acc_bytes;
    const bool aligned = reinterpret_cast<uintptr_t>(block) % kGemmPointerAlignment == 0;
    out.a[i] = p.x + i * p.x_step;
    out.b[i] = p.dy + i * p.dy_step;
    out.c[i] = aligned ? block : p.staging + i * p.staging_step;
    out.staged[i] = aligned ? nullptr : block;
  }
}

// Steps 0 and 3 for unaligned blocks only: staging slot <- block (kIn) or block <- slot,
// in 2-byte units (every accumulator dtype is a multiple of 2 bytes).
template <bool kIn>
__global__ void StageKernel(void* const* staged, char* staging, int64_t problems,
                            int64_t units, int64_t staging_step) {
  for (int64_t i = blockIdx.y; i < problems; i += gridDim.y) {
    auto* block = static_cast<uint16_t*>(staged[i]);
    if (block == nullptr) continue;  // aligned: accumulated in place
    auto* slot = reinterpret_cast<uint16_t*>(staging + i * staging_step);
    for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < units;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      if (kIn) {
        slot[j] = block[j];
      } else {
        block[j] = slot[j];
      }
    }
  }
}

// The pointer alignment the cuBLAS docs ask of a pointer-array GEMM with k = `tokens`
// (1: no requirement: full-fp32 compute of fp32 inputs).
uintptr_t RequiredAlignment(const WgradDims& d, ffi::DataType in_t) {
  const bool fast = in_t != ffi::DataType::F32 || d.precision != Precision::kHighest;
  if (!fast) return 1;
  return d.tokens % 8 == 0 ? 16 : (d.tokens % 2 == 0 ? 4 : 1);
}

// Whether every block the position can address starts 16 bytes after an aligned buffer
// start whatever the index: base, stride, the block and N multiples of 16 bytes (the rule
// of jax_wgrad/ops/position.py: provably_aligned, by which the lowering sizes staging).
bool ProvablyAligned(const BlockPosition& position, const WgradDims& d, int64_t acc_bytes) {
  const int64_t unit = static_cast<int64_t>(kGemmPointerAlignment) / acc_bytes;
  return position.base % unit == 0 && position.stride % unit == 0 &&
         (d.out * d.in) % unit == 0 && d.acc_stride % unit == 0;
}

ffi::Error WgradAccumulateAtCudaBody(cudaStream_t stream, int32_t device,
    ffi::AnyBuffer x, ffi::AnyBuffer dy,
                                     ffi::AnyBuffer acc, ffi::AnyBuffer offset,
                                     ffi::Result<ffi::AnyBuffer> result,
                                     ffi::Result<ffi::AnyBuffer> workspace,
                                     ffi::Result<ffi::AnyBuffer> pointers,
                                     ffi::Result<ffi::AnyBuffer> staging, int64_t base,
                                     int64_t stride, int32_t precision) {
  WgradDims d;
  BlockPosition position;
  if (ffi::Error err = CheckWgradAtArgs(x, dy, acc, *result, offset, base, stride, precision,
                                        &d, &position);
      err.failure()) {
    return err;
  }
  const int64_t problems = d.batch * d.groups;
  const int64_t acc_bytes = ffi::ByteWidth(acc.element_type());
  const int64_t in_bytes = ffi::ByteWidth(x.element_type());
  const int64_t block_bytes = d.out * d.in * acc_bytes;
  const int64_t staging_step =
      (block_bytes + kGemmPointerAlignment - 1) / kGemmPointerAlignment * kGemmPointerAlignment;
  if (ffi::Error err = Prologue(stream, d, acc, result, workspace); err.failure()) return err;
  if (Empty(d)) return ffi::Error::Success();  // no GEMM: pointers and staging unused
  // No staging result: every block must be aligned by construction (file comment).
  const bool unstaged = staging->size_bytes() == 0;
  if (pointers->element_type() != ffi::DataType::U8 ||
      static_cast<int64_t>(pointers->size_bytes()) < 4 * problems * 8 ||
      staging->element_type() != acc.element_type() ||
      (!unstaged && static_cast<int64_t>(staging->size_bytes()) < problems * staging_step)) {
    return ffi::Error::InvalidArgument(
        "wgrad_accumulate: the pointers (uint8[" + std::to_string(4 * problems * 8) +
        "]) or staging (main_grad's dtype, " + std::to_string(problems * staging_step) +
        " bytes, or none for provably aligned blocks) result is too small: pointers=" +
        ShapeString(*pointers) + ", staging=" + ShapeString(*staging));
  }
  if (unstaged && (!ProvablyAligned(position, d, acc_bytes) ||
                   reinterpret_cast<uintptr_t>(result->untyped_data()) %
                           kGemmPointerAlignment != 0)) {
    return ffi::Error::InvalidArgument(
        "wgrad_accumulate: without a staging result every block must be 16-byte aligned: "
        "base (" + std::to_string(base) + "), stride (" + std::to_string(stride) +
        "), out * in and N multiples of 16 bytes and main_grad 16-byte aligned (main_grad=" +
        ShapeString(acc) + ")");
  }

  const int64_t x_step = d.tokens * d.in * in_bytes, dy_step = d.tokens * d.out * in_bytes;
  const uintptr_t need = RequiredAlignment(d, x.element_type());
  const auto misaligned = [need](const void* ptr, int64_t step) {
    return reinterpret_cast<uintptr_t>(ptr) % need != 0 || static_cast<uintptr_t>(step) % need;
  };
  if (misaligned(x.untyped_data(), x_step) || misaligned(dy.untyped_data(), dy_step)) {
    return ffi::Error::InvalidArgument(
        "wgrad_accumulate: x or dy is not aligned to " + std::to_string(need) +
        " bytes as cuBLAS's pointer-array GEMM needs (x=" + ShapeString(x) + ", dy=" +
        ShapeString(dy) + ")");
  }
  auto** slots = static_cast<void**>(pointers->untyped_data());
  const AtPointers out{const_cast<const void**>(slots), const_cast<const void**>(slots + problems),
                       slots + 2 * problems, slots + 3 * problems};
  const AtProblems p{static_cast<const int32_t*>(offset.untyped_data()), position, problems,
                     d.groups, d.max_offset, d.acc_stride, d.out * d.in,
                     static_cast<const char*>(x.untyped_data()),
                     static_cast<const char*>(dy.untyped_data()), x_step, dy_step,
                     static_cast<char*>(result->untyped_data()),
                     static_cast<char*>(staging->untyped_data()), staging_step, acc_bytes};
  const int64_t units = block_bytes / 2;
  const dim3 stage_grid(static_cast<unsigned>(std::min<int64_t>((units + kThreads - 1) / kThreads,
                                                                1024)),
                        static_cast<unsigned>(std::min<int64_t>(problems, 65535)));
  const unsigned prepare_blocks =
      static_cast<unsigned>(std::min<int64_t>((problems + kThreads - 1) / kThreads, 1024));

  PrepareAtKernel<<<prepare_blocks, kThreads, 0, stream>>>(p, out);
  if (!unstaged) {
    StageKernel<true><<<stage_grid, kThreads, 0, stream>>>(out.staged, p.staging, problems,
                                                           units, staging_step);
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return CudaError("launching the offset set-up kernels", e);
  }
  const float alpha = 1.0f, beta = 1.0f;
  const GemmShape g = ShapeOf(d, x, acc);
  if (ffi::Error err = WithCublas(stream, device, workspace, "cublasGemmBatchedEx",
                                  [&](cublasHandle_t h) {
        return cublasGemmBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_T, g.m, g.n, g.k, &alpha, out.a,
                                   g.in_t, g.m, out.b, g.in_t, g.n, &beta, out.c, g.acc_t, g.m,
                                   static_cast<int>(problems), g.compute, CUBLAS_GEMM_DEFAULT);
      });
      err.failure()) {
    return err;
  }
  if (unstaged) return ffi::Error::Success();
  StageKernel<false><<<stage_grid, kThreads, 0, stream>>>(out.staged, p.staging, problems,
                                                          units, staging_step);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return CudaError("launching the staging copy-back kernel", e);
  }
  return ffi::Error::Success();
}

ffi::Error WgradAccumulateAtCudaImpl(cudaStream_t stream, int32_t device,
    ffi::AnyBuffer x, ffi::AnyBuffer dy,
                                     ffi::AnyBuffer acc, ffi::AnyBuffer offset,
                                     ffi::Result<ffi::AnyBuffer> result,
                                     ffi::Result<ffi::AnyBuffer> workspace,
                                     ffi::Result<ffi::AnyBuffer> pointers,
                                     ffi::Result<ffi::AnyBuffer> staging, int64_t base,
                                     int64_t stride, int32_t precision) {
  return Guarded("wgrad_accumulate", [&] {
    return WgradAccumulateAtCudaBody(stream, device, x, dy, acc, offset, result, workspace, pointers,
                                     staging, base, stride, precision);
  });
}

ffi::Error WgradAccumulateCudaImpl(cudaStream_t stream, int32_t device,
    ffi::AnyBuffer x, ffi::AnyBuffer dy,
                                   ffi::AnyBuffer acc, ffi::Result<ffi::AnyBuffer> result,
                                   ffi::Result<ffi::AnyBuffer> workspace, int64_t offset,
                                   int32_t precision) {
  return Guarded("wgrad_accumulate", [&] {
    return WgradAccumulateCudaBody(stream, device, x, dy, acc, result, workspace, offset,
                                   precision);
  });
}

// Initialize stage: the cuBLAS handle of the call's device, outside any capture.
ffi::Error WgradAccumulateCudaInitializeImpl(int32_t device) {
  return Guarded("wgrad_accumulate", [&]() -> ffi::Error {
    auto entry = GetHandle(device, /*create=*/true);
    if (entry.has_error()) return entry.error();
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WgradAccumulateCudaInitialize,
                              WgradAccumulateCudaInitializeImpl,
                              ffi::Ffi::BindInitialize()
                                  .Ctx<ffi::DeviceOrdinal>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(WgradAccumulateCuda, WgradAccumulateCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()  // XLA's device of the call
                                  .Arg<ffi::AnyBuffer>()   // x          [..., T, in]
                                  .Arg<ffi::AnyBuffer>()   // dy         [..., T, out]
                                  .Arg<ffi::AnyBuffer>()   // main_grad  [..., out, in]
                                  .Ret<ffi::AnyBuffer>()   // main_grad  (aliased)
                                  .Ret<ffi::AnyBuffer>()   // cuBLAS workspace, uint8
                                  .Attr<int64_t>("offset")       // block start (flat)
                                  .Attr<int32_t>("precision"),   // 0/1/2: TF32 unless 2
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(WgradAccumulateAtCuda, WgradAccumulateAtCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()  // XLA's device of the call
                                  .Arg<ffi::AnyBuffer>()   // x          [..., T, in]
                                  .Arg<ffi::AnyBuffer>()   // dy         [..., T, out]
                                  .Arg<ffi::AnyBuffer>()   // main_grad  [..., N] (flat)
                                  .Arg<ffi::AnyBuffer>()   // offset     int32 [...] index, device
                                  .Ret<ffi::AnyBuffer>()   // main_grad  (aliased)
                                  .Ret<ffi::AnyBuffer>()   // cuBLAS workspace, uint8
                                  .Ret<ffi::AnyBuffer>()   // GEMM pointer arrays, uint8
                                  .Ret<ffi::AnyBuffer>()   // staging of unaligned blocks / [0]
                                  .Attr<int64_t>("base")         // block at base + index *
                                  .Attr<int64_t>("stride")       // stride, int64, clamped
                                  .Attr<int32_t>("precision"),   // 0/1/2: TF32 unless 2
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_wgrad
