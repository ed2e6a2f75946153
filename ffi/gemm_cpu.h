// BLAS GEMMs of the CPU handlers (wgrad_accumulate_cpu.cc, ragged_gemm_cpu.cc): scipy-
// openblas32's sgemm, single-threaded, split into tiles that run on XLA's intra-op pool
// (parallel_cpu.h), and the bounded-block conversions that feed it 16-bit data.
//
// Threads: OpenBLAS is used single-threaded (its own thread server, next to XLA's
// intra-op pool on the same cores, made the fused train step up to 10x slower on a
// loaded 2-core machine: docs/design/cpu_performance.md). Instead each GEMM's output block is
// split into tiles (row or column ranges, each its own sgemm) that run on the calling
// thread and on XLA's intra-op pool, as XLA's own dots do; a GEMM too small to amortize a
// task runs on the calling thread alone.
#ifndef JAX_WGRAD_FFI_GEMM_CPU_H_
#define JAX_WGRAD_FFI_GEMM_CPU_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cblas.h"  // scipy-openblas32: scipy_cblas_* symbols
#include "common.h"
#include "convert_cpu.h"
#include "parallel_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace jax_wgrad {

inline constexpr int64_t kTokenBlock = 512;      // rows (tokens) converted to f32 per GEMM
inline constexpr double kMinTileFlops = 8.0e6;   // smallest GEMM tile worth a pool task
inline constexpr int64_t kTilesPerThread = 1;    // tiles per thread (2 measured slower)
inline constexpr int64_t kTileAlign = 16;        // tile boundaries: multiples of 16 elements
inline constexpr int64_t kMinConvertPart = 1 << 16;  // elements per parallel conversion part

// OpenBLAS's own threads off, once per process (the library is scipy-openblas32's copy,
// loaded for this extension; numpy and scipy use their own).
inline void UseSingleThreadedBlas() {
  static const bool done = [] {
    scipy_openblas_set_num_threads(1);
    return true;
  }();
  (void)done;
}

// A dtype as a type, for generic lambdas: fn(TypeTag<Bf16>{}) -> decltype(tag)::type.
template <typename T>
struct TypeTag {
  using type = T;
};

// fn(TypeTag<In>{}, TypeTag<Acc>{}) for a validated (inputs, accumulator) dtype pair:
// In is float, Bf16 or F16; Acc is float, or In when In is 16-bit.
template <typename Fn>
void DispatchInputsAndAcc(ffi::DataType in_t, ffi::DataType acc_t, Fn&& fn) {
  using DT = ffi::DataType;
  const bool f32_acc = acc_t == DT::F32;
  if (in_t == DT::F32) {
    fn(TypeTag<float>{}, TypeTag<float>{});
  } else if (in_t == DT::BF16) {
    f32_acc ? fn(TypeTag<Bf16>{}, TypeTag<float>{}) : fn(TypeTag<Bf16>{}, TypeTag<Bf16>{});
  } else {
    f32_acc ? fn(TypeTag<F16>{}, TypeTag<float>{}) : fn(TypeTag<F16>{}, TypeTag<F16>{});
  }
}

// --- C[out, in] += dy[T, out]^T @ x[T, in], all f32, row-major ------------------------
struct Gemm {
  const float* x;
  const float* dy;
  float* c;
  int64_t tokens, in, out;
};

// Rows [r0, r1) and columns [c0, c1) of a GEMM's output tile.
struct Tile {
  int64_t r0, r1, c0, c1;
  bool empty() const { return r0 >= r1 || c0 >= c1; }
};

// Tile t of `tiles` of a [rows, cols] output: a range of its rows or of its columns,
// whichever dimension is larger. Tiles never overlap; each computed by its own sgemm,
// every element is summed over the reduction in the same order as by one whole sgemm.
inline Tile SplitTile(int64_t rows, int64_t cols, int64_t tiles, int64_t t) {
  Tile tile{0, rows, 0, cols};
  if (rows >= cols) {
    std::tie(tile.r0, tile.r1) = SplitRange(rows, tiles, t, kTileAlign);
  } else {
    std::tie(tile.c0, tile.c1) = SplitRange(cols, tiles, t, kTileAlign);
  }
  return tile;
}

// Tile t of `tiles` of C [out, in] (rows: out), its own sgemm over all tokens.
inline void GemmTile(const Gemm& g, int64_t tiles, int64_t t) {
  const Tile tile = SplitTile(g.out, g.in, tiles, t);
  if (tile.empty()) return;
  scipy_cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans,
                    static_cast<blasint>(tile.r1 - tile.r0),
                    static_cast<blasint>(tile.c1 - tile.c0), static_cast<blasint>(g.tokens),
                    1.0f, g.dy + tile.r0, static_cast<blasint>(g.out), g.x + tile.c0,
                    static_cast<blasint>(g.in), 1.0f, g.c + tile.r0 * g.in + tile.c0,
                    static_cast<blasint>(g.in));
}

// Tiles per GEMM for `count` GEMMs of this size run together: enough items to keep
// `width` threads busy, none smaller than kMinTileFlops, at most one per 16 rows/columns.
inline int64_t TilesPerGemm(int64_t count, int64_t tokens, int64_t in, int64_t out,
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

// Runs `count` GEMMs of one size (gemm(i) describes the i-th) split into tiles on the pool.
template <typename GemmAt>
void RunGemms(ffi::ThreadPool* pool, int64_t count, const Gemm& shape, GemmAt gemm) {
  const int64_t width = ParallelWidth(pool);
  const int64_t tiles = width == 1 ? 1 : TilesPerGemm(count, shape.tokens, shape.in,
                                                     shape.out, width);
  ParallelFor(pool, count * tiles, width - 1,
              [&](int64_t item) { GemmTile(gemm(item / tiles), tiles, item % tiles); });
}

// GEMMs of different sizes run together (e.g. the groups of a ragged call): tiles per
// GEMM in proportion to its share of `flops` (the items keep `width` threads busy, none
// smaller than kMinTileFlops), at least 1, at most max_tiles[i].
inline std::vector<int64_t> TileCounts(const std::vector<double>& flops,
                                       const std::vector<int64_t>& max_tiles,
                                       int64_t width) {
  double total = 0;
  for (double f : flops) total += f;
  const double items = std::min(std::max(1.0, total / kMinTileFlops),
                                static_cast<double>(width * kTilesPerThread));
  std::vector<int64_t> tiles(flops.size(), 1);
  if (width == 1 || total <= 0) return tiles;
  for (size_t i = 0; i < flops.size(); ++i) {
    const auto share = static_cast<int64_t>(std::llround(items * flops[i] / total));
    tiles[i] = std::clamp<int64_t>(share, 1, std::max<int64_t>(1, max_tiles[i]));
  }
  return tiles;
}

// tile(i, tiles[i], t) for every tile t of every GEMM i, all in one loop on the pool.
template <typename Tile>
void RunTiles(ffi::ThreadPool* pool, const std::vector<int64_t>& tiles, const Tile& tile) {
  std::vector<int64_t> first(tiles.size() + 1, 0);
  for (size_t i = 0; i < tiles.size(); ++i) first[i + 1] = first[i] + tiles[i];
  ParallelFor(pool, first.back(), ParallelWidth(pool) - 1, [&](int64_t item) {
    const auto i = std::upper_bound(first.begin(), first.end(), item) - first.begin() - 1;
    tile(i, tiles[i], item - first[i]);
  });
}

// --- conversions of 16-bit data, in parallel ----------------------------------------
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

// c[out, in] (f32) += dy^T x for 16-bit x [tokens, in], dy [tokens, out]: widened
// kTokenBlock tokens at a time into xs, gs (in parallel), then that block's GEMM tiles.
template <typename In>
void AccumulateWidened(ffi::ThreadPool* pool, const In* x, const In* dy, int64_t tokens,
                       int64_t in, int64_t out, float* c, std::vector<float>& xs,
                       std::vector<float>& gs) {
  const int64_t block = std::min<int64_t>(kTokenBlock, tokens);
  xs.resize(block * in);
  gs.resize(block * out);
  for (int64_t t0 = 0; t0 < tokens; t0 += block) {
    const int64_t tb = std::min(block, tokens - t0);
    ParallelWiden(pool, x + t0 * in, xs.data(), tb * in);
    ParallelWiden(pool, dy + t0 * out, gs.data(), tb * out);
    const Gemm gemm{xs.data(), gs.data(), c, tb, in, out};
    RunGemms(pool, 1, gemm, [&](int64_t) { return gemm; });
  }
}

// A 16-bit accumulator block of n elements: widened into c32, accumulate(c32.data())
// adds to it in f32, and it is rounded back once.
template <typename T, typename Accumulate>
void AccumulateInF32(ffi::ThreadPool* pool, T* block, int64_t n, std::vector<float>& c32,
                     const Accumulate& accumulate) {
  c32.resize(n);
  ParallelWiden(pool, block, c32.data(), n);
  accumulate(c32.data());
  ParallelNarrow(pool, c32.data(), block, n);
}

}  // namespace jax_wgrad

#endif  // JAX_WGRAD_FFI_GEMM_CPU_H_
