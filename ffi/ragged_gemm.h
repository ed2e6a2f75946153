// Shared argument checking for the ragged grouped GEMM FFI handlers (CPU and CUDA): the
// expert GEMMs of a dropless MoE layer, whose tokens are sorted by expert into G
// contiguous groups of rows whose sizes are known only at run time.
//
// Groups. group_sizes is an int32 [G] operand (host memory on the CPU, device memory on a
// GPU: read by the kernels, never copied to the host). Group g owns the rows
// [GroupStart(g), GroupEnd(g)) of the R rows, where sizes are taken as max(size, 0) and
// every bound is clamped into [0, R] (RaggedBounds): rows past the last group belong to
// no group. A group of zero rows does nothing.
//
// jax_wgrad_ragged_matmul (forward and input gradient):
//   y[r, :] = x[r, :] @ op(w[g])  for every row r of group g;  y[r, :] = 0 past the groups
//   x [R, K] and w of the same dtype (f32, bf16 or f16); y [R, N] of that dtype, accumulated
//   in fp32 and rounded once. Attribute transpose_rhs: 1 -> w is [G, N, K] and
//   op(w) = w^T (forward of a linear with weights [E, out, in]); 0 -> w is [G, K, N] and
//   op(w) = w (its input gradient: dy [R, out] @ w[g] [out, in]).
//
// jax_wgrad_ragged_wgrad_accumulate (fused weight gradient, in place):
//   main_grad[g] += dy[rows of g]^T @ x[rows of g]   for every group g
//   x [R, in], dy [R, out] (same dtype: f32, bf16 or f16); main_grad either [G, out, in] or
//   a flat [N] bucket holding the G row-major [out, in] blocks back to back from element
//   base + offset * stride on (a BlockPosition, wgrad_accumulate.h): int64 attributes base
//   and stride, offset an int32 scalar operand (host memory on the CPU, device memory on a
//   GPU), combined in int64 and CLAMPED into [0, N - G * out * in] like the start index of
//   XLA's DynamicUpdateSlice; for a [G, out, in] accumulator they are not read.
//   main_grad is f32 for any input dtype, or the 16-bit dtype of the inputs (accumulated in
//   fp32, rounded once). Result 0 is main_grad (aliased by the caller).
//
// Both: attribute precision numbered like XLA's PrecisionConfig (wgrad_accumulate.h).
#ifndef JAX_WGRAD_FFI_RAGGED_GEMM_H_
#define JAX_WGRAD_FFI_RAGGED_GEMM_H_

#include <cstdint>
#include <string>

#include "common.h"
#include "wgrad_accumulate.h"
#include "xla/ffi/api/ffi.h"

namespace jax_wgrad {

// Row bounds of the groups: start of group g = clamp(sum_{h<g} max(size_h, 0), 0, rows).
struct RaggedBounds {
  int64_t rows;
  JAX_WGRAD_HOST_DEVICE int64_t Clamp(int64_t r) const {
    return r < 0 ? 0 : (r > rows ? rows : r);
  }
  // [start, end) of group g, given start = the clamped end of group g - 1 (0 for g = 0).
  JAX_WGRAD_HOST_DEVICE int64_t End(int64_t start, int32_t size) const {
    return Clamp(start + (size > 0 ? size : 0));
  }
};

// Problem sizes of one ragged call, after validation.
struct RaggedDims {
  int64_t groups = 0;  // G
  int64_t rows = 0;    // R
  int64_t k = 0;       // reduction dim of the forward GEMM (x features); wgrad: `in`
  int64_t n = 0;       // output features; wgrad: `out`
  bool transpose_rhs = true;
  // wgrad only: elements of the accumulator, and whether it is flat (offset operand read).
  int64_t acc_elements = 0;
  bool flat = false;
  int64_t max_offset = 0;  // N - G * out * in (flat)
  BlockPosition position;  // of group 0's block (flat)
  Precision precision = Precision::kDefault;
};

inline ffi::Error CheckPrecision(const char* op, int32_t precision) {
  if (precision < 0 || precision > 2) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": precision must be 0 (DEFAULT), 1 (HIGH) or 2 (HIGHEST), got " +
        std::to_string(precision));
  }
  return ffi::Error::Success();
}

// `describe()`: the operands for an error message, formatted only when one is returned (a
// handler that runs every step formats nothing on success).
template <typename Describe>
ffi::Error CheckGroupSizes(const char* op, const ffi::AnyBuffer& sizes, Describe describe) {
  if (sizes.element_type() != ffi::DataType::S32 || sizes.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": group_sizes must be int32 [G]" + describe());
  }
  return ffi::Error::Success();
}

// jax_wgrad_ragged_matmul: x [R, K], w [G, N, K] (transpose_rhs) or [G, K, N],
// group_sizes [G], y [R, N].
inline ffi::Error CheckRaggedMatmulArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                                        const ffi::AnyBuffer& sizes, const ffi::AnyBuffer& y,
                                        int32_t transpose_rhs, int32_t precision,
                                        RaggedDims* dims) {
  const char* op = "ragged_matmul";
  auto describe = [&] {
    return " (x=" + ShapeString(x) + ", w=" + ShapeString(w) + ", group_sizes=" +
           ShapeString(sizes) + ", y=" + ShapeString(y) + ")";
  };
  if (ffi::Error err = CheckGroupSizes(op, sizes, describe); err.failure()) return err;
  if (ffi::Error err = CheckPrecision(op, precision); err.failure()) return err;
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2) {
    return ffi::Error::InvalidArgument(
        "ragged_matmul: x must be [R, K], w [G, N, K] or [G, K, N], y [R, N]" + describe());
  }
  if (transpose_rhs != 0 && transpose_rhs != 1) {
    return ffi::Error::InvalidArgument("ragged_matmul: transpose_rhs must be 0 or 1, got " +
                                       std::to_string(transpose_rhs));
  }
  const int64_t g = wd[0];
  const int64_t k = transpose_rhs ? wd[2] : wd[1];
  const int64_t n = transpose_rhs ? wd[1] : wd[2];
  if (sizes.dimensions()[0] != g || xd[1] != k || yd[0] != xd[0] || yd[1] != n) {
    return ffi::Error::InvalidArgument(
        "ragged_matmul: shapes disagree: need group_sizes [G], x [R, K], y [R, N] for w " +
        std::string(transpose_rhs ? "[G, N, K]" : "[G, K, N]") + describe());
  }
  const ffi::DataType t = x.element_type();
  if (!IsSupportedFloat(t) || w.element_type() != t || y.element_type() != t) {
    return ffi::Error::InvalidArgument(
        "ragged_matmul: x, w and y must share one dtype: float32, bfloat16 or float16" +
        describe());
  }
  dims->groups = g;
  dims->rows = xd[0];
  dims->k = k;
  dims->n = n;
  dims->transpose_rhs = transpose_rhs != 0;
  dims->precision = static_cast<Precision>(precision);
  return ffi::Error::Success();
}

// jax_wgrad_ragged_wgrad_accumulate: x [R, in], dy [R, out], group_sizes [G],
// main_grad [G, out, in] or flat [N], offset int32 [] (the index of base + offset * stride),
// result like main_grad.
inline ffi::Error CheckRaggedWgradArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& dy,
                                       const ffi::AnyBuffer& sizes, const ffi::AnyBuffer& acc,
                                       const ffi::AnyBuffer& offset,
                                       const ffi::AnyBuffer& result, int64_t base,
                                       int64_t stride, int32_t precision, RaggedDims* dims) {
  const char* op = "ragged_wgrad_accumulate";
  auto describe = [&] {
    return " (x=" + ShapeString(x) + ", dy=" + ShapeString(dy) + ", group_sizes=" +
           ShapeString(sizes) + ", main_grad=" + ShapeString(acc) + ")";
  };
  if (ffi::Error err = CheckGroupSizes(op, sizes, describe); err.failure()) return err;
  if (ffi::Error err = CheckPrecision(op, precision); err.failure()) return err;
  auto xd = x.dimensions(), gd = dy.dimensions(), ad = acc.dimensions();
  if (xd.size() != 2 || gd.size() != 2 || xd[0] != gd[0]) {
    return ffi::Error::InvalidArgument(
        "ragged_wgrad_accumulate: x and dy must be [R, in] and [R, out]" + describe());
  }
  const int64_t g = sizes.dimensions()[0], in = xd[1], out = gd[1];
  const bool flat = ad.size() == 1;
  if (flat) {
    if (ad[0] < g * out * in) {
      return ffi::Error::InvalidArgument(
          "ragged_wgrad_accumulate: a flat main_grad must hold G * out * in elements" +
          describe());
    }
  } else if (ad.size() != 3 || ad[0] != g || ad[1] != out || ad[2] != in) {
    return ffi::Error::InvalidArgument(
        "ragged_wgrad_accumulate: main_grad must be [G, out, in] or flat [N]" + describe());
  }
  if (offset.element_type() != ffi::DataType::S32 || offset.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "ragged_wgrad_accumulate: offset must be an int32 scalar (the index of base + "
        "index * stride), got " + ShapeString(offset));
  }
  if (ffi::Error err = CheckBlockPosition(op, base, stride, &dims->position); err.failure()) {
    return err;
  }
  const ffi::DataType in_t = x.element_type(), acc_t = acc.element_type();
  if (!IsSupportedFloat(in_t) || dy.element_type() != in_t) {
    return ffi::Error::InvalidArgument(
        "ragged_wgrad_accumulate: x and dy must both be float32, bfloat16 or float16" +
        describe());
  }
  if (!(acc_t == ffi::DataType::F32 || (in_t != ffi::DataType::F32 && acc_t == in_t))) {
    return ffi::Error::InvalidArgument(
        "ragged_wgrad_accumulate: main_grad must be float32, or the 16-bit dtype of the "
        "inputs" + describe());
  }
  if (result.element_type() != acc_t || result.element_count() != acc.element_count()) {
    return ffi::Error::InvalidArgument(
        "ragged_wgrad_accumulate: result must have main_grad's shape and dtype" + describe());
  }
  dims->groups = g;
  dims->rows = xd[0];
  dims->k = in;
  dims->n = out;
  dims->acc_elements = static_cast<int64_t>(acc.element_count());
  dims->flat = flat;
  dims->max_offset = flat ? ad[0] - g * out * in : 0;
  dims->precision = static_cast<Precision>(precision);
  return ffi::Error::Success();
}

}  // namespace jax_wgrad

#endif  // JAX_WGRAD_FFI_RAGGED_GEMM_H_
