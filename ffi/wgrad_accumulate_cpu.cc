// CPU handler of the jax_wgrad_wgrad_accumulate FFI target:
//   main_grad[out, in] += dy[T, out]^T @ x[T, in]   (in place when XLA aliases the buffer)
// main_grad may also be a flat buffer with the block at an element `offset`: an int64
// attribute (jax_wgrad_wgrad_accumulate), or the position base + index * stride (int64
// attributes, an int32 index operand in host memory) computed in int64 and clamped like
// lax.dynamic_update_slice (jax_wgrad_wgrad_accumulate_at); both run the same GEMMs.
// A BLAS sgemm with beta = 1 from scipy-openblas32. 16-bit inputs are converted to f32 in
// blocks of tokens, so temporary memory is bounded independently of T. A 16-bit
// main_grad is widened once, accumulated in f32 and rounded once per call.
// The `precision` attribute is validated and otherwise ignored: like XLA:CPU, which
// computes float32 dots in float32 at every jax.lax.Precision, this handler always does.
//
// Threads and tiles: gemm_cpu.h.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cblas.h"  // scipy-openblas32: scipy_cblas_* symbols
#include "common.h"
#include "gemm_cpu.h"
#include "wgrad_accumulate.h"
#include "xla/ffi/api/ffi.h"

namespace jax_wgrad {
namespace {

// --- typed implementations ----------------------------------------------------------
// f32 inputs, f32 accumulator: every (batch element, group) GEMM's tiles in one parallel
// loop, no temporaries.
void ImplF32(ffi::ThreadPool* pool, const WgradDims& d, const float* x, const float* dy,
             float* c) {
  const Gemm shape{nullptr, nullptr, nullptr, d.tokens, d.in, d.out};
  RunGemms(pool, d.batch * d.groups, shape, [&](int64_t i) {
    const int64_t b = i / d.groups, g = i % d.groups;
    return Gemm{x + i * d.tokens * d.in, dy + i * d.tokens * d.out, c + d.AccOffset(b, g),
                d.tokens, d.in, d.out};
  });
}

// 16-bit inputs into an f32 accumulator, GEMM by GEMM (gemm_cpu.h: AccumulateWidened).
template <typename In>
void ImplF32Acc(ffi::ThreadPool* pool, const WgradDims& d, const In* x, const In* dy,
                float* c) {
  std::vector<float> xs, gs;
  for (int64_t i = 0; i < d.batch * d.groups; ++i) {
    AccumulateWidened(pool, x + i * d.tokens * d.in, dy + i * d.tokens * d.out, d.tokens,
                      d.in, d.out, c + d.AccOffset(i / d.groups, i % d.groups), xs, gs);
  }
}

// 16-bit inputs and 16-bit accumulator: accumulate in f32, round once per call.
template <typename In>
void ImplLowAcc(ffi::ThreadPool* pool, const WgradDims& d, const In* x, const In* dy,
                In* c) {
  std::vector<float> c32, xs, gs;
  for (int64_t i = 0; i < d.batch * d.groups; ++i) {
    In* block = c + d.AccOffset(i / d.groups, i % d.groups);
    AccumulateInF32(pool, block, d.out * d.in, c32, [&](float* c32p) {
      AccumulateWidened(pool, x + i * d.tokens * d.in, dy + i * d.tokens * d.out, d.tokens,
                        d.in, d.out, c32p, xs, gs);
    });
  }
}

// --- dtype dispatch -------------------------------------------------------------------
ffi::Error Dispatch(ffi::ThreadPool* pool, const WgradDims& d, ffi::DataType in_t,
                    ffi::DataType acc_t, const void* x, const void* dy, void* c) {
  DispatchInputsAndAcc(in_t, acc_t, [&](auto in_tag, auto acc_tag) {
    using In = typename decltype(in_tag)::type;
    using Acc = typename decltype(acc_tag)::type;
    const auto* xt = static_cast<const In*>(x);
    const auto* gt = static_cast<const In*>(dy);
    if constexpr (std::is_same_v<In, float>) {
      ImplF32(pool, d, xt, gt, static_cast<float*>(c));
    } else if constexpr (std::is_same_v<Acc, float>) {
      ImplF32Acc(pool, d, xt, gt, static_cast<float*>(c));
    } else {
      ImplLowAcc(pool, d, xt, gt, static_cast<In*>(c));
    }
  });
  return ffi::Error::Success();
}

// The GEMMs of one validated call (either target): result = acc + dy^T x per block.
ffi::Error WgradAccumulateCpuRun(ffi::ThreadPool* pool, const WgradDims& d, ffi::AnyBuffer x,
                                 ffi::AnyBuffer dy, ffi::AnyBuffer acc,
                                 ffi::Result<ffi::AnyBuffer> result) {
  constexpr int64_t kMaxBlas = std::numeric_limits<blasint>::max();
  if (d.tokens > kMaxBlas || d.in > kMaxBlas || d.out > kMaxBlas) {
    return ffi::Error::InvalidArgument(
        "wgrad_accumulate: a dimension exceeds the 32-bit BLAS index range" );
  }
  // When XLA could not alias (the accumulator was not donated), start from a copy.
  if (result->untyped_data() != acc.untyped_data()) {
    std::memcpy(result->untyped_data(), acc.untyped_data(), acc.size_bytes());
  }
  if (d.batch == 0 || d.groups == 0 || d.tokens == 0 || d.in == 0 || d.out == 0) {
    return ffi::Error::Success();
  }
  UseSingleThreadedBlas();
  return Dispatch(pool, d, x.element_type(), acc.element_type(), x.untyped_data(),
                  dy.untyped_data(), result->untyped_data());
}

ffi::Error WgradAccumulateCpuBody(ffi::ThreadPool* pool, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                                  ffi::AnyBuffer acc, ffi::Result<ffi::AnyBuffer> result,
                                  int64_t offset, int32_t precision) {
  WgradDims d;
  if (ffi::Error err = CheckWgradArgs(x, dy, acc, *result, offset, precision, &d);
      err.failure()) {
    return err;
  }
  return WgradAccumulateCpuRun(pool, d, x, dy, acc, result);
}

// Positions: indices read from host memory, base + index * stride in int64, clamped per
// batch element, then the same GEMMs.
ffi::Error WgradAccumulateAtCpuBody(ffi::ThreadPool* pool, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                                    ffi::AnyBuffer acc, ffi::AnyBuffer offset,
                                    ffi::Result<ffi::AnyBuffer> result, int64_t base,
                                    int64_t stride, int32_t precision) {
  WgradDims d;
  BlockPosition position;
  if (ffi::Error err = CheckWgradAtArgs(x, dy, acc, *result, offset, base, stride, precision,
                                        &d, &position);
      err.failure()) {
    return err;
  }
  const auto* index = static_cast<const int32_t*>(offset.untyped_data());
  std::vector<int64_t> clamped(d.batch);
  for (int64_t b = 0; b < d.batch; ++b) clamped[b] = position.Clamped(index[b], d.max_offset);
  d.batch_offsets = clamped.data();
  return WgradAccumulateCpuRun(pool, d, x, dy, acc, result);
}

ffi::Error WgradAccumulateAtCpuImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                                    ffi::AnyBuffer acc, ffi::AnyBuffer offset,
                                    ffi::Result<ffi::AnyBuffer> result, int64_t base,
                                    int64_t stride, int32_t precision) {
  return Guarded("wgrad_accumulate", [&] {
    return WgradAccumulateAtCpuBody(&pool, x, dy, acc, offset, result, base, stride,
                                    precision);
  });
}

ffi::Error WgradAccumulateCpuImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                                  ffi::AnyBuffer acc, ffi::Result<ffi::AnyBuffer> result,
                                  int64_t offset, int32_t precision) {
  return Guarded("wgrad_accumulate", [&] {
    return WgradAccumulateCpuBody(&pool, x, dy, acc, result, offset, precision);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WgradAccumulateCpu, WgradAccumulateCpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()  // XLA's intra-op pool
                                  .Arg<ffi::AnyBuffer>()   // x          [..., T, in]
                                  .Arg<ffi::AnyBuffer>()   // dy         [..., T, out]
                                  .Arg<ffi::AnyBuffer>()   // main_grad  [..., out, in]
                                  .Ret<ffi::AnyBuffer>()   // main_grad  (aliased)
                                  .Attr<int64_t>("offset")      // block start (flat)
                                  .Attr<int32_t>("precision"));  // validated, unused

XLA_FFI_DEFINE_HANDLER_SYMBOL(WgradAccumulateAtCpu, WgradAccumulateAtCpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()  // XLA's intra-op pool
                                  .Arg<ffi::AnyBuffer>()   // x          [..., T, in]
                                  .Arg<ffi::AnyBuffer>()   // dy         [..., T, out]
                                  .Arg<ffi::AnyBuffer>()   // main_grad  [..., N] (flat)
                                  .Arg<ffi::AnyBuffer>()   // offset     int32 [...]: index
                                  .Ret<ffi::AnyBuffer>()   // main_grad  (aliased)
                                  .Attr<int64_t>("base")    // block at base + index * stride,
                                  .Attr<int64_t>("stride")  // int64, clamped
                                  .Attr<int32_t>("precision"));  // validated, unused

}  // namespace jax_wgrad
