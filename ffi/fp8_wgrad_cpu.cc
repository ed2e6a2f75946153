// CPU handlers of the jax_wgrad_fp8_wgrad_accumulate(_at) FFI targets (fp8_wgrad.h):
//   main_grad[out, in] += (dy_scale_inv * dy[T, out])^T @ (x_scale_inv * x[T, in])
// in place when XLA aliases the buffer; the block at a static `offset` of a flat buffer, or
// at the clamped position base + index * stride (the index read from host memory).
// Dequantization as the plain-XLA reference does it: each fp8 value converted to float
// exactly (convert_cpu.h), times its float32 scale_inv (one fp32 rounding), kTokenBlock
// tokens at a time into bounded temporaries; then the f32 GEMM path of the bf16 op
// (gemm_cpu.h: BLAS sgemm tiles on XLA's intra-op pool, beta = 1 into the accumulator).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cblas.h"  // scipy-openblas32: blasint
#include "common.h"
#include "convert_cpu.h"
#include "fp8_wgrad.h"
#include "gemm_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace jax_wgrad {
namespace {

// dst[0, n) = scale * float(src[0, n)), in parallel parts.
template <typename T>
void ParallelDequantize(ffi::ThreadPool* pool, const T* src, float scale, float* dst,
                        int64_t n) {
  ParallelConvert(pool, n, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = scale * ToFloat(src[i]);
  });
}

// c[out, in] += (sg * dy)^T (sx * x), kTokenBlock tokens per GEMM.
template <typename Dy>
void Accumulate(ffi::ThreadPool* pool, const WgradDims& d, const F8E4M3* x, float sx,
                const Dy* dy, float sg, float* c) {
  const int64_t block = std::min<int64_t>(kTokenBlock, d.tokens);
  std::vector<float> xs(block * d.in), gs(block * d.out);
  for (int64_t t0 = 0; t0 < d.tokens; t0 += block) {
    const int64_t tb = std::min(block, d.tokens - t0);
    ParallelDequantize(pool, x + t0 * d.in, sx, xs.data(), tb * d.in);
    ParallelDequantize(pool, dy + t0 * d.out, sg, gs.data(), tb * d.out);
    const Gemm gemm{xs.data(), gs.data(), c, tb, d.in, d.out};
    RunGemms(pool, 1, gemm, [&](int64_t) { return gemm; });
  }
}

// The GEMMs of one validated call (either target), into the block at `offset`.
ffi::Error Fp8WgradCpuRun(ffi::ThreadPool* pool, const WgradDims& d, int64_t offset,
                          const ffi::AnyBuffer& x, const ffi::AnyBuffer& dy,
                          const ffi::AnyBuffer& acc, const ffi::AnyBuffer& x_scale_inv,
                          const ffi::AnyBuffer& dy_scale_inv,
                          ffi::Result<ffi::AnyBuffer>& result) {
  constexpr int64_t kMaxBlas = std::numeric_limits<blasint>::max();
  if (d.in > kMaxBlas || d.out > kMaxBlas) {
    return ffi::Error::InvalidArgument(
        "fp8_wgrad_accumulate: a dimension exceeds the 32-bit BLAS index range");
  }
  // When XLA could not alias (the accumulator was not donated), start from a copy.
  if (result->untyped_data() != acc.untyped_data()) {
    std::memcpy(result->untyped_data(), acc.untyped_data(), acc.size_bytes());
  }
  if (d.tokens == 0 || d.in == 0 || d.out == 0) return ffi::Error::Success();
  UseSingleThreadedBlas();
  const float sx = *static_cast<const float*>(x_scale_inv.untyped_data());
  const float sg = *static_cast<const float*>(dy_scale_inv.untyped_data());
  const auto* xt = static_cast<const F8E4M3*>(x.untyped_data());
  float* c = static_cast<float*>(result->untyped_data()) + offset;
  if (dy.element_type() == ffi::DataType::F8E5M2) {
    Accumulate(pool, d, xt, sx, static_cast<const F8E5M2*>(dy.untyped_data()), sg, c);
  } else {
    Accumulate(pool, d, xt, sx, static_cast<const F8E4M3*>(dy.untyped_data()), sg, c);
  }
  return ffi::Error::Success();
}

ffi::Error Fp8WgradCpuImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                           ffi::AnyBuffer acc, ffi::AnyBuffer x_scale_inv,
                           ffi::AnyBuffer dy_scale_inv, ffi::Result<ffi::AnyBuffer> result,
                           int64_t offset) {
  return Guarded("fp8_wgrad_accumulate", [&] {
    WgradDims d;
    if (ffi::Error err = CheckFp8WgradArgs(x, dy, acc, x_scale_inv, dy_scale_inv, *result,
                                           offset, /*flat_only=*/false, &d);
        err.failure()) {
      return err;
    }
    return Fp8WgradCpuRun(&pool, d, offset, x, dy, acc, x_scale_inv, dy_scale_inv, result);
  });
}

// Position: the index read from host memory, base + index * stride in int64, clamped.
ffi::Error Fp8WgradAtCpuImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                             ffi::AnyBuffer acc, ffi::AnyBuffer x_scale_inv,
                             ffi::AnyBuffer dy_scale_inv, ffi::AnyBuffer index,
                             ffi::Result<ffi::AnyBuffer> result, int64_t base,
                             int64_t stride) {
  return Guarded("fp8_wgrad_accumulate", [&] {
    WgradDims d;
    BlockPosition position;
    if (ffi::Error err = CheckFp8WgradAtArgs(x, dy, acc, x_scale_inv, dy_scale_inv, index,
                                             *result, base, stride, &d, &position);
        err.failure()) {
      return err;
    }
    const int64_t offset =
        position.Clamped(*static_cast<const int32_t*>(index.untyped_data()), d.max_offset);
    return Fp8WgradCpuRun(&pool, d, offset, x, dy, acc, x_scale_inv, dy_scale_inv, result);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8WgradAccumulateCpu, Fp8WgradCpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()  // XLA's intra-op pool
                                  .Arg<ffi::AnyBuffer>()   // x            f8e4m3fn [T, in]
                                  .Arg<ffi::AnyBuffer>()   // dy           f8e4m3fn/e5m2 [T, out]
                                  .Arg<ffi::AnyBuffer>()   // main_grad    f32 [out, in] / [N]
                                  .Arg<ffi::AnyBuffer>()   // x_scale_inv  f32 [] or [1]
                                  .Arg<ffi::AnyBuffer>()   // dy_scale_inv f32 [] or [1]
                                  .Ret<ffi::AnyBuffer>()   // main_grad    (aliased)
                                  .Attr<int64_t>("offset"));  // block start (flat)

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8WgradAccumulateAtCpu, Fp8WgradAtCpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()  // XLA's intra-op pool
                                  .Arg<ffi::AnyBuffer>()   // x            f8e4m3fn [T, in]
                                  .Arg<ffi::AnyBuffer>()   // dy           f8e4m3fn/e5m2 [T, out]
                                  .Arg<ffi::AnyBuffer>()   // main_grad    f32 [N] (flat)
                                  .Arg<ffi::AnyBuffer>()   // x_scale_inv  f32 [] or [1]
                                  .Arg<ffi::AnyBuffer>()   // dy_scale_inv f32 [] or [1]
                                  .Arg<ffi::AnyBuffer>()   // index        int32 []
                                  .Ret<ffi::AnyBuffer>()   // main_grad    (aliased)
                                  .Attr<int64_t>("base")     // block at base + index *
                                  .Attr<int64_t>("stride"));  // stride, int64, clamped

}  // namespace jax_wgrad
