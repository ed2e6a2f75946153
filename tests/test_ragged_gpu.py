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
weights must not leak into a group's rows. On a Hopper GPU (compute capability 9.0) the
16-bit cases whose feature dims are multiples of 8 run the CUTLASS grouped GEMMs (the
others, the WMMA kernels); ``test_cutlass_*`` check that they did, against float64 and
against the WMMA kernels forced with :func:`jax_wgrad.ops.ragged.set_cuda_kernel`. The
``cuda_handler`` tests (no GPU needed) check what the handlers declare, how the ops lower
for CUDA, and the kernel switch.
"""

import contextlib
import functools
import importlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_wgrad import ops
from jax_wgrad.ops import handlers, ragged

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
@pytest.mark.parametrize("d_in,d_out", [(70, 45), (64, 48)], ids=["ragged_tiles", "aligned"])
@pytest.mark.parametrize("layout", ["stacked", "flat"])
@pytest.mark.parametrize("case", list(SIZES))
@pytest.mark.parametrize("in_dtype,acc_dtype,precision", WGRAD_DTYPES, ids=WGRAD_IDS)
def test_wgrad_matches_float64_and_reference(
    in_dtype, acc_dtype, precision, case, layout, d_in, d_out
):
    # 70 x 45: neither a multiple of the 64 x 64 tile; 64 x 48: TMA-aligned rows (CUTLASS on
    # Hopper for 16-bit inputs into fp32, stacked; the flat bucket's unaligned offset 5 is
    # not provably aligned: WMMA).
    rows, sizes = SIZES[case]
    g = len(sizes)
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


# ------------------------------------------------------------- CUTLASS (Hopper) vs WMMA
def _hopper() -> bool:
    return str(getattr(_gpu(), "compute_capability", "")) == "9.0"


@contextlib.contextmanager
def _kernels(name):
    """Runs the block with the ragged handlers' kernel choice ``name`` (fresh compiles)."""
    previous = ragged.set_cuda_kernel(name)
    jax.clear_caches()
    try:
        yield
    finally:
        ragged.set_cuda_kernel(previous)
        jax.clear_caches()


def _launched(fn, *args):
    """``fn(*args)`` (a fresh jit) as float64, and the kernels the handlers enqueued."""
    before = ragged.cuda_kernel_launches()
    out = jax.block_until_ready(jax.jit(fn)(*args))
    after = ragged.cuda_kernel_launches()
    return _f64(out), {k: after[k] - before[k] for k in after}


def _check_kernel(launched, kernel):
    other = "wmma" if kernel == "cutlass" else "cutlass"
    assert launched[kernel] >= 1 and launched[other] == 0, launched


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(SIZES))
@pytest.mark.parametrize("transpose_rhs", [True, False], ids=["w_NK", "w_KN"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_cutlass_matmul_matches_float64_and_wmma(dtype, transpose_rhs, case):
    rows, sizes = SIZES[case]
    g, k, n = len(sizes), 136, 264  # multiples of 8, not of the 64- or 256-wide tiles
    x = np.random.default_rng(20).standard_normal((rows, k))
    end = _groups(sizes, rows)[-1][1]
    x[end:] = np.nan  # past the groups: never read
    w = np.random.default_rng(21).standard_normal((g, n, k) if transpose_rhs else (g, k, n))
    args = jax.device_put(
        (jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(sizes, jnp.int32)), _gpu()
    )
    fn = functools.partial(ops.ragged_matmul, transpose_rhs=transpose_rhs)
    with _kernels("auto"):
        got, launched = _launched(fn, *args)
    _check_kernel(launched, "cutlass" if _hopper() else "wmma")
    with _kernels("wmma"):
        wmma, launched = _launched(fn, *args)
    _check_kernel(launched, "wmma")
    exact, magnitude = _matmul_exact(args[0], args[1], sizes, transpose_rhs)
    bound = _accumulation(dtype, None, k) * magnitude + U[jnp.dtype(dtype)] * np.abs(exact)
    np.testing.assert_array_equal(got[end:], 0)
    got, exact, magnitude, bound, wmma = (a[:end] for a in (got, exact, magnitude, bound, wmma))
    assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) - bound)
    assert np.all(np.abs(got - wmma) <= 2 * bound), np.max(np.abs(got - wmma) - 2 * bound)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(SIZES))
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_cutlass_wgrad_in_a_donated_scan_matches_float64_and_wmma(dtype, case):
    """Two layers' expert blocks in one donated fp32 bucket, each at BlockOffset(base,
    layer, stride) (provably 16-byte aligned: CUTLASS on Hopper), the second clamped;
    accumulated onto non-zero blocks; rows past the groups are NaN (never read)."""
    rows, sizes = SIZES[case]
    g, d_in, d_out, layers = len(sizes), 72, 40, 2
    block = g * d_out * d_in
    base, tail = 8, 12  # the clamp's end: base + tail, a multiple of 4 elements
    x = np.random.default_rng(22).standard_normal((layers, rows, d_in))
    dy = np.random.default_rng(23).standard_normal((layers, rows, d_out))
    end = _groups(sizes, rows)[-1][1]
    x[:, end:], dy[:, end:] = np.nan, np.nan
    x, dy = jnp.asarray(x, dtype), jnp.asarray(dy, dtype)
    bucket = _rand(24, (base + block + tail,), F32)
    # layer 0 at base; layer 1 at base + block, clamped to base + tail (overlapping 0's)
    group_sizes = jnp.asarray(sizes, jnp.int32)

    def run(b, x, dy):
        def step(b, layer):
            xl, dyl, i = layer
            offset = ops.BlockOffset(base, i, block)
            return ops.ragged_wgrad_accumulate(xl, dyl, group_sizes, b, offset=offset), None

        return jax.lax.scan(step, b, (x, dy, jnp.arange(layers, dtype=jnp.int32)))[0]

    args = jax.device_put((bucket, x, dy), _gpu())
    donated = jax.jit(run, donate_argnums=0)
    with _kernels("auto"):
        before = ragged.cuda_kernel_launches()
        got = _f64(jax.block_until_ready(donated(jnp.array(args[0]), *args[1:])))
        after = ragged.cuda_kernel_launches()
    _check_kernel({k: after[k] - before[k] for k in after}, "cutlass" if _hopper() else "wmma")
    with _kernels("wmma"):
        wmma, launched = _launched(run, *args)
    _check_kernel(launched, "wmma")

    exact, magnitude = _f64(bucket).copy(), np.abs(_f64(bucket))
    for layer, at in ((0, base), (1, base + tail)):
        e, m = _wgrad_exact(x[layer], dy[layer], np.zeros((g, d_out, d_in)), sizes)
        exact[at : at + block] += e.reshape(-1)
        magnitude[at : at + block] += m.reshape(-1)
    longest = max(e - s for s, e in _groups(sizes, rows))
    bound = _accumulation(dtype, None, longest) * magnitude + U[jnp.dtype(F32)] * np.abs(exact)
    assert np.all(np.isfinite(got))
    assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) - bound)
    assert np.all(np.abs(got - wmma) <= 2 * bound), np.max(np.abs(got - wmma) - 2 * bound)
    np.testing.assert_array_equal(got[:base], _f64(bucket)[:base])  # before the blocks


# ------------------------------------------------------- declaration and lowering, no GPU
@pytest.mark.cuda_handler
def test_cuda_handlers_are_graph_capturable_and_lower_to_one_call():
    metadata = handlers.handler_metadata("cuda")
    module = importlib.import_module("jax_wgrad._wgrad_ffi_cuda")
    for name in (handlers.RAGGED_MATMUL_TARGET, handlers.RAGGED_WGRAD_TARGET):
        assert metadata[name]["command_buffer_compatible"], metadata[name]
        # Bundles: the initialize stage queries the device and readies CUTLASS's kernels.
        assert set(module.registrations()[name]) == {"initialize", "execute"}
    x, w, sizes = jnp.ones((10, 4)), jnp.ones((3, 5, 4)), jnp.array([3, 0, 4], jnp.int32)
    text = (
        jax.jit(ops.ragged_matmul).trace(x, w, sizes).lower(lowering_platforms=("cuda",)).as_text()
    )
    calls = [l for l in text.splitlines() if f"@{handlers.RAGGED_MATMUL_TARGET}(" in l]
    assert len(calls) == 1 and "transpose_rhs = 1" in calls[0], text
    # float32: an empty scratch result (CUTLASS runs 16-bit data only).
    assert calls[0].rstrip().endswith("-> (tensor<10x5xf32>, tensor<0xui8>)"), calls[0]
    scratch = ragged.cutlass_scratch_bytes(3)
    for x16, w16 in ((x.astype(BF16), w.astype(BF16)), (x.astype(F16), jnp.swapaxes(w, 1, 2))):
        t = "bf16" if x16.dtype == BF16 else "f16"
        opts = {"transpose_rhs": x16.dtype == BF16}
        text = (
            jax.jit(functools.partial(ops.ragged_matmul, **opts))
            .trace(x16, w16.astype(x16.dtype), sizes)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        call = next(l for l in text.splitlines() if f"@{handlers.RAGGED_MATMUL_TARGET}(" in l)
        assert call.rstrip().endswith(f"-> (tensor<10x5x{t}>, tensor<{scratch}xui8>)"), call
    dy, bucket = jnp.ones((10, 5)), jnp.zeros(100)
    text = (
        jax.jit(lambda b, o: ops.ragged_wgrad_accumulate(x, dy, sizes, b, offset=o))
        .trace(bucket, jnp.int32(3))
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    calls = [l for l in text.splitlines() if f"@{handlers.RAGGED_WGRAD_TARGET}(" in l]
    assert len(calls) == 1, text
    assert "output_tuple_indices = [0], operand_index = 3" in calls[0], calls[0]
    # The handler allocates nothing: float32 data gets an empty scratch result, bf16 data
    # into an fp32 bucket CUTLASS's workspace and per-group arrays, into bf16 blocks none.
    assert calls[0].rstrip().endswith("-> (tensor<100xf32>, tensor<0xui8>)"), calls[0]
    for acc, want in ((bucket, scratch), (bucket.astype(BF16), 0)):
        text = (
            jax.jit(
                lambda b, o: ops.ragged_wgrad_accumulate(
                    x.astype(BF16), dy.astype(BF16), sizes, b, offset=o
                )
            )
            .trace(acc, jnp.int32(3))
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        call = next(l for l in text.splitlines() if f"@{handlers.RAGGED_WGRAD_TARGET}(" in l)
        assert f"tensor<{want}xui8>)" in call, call


@pytest.mark.cuda_handler
def test_kernel_switch_and_launch_counts():
    assert set(ragged.cuda_kernel_launches()) == {"cutlass", "wmma"}
    previous = ragged.set_cuda_kernel("wmma")
    try:
        assert ragged.set_cuda_kernel("wmma") == "wmma"
        with pytest.raises(ValueError, match="'auto' or 'wmma'"):
            ragged.set_cuda_kernel("cublas")
    finally:
        ragged.set_cuda_kernel(previous)
    # The environment variable sets the initial choice when the handlers are loaded; an
    # unknown name makes loading fail loudly.
    code = "from jax_wgrad.ops import ragged; print(ragged.set_cuda_kernel('auto'))"
    for value, want in (("wmma", "wmma"), ("auto", "auto"), ("", "auto")):
        env = {**os.environ, "JAX_WGRAD_RAGGED_KERNEL": value, "JAX_PLATFORMS": "cpu"}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == want, out
    env = {**os.environ, "JAX_WGRAD_RAGGED_KERNEL": "fast", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "JAX_WGRAD_RAGGED_KERNEL must be" in out.stderr, out


@pytest.mark.gpu
def test_dropless_layer_through_the_native_ragged_all_to_all():
    """The dropless MoE layer on one GPU with an expert axis of size 1: its exchanges are
    XLA:GPU's ragged all-to-all (not the CPU emulation), forward and transpose; the loss
    and gradients equal the dense fp32 reference's at HIGHEST precision."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jax_wgrad.functional import MoEConfig, moe_mlp
    from jax_wgrad.parallel.mesh import EXPERT
    from jax_wgrad.testing import reference_moe_mlp

    e, h, f, t = 8, 32, 64, 96
    cfg = MoEConfig(num_experts=e, ffn_hidden_size=f, topk=2, dropless_buffer_factor=1.0)
    params = {
        "router": _rand(1, (e, h), F32),
        "fc1": _rand(2, (e, f, h), F32) / np.sqrt(h),
        "fc2": _rand(3, (e, h, f), F32) / np.sqrt(f),
    }
    x, r = _rand(4, (t, h), F32), _rand(5, (t, h), F32)
    mesh = Mesh(np.array([_gpu()]), (EXPERT,))

    def loss(p, x):
        y, stats = moe_mlp(p, x, cfg, expert_axis=EXPERT, precision="highest")
        return jnp.sum(y * r), stats.overflow_rows

    step = jax.jit(
        jax.shard_map(
            jax.value_and_grad(loss, argnums=(0, 1), has_aux=True),
            mesh=mesh,
            in_specs=(P(), P()),
            out_specs=((P(), P()), (P(), P())),
            check_vma=False,
        )
    )
    args = jax.device_put((params, x), _gpu())
    assert "ragged_all_to_all" in step.lower(*args).as_text()  # lowered for the GPU
    (value, overflow), (grads, dx) = step(*args)

    def ref(p, x):
        return jnp.sum(reference_moe_mlp(p, x, cfg)[0] * r)

    with jax.default_matmul_precision("highest"):  # fp32, not TF32
        want, (wgrads, wdx) = jax.jit(jax.value_and_grad(ref, argnums=(0, 1)))(*args)
    assert float(overflow) == 0.0
    np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
    for name in params:
        g, w = np.asarray(grads[name]), np.asarray(wgrads[name])
        assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max(), name
    assert np.abs(np.asarray(dx) - np.asarray(wdx)).max() <= 1e-5 * np.abs(wdx).max()
