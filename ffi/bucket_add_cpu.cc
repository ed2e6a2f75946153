// CPU handler of the jax_wgrad_bucket_add FFI target (see bucket_add.h):
//   bucket[offset_k : offset_k + n_k] += grad_k   for every gradient k, in place.
#include <cstdint>
#include <cstring>
#include <vector>

#include "bucket_add.h"
#include "common.h"
#include "convert_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace jax_wgrad {
namespace {

template <typename Acc, typename G>
void AddSegment(Acc* bucket, const BucketSegment& s) {
  const G* g = static_cast<const G*>(s.src);
  Acc* b = bucket + s.offset;
  for (int64_t i = 0; i < s.n; ++i) b[i] = FromFloat<Acc>(ToFloat(b[i]) + ToFloat(g[i]));
}

template <typename Acc>
void AddSegments(Acc* bucket, const std::vector<BucketSegment>& segments) {
  using DT = ffi::DataType;
  for (const BucketSegment& s : segments) {
    switch (s.dtype) {
      case DT::F32: AddSegment<Acc, float>(bucket, s); break;
      case DT::BF16: AddSegment<Acc, Bf16>(bucket, s); break;
      default: AddSegment<Acc, F16>(bucket, s); break;  // F16 (checked)
    }
  }
}

ffi::Error BucketAddCpuBody(ffi::AnyBuffer bucket, ffi::RemainingArgs grads,
                            ffi::Result<ffi::AnyBuffer> result,
                            ffi::Span<const int64_t> offsets) {
  std::vector<BucketSegment> segments;
  if (ffi::Error err = CheckBucketAddArgs(bucket, grads, *result, offsets, &segments);
      err.failure()) {
    return err;
  }
  // When XLA could not alias (the bucket was not donated), start from a copy.
  if (result->untyped_data() != bucket.untyped_data()) {
    std::memcpy(result->untyped_data(), bucket.untyped_data(), bucket.size_bytes());
  }
  using DT = ffi::DataType;
  switch (bucket.element_type()) {
    case DT::F32: AddSegments(static_cast<float*>(result->untyped_data()), segments); break;
    case DT::BF16: AddSegments(static_cast<Bf16*>(result->untyped_data()), segments); break;
    default: AddSegments(static_cast<F16*>(result->untyped_data()), segments); break;
  }
  return ffi::Error::Success();
}

ffi::Error BucketAddCpuImpl(ffi::AnyBuffer bucket, ffi::RemainingArgs grads,
                            ffi::Result<ffi::AnyBuffer> result,
                            ffi::Span<const int64_t> offsets) {
  return Guarded("bucket_add",
                 [&] { return BucketAddCpuBody(bucket, grads, result, offsets); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BucketAddCpu, BucketAddCpuImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // bucket   [N]
                                  .RemainingArgs()        // grads    any shapes
                                  .Ret<ffi::AnyBuffer>()  // bucket   (aliased)
                                  .Attr<ffi::Span<const int64_t>>("offsets"));

}  // namespace jax_wgrad
