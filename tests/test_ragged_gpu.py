"""The CUDA ragged grouped GEMMs (``ffi/ragged_gemm_cuda.cu``) on a GPU.

Both ops against float64 (computed in numpy from the already rounded inputs, with the
error bound of fp32 accumulation, widened by TF32's input rounding at DEFAULT precision)
and against the plain-XLA references on the same GPU, over f32 at DEFAULT and HIGHEST
(HIGHEST must meet the full-fp32 bound, so a TF32 path there fails), bf16 and f16, both
weight layouts, 16-bit accumulators, sizes that are not multiples of the 64 x 64 x 32
tiles (and 16-byte aligned ones, the vector-load path), skewed group sizes with empty and
negative ones, sizes summing past R, more groups than one 128-group scan chunk, and a flat
bucket at an unaligned traced offset (clamped). Rows past the groups must be zeros
(matmul) or never read (wgrad: NaNs there change nothing), and another expert's inf
weights must not leak into a group's rows. One test (``cuda_handler``, no GPU needed)
checks what the handlers declare and how the ops lower for CUDA.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_wgrad import ops
from jax_wgrad.ops import registry

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
U = {jnp.dtype(F32): 2.0**-24, jnp.dtype(BF16): 2.0**-8, jnp.dtype(F16): 2.0**-11}
TF32_U = 2.0**-11  # unit roundoff of TF32's 10-bit mantissa

# rows R, group_sizes
_MANY = np.random.default_rng(99).integers(0, 7, 160)
_MANY[[0, 5, 127, 128, 159]] = 0  # empty groups, two at the 128-group chunk boundary
SIZES = {
    # 268 of 300 rows in groups: a zero and a negative (= zero) size, one single row
    "skewed": (300, [50, 0, 113, 1, 64, 40, -3]),
    # sizes summing past R: group 2 is cut at R, group 3 lies wholly past it (empty)
    "past_rows": (300, [200, 0, 150, 7]),
    # 160 groups (two scan chunks), most of a few rows, several in one 64-row tile
    "many": (int(_MANY.sum()) + 21, _MANY.tolist()),
}


def _gpu():
    return jax.devices("gpu")[0]


def _rand(seed, shape, dtype):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _groups(sizes, rows):
    """[start, end) of every group, clamped as ffi/ragged_gemm.h says."""
    out, start = [], 0
    for s in sizes:
        end = min(start + max(int(s), 0), rows)
        out.append((start, end))
        start = end
    return out


def _f64(a):
    return np.asarray(a, np.float64)


def _accumulation(dtype, precision, terms):
    """Bound factor on |computed - exact| per unit of sum |a||b| of a dot of ``terms``
    products: fp32 accumulation (any order; a margin of 2), plus, for float32 below
    HIGHEST, TF32 conversion of both inputs (rounded: 2 u; truncated, as a GEMM library
    may do: 4 u; allowed 5 u)."""
    bound = 2 * (terms + 2) * U[jnp.dtype(F32)]
    if jnp.dtype(dtype) == jnp.dtype(F32) and precision != "highest":
        bound += 5 * TF32_U
    return bound


# ------------------------------------------------------------------------ ragged_matmul
def _matmul_exact(x, w, sizes, transpose_rhs):
    """float64 y and sum |x||op(w)| per element (zeros past the groups)."""
    x64, w64 = _f64(x), _f64(w)
    n = w64.shape[1] if transpose_rhs else w64.shape[2]
    exact, magnitude = np.zeros((x64.shape[0], n)), np.zeros((x64.shape[0], n))
    for g, (s, e) in enumerate(_groups(sizes, x64.shape[0])):
        wg = w64[g].T if transpose_rhs else w64[g]
        exact[s:e] = x64[s:e] @ wg
        magnitude[s:e] = np.abs(x64[s:e]) @ np.abs(wg)
    return exact, magnitude


MATMUL_DTYPES = [(F32, "default"), (F32, "highest"), (BF16, None), (F16, None)]


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(70, 130), (64, 128)], ids=["ragged_tiles", "aligned"])
@pytest.mark.parametrize("case", list(SIZES))
@pytest.mark.parametrize("transpose_rhs", [True, False], ids=["w_NK", "w_KN"])
@pytest.mark.parametrize(
    "dtype,precision", MATMUL_DTYPES, ids=["f32", "f32_highest", "bf16", "f16"]
)
def test_matmul_matches_float64_and_reference(dtype, precision, transpose_rhs, case, k, n):
    rows, sizes = SIZES[case]
    g = len(sizes)
    x = _rand(1, (rows, k), dtype)
    w = _rand(2, (g, n, k) if transpose_rhs else (g, k, n), dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    x, w, group_sizes = jax.device_put((x, w, group_sizes), _gpu())
    opts = {"transpose_rhs": transpose_rhs, "precision": precision}
    got = jax.jit(functools.partial(ops.ragged_matmul, **opts))(x, w, group_sizes)
    assert got.shape == (rows, n) and got.dtype == x.dtype
    assert got.devices() == {_gpu()}
    got = _f64(got)

    exact, magnitude = _matmul_exact(x, w, sizes, transpose_rhs)
    bound = _accumulation(dtype, precision, k) * magnitude + U[jnp.dtype(dtype)] * np.abs(exact)
    assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) - bound)
    end = _groups(sizes, rows)[-1][1]
    np.testing.assert_array_equal(got[end:], 0)  # rows past the groups: zeros

    ref = _f64(jax.jit(functools.partial(ops.ragged_matmul_ref, **opts))(x, w, group_sizes))
    assert np.all(np.abs(got - ref) <= 2 * bound), np.max(np.abs(got - ref) - 2 * bound)


@pytest.mark.gpu
def test_matmul_rows_past_groups_and_other_experts_do_not_leak():
    rows, sizes, k, n = 150, [40, 0, 70], 33, 20
    x = np.random.default_rng(3).standard_normal((rows, k)).astype(np.float32)
    x[110:] = np.nan  # past the groups: never multiplied
    w = np.random.default_rng(4).standard_normal((3, n, k)).astype(np.float32)
    w[0, 0, 0] = np.inf  # expert 0 only: its rows' column 0 becomes +-inf or nan
    w[1] = np.nan  # the empty group's weight: never read
    args = jax.device_put((jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32)), _gpu())
    got = _f64(jax.jit(functools.partial(ops.ragged_matmul, precision="highest"))(*args))
    np.testing.assert_array_equal(got[110:], 0)
    x64, w64 = _f64(x[40:110]), _f64(w[2])  # group 2's rows share row tiles with group 0's
    bound = _accumulation(F32, "highest", k) * (np.abs(x64) @ np.abs(w64).T)
    assert np.all(np.abs(got[40:110] - x64 @ w64.T) <= bound)
    assert np.all(np.isfinite(got[:40, 1:]))


# -------------------------------------------------------------- ragged_wgrad_accumulate
def _wgrad_exact(x, dy, acc_blocks, sizes):
    """float64 acc[g] + dy[g]^T x[g] and the magnitude sum |acc| + |dy|^T |x|, [G, out, in]."""
    x64, dy64, acc64 = _f64(x), _f64(dy), _f64(acc_blocks)
    exact, magnitude = acc64.copy(), np.abs(acc64)
    for g, (s, e) in enumerate(_groups(sizes, x64.shape[0])):
        exact[g] += dy64[s:e].T @ x64[s:e]
        magnitude[g] += np.abs(dy64[s:e]).T @ np.abs(x64[s:e])
    return exact, magnitude


WGRAD_DTYPES = [
    (F32, F32, "default"),
    (F32, F32, "highest"),
    (BF16, F32, None),
    (F16, F32, None),
    (BF16, BF16, None),
    (F16, F16, None),
]
WGRAD_IDS = ["f32", "f32_highest", "bf16_f32", "f16_f32", "bf16_bf16", "f16_f16"]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["stacked", "flat"])
@pytest.mark.parametrize("case", list(SIZES))
@pytest.mark.parametrize("in_dtype,acc_dtype,precision", WGRAD_DTYPES, ids=WGRAD_IDS)
def test_wgrad_matches_float64_and_reference(in_dtype, acc_dtype, precision, case, layout):
    rows, sizes = SIZES[case]
    g, d_in, d_out = len(sizes), 70, 45  # neither a multiple of the 64 x 64 tile
    x, dy = _rand(5, (rows, d_in), in_dtype), _rand(6, (rows, d_out), in_dtype)
    blocks = _rand(7, (g, d_out, d_in), acc_dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    exact, magnitude = _wgrad_exact(x, dy, blocks, sizes)
    longest = max(e - s for s, e in _groups(sizes, rows))
    accumulation = _accumulation(in_dtype, precision, longest) * magnitude
    bound = accumulation + U[jnp.dtype(acc_dtype)] * np.abs(exact)
    empty = [i for i, (s, e) in enumerate(_groups(sizes, rows)) if s == e]

    if layout == "stacked":
        args = jax.device_put((x, dy, group_sizes, blocks), _gpu())
        op = functools.partial(ops.ragged_wgrad_accumulate, precision=precision)
        ref_op = functools.partial(ops.ragged_wgrad_accumulate_ref, precision=precision)
        got = jax.jit(op)(*args)
        assert got.shape == blocks.shape and got.dtype == blocks.dtype
        got, ref = _f64(got), _f64(jax.jit(ref_op)(*args))
    else:  # a flat bucket, the blocks at a traced, unaligned offset (clamped)
        pad, tail = 5, 11
        bucket = jnp.concatenate(
            [_rand(8, (pad,), acc_dtype), blocks.reshape(-1), _rand(9, (tail,), acc_dtype)]
        )
        args = jax.device_put((x, dy, group_sizes, bucket), _gpu())
        op = jax.jit(
            lambda x, dy, s, b, o: ops.ragged_wgrad_accumulate(
                x, dy, s, b, offset=o, precision=precision
            )
        )
        ref_op = jax.jit(
            lambda x, dy, s, b, o: ops.ragged_wgrad_accumulate_ref(
                x, dy, s, b, offset=o, precision=precision
            )
        )
        flat = _f64(op(*args, jnp.int32(pad)))
        before = _f64(bucket)
        np.testing.assert_array_equal(flat[:pad], before[:pad])
        np.testing.assert_array_equal(flat[pad + blocks.size :], before[pad + blocks.size :])
        got = flat[pad : pad + blocks.size].reshape(blocks.shape)
        ref = _f64(ref_op(*args, jnp.int32(pad)))[pad : pad + blocks.size].reshape(blocks.shape)
        # Offsets out of range are clamped (as lax.dynamic_update_slice): -2 -> 0,
        # a huge one -> N - G * out * in = pad + tail. Into zeros: the sums alone, there.
        zeros = jax.device_put(jnp.zeros_like(bucket), _gpu())
        sums = exact - _f64(blocks)
        for offset, at in ((-2, 0), (1 << 30, pad + tail)):
            moved = _f64(op(*args[:3], zeros, jnp.int32(offset)))
            np.testing.assert_array_equal(np.delete(moved, np.s_[at : at + blocks.size]), 0)
            moved = moved[at : at + blocks.size].reshape(blocks.shape)
            assert np.all(
                np.abs(moved - sums) <= accumulation + U[jnp.dtype(acc_dtype)] * np.abs(sums)
            ), offset

    assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) - bound)
    np.testing.assert_array_equal(got[empty], _f64(blocks)[empty])  # untouched
    assert np.all(np.abs(got - ref) <= 2 * bound), np.max(np.abs(got - ref) - 2 * bound)


@pytest.mark.gpu
def test_wgrad_does_not_read_rows_past_the_groups():
    rows, sizes = 100, [30, 0, 41]
    x = np.random.default_rng(10).standard_normal((rows, 9)).astype(np.float32)
    dy = np.random.default_rng(11).standard_normal((rows, 7)).astype(np.float32)
    x[71:], dy[71:] = np.nan, np.nan
    blocks = np.zeros((3, 7, 9), np.float32)
    args = jax.device_put(
        (jnp.asarray(x), jnp.asarray(dy), jnp.asarray(sizes, jnp.int32), jnp.asarray(blocks)),
        _gpu(),
    )
    got = _f64(jax.jit(functools.partial(ops.ragged_wgrad_accumulate, precision="highest"))(*args))
    exact, magnitude = _wgrad_exact(x[:71], dy[:71], blocks, sizes)
    assert np.all(np.abs(got - exact) <= _accumulation(F32, "highest", 41) * magnitude)


@pytest.mark.gpu
def test_wgrad_in_place_in_a_donated_scan_over_layers():
    """Three layers' expert blocks back to back in one donated f32 bucket, threaded through
    a scan carry, each layer at its own traced offset: every block gets its own sum."""
    layers, rows, sizes, d_in, d_out = 3, 90, [20, 0, 50, 13], 24, 17
    block = len(sizes) * d_out * d_in
    x = _rand(12, (layers, rows, d_in), BF16)
    dy = _rand(13, (layers, rows, d_out), BF16)
    offsets = jnp.asarray([3 + i * block for i in range(layers)], jnp.int32)
    bucket = jnp.zeros(3 + layers * block + 4, F32)
    group_sizes = jnp.asarray(sizes, jnp.int32)

    def step(b, layer):
        xl, dyl, off = layer
        return ops.ragged_wgrad_accumulate(xl, dyl, group_sizes, b, offset=off), None

    run = jax.jit(lambda b, x, dy, o: jax.lax.scan(step, b, (x, dy, o))[0], donate_argnums=0)
    got = _f64(run(*jax.device_put((bucket, x, dy, offsets), _gpu())))
    for i in range(layers):
        exact, magnitude = _wgrad_exact(x[i], dy[i], np.zeros((4, d_out, d_in)), sizes)
        blk = got[3 + i * block : 3 + (i + 1) * block].reshape(exact.shape)
        assert np.all(np.abs(blk - exact) <= _accumulation(BF16, None, 50) * magnitude)
    np.testing.assert_array_equal(got[:3], 0)
    np.testing.assert_array_equal(got[3 + layers * block :], 0)


# ------------------------------------------------------- declaration and lowering, no GPU
@pytest.mark.cuda_handler
def test_cuda_handlers_are_graph_capturable_and_lower_to_one_call():
    metadata = registry.handler_metadata("cuda")
    module = importlib.import_module("jax_wgrad._wgrad_ffi_cuda")
    for name in (registry.RAGGED_MATMUL_TARGET, registry.RAGGED_WGRAD_TARGET):
        assert metadata[name]["command_buffer_compatible"], metadata[name]
        # Kernels of their own (no cuBLAS handle to create): no initialize stage.
        assert not isinstance(module.registrations()[name], dict)
    x, w, sizes = jnp.ones((10, 4)), jnp.ones((3, 5, 4)), jnp.array([3, 0, 4], jnp.int32)
    text = (
        jax.jit(ops.ragged_matmul).trace(x, w, sizes).lower(lowering_platforms=("cuda",)).as_text()
    )
    calls = [l for l in text.splitlines() if f"@{registry.RAGGED_MATMUL_TARGET}(" in l]
    assert len(calls) == 1 and "transpose_rhs = 1" in calls[0], text
    dy, bucket = jnp.ones((10, 5)), jnp.zeros(100)
    text = (
        jax.jit(lambda b, o: ops.ragged_wgrad_accumulate(x, dy, sizes, b, offset=o))
        .trace(bucket, jnp.int32(3))
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    calls = [l for l in text.splitlines() if f"@{registry.RAGGED_WGRAD_TARGET}(" in l]
    assert len(calls) == 1, text
    assert "output_tuple_indices = [], operand_index = 3" in calls[0], calls[0]
    # No workspace or other extra result: the handler allocates nothing.
    assert calls[0].rstrip().endswith("-> tensor<100xf32>"), calls[0]
