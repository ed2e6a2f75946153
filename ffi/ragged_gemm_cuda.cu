// CUDA handlers of the ragged grouped GEMM FFI targets (ragged_gemm.h says what they do):
//   jax_wgrad_ragged_matmul:           y[rows of g] = x[rows of g] @ op(w[g]), 0 past them
//   jax_wgrad_ragged_wgrad_accumulate: main_grad[g] += dy[rows of g]^T @ x[rows of g]
//
// Hopper: CUTLASS (the default; JAX_WGRAD_RAGGED_KERNEL=wmma or the module's
// set_ragged_kernel("wmma") forces the WMMA kernels). On a compute capability 9.0 device, bf16 and f16 operands whose shapes meet TMA's alignment go to CUTLASS 3.x sm90
// grouped GEMMs instead (ragged_gemm_cutlass.h
// and .cu: a set-up kernel writes the per-group problem shapes, pointers and strides from
// group_sizes into the custom call's scratch result, on the device, then one persistent
// warp-specialized TMA + wgmma kernel runs every group); fp32 and TF32, 16-bit
// accumulators, other devices and unaligned shapes run the WMMA kernels below. The choice
// is made on the host from what it knows (device, dtypes, shapes, attributes), never from
// group_sizes. The device's compute capability and SM count are queried once per device
// by the handlers' initialize stage (which also raises the CUTLASS kernels' dynamic shared
// memory limit there, before any CUDA-graph capture) and cached.
//
// Why own kernels and not cuBLAS. group_sizes (and the wgrad position's index) live in
// device memory
// and the step may be captured into a CUDA graph, so the handlers may not copy them to the
// host. cublasGemmGroupedBatchedEx takes m/n/k as host arrays; cuBLASLt's grouped layout
// with device shape arrays is experimental and only in cuBLAS 13.1+. So both ops are tiled
// GEMMs written here that read the group sizes on the device. They allocate nothing (no
// workspace result) and only enqueue kernels (and a copy when XLA did not alias the
// accumulator) on XLA's stream: they declare the command-buffer trait.
//
// Tiles. Every block (kThreads = 128 threads, 4 warps) computes one kBM x kBN = 64 x 64
// output tile, stepping over the reduction dimension in slabs of kBK = 32: each slab of
// both operands is staged in shared memory (zero-filled outside the matrix and outside the
// group, 16-byte vector loads where aligned), then multiplied:
//   * bf16 / f16 inputs: WMMA 16x16x16 tensor-core MMAs with fp32 accumulators, each warp
//     a 32 x 32 quarter of the tile (2 x 2 fragments);
//   * f32 inputs at precision DEFAULT or HIGH: the same with TF32 WMMA (m16n16k8, operands
//     rounded to TF32 with __float_to_tf32), XLA:GPU's rule for a float32 dot;
//   * f32 inputs at HIGHEST: full-fp32 FMAs on the CUDA cores (each thread 8 x 4 outputs).
// The fp32 tile goes through shared memory (float [64][68]) to a bounds-checked epilogue,
// which rounds once to the output dtype. Static shared memory per block (ptxas, sm_90):
// the fp32 tile 17 KiB + the operand slabs 9.5-10 (16-bit) or 17.5-18 (f32) KiB + the matmul's
// group list 2.3 KiB: 26.0 to 37.3 KiB, under the 48 KiB static limit.
// Devices below sm_80 (no bf16/TF32 WMMA) get the CUDA-core path for every dtype.
//
// Ragged matmul: grid (column tiles of N) x (row tiles of R). A block finds the groups
// whose rows intersect its row tile by a block-wide prefix sum of group_sizes (chunks of
// 128 groups, Hillis-Steele in shared memory; it stops at the first chunk that reaches
// past its tile), the group bounds clamped exactly as RaggedBounds says. For every
// intersecting non-empty group it computes the full tile with that group's weight, the
// rows outside the group read as zero, and writes only the group's rows; rows past the
// last group are written as zeros without any multiply. A tile wholly past the groups
// does no GEMM work. FLOP bound, per column tile: one 64-row pass per (row tile, group)
// pair, i.e. at most ceil(routed / 64) + (non-empty groups - 1) passes:
//   2 * K_pad * N_pad * (routed rows + 64 * G)   with K_pad, N_pad rounded up to 32, 64,
// against 2 * K * N * routed useful FLOPs. Each output element is written exactly once and
// depends on its own group's weight only (an inf/NaN in another expert does not leak).
//
// Ragged wgrad: grid (tiles of out) x (tiles of in) x G. Block (i, j, g) finds group g's
// first row (a block reduction of max(size, 0) over group_sizes[0, g)) and returns at once
// for a group of zero rows; otherwise it reduces over the rows [start, end) in slabs of
// 32 rows (the last slab zero-filled past `end`) and adds the fp32 tile into
// main_grad[g] at the clamped position base + index * stride (computed in int64 from the
// index in device memory; beta = 1; a 16-bit accumulator is widened, added and rounded
// once). Blocks own disjoint outputs: no atomics, deterministic.
// FLOP bound: 2 * out_pad * in_pad * (routed rows + 32 * G).
//
// Measured on an H200 (jax 0.11.2, built for sm_90): tests/test_ragged_gpu.py passes (every
// dtype and layout against float64 and XLA), and benchmarks/ragged_gemm_gpu.py gives
// 48-83 TFLOP/s bf16 (forward, input gradient, weight gradient) at Mixtral's and
// Qwen3-MoE's shapes, 5-8% of the 989 TFLOP/s peak and 0.12-0.21x cuBLAS's batched GEMM
// with the same useful FLOPs: the expected figure for 64 x 64 tiles, one shared-memory
// stage, no cp.async pipelining. A fallback, not a Hopper kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>

#include "common.h"
#include "convert_cuda.cuh"
#include "ragged_gemm.h"
#include "ragged_gemm_cutlass.h"
#include "wgrad_accumulate.h"
#include "xla/ffi/api/ffi.h"

// bf16 and TF32 WMMA need sm_80; older devices (only if a builder asks for them) get the
// CUDA-core path. The host pass sees 1 (it compiles no device code).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define JAX_WGRAD_RAGGED_WMMA 0  // (nvcuda::wmma has no bf16 or tf32 types there)
#else
#define JAX_WGRAD_RAGGED_WMMA 1
#endif

// 1 when ragged_gemm_cutlass.cu is part of the module (CMake: CUDA architectures with 90).
#ifndef JAX_WGRAD_CUTLASS
#define JAX_WGRAD_CUTLASS 0
#endif

namespace jax_wgrad {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kBM = 64;        // output tile rows (matmul: rows of x; wgrad: out)
constexpr int kBN = 64;        // output tile columns (matmul: N; wgrad: in)
constexpr int kBK = 32;        // reduction slab (matmul: K; wgrad: rows of the group)
constexpr int kThreads = 128;  // 4 warps, each a 32 x 32 quarter of the tile
constexpr int kCLd = kBN + 4;  // leading dim of the fp32 tile in shared memory
constexpr int64_t kMaxGridY = 65535;  // CUDA's limit for gridDim.y and gridDim.z
constexpr int64_t kMaxGridX = 2147483647;

// How a tile is multiplied: tensor cores (WMMA: bf16/f16 exact, f32 as TF32) or fp32 FMAs.
enum class Mma { kTensorCores, kFp32 };

// --- element conversions -----------------------------------------------------------------
template <typename T> struct BitsOf;
template <> struct BitsOf<float> { using type = uint32_t; };
template <> struct BitsOf<__nv_bfloat16> { using type = uint16_t; };
template <> struct BitsOf<__half> { using type = uint16_t; };


// --- operand slabs in shared memory ----------------------------------------------------------
// kRows x kCols elements of T kept as raw bits (no constructors in __shared__), each row
// padded by 16 bytes: the row stride stays a multiple of 16 bytes (vector stores) and of
// the 8 (16-bit) or 4 (f32) elements WMMA needs as a leading dimension, and every fragment
// start (rows multiple of 8, columns multiple of 8 or 16) is 32-byte aligned.
template <typename T, int kRows, int kCols>
struct Slab {
  static constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte vector
  static constexpr int kLd = kCols + kVec;
  static_assert(kCols % kVec == 0, "rows are copied in 16-byte vectors");
  typename BitsOf<T>::type v[kRows][kLd];

  __device__ __forceinline__ const T* At(int r, int c) const {
    return reinterpret_cast<const T*>(&v[r][c]);
  }
};

// Copies rows [r0, r0 + kRows) x columns [c0, c0 + kCols) of a row-major matrix `src`
// (leading dimension ld) into `slab`; rows outside [r_lo, r_hi) and columns >= c_hi read
// as zero. 16-byte vector loads where the source vector is whole and aligned, else
// element by element. Every thread of the block takes part; the caller synchronises.
template <typename T, int kRows, int kCols>
__device__ __forceinline__ void LoadSlab(Slab<T, kRows, kCols>& slab, const T* src, int64_t ld,
                                         int64_t r0, int64_t r_lo, int64_t r_hi, int64_t c0,
                                         int64_t c_hi) {
  using Bits = typename BitsOf<T>::type;
  using S = Slab<T, kRows, kCols>;
  constexpr int kVectorsPerRow = kCols / S::kVec;
  const Bits* bits = reinterpret_cast<const Bits*>(src);
  for (int q = threadIdx.x; q < kRows * kVectorsPerRow; q += kThreads) {
    const int rr = q / kVectorsPerRow;
    const int cc = (q % kVectorsPerRow) * S::kVec;
    const int64_t r = r0 + rr, c = c0 + cc;
    Bits* dst = &slab.v[rr][cc];
    if (r < r_lo || r >= r_hi || c >= c_hi) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      continue;
    }
    const Bits* from = bits + r * ld + c;
    if (c + S::kVec <= c_hi && reinterpret_cast<uintptr_t>(from) % 16 == 0) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(from);
    } else {
#pragma unroll
      for (int e = 0; e < S::kVec; ++e) dst[e] = c + e < c_hi ? from[e] : Bits(0);
    }
  }
}

// One slab of each operand of a kBM x kBN tile and the fp32 tile itself.
// kARowMajor: A(m, k) at a[m][k] (a [kBM][kBK]); else at a[k][m] (a [kBK][kBM]).
// kBRowMajor: B(k, n) at b[k][n] (b [kBK][kBN]); else at b[n][k] (b [kBN][kBK]).
template <typename T, bool kARowMajor, bool kBRowMajor>
struct alignas(128) Stage {
  using ASlab = std::conditional_t<kARowMajor, Slab<T, kBM, kBK>, Slab<T, kBK, kBM>>;
  using BSlab = std::conditional_t<kBRowMajor, Slab<T, kBK, kBN>, Slab<T, kBN, kBK>>;
  ASlab a;
  BSlab b;
  float c[kBM][kCLd];

  __device__ __forceinline__ const T* A(int m, int k) const {
    return kARowMajor ? a.At(m, k) : a.At(k, m);
  }
  __device__ __forceinline__ const T* B(int k, int n) const {
    return kBRowMajor ? b.At(k, n) : b.At(n, k);
  }
};

// --- tile accumulators -----------------------------------------------------------------------
// CUDA cores, full fp32 FMAs: thread t owns rows t / 16 + 8 * i (i < 8) and columns
// t % 16 + 16 * j (j < 4) of the tile.
template <typename T, bool kARowMajor, bool kBRowMajor>
struct Fp32Accumulator {
  using St = Stage<T, kARowMajor, kBRowMajor>;
  static_assert(kThreads == 128 && kBM == 8 * 8 && kBN == 16 * 4, "thread layout");
  float acc[8][4];
  int tr, tc;

  __device__ Fp32Accumulator() : tr(threadIdx.x / 16), tc(threadIdx.x % 16) {}
  __device__ __forceinline__ void Zero() {
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
  }
  __device__ __forceinline__ void Step(const St& s) {
#pragma unroll 4
    for (int k = 0; k < kBK; ++k) {
      float a[8], b[4];
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i] = ToF(*s.A(tr + 8 * i, k));
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = ToF(*s.B(k, tc + 16 * j));
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
  }
  __device__ __forceinline__ void Store(St& s) const {
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) s.c[tr + 8 * i][tc + 16 * j] = acc[i][j];
  }
};

#if JAX_WGRAD_RAGGED_WMMA
// Tensor cores: warp w owns rows 32 * (w / 2) + [0, 32) and columns 32 * (w % 2) + [0, 32)
// of the tile as 2 x 2 fp32 accumulator fragments.
template <typename T, bool kARowMajor, bool kBRowMajor>
struct WmmaAccumulator {
  using St = Stage<T, kARowMajor, kBRowMajor>;
  static constexpr bool kTf32 = std::is_same_v<T, float>;
  static constexpr int kK = kTf32 ? 8 : 16;  // m16n16k8 (TF32) or m16n16k16
  using In = std::conditional_t<kTf32, wmma::precision::tf32, T>;
  using ALayout = std::conditional_t<kARowMajor, wmma::row_major, wmma::col_major>;
  using BLayout = std::conditional_t<kBRowMajor, wmma::row_major, wmma::col_major>;
  static_assert(kBK % kK == 0, "whole MMA steps per slab");

  wmma::fragment<wmma::accumulator, 16, 16, kK, float> acc[2][2];
  int m0, n0;

  __device__ WmmaAccumulator() {
    const int warp = threadIdx.x / 32;
    m0 = (warp / 2) * 32;
    n0 = (warp % 2) * 32;
  }
  __device__ __forceinline__ void Zero() {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  }
  __device__ __forceinline__ void Step(const St& s) {
#pragma unroll
    for (int k = 0; k < kBK; k += kK) {
      wmma::fragment<wmma::matrix_a, 16, 16, kK, In, ALayout> a[2];
      wmma::fragment<wmma::matrix_b, 16, 16, kK, In, BLayout> b[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        wmma::load_matrix_sync(a[i], s.A(m0 + 16 * i, k), St::ASlab::kLd);
        wmma::load_matrix_sync(b[i], s.B(k, n0 + 16 * i), St::BSlab::kLd);
        if constexpr (kTf32) {
#pragma unroll
          for (int e = 0; e < a[i].num_elements; ++e) a[i].x[e] = wmma::__float_to_tf32(a[i].x[e]);
#pragma unroll
          for (int e = 0; e < b[i].num_elements; ++e) b[i].x[e] = wmma::__float_to_tf32(b[i].x[e]);
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
  }
  __device__ __forceinline__ void Store(St& s) const {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        wmma::store_matrix_sync(&s.c[m0 + 16 * i][n0 + 16 * j], acc[i][j], kCLd,
                                wmma::mem_row_major);
      }
  }
};

template <typename T, Mma kMma, bool kARowMajor, bool kBRowMajor>
using Accumulator = std::conditional_t<kMma == Mma::kTensorCores,
                                       WmmaAccumulator<T, kARowMajor, kBRowMajor>,
                                       Fp32Accumulator<T, kARowMajor, kBRowMajor>>;
#else
template <typename T, Mma kMma, bool kARowMajor, bool kBRowMajor>
using Accumulator = Fp32Accumulator<T, kARowMajor, kBRowMajor>;
#endif  // JAX_WGRAD_RAGGED_WMMA

// --- ragged matmul -------------------------------------------------------------------------
// The non-empty groups that own rows of one row tile [row0, row_end): at most kBM of them
// (each owns at least one row of the tile), bounds clipped to the tile, in no particular
// order (they own disjoint rows). `covered`: how many rows of the tile they own, which
// are [row0, row0 + covered); the rest lie past the last group.
struct TileGroups {
  int count;
  int covered;
  int group[kBM];
  int64_t start[kBM];
  int64_t end[kBM];
  int64_t scan[kThreads];
};

__device__ void FindTileGroups(const int32_t* __restrict__ sizes, int64_t groups,
                               const RaggedBounds& bounds, int64_t row0, int64_t row_end,
                               TileGroups& t) {
  const int tid = threadIdx.x;
  if (tid == 0) {
    t.count = 0;
    t.covered = 0;
  }
  int64_t carry = 0;  // sum of max(size, 0) over the groups before this chunk (same in all)
  for (int64_t base = 0; base < groups; base += kThreads) {
    const int64_t g = base + tid;
    const int32_t size = g < groups ? sizes[g] : 0;
    const int64_t rows = size > 0 ? size : 0;
    t.scan[tid] = rows;
    __syncthreads();
    for (int off = 1; off < kThreads; off <<= 1) {  // inclusive scan of the chunk
      const int64_t before = tid >= off ? t.scan[tid - off] : 0;
      __syncthreads();
      t.scan[tid] += before;
      __syncthreads();
    }
    const int64_t start = bounds.Clamp(carry + t.scan[tid] - rows);
    const int64_t end = bounds.End(start, size);
    if (g < groups && end > start && start < row_end && end > row0) {
      const int slot = atomicAdd(&t.count, 1);  // < kBM: groups own disjoint tile rows
      const int64_t s = start > row0 ? start : row0;
      const int64_t e = end < row_end ? end : row_end;
      t.group[slot] = static_cast<int>(g);
      t.start[slot] = s;
      t.end[slot] = e;
      atomicAdd(&t.covered, static_cast<int>(e - s));
    }
    carry += t.scan[kThreads - 1];
    __syncthreads();  // the chunk's scan is read before the next chunk overwrites it
    if (carry >= row_end) break;  // later groups start at or past the tile
  }
  __syncthreads();  // count, covered and the list are complete (also when groups == 0)
}

struct MatmulArgs {
  const void* x;              // [R, K]
  const void* w;              // [G, N, K] (transpose_rhs) or [G, K, N]
  const int32_t* sizes;       // [G], device memory
  void* y;                    // [R, N]
  int64_t groups, rows, k, n;
};

template <typename T, Mma kMma, bool kTransposeRhs>
__global__ void __launch_bounds__(kThreads) RaggedMatmulKernel(MatmulArgs p) {
  // A = x rows (row-major [rows, K]); B = op(w[g]) [K, N]: w[g] stored [N, K] is B
  // column-major, stored [K, N] is B row-major.
  using St = Stage<T, /*kARowMajor=*/true, /*kBRowMajor=*/!kTransposeRhs>;
  __shared__ St s;
  __shared__ TileGroups tile;
  const auto* x = static_cast<const T*>(p.x);
  const auto* w = static_cast<const T*>(p.w);
  auto* y = static_cast<T*>(p.y);
  const RaggedBounds bounds{p.rows};
  const int64_t row_tiles = (p.rows + kBM - 1) / kBM, col_tiles = (p.n + kBN - 1) / kBN;
  Accumulator<T, kMma, true, !kTransposeRhs> acc;

  for (int64_t rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
    const int64_t row0 = rt * kBM;
    const int64_t row_end = row0 + kBM < p.rows ? row0 + kBM : p.rows;
    FindTileGroups(p.sizes, p.groups, bounds, row0, row_end, tile);
    const int count = tile.count;
    const int64_t zero_from = row0 + tile.covered;
    for (int64_t ct = blockIdx.x; ct < col_tiles; ct += gridDim.x) {
      const int64_t col0 = ct * kBN;
      for (int q = 0; q < count; ++q) {
        const int64_t rs = tile.start[q], re = tile.end[q];
        const T* wg = w + static_cast<int64_t>(tile.group[q]) * p.k * p.n;
        acc.Zero();
        for (int64_t k0 = 0; k0 < p.k; k0 += kBK) {
          LoadSlab(s.a, x, p.k, row0, rs, re, k0, p.k);  // rows of group q only
          if constexpr (kTransposeRhs) {
            LoadSlab(s.b, wg, p.k, col0, 0, p.n, k0, p.k);  // w[g] rows = output columns
          } else {
            LoadSlab(s.b, wg, p.n, k0, 0, p.k, col0, p.n);  // w[g] rows = K
          }
          __syncthreads();
          acc.Step(s);
          __syncthreads();  // the slabs are read before the next k0 overwrites them
        }
        acc.Store(s);
        __syncthreads();
        for (int idx = threadIdx.x; idx < kBM * kBN; idx += kThreads) {
          const int m = idx / kBN, nn = idx % kBN;
          const int64_t r = row0 + m, c = col0 + nn;
          if (r >= rs && r < re && c < p.n) y[r * p.n + c] = FromF<T>(s.c[m][nn]);
        }
        __syncthreads();  // s.c is read before the next group's tile is stored
      }
      for (int idx = threadIdx.x; idx < kBM * kBN; idx += kThreads) {  // past the groups
        const int64_t r = row0 + idx / kBN, c = col0 + idx % kBN;
        if (r >= zero_from && r < row_end && c < p.n) y[r * p.n + c] = FromF<T>(0.0f);
      }
    }
    __syncthreads();  // the tile's group list is read before the next row tile's search
  }
}

// --- ragged wgrad ---------------------------------------------------------------------------
struct WgradArgs {
  const void* x;            // [R, in]
  const void* dy;           // [R, out]
  const int32_t* sizes;     // [G], device memory
  const int32_t* index;     // int32 scalar, device memory (read only when flat)
  BlockPosition position;   // group 0's block at position.Clamped(*index, max_offset)
  void* acc;                // the result: [G, out, in] or flat [N]
  int64_t groups, rows, in, out, max_offset;
  bool flat;
};

// Sum over the block of one int64 per thread; every thread gets it.
__device__ int64_t BlockSum(int64_t v, int64_t* scratch /* [kThreads / 32] */) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  int64_t total = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += scratch[w];
  __syncthreads();  // scratch is read before a next call writes it
  return total;
}

template <typename T, typename AccT, Mma kMma>
__global__ void __launch_bounds__(kThreads) RaggedWgradKernel(WgradArgs p) {
  // main_grad[g] (+)= A @ B with A(o, r) = dy[r, o] (dy rows staged as they lie: A
  // column-major) and B(r, i) = x[r, i] (row-major).
  using St = Stage<T, /*kARowMajor=*/false, /*kBRowMajor=*/true>;
  __shared__ St s;
  __shared__ int64_t scratch[kThreads / 32];
  const auto* x = static_cast<const T*>(p.x);
  const auto* dy = static_cast<const T*>(p.dy);
  auto* main_grad = static_cast<AccT*>(p.acc);
  const RaggedBounds bounds{p.rows};
  const int64_t out_tiles = (p.out + kBM - 1) / kBM, in_tiles = (p.in + kBN - 1) / kBN;
  Accumulator<T, kMma, false, true> acc;

  for (int64_t g = blockIdx.z; g < p.groups; g += gridDim.z) {
    int64_t before = 0;  // rows of the groups before g
    for (int64_t h = threadIdx.x; h < g; h += kThreads) {
      const int32_t size = p.sizes[h];
      before += size > 0 ? size : 0;
    }
    const int64_t start = bounds.Clamp(BlockSum(before, scratch));
    const int64_t end = bounds.End(start, p.sizes[g]);
    if (end == start) continue;  // a group of zero rows touches nothing (same in all threads)
    const int64_t block0 = (p.flat ? p.position.Clamped(*p.index, p.max_offset) : 0) +
                           g * p.out * p.in;
    for (int64_t ot = blockIdx.x; ot < out_tiles; ot += gridDim.x) {
      for (int64_t it = blockIdx.y; it < in_tiles; it += gridDim.y) {
        const int64_t o0 = ot * kBM, i0 = it * kBN;
        acc.Zero();
        for (int64_t r0 = start; r0 < end; r0 += kBK) {
          LoadSlab(s.a, dy, p.out, r0, r0, end, o0, p.out);  // [rows][out] slab
          LoadSlab(s.b, x, p.in, r0, r0, end, i0, p.in);     // [rows][in] slab
          __syncthreads();
          acc.Step(s);
          __syncthreads();
        }
        acc.Store(s);
        __syncthreads();
        for (int idx = threadIdx.x; idx < kBM * kBN; idx += kThreads) {
          const int m = idx / kBN, nn = idx % kBN;
          const int64_t o = o0 + m, i = i0 + nn;
          if (o < p.out && i < p.in) {
            AccT* dst = main_grad + block0 + o * p.in + i;
            *dst = FromF<AccT>(ToF(*dst) + s.c[m][nn]);
          }
        }
        __syncthreads();  // s.c is read before the next tile is stored
      }
    }
  }
}

#if !JAX_WGRAD_CUTLASS
}  // namespace
// Built without ragged_gemm_cutlass.cu (no sm_90 among the CUDA architectures): never
// called (CutlassDevice is false), defined so that the handlers link.
namespace ragged_cutlass {
ffi::Error PrepareDeviceBf16(int) { return ffi::Error::Success(); }
ffi::Error PrepareDeviceF16(int) { return ffi::Error::Success(); }
ffi::Error MatmulBf16(cudaStream_t, const MatmulProblem&, const Scratch&) {
  return ffi::Error::Internal("ragged_matmul: built without the CUTLASS kernels");
}
ffi::Error MatmulF16(cudaStream_t, const MatmulProblem&, const Scratch&) {
  return ffi::Error::Internal("ragged_matmul: built without the CUTLASS kernels");
}
ffi::Error WgradBf16(cudaStream_t, const WgradProblem&, const Scratch&) {
  return ffi::Error::Internal("ragged_wgrad_accumulate: built without the CUTLASS kernels");
}
ffi::Error WgradF16(cudaStream_t, const WgradProblem&, const Scratch&) {
  return ffi::Error::Internal("ragged_wgrad_accumulate: built without the CUTLASS kernels");
}
}  // namespace ragged_cutlass
namespace {
#endif  // !JAX_WGRAD_CUTLASS

// --- kernel choice -------------------------------------------------------------------------
// CUTLASS where it applies (kAuto) unless JAX_WGRAD_RAGGED_KERNEL=wmma (the module
// refuses any other value when it loads). tests/test_ragged_gpu.py and
// benchmarks/ragged_gemm_gpu.py have run both kernels on an H200.
RaggedKernel KernelFromEnvironment() {
  const char* v = std::getenv("JAX_WGRAD_RAGGED_KERNEL");
  return v != nullptr && std::strcmp(v, "wmma") == 0 ? RaggedKernel::kWmma
                                                     : RaggedKernel::kAuto;
}
std::atomic<int> g_kernel{static_cast<int>(KernelFromEnvironment())};
std::atomic<int64_t> g_cutlass_launches{0};
std::atomic<int64_t> g_wmma_launches{0};

// What the handlers need to know of a device, queried once (initialize stage, or the first
// execute should a runtime skip that stage: cudaDeviceGetAttribute is a plain query).
struct DeviceFacts {
  int major = 0, minor = 0, sm_count = 0;
  bool cutlass_ready = false;  // PrepareDevice done
};

std::mutex& FactsMutex() {
  static auto* mu = new std::mutex();
  return *mu;
}
std::unordered_map<int, DeviceFacts>& FactsTable() {
  static auto* table = new std::unordered_map<int, DeviceFacts>();
  return *table;
}

ffi::ErrorOr<DeviceFacts> GetDeviceFacts(int device) {
  std::lock_guard<std::mutex> lock(FactsMutex());
  auto it = FactsTable().find(device);
  if (it != FactsTable().end()) return it->second;
  DeviceFacts f;
  for (auto [attr, out] : {std::pair{cudaDevAttrComputeCapabilityMajor, &f.major},
                           std::pair{cudaDevAttrComputeCapabilityMinor, &f.minor},
                           std::pair{cudaDevAttrMultiProcessorCount, &f.sm_count}}) {
    if (cudaError_t e = cudaDeviceGetAttribute(out, attr, device); e != cudaSuccess) {
      return ffi::Unexpected(ffi::Error::Internal(
          std::string("ragged GEMMs: cudaDeviceGetAttribute failed: ") + cudaGetErrorString(e)));
    }
  }
#if JAX_WGRAD_CUTLASS
  if (f.major == 9 && f.minor == 0) {
    if (ffi::Error err = ragged_cutlass::PrepareDevice(device); err.failure()) {
      return ffi::Unexpected(err);
    }
    f.cutlass_ready = true;
  }
#endif
  FactsTable()[device] = f;
  return f;
}

// Whether the CUTLASS kernels may run on `f`'s device for 16-bit operands.
bool CutlassDevice(const DeviceFacts& f) {
  return JAX_WGRAD_CUTLASS && f.cutlass_ready &&
         static_cast<RaggedKernel>(g_kernel.load()) == RaggedKernel::kAuto;
}

ffi::Error CheckScratch(const char* op, const ffi::AnyBuffer& scratch) {
  if (scratch.element_type() != ffi::DataType::U8 || scratch.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": the scratch result must be uint8 [bytes], got " +
                                       ShapeString(scratch));
  }
  return ffi::Error::Success();
}

// The scratch result, if it holds what ragged_gemm_cutlass.h's layout needs for G groups.
bool ScratchFits(const ffi::AnyBuffer& scratch, int64_t groups) {
  return static_cast<int64_t>(scratch.size_bytes()) >= ragged_cutlass::ScratchBytes(groups);
}

// --- handlers -------------------------------------------------------------------------------
ffi::Error CudaError(const char* op, const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string(op) + ": " + what + " failed: " +
                              cudaGetErrorString(e));
}

unsigned GridDim(int64_t tiles, int64_t limit) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(tiles, limit)));
}

template <typename T, Mma kMma>
void LaunchMatmul(cudaStream_t stream, const MatmulArgs& p, bool transpose_rhs) {
  const dim3 grid(GridDim((p.n + kBN - 1) / kBN, kMaxGridX),
                  GridDim((p.rows + kBM - 1) / kBM, kMaxGridY));
  if (transpose_rhs) {
    RaggedMatmulKernel<T, kMma, true><<<grid, kThreads, 0, stream>>>(p);
  } else {
    RaggedMatmulKernel<T, kMma, false><<<grid, kThreads, 0, stream>>>(p);
  }
}

ffi::Error RaggedMatmulCudaBody(cudaStream_t stream, int device, ffi::AnyBuffer x,
                                ffi::AnyBuffer w, ffi::AnyBuffer sizes,
                                ffi::Result<ffi::AnyBuffer> y,
                                ffi::Result<ffi::AnyBuffer> scratch, int32_t transpose_rhs,
                                int32_t precision) {
  const char* op = "ragged_matmul";
  RaggedDims d;
  if (ffi::Error err =
          CheckRaggedMatmulArgs(x, w, sizes, *y, transpose_rhs, precision, &d);
      err.failure()) {
    return err;
  }
  if (ffi::Error err = CheckScratch(op, *scratch); err.failure()) return err;
  if (d.rows == 0 || d.n == 0) return ffi::Error::Success();  // y is empty
  const ffi::DataType t = x.element_type();
  if (t == ffi::DataType::BF16 || t == ffi::DataType::F16) {
    auto facts = GetDeviceFacts(device);
    if (facts.has_error()) return facts.error();
    const ragged_cutlass::MatmulProblem cp{
        x.untyped_data(), w.untyped_data(),
        static_cast<const int32_t*>(sizes.untyped_data()), y->untyped_data(), d.groups,
        d.rows, d.k, d.n, d.transpose_rhs, t == ffi::DataType::F16};
    if (CutlassDevice(*facts) && d.k > 0 && ragged_cutlass::CanMatmul(cp) &&
        ScratchFits(*scratch, d.groups)) {
      g_cutlass_launches.fetch_add(1, std::memory_order_relaxed);
      return ragged_cutlass::Matmul(
          stream, cp,
          {scratch->untyped_data(), static_cast<int64_t>(scratch->size_bytes()), device,
           facts->sm_count});
    }
  }
  g_wmma_launches.fetch_add(1, std::memory_order_relaxed);
  const MatmulArgs p{x.untyped_data(), w.untyped_data(),
                     static_cast<const int32_t*>(sizes.untyped_data()), y->untyped_data(),
                     d.groups, d.rows, d.k, d.n};
  switch (x.element_type()) {
    case ffi::DataType::BF16:
      LaunchMatmul<__nv_bfloat16, Mma::kTensorCores>(stream, p, d.transpose_rhs);
      break;
    case ffi::DataType::F16:
      LaunchMatmul<__half, Mma::kTensorCores>(stream, p, d.transpose_rhs);
      break;
    default:  // F32 (validated)
      if (d.precision == Precision::kHighest) {
        LaunchMatmul<float, Mma::kFp32>(stream, p, d.transpose_rhs);
      } else {
        LaunchMatmul<float, Mma::kTensorCores>(stream, p, d.transpose_rhs);
      }
      break;
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return CudaError(op, "kernel launch", e);
  }
  return ffi::Error::Success();
}

template <typename T, typename AccT, Mma kMma>
void LaunchWgrad(cudaStream_t stream, const WgradArgs& p) {
  const dim3 grid(GridDim((p.out + kBM - 1) / kBM, kMaxGridX),
                  GridDim((p.in + kBN - 1) / kBN, kMaxGridY), GridDim(p.groups, kMaxGridY));
  RaggedWgradKernel<T, AccT, kMma><<<grid, kThreads, 0, stream>>>(p);
}

template <typename T>
void LaunchWgradFor(cudaStream_t stream, const WgradArgs& p, bool acc_is_f32) {
  if (acc_is_f32) {
    LaunchWgrad<T, float, Mma::kTensorCores>(stream, p);
  } else {
    LaunchWgrad<T, T, Mma::kTensorCores>(stream, p);
  }
}

ffi::Error RaggedWgradCudaBody(cudaStream_t stream, int device, ffi::AnyBuffer x,
                               ffi::AnyBuffer dy, ffi::AnyBuffer sizes, ffi::AnyBuffer acc,
                               ffi::AnyBuffer offset, ffi::Result<ffi::AnyBuffer> result,
                               ffi::Result<ffi::AnyBuffer> scratch, int64_t base,
                               int64_t stride, int32_t precision) {
  const char* op = "ragged_wgrad_accumulate";
  RaggedDims d;
  if (ffi::Error err = CheckRaggedWgradArgs(x, dy, sizes, acc, offset, *result, base, stride,
                                            precision, &d);
      err.failure()) {
    return err;
  }
  if (ffi::Error err = CheckScratch(op, *scratch); err.failure()) return err;
  if (result->untyped_data() != acc.untyped_data()) {  // XLA did not alias: start from acc
    if (cudaError_t e = cudaMemcpyAsync(result->untyped_data(), acc.untyped_data(),
                                        acc.size_bytes(), cudaMemcpyDeviceToDevice, stream);
        e != cudaSuccess) {
      return CudaError(op, "cudaMemcpyAsync", e);
    }
  }
  if (d.groups == 0 || d.rows == 0 || d.k == 0 || d.n == 0) return ffi::Error::Success();
  const ffi::DataType t = x.element_type();
  if ((t == ffi::DataType::BF16 || t == ffi::DataType::F16) &&
      acc.element_type() == ffi::DataType::F32) {
    auto facts = GetDeviceFacts(device);
    if (facts.has_error()) return facts.error();
    const ragged_cutlass::WgradProblem cp{x.untyped_data(),
                                          dy.untyped_data(),
                                          static_cast<const int32_t*>(sizes.untyped_data()),
                                          static_cast<const int32_t*>(offset.untyped_data()),
                                          d.position,
                                          static_cast<float*>(result->untyped_data()),
                                          d.groups,
                                          d.rows,
                                          /*in=*/d.k,
                                          /*out=*/d.n,
                                          d.max_offset,
                                          d.flat,
                                          t == ffi::DataType::F16};
    if (CutlassDevice(*facts) && ragged_cutlass::CanWgrad(cp) &&
        ScratchFits(*scratch, d.groups)) {
      g_cutlass_launches.fetch_add(1, std::memory_order_relaxed);
      return ragged_cutlass::Wgrad(
          stream, cp,
          {scratch->untyped_data(), static_cast<int64_t>(scratch->size_bytes()), device,
           facts->sm_count});
    }
  }
  g_wmma_launches.fetch_add(1, std::memory_order_relaxed);
  const WgradArgs p{x.untyped_data(),
                    dy.untyped_data(),
                    static_cast<const int32_t*>(sizes.untyped_data()),
                    static_cast<const int32_t*>(offset.untyped_data()),
                    d.position,
                    result->untyped_data(),
                    d.groups,
                    d.rows,
                    /*in=*/d.k,
                    /*out=*/d.n,
                    d.max_offset,
                    d.flat};
  const bool acc_is_f32 = acc.element_type() == ffi::DataType::F32;
  switch (x.element_type()) {
    case ffi::DataType::BF16:
      LaunchWgradFor<__nv_bfloat16>(stream, p, acc_is_f32);
      break;
    case ffi::DataType::F16:
      LaunchWgradFor<__half>(stream, p, acc_is_f32);
      break;
    default:  // F32 inputs: the accumulator is F32 (validated)
      if (d.precision == Precision::kHighest) {
        LaunchWgrad<float, float, Mma::kFp32>(stream, p);
      } else {
        LaunchWgrad<float, float, Mma::kTensorCores>(stream, p);
      }
      break;
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return CudaError(op, "kernel launch", e);
  }
  return ffi::Error::Success();
}

ffi::Error RaggedMatmulCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                ffi::AnyBuffer w, ffi::AnyBuffer sizes,
                                ffi::Result<ffi::AnyBuffer> y,
                                ffi::Result<ffi::AnyBuffer> scratch, int32_t transpose_rhs,
                                int32_t precision) {
  return Guarded("ragged_matmul", [&] {
    return RaggedMatmulCudaBody(stream, device, x, w, sizes, y, scratch, transpose_rhs,
                                precision);
  });
}

ffi::Error RaggedWgradCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                               ffi::AnyBuffer dy, ffi::AnyBuffer sizes, ffi::AnyBuffer acc,
                               ffi::AnyBuffer offset, ffi::Result<ffi::AnyBuffer> result,
                               ffi::Result<ffi::AnyBuffer> scratch, int64_t base,
                               int64_t stride, int32_t precision) {
  return Guarded("ragged_wgrad_accumulate", [&] {
    return RaggedWgradCudaBody(stream, device, x, dy, sizes, acc, offset, result, scratch,
                               base, stride, precision);
  });
}

// Initialize stage (both targets): the device's facts, and the CUTLASS kernels' shared
// memory limit, before any run or CUDA-graph capture.
ffi::Error RaggedGemmCudaInitializeImpl(int32_t device) {
  return Guarded("ragged GEMMs", [&]() -> ffi::Error {
    auto facts = GetDeviceFacts(device);
    if (facts.has_error()) return facts.error();
    return ffi::Error::Success();
  });
}

}  // namespace

void SetRaggedKernel(RaggedKernel kernel) { g_kernel.store(static_cast<int>(kernel)); }
RaggedKernel GetRaggedKernel() { return static_cast<RaggedKernel>(g_kernel.load()); }
RaggedLaunches GetRaggedLaunches() {
  return {g_cutlass_launches.load(), g_wmma_launches.load()};
}
bool RaggedCutlassBuilt() { return JAX_WGRAD_CUTLASS != 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedGemmCudaInitialize, RaggedGemmCudaInitializeImpl,
                              ffi::Ffi::BindInitialize()
                                  .Ctx<ffi::DeviceOrdinal>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedMatmulCuda, RaggedMatmulCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()  // XLA's device of the call
                                  .Arg<ffi::AnyBuffer>()  // x            [R, K]
                                  .Arg<ffi::AnyBuffer>()  // w            [G, N, K] / [G, K, N]
                                  .Arg<ffi::AnyBuffer>()  // group_sizes  int32 [G], device
                                  .Ret<ffi::AnyBuffer>()  // y            [R, N]
                                  .Ret<ffi::AnyBuffer>()  // CUTLASS scratch, uint8 (or [0])
                                  .Attr<int32_t>("transpose_rhs")  // 1: w is [G, N, K]
                                  .Attr<int32_t>("precision"),     // 0/1/2: TF32 unless 2
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedWgradAccumulateCuda, RaggedWgradCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()  // XLA's device of the call
                                  .Arg<ffi::AnyBuffer>()  // x            [R, in]
                                  .Arg<ffi::AnyBuffer>()  // dy           [R, out]
                                  .Arg<ffi::AnyBuffer>()  // group_sizes  int32 [G], device
                                  .Arg<ffi::AnyBuffer>()  // main_grad    [G, out, in] / [N]
                                  .Arg<ffi::AnyBuffer>()  // offset       int32 [] index, device
                                  .Ret<ffi::AnyBuffer>()  // main_grad    (aliased)
                                  .Ret<ffi::AnyBuffer>()  // CUTLASS scratch, uint8 (or [0])
                                  .Attr<int64_t>("base")           // group 0's block at base +
                                  .Attr<int64_t>("stride")         // index * stride, clamped
                                  .Attr<int32_t>("precision"),     // 0/1/2: TF32 unless 2
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_wgrad
