// Shared argument checking for the wgrad_accumulate FFI handlers (CPU and CUDA).
//
// Operation, per batch element b (batch dims only appear under jax.vmap):
//   main_grad[b, out, in] += dy[b, T, out]^T @ x[b, T, in]
// Grouped (experts): x [..., G, T, in], dy [..., G, T, out] and a flat main_grad [..., N]
// one rank lower than in the flat layout, whose G [out, in] blocks lie back to back from
// element `offset` on: block g at [offset + g * out * in, offset + (g + 1) * out * in).
// x and dy are f32, bf16 or f16 (the same dtype); main_grad is f32 for any input dtype,
// or the input dtype itself when it is 16-bit (accumulated in fp32, rounded once).
//
// Block offset: an int64 attribute (static, checked: out of range is an error), or, for
// the jax_wgrad_wgrad_accumulate_at target, a block POSITION base + index * stride: int64
// attributes `base` and `stride` and an int32 operand `index` [...batch] (one per batch
// element; traced in JAX), combined in int64 (BlockPosition) and CLAMPED into
// [0, N - G * out * in] like the start index of XLA's DynamicUpdateSlice (a negative
// position becomes 0). An int32 offset of the Python API is base 0, stride 1.
#ifndef JAX_WGRAD_FFI_WGRAD_ACCUMULATE_H_
#define JAX_WGRAD_FFI_WGRAD_ACCUMULATE_H_

#include <cstdint>
#include <limits>
#include <string>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace jax_wgrad {

// Matmul precision of float32 inputs, numbered like XLA's PrecisionConfig (and
// jax.lax.Precision): DEFAULT and HIGH allow TF32 on GPUs that have it (what XLA:GPU
// does for a float32 dot), HIGHEST computes in full fp32. 16-bit inputs are multiplied
// exactly and accumulated in fp32 at every precision.
enum class Precision : int32_t { kDefault = 0, kHigh = 1, kHighest = 2 };

// Problem sizes of one call, after validation.
struct WgradDims {
  int64_t batch = 1;       // product of leading (vmap) dims
  int64_t groups = 1;      // G: [out, in] blocks back to back in one flat accumulator
  int64_t tokens = 0;      // T
  int64_t in = 0;          // x features (columns of main_grad)
  int64_t out = 0;         // dy features (rows of main_grad)
  int64_t offset = 0;      // element offset of the [out, in] block in the accumulator
  int64_t acc_stride = 0;  // elements per batch element of the accumulator
  int64_t max_offset = 0;  // largest valid block offset of a flat accumulator
  // Operand offsets, already clamped, one per batch element (host memory), or nullptr:
  // then `offset` holds for every batch element.
  const int64_t* batch_offsets = nullptr;
  Precision precision = Precision::kDefault;

  // Element offset in the accumulator of the block of batch element b, group g.
  int64_t AccOffset(int64_t b, int64_t g) const {
    return b * acc_stride + (batch_offsets ? batch_offsets[b] : offset) + g * out * in;
  }
};

// A block position base + index * stride (jax_wgrad/ops/position.py: BlockOffset): the
// static base and stride are int64 attributes, the index an int32 operand (a layer of a
// scan, a model chunk). CheckBlockPosition guarantees |base| + 2^31 * |stride| <= 2^63 - 1,
// so the value is exact in int64 for every int32 index: buckets past 2^31 elements.
struct BlockPosition {
  int64_t base = 0;
  int64_t stride = 0;

  // base + index * stride clamped into [0, max_offset]: XLA DynamicUpdateSlice's rule for
  // a start index, on the exact 64-bit value.
  JAX_WGRAD_HOST_DEVICE int64_t Clamped(int32_t index, int64_t max_offset) const {
    const int64_t position = base + static_cast<int64_t>(index) * stride;
    return position < 0 ? 0 : (position > max_offset ? max_offset : position);
  }
};

// The attributes of a BlockPosition, checked (the Python API refuses the same values).
inline ffi::Error CheckBlockPosition(const char* op, int64_t base, int64_t stride,
                                     BlockPosition* position) {
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kIndexMagnitude = int64_t{1} << 31;  // |int32 index| <= 2^31
  const bool exact = base != kMin && stride != kMin &&
                     (stride < 0 ? -stride : stride) <=
                         (kMax - (base < 0 ? -base : base)) / kIndexMagnitude;
  if (!exact) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": the block position base + index * stride must be exact in "
        "int64 for every int32 index (|base| + 2^31 * |stride| <= 2^63 - 1), got base=" +
        std::to_string(base) + ", stride=" + std::to_string(stride));
  }
  position->base = base;
  position->stride = stride;
  return ffi::Error::Success();
}

// Validates ranks, shapes and dtypes; fills `dims`. Returns an InvalidArgument error
// naming the offending operands otherwise. The accumulator is either a matrix
// [..., out, in] (offset 0), a flat buffer [..., N] holding the row-major [out, in]
// block at elements [offset, offset + out * in) (a parameter's slice of a gradient
// bucket), or, grouped, a flat buffer [..., N] two ranks below x holding G blocks.
inline ffi::Error CheckWgradArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& dy,
                                 const ffi::AnyBuffer& acc, const ffi::AnyBuffer& out,
                                 int64_t offset, int32_t precision, WgradDims* dims) {
  auto describe = [&]() {
    return " (x=" + ShapeString(x) + ", dy=" + ShapeString(dy) +
           ", main_grad=" + ShapeString(acc) + ")";
  };
  auto xd = x.dimensions(), gd = dy.dimensions(), ad = acc.dimensions();
  const size_t rank = xd.size();
  const bool grouped = rank >= 3 && ad.size() + 2 == rank;
  const bool flat = grouped || ad.size() + 1 == rank;
  if (rank < 2 || gd.size() != rank || !(ad.size() == rank || flat)) {
    return ffi::Error::InvalidArgument(
        "wgrad_accumulate: x and dy must have equal rank >= 2 and main_grad the same "
        "rank, one less (flat buffer) or two less (flat buffer of grouped blocks)" +
        describe());
  }
  const size_t batch_dims = grouped ? rank - 3 : rank - 2;
  int64_t batch = 1;
  for (size_t i = 0; i < batch_dims; ++i) {
    if (xd[i] != gd[i] || xd[i] != ad[i]) {
      return ffi::Error::InvalidArgument(
          "wgrad_accumulate: leading (batch) dims differ" + describe());
    }
    batch *= xd[i];
  }
  const int64_t groups = grouped ? xd[rank - 3] : 1;
  if (grouped && gd[rank - 3] != groups) {
    return ffi::Error::InvalidArgument(
        "wgrad_accumulate: x and dy must have the same number of groups" + describe());
  }
  if (xd[rank - 2] != gd[rank - 2]) {
    return ffi::Error::InvalidArgument(
        "wgrad_accumulate: x and dy must have the same number of tokens" + describe());
  }
  const int64_t block = gd[rank - 1] * xd[rank - 1];
  if (flat) {
    const int64_t n = ad[ad.size() - 1];
    if (offset < 0 || offset > n - groups * block) {
      return ffi::Error::InvalidArgument(
          "wgrad_accumulate: block [offset, offset + groups * out * in) = [" +
          std::to_string(offset) + ", " + std::to_string(offset + groups * block) +
          ") exceeds the flat main_grad" + describe());
    }
    dims->acc_stride = n;
    dims->max_offset = n - groups * block;
  } else {
    if (ad[rank - 2] != gd[rank - 1] || ad[rank - 1] != xd[rank - 1] || offset != 0) {
      return ffi::Error::InvalidArgument(
          "wgrad_accumulate: main_grad must be [out, in] = [dy features, x features] "
          "with offset 0" + describe());
    }
    dims->acc_stride = block;
  }
  if (precision < 0 || precision > 2) {
    return ffi::Error::InvalidArgument(
        "wgrad_accumulate: precision must be 0 (DEFAULT), 1 (HIGH) or 2 (HIGHEST), got " +
        std::to_string(precision));
  }
  const ffi::DataType in_t = x.element_type();
  if (!IsSupportedFloat(in_t) || dy.element_type() != in_t) {
    return ffi::Error::InvalidArgument(
        "wgrad_accumulate: x and dy must both be float32, bfloat16 or float16" +
        describe());
  }
  const ffi::DataType acc_t = acc.element_type();
  if (!(acc_t == ffi::DataType::F32 || (in_t != ffi::DataType::F32 && acc_t == in_t))) {
    return ffi::Error::InvalidArgument(
        "wgrad_accumulate: main_grad must be float32, or the 16-bit dtype of the inputs" +
        describe());
  }
  if (out.element_type() != acc_t || out.element_count() != acc.element_count()) {
    return ffi::Error::InvalidArgument(
        "wgrad_accumulate: result must have main_grad's shape and dtype" + describe());
  }
  dims->batch = batch;
  dims->groups = groups;
  dims->tokens = xd[rank - 2];
  dims->in = xd[rank - 1];
  dims->out = gd[rank - 1];
  dims->offset = offset;
  dims->precision = static_cast<Precision>(precision);
  return ffi::Error::Success();
}

// CheckWgradArgs for the position form (jax_wgrad_wgrad_accumulate_at): the accumulator
// must be flat (N >= G * out * in), `offset` (the index of the position) an int32 array
// with one element per batch element, and base / stride exact (CheckBlockPosition). The
// positions themselves are not checked (they are clamped).
inline ffi::Error CheckWgradAtArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& dy,
                                   const ffi::AnyBuffer& acc, const ffi::AnyBuffer& out,
                                   const ffi::AnyBuffer& offset, int64_t base, int64_t stride,
                                   int32_t precision, WgradDims* dims,
                                   BlockPosition* position) {
  if (ffi::Error err = CheckWgradArgs(x, dy, acc, out, 0, precision, dims); err.failure()) {
    return err;
  }
  if (ffi::Error err = CheckBlockPosition("wgrad_accumulate", base, stride, position);
      err.failure()) {
    return err;
  }
  if (acc.dimensions().size() == x.dimensions().size()) {
    return ffi::Error::InvalidArgument(
        "wgrad_accumulate: an operand offset needs a flat main_grad [..., N] (main_grad=" +
        ShapeString(acc) + ")");
  }
  if (offset.element_type() != ffi::DataType::S32 ||
      static_cast<int64_t>(offset.element_count()) != dims->batch) {
    return ffi::Error::InvalidArgument(
        "wgrad_accumulate: the offset operand must be int32 with one element per batch "
        "element (" + std::to_string(dims->batch) + ": the index of base + index * "
        "stride), got " + ShapeString(offset));
  }
  return ffi::Error::Success();
}

}  // namespace jax_wgrad

#endif  // JAX_WGRAD_FFI_WGRAD_ACCUMULATE_H_
