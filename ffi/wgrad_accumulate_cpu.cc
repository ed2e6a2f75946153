// CPU handler of the jax_wgrad_wgrad_accumulate FFI target:
//   main_grad[out, in] += dy[T, out]^T @ x[T, in]   (in place when XLA aliases the buffer)
// main_grad may also be a flat buffer with the block at an element `offset`.
// A BLAS sgemm with beta = 1 from scipy-openblas32. 16-bit inputs are converted to f32 in
// blocks of tokens, so temporary memory is bounded independently of T. A 16-bit
// main_grad is widened once, accumulated in f32 and rounded once per call.
// The `precision` attribute is validated and otherwise ignored: like XLA:CPU, which
// computes float32 dots in float32 at every jax.lax.Precision, this handler always does.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cblas.h"  // scipy-openblas32: scipy_cblas_* symbols
#include "common.h"
#include "convert_cpu.h"
#include "wgrad_accumulate.h"
#include "xla/ffi/api/ffi.h"

namespace jax_wgrad {
namespace {

constexpr int64_t kTokenBlock = 512;  // tokens converted to f32 per GEMM

// --- plain compute: C[out, in] += dy[T, out]^T @ x[T, in], all f32 ---------------------
void SgemmAccumulate(const float* x, const float* dy, float* c, int64_t tokens,
                     int64_t in, int64_t out) {
  scipy_cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans,
                    static_cast<blasint>(out), static_cast<blasint>(in),
                    static_cast<blasint>(tokens), 1.0f, dy, static_cast<blasint>(out), x,
                    static_cast<blasint>(in), 1.0f, c, static_cast<blasint>(in));
}

// --- typed implementations ----------------------------------------------------------
// Visits every (batch element, group) GEMM: fn(index into x / dy, accumulator offset).
template <typename Fn>
void ForEachGemm(const WgradDims& d, Fn fn) {
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t g = 0; g < d.groups; ++g) fn(b * d.groups + g, d.AccOffset(b, g));
  }
}

// f32 inputs, f32 accumulator: one sgemm per batch element and group, no temporaries.
void ImplF32(const WgradDims& d, const float* x, const float* dy, float* c) {
  ForEachGemm(d, [&](int64_t i, int64_t acc) {
    SgemmAccumulate(x + i * d.tokens * d.in, dy + i * d.tokens * d.out, c + acc, d.tokens,
                    d.in, d.out);
  });
}

// 16-bit inputs into an f32 accumulator `c`: widen kTokenBlock tokens at a time.
template <typename In>
void ImplWidenInputs(const WgradDims& d, const In* x, const In* dy, float* c,
                     int64_t batch_index) {
  const int64_t block = std::min<int64_t>(kTokenBlock, d.tokens);
  std::vector<float> xs(block * d.in), gs(block * d.out);
  const In* xb = x + batch_index * d.tokens * d.in;
  const In* gb = dy + batch_index * d.tokens * d.out;
  for (int64_t t0 = 0; t0 < d.tokens; t0 += block) {
    const int64_t tb = std::min(block, d.tokens - t0);
    Widen(xb + t0 * d.in, xs.data(), tb * d.in);
    Widen(gb + t0 * d.out, gs.data(), tb * d.out);
    SgemmAccumulate(xs.data(), gs.data(), c, tb, d.in, d.out);
  }
}

template <typename In>
void ImplF32Acc(const WgradDims& d, const In* x, const In* dy, float* c) {
  ForEachGemm(d, [&](int64_t i, int64_t acc) { ImplWidenInputs(d, x, dy, c + acc, i); });
}

// 16-bit inputs and 16-bit accumulator: accumulate in f32, round once per call.
template <typename In>
void ImplLowAcc(const WgradDims& d, const In* x, const In* dy, In* c) {
  std::vector<float> c32(d.out * d.in);
  ForEachGemm(d, [&](int64_t i, int64_t acc) {
    Widen(c + acc, c32.data(), d.out * d.in);
    ImplWidenInputs(d, x, dy, c32.data(), i);
    Narrow(c32.data(), c + acc, d.out * d.in);
  });
}

// --- dtype dispatch -------------------------------------------------------------------
ffi::Error Dispatch(const WgradDims& d, ffi::DataType in_t, ffi::DataType acc_t,
                    const void* x, const void* dy, void* c) {
  using DT = ffi::DataType;
  if (in_t == DT::F32) {
    ImplF32(d, static_cast<const float*>(x), static_cast<const float*>(dy),
            static_cast<float*>(c));
  } else if (in_t == DT::BF16 && acc_t == DT::F32) {
    ImplF32Acc(d, static_cast<const Bf16*>(x), static_cast<const Bf16*>(dy),
               static_cast<float*>(c));
  } else if (in_t == DT::F16 && acc_t == DT::F32) {
    ImplF32Acc(d, static_cast<const F16*>(x), static_cast<const F16*>(dy),
               static_cast<float*>(c));
  } else if (in_t == DT::BF16) {
    ImplLowAcc(d, static_cast<const Bf16*>(x), static_cast<const Bf16*>(dy),
               static_cast<Bf16*>(c));
  } else {
    ImplLowAcc(d, static_cast<const F16*>(x), static_cast<const F16*>(dy),
               static_cast<F16*>(c));
  }
  return ffi::Error::Success();
}

ffi::Error WgradAccumulateCpuBody(ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::AnyBuffer acc,
                                  ffi::Result<ffi::AnyBuffer> result, int64_t offset,
                                  int32_t precision) {
  WgradDims d;
  if (ffi::Error err = CheckWgradArgs(x, dy, acc, *result, offset, precision, &d);
      err.failure()) {
    return err;
  }
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
  return Dispatch(d, x.element_type(), acc.element_type(), x.untyped_data(),
                  dy.untyped_data(), result->untyped_data());
}

ffi::Error WgradAccumulateCpuImpl(ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::AnyBuffer acc,
                                  ffi::Result<ffi::AnyBuffer> result, int64_t offset,
                                  int32_t precision) {
  return Guarded("wgrad_accumulate", [&] {
    return WgradAccumulateCpuBody(x, dy, acc, result, offset, precision);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WgradAccumulateCpu, WgradAccumulateCpuImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()   // x          [..., T, in]
                                  .Arg<ffi::AnyBuffer>()   // dy         [..., T, out]
                                  .Arg<ffi::AnyBuffer>()   // main_grad  [..., out, in]
                                  .Ret<ffi::AnyBuffer>()   // main_grad  (aliased)
                                  .Attr<int64_t>("offset")      // block start (flat)
                                  .Attr<int32_t>("precision"));  // validated, unused

}  // namespace jax_wgrad
