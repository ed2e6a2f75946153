// Shared argument checking for the fp8_wgrad_accumulate FFI handlers (CPU and CUDA).
//
// Operation (FP8 training, Megatron/TransformerEngine's wgrad GEMM with fused accumulation):
//   main_grad[out, in] += (dy_scale_inv * dy[T, out])^T @ (x_scale_inv * x[T, in])
// x is float8_e4m3fn; dy is float8_e4m3fn or float8_e5m2 (Megatron's "hybrid" format:
// E5M2 gradients); x_scale_inv and dy_scale_inv are float32 scalars ([] or [1]: the
// dequantization factors, TransformerEngine's scale_inv); main_grad is float32, either
// [out, in] or a flat buffer [N] holding the row-major [out, in] block at an element
// offset. No batch dims: the Python op flattens leading dims into tokens and vmaps
// sequentially.
//
// Block offset: as for wgrad_accumulate (wgrad_accumulate.h): an int64 attribute `offset`
// (checked: out of range is an error), or, for jax_wgrad_fp8_wgrad_accumulate_at, the
// position base + index * stride (int64 attributes, an int32 scalar operand `index`)
// combined in int64 and CLAMPED into [0, N - out * in] (BlockPosition::Clamped).
#ifndef JAX_WGRAD_FFI_FP8_WGRAD_H_
#define JAX_WGRAD_FFI_FP8_WGRAD_H_

#include <cstdint>
#include <initializer_list>
#include <string>

#include "common.h"
#include "wgrad_accumulate.h"
#include "xla/ffi/api/ffi.h"

namespace jax_wgrad {

inline bool IsFp8(ffi::DataType t) {
  return t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E5M2;
}

// Validates ranks, shapes and dtypes of one call; fills `dims` (batch = groups = 1).
// `flat_only`: the position form, whose accumulator must be flat with N >= out * in (the
// offset is then not checked: it is clamped).
inline ffi::Error CheckFp8WgradArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& dy,
                                    const ffi::AnyBuffer& acc, const ffi::AnyBuffer& x_scale_inv,
                                    const ffi::AnyBuffer& dy_scale_inv,
                                    const ffi::AnyBuffer& out, int64_t offset, bool flat_only,
                                    WgradDims* dims) {
  auto describe = [&]() {
    return " (x=" + ShapeString(x) + ", dy=" + ShapeString(dy) + ", main_grad=" +
           ShapeString(acc) + ", x_scale_inv=" + ShapeString(x_scale_inv) +
           ", dy_scale_inv=" + ShapeString(dy_scale_inv) + ")";
  };
  auto xd = x.dimensions(), gd = dy.dimensions(), ad = acc.dimensions();
  if (xd.size() != 2 || gd.size() != 2 || xd[0] != gd[0]) {
    return ffi::Error::InvalidArgument(
        "fp8_wgrad_accumulate: x and dy must be [T, in] and [T, out] with the same T" +
        describe());
  }
  if (x.element_type() != ffi::DataType::F8E4M3FN || !IsFp8(dy.element_type())) {
    return ffi::Error::InvalidArgument(
        "fp8_wgrad_accumulate: x must be float8_e4m3fn and dy float8_e4m3fn or "
        "float8_e5m2" + describe());
  }
  for (const ffi::AnyBuffer* s : {&x_scale_inv, &dy_scale_inv}) {
    if (s->element_type() != ffi::DataType::F32 || s->element_count() != 1 ||
        s->dimensions().size() > 1) {
      return ffi::Error::InvalidArgument(
          "fp8_wgrad_accumulate: x_scale_inv and dy_scale_inv must be float32 scalars "
          "([] or [1])" + describe());
    }
  }
  if (acc.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument(
        "fp8_wgrad_accumulate: main_grad must be float32" + describe());
  }
  const int64_t tokens = xd[0], in = xd[1], outs = gd[1], block = in * outs;
  if (ad.size() == 1) {
    const int64_t n = ad[0];
    if (flat_only ? n < block : (offset < 0 || offset > n - block)) {
      return ffi::Error::InvalidArgument(
          "fp8_wgrad_accumulate: block [offset, offset + out * in) = [" +
          std::to_string(offset) + ", " + std::to_string(offset + block) +
          ") exceeds the flat main_grad" + describe());
    }
    dims->max_offset = n - block;
  } else if (flat_only) {
    return ffi::Error::InvalidArgument(
        "fp8_wgrad_accumulate: an operand offset needs a flat main_grad [N]" + describe());
  } else if (ad.size() != 2 || ad[0] != outs || ad[1] != in || offset != 0) {
    return ffi::Error::InvalidArgument(
        "fp8_wgrad_accumulate: main_grad must be [out, in] = [dy features, x features] "
        "with offset 0, or flat [N]" + describe());
  }
  if (out.element_type() != ffi::DataType::F32 ||
      out.element_count() != acc.element_count()) {
    return ffi::Error::InvalidArgument(
        "fp8_wgrad_accumulate: result must have main_grad's shape and dtype" + describe());
  }
  dims->tokens = tokens;
  dims->in = in;
  dims->out = outs;
  dims->offset = offset;
  dims->acc_stride = acc.element_count();
  dims->precision = Precision::kHighest;  // fp8 products are exact; fp32 accumulation
  return ffi::Error::Success();
}

// CheckFp8WgradArgs for jax_wgrad_fp8_wgrad_accumulate_at: a flat accumulator, an exact
// position (CheckBlockPosition) and an int32 scalar index operand.
inline ffi::Error CheckFp8WgradAtArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& dy,
                                      const ffi::AnyBuffer& acc,
                                      const ffi::AnyBuffer& x_scale_inv,
                                      const ffi::AnyBuffer& dy_scale_inv,
                                      const ffi::AnyBuffer& index, const ffi::AnyBuffer& out,
                                      int64_t base, int64_t stride, WgradDims* dims,
                                      BlockPosition* position) {
  if (ffi::Error err = CheckFp8WgradArgs(x, dy, acc, x_scale_inv, dy_scale_inv, out, 0,
                                         /*flat_only=*/true, dims);
      err.failure()) {
    return err;
  }
  if (ffi::Error err = CheckBlockPosition("fp8_wgrad_accumulate", base, stride, position);
      err.failure()) {
    return err;
  }
  if (index.element_type() != ffi::DataType::S32 || index.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "fp8_wgrad_accumulate: the index operand must be an int32 scalar (the index of base "
        "+ index * stride), got " + ShapeString(index));
  }
  return ffi::Error::Success();
}

}  // namespace jax_wgrad

#endif  // JAX_WGRAD_FFI_FP8_WGRAD_H_
