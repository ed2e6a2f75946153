// Shared argument checking for the bucket_add FFI handlers (CPU and CUDA).
//
// Operation: for every gradient k,
//   bucket[offsets[k] : offsets[k] + size(grad_k)] += grad_k   (flattened, row-major)
// in the bucket's dtype, computed in fp32. The result aliases the bucket: every
// parameter's gradient touches only its own block of a flat gradient bucket (Megatron's
// `param.main_grad.add_(param.grad)`), so the update is in place whatever the backend.
#ifndef JAX_WGRAD_FFI_BUCKET_ADD_H_
#define JAX_WGRAD_FFI_BUCKET_ADD_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace jax_wgrad {

// One gradient's block: `n` elements of dtype `dtype` at `src`, added at `offset`.
struct BucketSegment {
  const void* src = nullptr;
  int64_t offset = 0;
  int64_t n = 0;
  ffi::DataType dtype = ffi::DataType::F32;
};

// Validates the bucket, the gradients and their offsets; fills `segments` (empty
// gradients are dropped). Returns an InvalidArgument error naming the offending operand.
inline ffi::Error CheckBucketAddArgs(const ffi::AnyBuffer& bucket,
                                     const ffi::RemainingArgs& grads,
                                     const ffi::AnyBuffer& out,
                                     ffi::Span<const int64_t> offsets,
                                     std::vector<BucketSegment>* segments) {
  if (bucket.dimensions().size() != 1 || !IsSupportedFloat(bucket.element_type())) {
    return ffi::Error::InvalidArgument(
        "bucket_add: the bucket must be a flat float32, bfloat16 or float16 array, got " +
        ShapeString(bucket));
  }
  if (out.element_type() != bucket.element_type() ||
      out.element_count() != bucket.element_count()) {
    return ffi::Error::InvalidArgument(
        "bucket_add: result must have the bucket's shape and dtype (bucket=" +
        ShapeString(bucket) + ", result=" + ShapeString(out) + ")");
  }
  if (offsets.size() != grads.size()) {
    return ffi::Error::InvalidArgument(
        "bucket_add: " + std::to_string(offsets.size()) + " offsets for " +
        std::to_string(grads.size()) + " gradients");
  }
  const int64_t numel = static_cast<int64_t>(bucket.element_count());
  segments->clear();
  for (size_t k = 0; k < grads.size(); ++k) {
    ffi::ErrorOr<ffi::AnyBuffer> g = grads.get<ffi::AnyBuffer>(k);
    if (g.has_error()) return g.error();
    // Error text is only formatted on the error path: this runs per gradient per call.
    auto where = [&] {
      return "bucket_add: gradient " + std::to_string(k) + " (" + ShapeString(*g) +
             " at offset " + std::to_string(offsets[k]) + ")";
    };
    if (!IsSupportedFloat(g->element_type())) {
      return ffi::Error::InvalidArgument(where() +
                                         " must be float32, bfloat16 or float16");
    }
    const int64_t n = static_cast<int64_t>(g->element_count());
    if (offsets[k] < 0 || offsets[k] > numel - n) {
      return ffi::Error::InvalidArgument(where() + " does not fit in the bucket of " +
                                         std::to_string(numel) + " elements");
    }
    if (n > 0) segments->push_back({g->untyped_data(), offsets[k], n, g->element_type()});
  }
  // Disjoint blocks (no races, no double counting). The library emits them in ascending
  // order, so the sort (of a copy) only happens for callers that do not.
  auto before = [](const BucketSegment& a, const BucketSegment& b) {
    return a.offset < b.offset;
  };
  const std::vector<BucketSegment>* ordered = segments;
  std::vector<BucketSegment> sorted;
  if (!std::is_sorted(segments->begin(), segments->end(), before)) {
    sorted = *segments;
    std::sort(sorted.begin(), sorted.end(), before);
    ordered = &sorted;
  }
  for (size_t k = 1; k < ordered->size(); ++k) {
    const BucketSegment& a = (*ordered)[k - 1];
    const BucketSegment& b = (*ordered)[k];
    if (a.offset + a.n > b.offset) {
      return ffi::Error::InvalidArgument("bucket_add: the blocks at offsets " +
                                         std::to_string(a.offset) + " and " +
                                         std::to_string(b.offset) + " overlap");
    }
  }
  return ffi::Error::Success();
}

}  // namespace jax_wgrad

#endif  // JAX_WGRAD_FFI_BUCKET_ADD_H_
