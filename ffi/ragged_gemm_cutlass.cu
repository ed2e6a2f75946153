// CUTLASS 3.x sm90 grouped GEMMs for the ragged handlers (ragged_gemm_cutlass.h says when
// they run). Compiled only for sm_90a (wgmma and TMA need the arch-specific target), once
// per 16-bit dtype (JAX_WGRAD_CUTLASS_F16 = 0: bf16, 1: f16; the build compiles the two
// objects in parallel: each takes 1.5 to 2 minutes of nvcc).
//
// Configuration (one for all six kernels), checked against CUTLASS 4.2's headers and its
// example 57_hopper_grouped_gemm:
//   * kernel schedule KernelPtrArrayTmaWarpSpecializedCooperative and epilogue schedule
//     PtrArrayTmaWarpSpecializedCooperative (cutlass/gemm/dispatch_policy.hpp,
//     cutlass/epilogue/dispatch_policy.hpp): TMA loads, two consumer warp groups of wgmma,
//     a persistent grid of one CTA per SM walking the groups' tiles
//     (kernel/sm90_tile_scheduler_group.hpp), the per-group TMA descriptors rewritten on
//     the device from the problem shapes, pointers and strides in device memory;
//   * ProblemShape GroupProblemShape<Shape<int, int, int>> with no host problem shapes
//     (group_array_problem_shape.hpp: host_problem_shapes = nullptr; the scheduler then
//     launches hw_info.sm_count CTAs and reads the shapes on the device);
//   * TileShape 128 x 256 x 64, ClusterShape 2 x 1 x 1 (the B tile, the wider one, is
//     multicast to both CTAs of a cluster), StageCountAutoCarveout by the epilogue's shared
//     storage, EpilogueTileAuto; fp32 accumulation (ElementAccumulator = float);
//   * layouts (detail/layout.hpp, TagToStrideA/B/C of `Layout*`):
//       forward, w [G, N, K]:  A = x RowMajor (K-major), B = w[g] ColumnMajor (B(n, k) at
//                              n * K + k: K-major), D = y RowMajor;
//       input gradient, w [G, K, N]: B = w[g] RowMajor (B(n, k) at k * N + n: N-major);
//       wgrad: M = out, N = in, K = rows of the group: A(o, r) = dy[r, o] at r * out + o:
//              ColumnMajor A (M-major), B(i, r) = x[r, i] at r * in + i: RowMajor B
//              (N-major), C = D = the accumulator block RowMajor, fp32;
//     wgmma reads 16-bit operands of either major from shared memory
//     (sm90_gmma_builder.inl, gmma_ss_tag_to_major_A/B), so dy^T needs no transpose;
//   * epilogue fusion LinearCombination (D = alpha * acc + beta * C): the forward has no C
//     (ElementC = void: no source load), alpha = 1; the wgrad has C = D, alpha = beta = 1
//     (the in-place accumulation; the epilogue loads each C tile before it stores the same
//     tile of D).
// Groups of zero rows: the forward gives them M = 0 and the wgrad M = 0, K = 1 (never a
// K = 0 problem): no tiles, nothing touched. The forward's rows past the last group are
// zeroed by the set-up kernel's grid.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "ragged_gemm.h"
#include "ragged_gemm_cutlass.h"

#if !defined(JAX_WGRAD_CUTLASS_F16)
#error "compile with -DJAX_WGRAD_CUTLASS_F16=0 (bf16) or 1 (f16)"
#endif
#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "the CUTLASS grouped GEMMs need a CUDA toolkit with sm90 modifiable TMA (12.3+)"
#endif

namespace jax_wgrad {
namespace ragged_cutlass {
namespace {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using Shape3 = ProblemShape::UnderlyingProblemShape;
using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

// One grouped GEMM: T the 16-bit input type, ElementC void (no source) or = ElementD.
template <typename T, typename LayoutA, typename LayoutB, typename ElementC, typename ElementD>
struct Grouped {
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<T>::value;       // 16 bytes
  static constexpr int kAlignCD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, RowMajor*,
      kAlignCD, ElementD, RowMajor*, kAlignCD,
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, LayoutA*, kAlignAB, T, LayoutB*,
      kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using CPtr = const typename Epilogue::ElementC*;  // never read when ElementC is void

  // The per-group arrays, carved from the scratch after the workspace.
  struct Arrays {
    Shape3* shapes;
    const T** a;
    const T** b;
    CPtr* c;
    ElementD** d;
    StrideA* sa;
    StrideB* sb;
    StrideC* sc;
    StrideD* sd;
  };
  static_assert(sizeof(Shape3) + 4 * sizeof(void*) + sizeof(StrideA) + sizeof(StrideB) +
                        sizeof(StrideC) + sizeof(StrideD) <=
                    kPerGroupBytes,
                "the lowering's per-group scratch (jax_wgrad/ops/ragged.py) is too small");
};

// Forward (w [G, N, K]) and input gradient (w [G, K, N]), and the wgrad into fp32.
template <typename T>
using MatmulNK = Grouped<T, RowMajor, ColumnMajor, void, T>;
template <typename T>
using MatmulKN = Grouped<T, RowMajor, RowMajor, void, T>;
template <typename T>
using WgradF32 = Grouped<T, ColumnMajor, RowMajor, float, float>;

// This object's 16-bit dtype, CUTLASS's type (same bits as __nv_bfloat16 / __half).
#if JAX_WGRAD_CUTLASS_F16
using Elem = cutlass::half_t;
#define JAX_WGRAD_CUTLASS_ENTRY(name) name##F16
#else
using Elem = cutlass::bfloat16_t;
#define JAX_WGRAD_CUTLASS_ENTRY(name) name##Bf16
#endif

int64_t AlignUp(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// The workspace (256-byte aligned start) and the arrays after it; false if the scratch
// result is smaller than the lowering promised.
template <typename G>
bool Carve(const Scratch& s, int64_t groups, void** workspace, typename G::Arrays* arrays) {
  const auto base = reinterpret_cast<uintptr_t>(s.data);
  const uintptr_t start = (base + kScratchAlignment - 1) & ~uintptr_t(kScratchAlignment - 1);
  int64_t used = static_cast<int64_t>(start - base) + kWorkspaceBytes;
  *workspace = reinterpret_cast<void*>(start);
  char* p = static_cast<char*>(s.data) + used;
  auto take = [&](auto*& array, size_t element) {
    using Ptr = std::remove_reference_t<decltype(array)>;
    const int64_t bytes = AlignUp(groups * static_cast<int64_t>(element), 16);
    array = reinterpret_cast<Ptr>(p);
    p += bytes;
    used += bytes;
  };
  take(arrays->shapes, sizeof(Shape3));
  take(arrays->a, sizeof(void*));
  take(arrays->b, sizeof(void*));
  take(arrays->c, sizeof(void*));
  take(arrays->d, sizeof(void*));
  take(arrays->sa, sizeof(typename G::StrideA));
  take(arrays->sb, sizeof(typename G::StrideB));
  take(arrays->sc, sizeof(typename G::StrideC));
  take(arrays->sd, sizeof(typename G::StrideD));
  return used <= s.bytes;
}

// --- set-up kernels ---------------------------------------------------------------------
constexpr int kSetupThreads = 256;

// Calls visit(g, start, end) for every group g (thread g % kSetupThreads), the bounds
// clamped as RaggedBounds says (block-wide Hillis-Steele scans of 256-group chunks), and
// returns the rows the groups cover (the last group's end; the same in every thread).
template <typename Visit>
__device__ int64_t ForEachGroup(const int32_t* __restrict__ sizes, int64_t groups,
                                int64_t rows, Visit visit) {
  __shared__ int64_t scan[kSetupThreads];
  const RaggedBounds bounds{rows};
  const int tid = threadIdx.x;
  int64_t carry = 0;  // rows of the groups before this chunk (unclamped, exact in int64)
  for (int64_t first = 0; first < groups; first += kSetupThreads) {
    const int64_t g = first + tid;
    const int32_t size = g < groups ? sizes[g] : 0;
    const int64_t own = size > 0 ? size : 0;
    scan[tid] = own;
    __syncthreads();
    for (int off = 1; off < kSetupThreads; off <<= 1) {
      const int64_t before = tid >= off ? scan[tid - off] : 0;
      __syncthreads();
      scan[tid] += before;
      __syncthreads();
    }
    const int64_t start = bounds.Clamp(carry + scan[tid] - own);
    if (g < groups) visit(g, start, bounds.End(start, size));
    carry += scan[kSetupThreads - 1];
    __syncthreads();  // read before the next chunk overwrites it
  }
  return bounds.Clamp(carry);
}

template <typename G, typename T>
__global__ void __launch_bounds__(kSetupThreads)
    MatmulSetupKernel(MatmulProblem p, typename G::Arrays arrays, typename G::StrideA sa,
                      typename G::StrideB sb, typename G::StrideD sd) {
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.w);
  T* y = static_cast<T*>(p.y);
  const bool writer = blockIdx.x == 0;
  const int64_t covered =
      ForEachGroup(p.sizes, p.groups, p.rows, [&](int64_t g, int64_t start, int64_t end) {
        if (!writer) return;
        arrays.shapes[g] = Shape3(static_cast<int>(end - start), static_cast<int>(p.n),
                                  static_cast<int>(p.k));
        arrays.a[g] = x + start * p.k;
        arrays.b[g] = w + g * p.k * p.n;
        arrays.c[g] = nullptr;  // no source (ElementC void)
        arrays.d[g] = y + start * p.n;
        arrays.sa[g] = sa;
        arrays.sb[g] = sb;
        arrays.sc[g] = typename G::StrideC{};
        arrays.sd[g] = sd;
      });
  // Rows past the groups are zeros: [covered * n, rows * n) in 16-byte vectors (n is a
  // multiple of 8 elements, so the range is whole vectors).
  auto* tail = reinterpret_cast<uint4*>(y + covered * p.n);
  const int64_t vectors = (p.rows - covered) * p.n / 8;
  for (int64_t i = blockIdx.x * int64_t{kSetupThreads} + threadIdx.x; i < vectors;
       i += int64_t{gridDim.x} * kSetupThreads) {
    tail[i] = make_uint4(0, 0, 0, 0);
  }
}

template <typename G, typename T>
__global__ void __launch_bounds__(kSetupThreads)
    WgradSetupKernel(WgradProblem p, typename G::Arrays arrays, typename G::StrideA sa,
                     typename G::StrideB sb, typename G::StrideC sc) {
  const T* x = static_cast<const T*>(p.x);
  const T* dy = static_cast<const T*>(p.dy);
  const int64_t block0 = p.flat ? p.position.Clamped(*p.index, p.max_offset) : 0;
  ForEachGroup(p.sizes, p.groups, p.rows, [&](int64_t g, int64_t start, int64_t end) {
    // A group of zero rows: M = 0 (no tiles; K = 1, never a K = 0 problem).
    arrays.shapes[g] = end > start ? Shape3(static_cast<int>(p.out), static_cast<int>(p.in),
                                            static_cast<int>(end - start))
                                   : Shape3(0, static_cast<int>(p.in), 1);
    float* block = p.acc + block0 + g * p.out * p.in;
    arrays.a[g] = dy + start * p.out;
    arrays.b[g] = x + start * p.in;
    arrays.c[g] = block;
    arrays.d[g] = block;
    arrays.sa[g] = sa;
    arrays.sb[g] = sb;
    arrays.sc[g] = sc;
    arrays.sd[g] = sc;
  });
}

// --- launching ----------------------------------------------------------------------------
ffi::Error Failed(const char* op, const char* what, const std::string& detail) {
  return ffi::Error::Internal(std::string(op) + ": CUTLASS grouped GEMM: " + what + detail);
}

// Builds the arguments, checks the workspace and enqueues the GEMM (no host sync, no
// allocation; cudaFuncSetAttribute was done by PrepareDevice).
template <typename G>
ffi::Error RunGrouped(const char* op, cudaStream_t stream, int64_t groups,
                      const typename G::Arrays& arrays, void* workspace, const Scratch& s,
                      float beta) {
  typename G::Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(groups), arrays.shapes, nullptr};
  args.mainloop = {arrays.a, arrays.sa, arrays.b, arrays.sb};
  args.epilogue.ptr_C = arrays.c;
  args.epilogue.dC = arrays.sc;
  args.epilogue.ptr_D = arrays.d;
  args.epilogue.dD = arrays.sd;
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = beta;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {cute::_0{}, cute::_0{}, 0};
  fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
  args.hw_info.device_id = s.device;
  args.hw_info.sm_count = s.sm_count;
  const size_t need = G::Gemm::get_workspace_size(args);
  if (need > static_cast<size_t>(kWorkspaceBytes)) {
    return Failed(op, "workspace too small: ",
                  "this device (" + std::to_string(s.sm_count) + " SMs) needs " +
                      std::to_string(need) + " bytes, the lowering reserves " +
                      std::to_string(kWorkspaceBytes) +
                      " (ffi/ragged_gemm_cutlass.h: kWorkspaceBytes); set "
                      "JAX_WGRAD_RAGGED_KERNEL=wmma to use the fallback kernels");
  }
  if (cutlass::Status st = G::Gemm::can_implement(args); st != cutlass::Status::kSuccess) {
    return Failed(op, "can_implement: ", cutlassGetStatusString(st));
  }
  if (cutlass::Status st = G::Kernel::initialize_workspace(args, workspace, stream);
      st != cutlass::Status::kSuccess) {
    return Failed(op, "initialize_workspace: ", cutlassGetStatusString(st));
  }
  typename G::Kernel::Params params = G::Kernel::to_underlying_arguments(args, workspace);
  if (cutlass::Status st = G::Gemm::run(params, stream); st != cutlass::Status::kSuccess) {
    return Failed(op, "launch: ", cutlassGetStatusString(st));
  }
  return ffi::Error::Success();
}

template <typename G>
ffi::Error SetSharedMemory() {
  constexpr int kSmem = G::Kernel::SharedStorageSize;
  if (kSmem >= (48 << 10)) {
    if (cudaError_t e = cudaFuncSetAttribute(cutlass::device_kernel<typename G::Kernel>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
        e != cudaSuccess) {
      return ffi::Error::Internal(std::string("ragged GEMMs: cudaFuncSetAttribute failed: ") +
                                  cudaGetErrorString(e));
    }
  }
  return ffi::Error::Success();
}

template <typename G, typename T>
ffi::Error MatmulAs(cudaStream_t stream, const MatmulProblem& p, const Scratch& s) {
  const char* op = "ragged_matmul";
  void* workspace = nullptr;
  typename G::Arrays arrays;
  if (!Carve<G>(s, p.groups, &workspace, &arrays)) {
    return Failed(op, "scratch result too small: ", std::to_string(s.bytes) + " bytes");
  }
  typename G::StrideA sa{};
  typename G::StrideB sb{};
  typename G::StrideD sd{};
  cute::get<0>(sa) = p.k;                       // x rows: dM = K
  if constexpr (cute::is_same_v<G, MatmulNK<T>>) {
    cute::get<0>(sb) = p.k;                     // w[g] [N, K]: dN = K
  } else {
    cute::get<1>(sb) = p.n;                     // w[g] [K, N]: dK = N
  }
  cute::get<0>(sd) = p.n;                       // y rows: dM = N
  // Enough blocks to zero a tail of up to R rows quickly; block 0 writes the arrays.
  const int64_t vectors = p.rows * p.n / 8;
  const int64_t blocks = std::clamp<int64_t>((vectors + 4 * kSetupThreads - 1) /
                                                 (4 * kSetupThreads),
                                             1, 8 * int64_t{s.sm_count});
  MatmulSetupKernel<G, T><<<static_cast<unsigned>(blocks), kSetupThreads, 0, stream>>>(
      p, arrays, sa, sb, sd);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return Failed(op, "set-up kernel launch: ", cudaGetErrorString(e));
  }
  return RunGrouped<G>(op, stream, p.groups, arrays, workspace, s, 0.0f);
}

template <typename T>
ffi::Error WgradAs(cudaStream_t stream, const WgradProblem& p, const Scratch& s) {
  using G = WgradF32<T>;
  const char* op = "ragged_wgrad_accumulate";
  void* workspace = nullptr;
  typename G::Arrays arrays;
  if (!Carve<G>(s, p.groups, &workspace, &arrays)) {
    return Failed(op, "scratch result too small: ", std::to_string(s.bytes) + " bytes");
  }
  typename G::StrideA sa{};
  typename G::StrideB sb{};
  typename G::StrideC sc{};
  cute::get<1>(sa) = p.out;  // A = dy^T, column-major: dK = out
  cute::get<1>(sb) = p.in;   // B(i, r) = x[r, i]: dK = in
  cute::get<0>(sc) = p.in;   // the [out, in] block, row-major: dM = in
  WgradSetupKernel<G, T><<<1, kSetupThreads, 0, stream>>>(p, arrays, sa, sb, sc);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return Failed(op, "set-up kernel launch: ", cudaGetErrorString(e));
  }
  return RunGrouped<G>(op, stream, p.groups, arrays, workspace, s, 1.0f);
}

}  // namespace

ffi::Error JAX_WGRAD_CUTLASS_ENTRY(PrepareDevice)(int device) {
  int previous = 0;
  if (cudaError_t e = cudaGetDevice(&previous); e != cudaSuccess) {
    return ffi::Error::Internal(std::string("ragged GEMMs: cudaGetDevice failed: ") +
                                cudaGetErrorString(e));
  }
  if (previous != device) {
    if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
      return ffi::Error::Internal(std::string("ragged GEMMs: cudaSetDevice failed: ") +
                                  cudaGetErrorString(e));
    }
  }
  ffi::Error err = ffi::Error::Success();
  for (auto set : {&SetSharedMemory<MatmulNK<Elem>>, &SetSharedMemory<MatmulKN<Elem>>,
                   &SetSharedMemory<WgradF32<Elem>>}) {
    if (err.success()) err = set();
  }
  if (previous != device) cudaSetDevice(previous);
  return err;
}

ffi::Error JAX_WGRAD_CUTLASS_ENTRY(Matmul)(cudaStream_t stream, const MatmulProblem& p,
                                          const Scratch& s) {
  return p.transpose_rhs ? MatmulAs<MatmulNK<Elem>, Elem>(stream, p, s)
                         : MatmulAs<MatmulKN<Elem>, Elem>(stream, p, s);
}

ffi::Error JAX_WGRAD_CUTLASS_ENTRY(Wgrad)(cudaStream_t stream, const WgradProblem& p,
                                         const Scratch& s) {
  return WgradAs<Elem>(stream, p, s);
}

}  // namespace ragged_cutlass
}  // namespace jax_wgrad
