// CPU handler of the jax_wgrad_wgrad_accumulate FFI target:
//   main_grad[out, in] += dy[T, out]^T @ x[T, in]   (in place when XLA aliases the buffer)
// main_grad may also be a flat buffer with the block at an element `offset`: an attribute
// (jax_wgrad_wgrad_accumulate), or an int32 operand in host memory, clamped like
// lax.dynamic_update_slice (jax_wgrad_wgrad_accumulate_at); both run the same GEMMs.
// A BLAS sgemm with beta = 1 from scipy-openblas32. 16-bit inputs are converted to f32 in
// blocks of tokens, so temporary memory is bounded independently of T. A 16-bit
// main_grad is widened once, accumulated in f32 and rounded once per call.
// The `precision` attribute is validated and otherwise ignored: like XLA:CPU, which
// computes float32 dots in float32 at every jax.lax.Precision, this handler always does.
//
// Threads: OpenBLAS is used single-threaded (its own thread server, next to XLA's
// intra-op pool on the same cores, made the fused train step up to 10x slower on a
// loaded 2-core machine: notes/issue17_cpu_perf.md). Instead each GEMM's output block is
// split into tiles (row or column ranges of main_grad, each its own sgemm) that run on
// the calling thread and on XLA's intra-op pool (parallel_cpu.h), as XLA's own dots do;
// a GEMM too small to amortize a task runs on the calling thread alone.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "cblas.h"  // scipy-openblas32: scipy_cblas_* symbols
#include "common.h"
#include "convert_cpu.h"
#include "parallel_cpu.h"
#include "wgrad_accumulate.h"
#include "xla/ffi/api/ffi.h"

namespace jax_wgrad {
namespace {

constexpr int64_t kTokenBlock = 512;      // tokens converted to f32 per GEMM
constexpr double kMinTileFlops = 8.0e6;   // smallest GEMM tile worth a pool task
constexpr int64_t kTilesPerThread = 1;    // tiles per thread (2 measured slower)
constexpr int64_t kTileAlign = 16;        // tile boundaries: multiples of 16 elements
constexpr int64_t kMinConvertPart = 1 << 16;  // elements per parallel conversion part

// OpenBLAS's own threads off, once per process (the library is scipy-openblas32's copy,
// loaded for this extension; numpy and scipy use their own).
void UseSingleThreadedBlas() {
  static const bool done = [] {
    scipy_openblas_set_num_threads(1);
    return true;
  }();
  (void)done;
}

// --- plain compute: C[out, in] += dy[T, out]^T @ x[T, in], all f32 ---------------------
// One GEMM of a call: x [tokens, in], dy [tokens, out], C [out, in], all row-major.
struct Gemm {
  const float* x;
  const float* dy;
  float* c;
  int64_t tokens, in, out;
};

// Tile t of `tiles` of the GEMM: a range of rows (out) or columns (in) of C, whichever
// dimension is larger, and its own sgemm over all tokens. Tiles never overlap, and each
// element is summed over the tokens in the same order as by one whole-block sgemm.
void GemmTile(const Gemm& g, int64_t tiles, int64_t t) {
  int64_t o0 = 0, o1 = g.out, i0 = 0, i1 = g.in;
  if (g.out >= g.in) {
    std::tie(o0, o1) = SplitRange(g.out, tiles, t, kTileAlign);
  } else {
    std::tie(i0, i1) = SplitRange(g.in, tiles, t, kTileAlign);
  }
  if (o0 >= o1 || i0 >= i1) return;
  scipy_cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<blasint>(o1 - o0),
                    static_cast<blasint>(i1 - i0), static_cast<blasint>(g.tokens), 1.0f,
                    g.dy + o0, static_cast<blasint>(g.out), g.x + i0,
                    static_cast<blasint>(g.in), 1.0f, g.c + o0 * g.in + i0,
                    static_cast<blasint>(g.in));
}

// Tiles per GEMM for `count` GEMMs of this size run together: enough items to keep
// `width` threads busy, none smaller than kMinTileFlops, at most one per 16 rows/columns.
int64_t TilesPerGemm(int64_t count, int64_t tokens, int64_t in, int64_t out,
                     int64_t width) {
  const double flops = 2.0 * static_cast<double>(tokens) * static_cast<double>(in) *
                       static_cast<double>(out) * static_cast<double>(count);
  const double by_size = std::max(1.0, flops / kMinTileFlops);
  const int64_t items = static_cast<int64_t>(
      std::min(by_size, static_cast<double>(width * kTilesPerThread)));
  const int64_t dim = std::max(in, out);
  const int64_t max_tiles = (dim + kTileAlign - 1) / kTileAlign;
  return std::clamp<int64_t>((items + count - 1) / count, 1, max_tiles);
}

// Runs `count` GEMMs (gemm(i) describes the i-th) split into tiles on the pool.
template <typename GemmAt>
void RunGemms(ffi::ThreadPool* pool, int64_t count, const Gemm& shape, GemmAt gemm) {
  const int64_t width = ParallelWidth(pool);
  const int64_t tiles = width == 1 ? 1 : TilesPerGemm(count, shape.tokens, shape.in,
                                                     shape.out, width);
  ParallelFor(pool, count * tiles, width - 1,
              [&](int64_t item) { GemmTile(gemm(item / tiles), tiles, item % tiles); });
}

// convert(begin, end) over [0, n), in parts on the pool when n is large.
template <typename Convert>
void ParallelConvert(ffi::ThreadPool* pool, int64_t n, Convert convert) {
  const int64_t width = ParallelWidth(pool);
  const int64_t parts = std::clamp<int64_t>(n / kMinConvertPart, 1, width);
  ParallelFor(pool, parts, width - 1, [&](int64_t p) {
    auto [b, e] = SplitRange(n, parts, p, kTileAlign);
    convert(b, e);
  });
}

// dst[0, n) = float(src[0, n)).
template <typename T>
void ParallelWiden(ffi::ThreadPool* pool, const T* src, float* dst, int64_t n) {
  ParallelConvert(pool, n, [&](int64_t b, int64_t e) { Widen(src + b, dst + b, e - b); });
}

// dst[0, n) = T(src[0, n)), rounded to nearest even.
template <typename T>
void ParallelNarrow(ffi::ThreadPool* pool, const float* src, T* dst, int64_t n) {
  ParallelConvert(pool, n, [&](int64_t b, int64_t e) { Narrow(src + b, dst + b, e - b); });
}

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

// 16-bit inputs of GEMM `i` into an f32 accumulator `c`: widen kTokenBlock tokens at a
// time (in parallel), then the block's GEMM tiles (in parallel).
template <typename In>
void ImplWidenInputs(ffi::ThreadPool* pool, const WgradDims& d, const In* x, const In* dy,
                     float* c, int64_t i, std::vector<float>& xs, std::vector<float>& gs) {
  const int64_t block = std::min<int64_t>(kTokenBlock, d.tokens);
  xs.resize(block * d.in);
  gs.resize(block * d.out);
  const In* xb = x + i * d.tokens * d.in;
  const In* gb = dy + i * d.tokens * d.out;
  for (int64_t t0 = 0; t0 < d.tokens; t0 += block) {
    const int64_t tb = std::min(block, d.tokens - t0);
    ParallelWiden(pool, xb + t0 * d.in, xs.data(), tb * d.in);
    ParallelWiden(pool, gb + t0 * d.out, gs.data(), tb * d.out);
    const Gemm gemm{xs.data(), gs.data(), c, tb, d.in, d.out};
    RunGemms(pool, 1, gemm, [&](int64_t) { return gemm; });
  }
}

template <typename In>
void ImplF32Acc(ffi::ThreadPool* pool, const WgradDims& d, const In* x, const In* dy,
                float* c) {
  std::vector<float> xs, gs;
  for (int64_t i = 0; i < d.batch * d.groups; ++i) {
    ImplWidenInputs(pool, d, x, dy, c + d.AccOffset(i / d.groups, i % d.groups), i, xs, gs);
  }
}

// 16-bit inputs and 16-bit accumulator: accumulate in f32, round once per call.
template <typename In>
void ImplLowAcc(ffi::ThreadPool* pool, const WgradDims& d, const In* x, const In* dy,
                In* c) {
  std::vector<float> c32(d.out * d.in), xs, gs;
  for (int64_t i = 0; i < d.batch * d.groups; ++i) {
    In* block = c + d.AccOffset(i / d.groups, i % d.groups);
    ParallelWiden(pool, block, c32.data(), d.out * d.in);
    ImplWidenInputs(pool, d, x, dy, c32.data(), i, xs, gs);
    ParallelNarrow(pool, c32.data(), block, d.out * d.in);
  }
}

// --- dtype dispatch -------------------------------------------------------------------
ffi::Error Dispatch(ffi::ThreadPool* pool, const WgradDims& d, ffi::DataType in_t,
                    ffi::DataType acc_t, const void* x, const void* dy, void* c) {
  using DT = ffi::DataType;
  if (in_t == DT::F32) {
    ImplF32(pool, d, static_cast<const float*>(x), static_cast<const float*>(dy),
            static_cast<float*>(c));
  } else if (in_t == DT::BF16 && acc_t == DT::F32) {
    ImplF32Acc(pool, d, static_cast<const Bf16*>(x), static_cast<const Bf16*>(dy),
               static_cast<float*>(c));
  } else if (in_t == DT::F16 && acc_t == DT::F32) {
    ImplF32Acc(pool, d, static_cast<const F16*>(x), static_cast<const F16*>(dy),
               static_cast<float*>(c));
  } else if (in_t == DT::BF16) {
    ImplLowAcc(pool, d, static_cast<const Bf16*>(x), static_cast<const Bf16*>(dy),
               static_cast<Bf16*>(c));
  } else {
    ImplLowAcc(pool, d, static_cast<const F16*>(x), static_cast<const F16*>(dy),
               static_cast<F16*>(c));
  }
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

// Operand offsets: read from host memory, clamped per batch element, then the same GEMMs.
ffi::Error WgradAccumulateAtCpuBody(ffi::ThreadPool* pool, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                                    ffi::AnyBuffer acc, ffi::AnyBuffer offset,
                                    ffi::Result<ffi::AnyBuffer> result, int32_t precision) {
  WgradDims d;
  if (ffi::Error err = CheckWgradAtArgs(x, dy, acc, *result, offset, precision, &d);
      err.failure()) {
    return err;
  }
  const auto* given = static_cast<const int32_t*>(offset.untyped_data());
  std::vector<int64_t> clamped(d.batch);
  for (int64_t b = 0; b < d.batch; ++b) clamped[b] = ClampOffset(given[b], d.max_offset);
  d.batch_offsets = clamped.data();
  return WgradAccumulateCpuRun(pool, d, x, dy, acc, result);
}

ffi::Error WgradAccumulateAtCpuImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                                    ffi::AnyBuffer acc, ffi::AnyBuffer offset,
                                    ffi::Result<ffi::AnyBuffer> result, int32_t precision) {
  return Guarded("wgrad_accumulate", [&] {
    return WgradAccumulateAtCpuBody(&pool, x, dy, acc, offset, result, precision);
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
                                  .Arg<ffi::AnyBuffer>()   // offset     int32 [...] (clamped)
                                  .Ret<ffi::AnyBuffer>()   // main_grad  (aliased)
                                  .Attr<int32_t>("precision"));  // validated, unused

}  // namespace jax_wgrad
