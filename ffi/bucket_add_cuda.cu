// CUDA handler of the jax_wgrad_bucket_add FFI target (see bucket_add.h):
//   bucket[offset_k : offset_k + n_k] += grad_k   for every gradient k, in place,
// on the stream XLA passes in. One kernel launch per group of up to kMaxSegments
// gradients: the segment table travels by value as a kernel parameter (no device copy
// of pointers), blockIdx.y picks the segment and a grid-stride loop covers it. Blocks
// are disjoint (checked), so there are no races. Only the blocks are read and written:
// the cost is proportional to the gradients, not to the bucket. The handler only enqueues
// stream work (a copy when XLA did not alias, the kernels), so it declares the
// command-buffer trait: XLA may capture it into a CUDA graph with its neighbours.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "bucket_add.h"
#include "common.h"
#include "convert_cuda.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_wgrad {
namespace {

constexpr int kMaxSegments = 32;  // 32 x 32 bytes of kernel parameters
constexpr int kThreads = 256;
constexpr int kMaxBlocksPerSegment = 1024;

enum class Elem : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct DeviceSegment {
  const void* src;
  int64_t offset;
  int64_t n;
  Elem elem;
};

struct SegmentTable {
  DeviceSegment seg[kMaxSegments];
};

__device__ __forceinline__ float LoadAsFloat(const void* p, Elem e, int64_t i) {
  switch (e) {
    case Elem::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case Elem::kF16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}


template <typename Acc>
__global__ void BucketAddKernel(Acc* bucket, SegmentTable table) {
  const DeviceSegment s = table.seg[blockIdx.y];
  Acc* dst = bucket + s.offset;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < s.n;
       i += stride) {
    dst[i] = FromF<Acc>(ToF(dst[i]) + LoadAsFloat(s.src, s.elem, i));
  }
}

Elem ElemOf(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return Elem::kBF16;
    case ffi::DataType::F16: return Elem::kF16;
    default: return Elem::kF32;
  }
}

template <typename Acc>
cudaError_t Launch(cudaStream_t stream, void* bucket,
                   const std::vector<BucketSegment>& segments) {
  for (size_t first = 0; first < segments.size(); first += kMaxSegments) {
    const size_t count = std::min<size_t>(kMaxSegments, segments.size() - first);
    SegmentTable table{};
    int64_t longest = 0;
    for (size_t k = 0; k < count; ++k) {
      const BucketSegment& s = segments[first + k];
      table.seg[k] = {s.src, s.offset, s.n, ElemOf(s.dtype)};
      longest = std::max(longest, s.n);
    }
    const int64_t blocks =
        std::min<int64_t>(kMaxBlocksPerSegment, (longest + kThreads - 1) / kThreads);
    BucketAddKernel<Acc><<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(count)),
                           kThreads, 0, stream>>>(static_cast<Acc*>(bucket), table);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

ffi::Error BucketAddCudaBody(cudaStream_t stream, ffi::AnyBuffer bucket,
                             ffi::RemainingArgs grads, ffi::Result<ffi::AnyBuffer> result,
                             ffi::Span<const int64_t> offsets) {
  std::vector<BucketSegment> segments;
  if (ffi::Error err = CheckBucketAddArgs(bucket, grads, *result, offsets, &segments);
      err.failure()) {
    return err;
  }
  if (result->untyped_data() != bucket.untyped_data()) {
    if (cudaError_t e = cudaMemcpyAsync(result->untyped_data(), bucket.untyped_data(),
                                        bucket.size_bytes(), cudaMemcpyDeviceToDevice,
                                        stream);
        e != cudaSuccess) {
      return ffi::Error::Internal(std::string("bucket_add: cudaMemcpyAsync failed: ") +
                                  cudaGetErrorString(e));
    }
  }
  if (segments.empty()) return ffi::Error::Success();
  cudaError_t e;
  switch (bucket.element_type()) {
    case ffi::DataType::F32:
      e = Launch<float>(stream, result->untyped_data(), segments);
      break;
    case ffi::DataType::BF16:
      e = Launch<__nv_bfloat16>(stream, result->untyped_data(), segments);
      break;
    default:
      e = Launch<__half>(stream, result->untyped_data(), segments);
      break;
  }
  if (e != cudaSuccess) {
    return ffi::Error::Internal(std::string("bucket_add: kernel launch failed: ") +
                                cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

ffi::Error BucketAddCudaImpl(cudaStream_t stream, ffi::AnyBuffer bucket,
                             ffi::RemainingArgs grads, ffi::Result<ffi::AnyBuffer> result,
                             ffi::Span<const int64_t> offsets) {
  return Guarded("bucket_add", [&] {
    return BucketAddCudaBody(stream, bucket, grads, result, offsets);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BucketAddCuda, BucketAddCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // bucket   [N]
                                  .RemainingArgs()        // grads    any shapes
                                  .Ret<ffi::AnyBuffer>()  // bucket   (aliased)
                                  .Attr<ffi::Span<const int64_t>>("offsets"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_wgrad
