// The CUTLASS 3.x sm90 grouped GEMMs behind the CUDA ragged handlers (ragged_gemm_cuda.cu),
// and the run-time kernel choice the extension module exposes.
//
// ragged_gemm_cutlass.cu (built only for sm_90a, when the build's CUDA architectures
// include 90; JAX_WGRAD_CUTLASS is then 1) defines the ragged_cutlass functions; the
// handlers call them for bf16/f16 operands on a compute capability 9.0 device when the
// shapes meet TMA's alignment (CanMatmul / CanWgrad), else they run their WMMA kernels.
//
// Scratch. The custom calls' second result is one uint8 buffer of ScratchBytes(G) bytes,
// sized at lowering time (jax_wgrad/ops/ragged.py mirrors the constants below): CUTLASS's
// workspace (kWorkspaceBytes, 256-byte aligned) followed by the per-group device arrays
// that a set-up kernel fills from group_sizes on the device (problem shapes, A/B/C/D
// pointers and strides). The workspace CUTLASS asks for grows with the SM count only
// (per SM: 128-byte TMA descriptors, 2 for A/B and 3 for C/D; 84,480 bytes for 132 SMs);
// the handler checks it against kWorkspaceBytes on every call and returns an FFI error
// on a device with more SMs than it holds.
#ifndef JAX_WGRAD_FFI_RAGGED_GEMM_CUTLASS_H_
#define JAX_WGRAD_FFI_RAGGED_GEMM_CUTLASS_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"
#include "wgrad_accumulate.h"
#include "xla/ffi/api/ffi.h"

namespace jax_wgrad {

// Which kernels the ragged handlers may run: kAuto (CUTLASS where it applies, else WMMA)
// or kWmma (always the WMMA kernels). Process-wide; initially from the environment
// variable JAX_WGRAD_RAGGED_KERNEL ("auto" or "wmma", read when the module is loaded).
// Read by the handlers each time they enqueue work: a call already recorded into a CUDA
// graph keeps the kernel it was recorded with.
enum class RaggedKernel : int { kAuto = 0, kWmma = 1 };
void SetRaggedKernel(RaggedKernel kernel);
RaggedKernel GetRaggedKernel();

// How many times the handlers enqueued each kind of kernel (both ops), since load.
struct RaggedLaunches {
  int64_t cutlass = 0;
  int64_t wmma = 0;
};
RaggedLaunches GetRaggedLaunches();

// Whether the CUTLASS grouped GEMMs were compiled into this module.
bool RaggedCutlassBuilt();

namespace ragged_cutlass {

constexpr int64_t kScratchAlignment = 256;       // the workspace start (TMA descriptors)
constexpr int64_t kWorkspaceBytes = 128 << 10;   // CUTLASS workspace, <= 204 SMs
constexpr int64_t kPerGroupBytes = 128;          // shapes, 4 pointers, 4 strides (<= 112)
constexpr int64_t kArraySlack = 256;             // 16-byte alignment of the 9 arrays
constexpr int64_t ScratchBytes(int64_t groups) {
  return kScratchAlignment + kWorkspaceBytes + kArraySlack + groups * kPerGroupBytes;
}

// jax_wgrad_ragged_matmul on 16-bit data (ragged_gemm.h): y [R, N], x [R, K], w
// [G, N, K] (transpose_rhs) or [G, K, N].
struct MatmulProblem {
  const void* x;
  const void* w;
  const int32_t* sizes;  // [G], device memory
  void* y;
  int64_t groups, rows, k, n;
  bool transpose_rhs;
  bool f16;  // else bf16
};

// jax_wgrad_ragged_wgrad_accumulate on 16-bit data into an fp32 accumulator.
struct WgradProblem {
  const void* x;          // [R, in]
  const void* dy;         // [R, out]
  const int32_t* sizes;   // [G], device memory
  const int32_t* index;   // int32 scalar, device memory (read only when flat)
  BlockPosition position;
  float* acc;             // [G, out, in] or flat [N]
  int64_t groups, rows, in, out, max_offset;
  bool flat;
  bool f16;  // else bf16
};

// The scratch result and the device's SM count (the persistent grid).
struct Scratch {
  void* data;
  int64_t bytes;
  int device;
  int sm_count;
};

// Shape and alignment conditions of TMA (16-byte aligned starts and row strides for
// every group, 32-bit extents), checked on the host from what it knows.
constexpr int64_t kInt32Max = 2147483647;
inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline bool CanMatmul(const MatmulProblem& p) {
  // 16-byte rows and group starts: K and N multiples of 8 16-bit elements.
  return p.k % 8 == 0 && p.n % 8 == 0 && p.rows <= kInt32Max && p.k <= kInt32Max &&
         p.n <= kInt32Max && p.groups <= kInt32Max && Aligned16(p.x) && Aligned16(p.w) &&
         Aligned16(p.y);
}

inline bool CanWgrad(const WgradProblem& p) {
  // dy and x rows (and every group's start) 16-byte aligned: out, in multiples of 8; every
  // fp32 block 16-byte aligned whatever the index: the block (out * in, a multiple of 64)
  // and, flat, base, stride and the clamp's end max_offset multiples of 4 elements (the
  // rule of jax_wgrad/ops/position.py: provably_aligned).
  const bool blocks_aligned =
      !p.flat || (p.position.base % 4 == 0 && p.position.stride % 4 == 0 &&
                  p.max_offset % 4 == 0);
  return p.in % 8 == 0 && p.out % 8 == 0 && p.rows <= kInt32Max && p.in <= kInt32Max &&
         p.out <= kInt32Max && p.groups <= kInt32Max && Aligned16(p.x) && Aligned16(p.dy) &&
         Aligned16(p.acc) && blocks_aligned;
}

// Per dtype (one object each, ragged_gemm_cutlass.cu): PrepareDevice* lets the kernels use
// their dynamic shared memory on `device` (cudaFuncSetAttribute; once per device, before
// the first launch: from the handlers' initialize stage); Matmul* / Wgrad* enqueue the
// set-up kernel and the grouped GEMM on `stream`, nothing else.
ffi::Error PrepareDeviceBf16(int device);
ffi::Error PrepareDeviceF16(int device);
ffi::Error MatmulBf16(cudaStream_t stream, const MatmulProblem& p, const Scratch& scratch);
ffi::Error MatmulF16(cudaStream_t stream, const MatmulProblem& p, const Scratch& scratch);
ffi::Error WgradBf16(cudaStream_t stream, const WgradProblem& p, const Scratch& scratch);
ffi::Error WgradF16(cudaStream_t stream, const WgradProblem& p, const Scratch& scratch);

inline ffi::Error PrepareDevice(int device) {
  ffi::Error err = PrepareDeviceBf16(device);
  return err.failure() ? err : PrepareDeviceF16(device);
}
inline ffi::Error Matmul(cudaStream_t stream, const MatmulProblem& p, const Scratch& s) {
  return p.f16 ? MatmulF16(stream, p, s) : MatmulBf16(stream, p, s);
}
inline ffi::Error Wgrad(cudaStream_t stream, const WgradProblem& p, const Scratch& s) {
  return p.f16 ? WgradF16(stream, p, s) : WgradBf16(stream, p, s);
}

}  // namespace ragged_cutlass
}  // namespace jax_wgrad

#endif  // JAX_WGRAD_FFI_RAGGED_GEMM_CUTLASS_H_
