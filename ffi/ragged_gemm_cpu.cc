// CPU handlers of the ragged grouped GEMM FFI targets (ragged_gemm.h says what they do):
//   jax_wgrad_ragged_matmul:           y[rows of g] = x[rows of g] @ op(w[g]), 0 past them
//   jax_wgrad_ragged_wgrad_accumulate: main_grad[g] += dy[rows of g]^T @ x[rows of g]
// group_sizes and the position's index are read from host memory. One BLAS sgemm per group (scipy-
// openblas32, single-threaded), split into tiles on XLA's intra-op pool (gemm_cpu.h):
// the work is proportional to the rows in groups; a group of zero rows does no GEMM and
// rows past the groups are only zeroed (matmul) or not read (wgrad). 16-bit data are
// widened to f32 in blocks of kTokenBlock rows (and one expert's weight at a time),
// accumulated in f32 and rounded once. `precision` is validated and otherwise ignored:
// XLA:CPU computes float32 dots in float32 at every precision, and so does this.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "cblas.h"  // scipy-openblas32: scipy_cblas_* symbols
#include "common.h"
#include "gemm_cpu.h"
#include "ragged_gemm.h"
#include "wgrad_accumulate.h"
#include "xla/ffi/api/ffi.h"

namespace jax_wgrad {
namespace {

// The rows [start, start + rows) of a group with at least one row.
struct GroupRows {
  int64_t group, start, rows;
};

// Non-empty groups from group_sizes (clamped as ragged_gemm.h says); *end: the row
// after the last group.
std::vector<GroupRows> NonEmptyGroups(const ffi::AnyBuffer& sizes, int64_t groups,
                                      int64_t rows, int64_t* end) {
  const auto* size = static_cast<const int32_t*>(sizes.untyped_data());
  const RaggedBounds bounds{rows};
  std::vector<GroupRows> out;
  int64_t start = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t stop = bounds.End(start, size[g]);
    if (stop > start) out.push_back({g, start, stop - start});
    start = stop;
  }
  *end = start;
  return out;
}

ffi::Error CheckBlasRange(const char* op, std::initializer_list<int64_t> dims) {
  for (int64_t d : dims) {
    if (d > std::numeric_limits<blasint>::max()) {
      return ffi::Error::InvalidArgument(std::string(op) +
                                         ": a dimension exceeds the 32-bit BLAS index range");
    }
  }
  return ffi::Error::Success();
}

// --- ragged matmul: y[rows, n] = x[rows, k] @ op(w), all f32, row-major ----------------
struct MatmulGemm {
  const float* x;
  const float* w;  // [n, k] (transposed) or [k, n]
  float* y;
  int64_t rows, k, n;
  bool transpose;
};

// Tile t of `tiles` of y [rows, n] (gemm_cpu.h: SplitTile), its own sgemm.
void MatmulTile(const MatmulGemm& g, int64_t tiles, int64_t t) {
  const Tile tile = SplitTile(g.rows, g.n, tiles, t);
  if (tile.empty()) return;
  scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, g.transpose ? CblasTrans : CblasNoTrans,
                    static_cast<blasint>(tile.r1 - tile.r0),
                    static_cast<blasint>(tile.c1 - tile.c0), static_cast<blasint>(g.k), 1.0f,
                    g.x + tile.r0 * g.k, static_cast<blasint>(g.k),
                    g.transpose ? g.w + tile.c0 * g.k : g.w + tile.c0,
                    static_cast<blasint>(g.transpose ? g.k : g.n), 0.0f,
                    g.y + tile.r0 * g.n + tile.c0, static_cast<blasint>(g.n));
}

// The GEMMs' tiles in one parallel loop.
void RunMatmuls(ffi::ThreadPool* pool, const std::vector<MatmulGemm>& gemms) {
  std::vector<double> flops;
  std::vector<int64_t> max_tiles;
  for (const MatmulGemm& g : gemms) {
    flops.push_back(2.0 * static_cast<double>(g.rows) * static_cast<double>(g.k) *
                    static_cast<double>(g.n));
    max_tiles.push_back((std::max(g.rows, g.n) + kTileAlign - 1) / kTileAlign);
  }
  RunTiles(pool, TileCounts(flops, max_tiles, ParallelWidth(pool)),
           [&](int64_t i, int64_t tiles, int64_t t) { MatmulTile(gemms[i], tiles, t); });
}

template <typename T>
void RaggedMatmulImpl(ffi::ThreadPool* pool, const RaggedDims& d,
                      const std::vector<GroupRows>& groups, const T* x, const T* w, T* y) {
  const int64_t wsize = d.n * d.k;
  if constexpr (std::is_same_v<T, float>) {
    std::vector<MatmulGemm> gemms;
    for (const GroupRows& g : groups) {
      gemms.push_back({x + g.start * d.k, w + g.group * wsize, y + g.start * d.n, g.rows,
                       d.k, d.n, d.transpose_rhs});
    }
    RunMatmuls(pool, gemms);
  } else {  // 16-bit: one expert's weight widened at a time, rows in blocks
    std::vector<float> ws(wsize), xs, ys;
    for (const GroupRows& g : groups) {
      ParallelWiden(pool, w + g.group * wsize, ws.data(), wsize);
      const int64_t block = std::min<int64_t>(kTokenBlock, g.rows);
      xs.resize(block * d.k);
      ys.resize(block * d.n);
      for (int64_t r0 = g.start; r0 < g.start + g.rows; r0 += block) {
        const int64_t rb = std::min(block, g.start + g.rows - r0);
        ParallelWiden(pool, x + r0 * d.k, xs.data(), rb * d.k);
        RunMatmuls(pool, {{xs.data(), ws.data(), ys.data(), rb, d.k, d.n, d.transpose_rhs}});
        ParallelNarrow(pool, ys.data(), y + r0 * d.n, rb * d.n);
      }
    }
  }
}

ffi::Error RaggedMatmulBody(ffi::ThreadPool* pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                            ffi::AnyBuffer sizes, ffi::Result<ffi::AnyBuffer> y,
                            int32_t transpose_rhs, int32_t precision) {
  RaggedDims d;
  if (ffi::Error err = CheckRaggedMatmulArgs(x, w, sizes, *y, transpose_rhs, precision, &d);
      err.failure()) {
    return err;
  }
  if (ffi::Error err = CheckBlasRange("ragged_matmul", {d.rows, d.k, d.n}); err.failure()) {
    return err;
  }
  int64_t end = 0;
  const std::vector<GroupRows> groups = NonEmptyGroups(sizes, d.groups, d.rows, &end);
  auto* out = static_cast<char*>(y->untyped_data());
  const size_t row_bytes = d.n * ffi::ByteWidth(x.element_type());
  if (d.k == 0) end = 0;  // an empty reduction: every row is zero
  std::memset(out + end * row_bytes, 0, (d.rows - end) * row_bytes);  // past the groups
  if (end == 0 || d.n == 0) return ffi::Error::Success();
  UseSingleThreadedBlas();
  const ffi::DataType t = x.element_type();
  auto run = [&](auto tag) {
    using T = typename decltype(tag)::type;
    RaggedMatmulImpl(pool, d, groups, static_cast<const T*>(x.untyped_data()),
                     static_cast<const T*>(w.untyped_data()), static_cast<T*>(y->untyped_data()));
  };
  if (t == ffi::DataType::F32) {
    run(TypeTag<float>{});
  } else if (t == ffi::DataType::BF16) {
    run(TypeTag<Bf16>{});
  } else {
    run(TypeTag<F16>{});
  }
  return ffi::Error::Success();
}

// --- ragged wgrad: main_grad[g] += dy_g^T x_g -----------------------------------------
template <typename In, typename Acc>
void RaggedWgradImpl(ffi::ThreadPool* pool, const RaggedDims& d,
                     const std::vector<GroupRows>& groups, const In* x, const In* dy,
                     Acc* c) {
  const int64_t in = d.k, out = d.n, block = out * in;
  if constexpr (std::is_same_v<In, float>) {  // every group's tiles in one loop
    std::vector<Gemm> gemms;
    std::vector<double> flops;
    std::vector<int64_t> max_tiles;
    for (const GroupRows& g : groups) {
      gemms.push_back({x + g.start * in, dy + g.start * out, c + g.group * block, g.rows,
                       in, out});
      flops.push_back(2.0 * static_cast<double>(g.rows) * static_cast<double>(block));
      max_tiles.push_back((std::max(in, out) + kTileAlign - 1) / kTileAlign);
    }
    RunTiles(pool, TileCounts(flops, max_tiles, ParallelWidth(pool)),
             [&](int64_t i, int64_t tiles, int64_t t) { GemmTile(gemms[i], tiles, t); });
  } else {
    std::vector<float> xs, gs, c32;
    for (const GroupRows& g : groups) {
      const In* xg = x + g.start * in;
      const In* gg = dy + g.start * out;
      if constexpr (std::is_same_v<Acc, float>) {
        AccumulateWidened(pool, xg, gg, g.rows, in, out, c + g.group * block, xs, gs);
      } else {
        AccumulateInF32(pool, c + g.group * block, block, c32, [&](float* c32p) {
          AccumulateWidened(pool, xg, gg, g.rows, in, out, c32p, xs, gs);
        });
      }
    }
  }
}

ffi::Error RaggedWgradBody(ffi::ThreadPool* pool, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                           ffi::AnyBuffer sizes, ffi::AnyBuffer acc, ffi::AnyBuffer offset,
                           ffi::Result<ffi::AnyBuffer> result, int64_t base, int64_t stride,
                           int32_t precision) {
  RaggedDims d;
  if (ffi::Error err = CheckRaggedWgradArgs(x, dy, sizes, acc, offset, *result, base, stride,
                                            precision, &d);
      err.failure()) {
    return err;
  }
  if (ffi::Error err = CheckBlasRange("ragged_wgrad_accumulate", {d.rows, d.k, d.n});
      err.failure()) {
    return err;
  }
  // When XLA could not alias (the accumulator was not donated), start from a copy.
  if (result->untyped_data() != acc.untyped_data()) {
    std::memcpy(result->untyped_data(), acc.untyped_data(), acc.size_bytes());
  }
  int64_t end = 0;
  const std::vector<GroupRows> groups = NonEmptyGroups(sizes, d.groups, d.rows, &end);
  if (groups.empty() || d.k == 0 || d.n == 0) return ffi::Error::Success();
  const int64_t block0 =
      d.flat ? d.position.Clamped(*static_cast<const int32_t*>(offset.untyped_data()),
                                  d.max_offset)
             : 0;
  UseSingleThreadedBlas();
  DispatchInputsAndAcc(x.element_type(), acc.element_type(), [&](auto in_tag, auto acc_tag) {
    using In = typename decltype(in_tag)::type;
    using Acc = typename decltype(acc_tag)::type;
    RaggedWgradImpl(pool, d, groups, static_cast<const In*>(x.untyped_data()),
                    static_cast<const In*>(dy.untyped_data()),
                    static_cast<Acc*>(result->untyped_data()) + block0);
  });
  return ffi::Error::Success();
}

ffi::Error RaggedMatmulCpuImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                               ffi::AnyBuffer sizes, ffi::Result<ffi::AnyBuffer> y,
                               int32_t transpose_rhs, int32_t precision) {
  return Guarded("ragged_matmul", [&] {
    return RaggedMatmulBody(&pool, x, w, sizes, y, transpose_rhs, precision);
  });
}

ffi::Error RaggedWgradAccumulateCpuImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                                        ffi::AnyBuffer dy, ffi::AnyBuffer sizes,
                                        ffi::AnyBuffer acc, ffi::AnyBuffer offset,
                                        ffi::Result<ffi::AnyBuffer> result, int64_t base,
                                        int64_t stride, int32_t precision) {
  return Guarded("ragged_wgrad_accumulate", [&] {
    return RaggedWgradBody(&pool, x, dy, sizes, acc, offset, result, base, stride,
                           precision);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedMatmulCpu, RaggedMatmulCpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()  // XLA's intra-op pool
                                  .Arg<ffi::AnyBuffer>()   // x            [R, K]
                                  .Arg<ffi::AnyBuffer>()   // w            [G, N, K] / [G, K, N]
                                  .Arg<ffi::AnyBuffer>()   // group_sizes  int32 [G]
                                  .Ret<ffi::AnyBuffer>()   // y            [R, N]
                                  .Attr<int32_t>("transpose_rhs")  // 1: w is [G, N, K]
                                  .Attr<int32_t>("precision"));    // validated, unused

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedWgradAccumulateCpu, RaggedWgradAccumulateCpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()  // XLA's intra-op pool
                                  .Arg<ffi::AnyBuffer>()   // x            [R, in]
                                  .Arg<ffi::AnyBuffer>()   // dy           [R, out]
                                  .Arg<ffi::AnyBuffer>()   // group_sizes  int32 [G]
                                  .Arg<ffi::AnyBuffer>()   // main_grad    [G, out, in] / [N]
                                  .Arg<ffi::AnyBuffer>()   // offset       int32 []: index
                                  .Ret<ffi::AnyBuffer>()   // main_grad    (aliased)
                                  .Attr<int64_t>("base")    // group 0's block at base +
                                  .Attr<int64_t>("stride")  // index * stride, clamped
                                  .Attr<int32_t>("precision"));  // validated, unused

}  // namespace jax_wgrad
