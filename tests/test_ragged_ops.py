"""Ragged grouped GEMMs (jax_wgrad.ops.ragged): the CPU handlers against numpy float64,
jax.lax.ragged_dot (and its gradient) and the plain-XLA references; clamping of the group
bounds, offsets, in-place updates, vmap, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_util import compiled_text, copies_of, custom_calls, entry_aliases_param

from jax_wgrad import ops
from jax_wgrad.ops import handlers

pytestmark = pytest.mark.skipif(
    not ops.fusion_available("cpu", families="ragged"), reason="needs the CPU handler"
)

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
R = 37
SIZES = {  # G = 4 unless said; R = 37 rows
    "even": [10, 9, 9, 9],
    "skewed": [0, 37, 0, 0],  # one group has every row, the others none
    "short": [5, 0, 12, 3],  # 17 rows past the groups
    "long": [20, 0, 30, 15],  # sums past R: the third group is cut, the last is empty
    "one_group": [25],  # G = 1
}
TOL = {F32: 1e-5, BF16: 2.0**-8, F16: 2.0**-11}  # one rounding of the f32 result


def _rows(sizes, rows):
    """Per group, slice(start, end) of its rows, clamped (sizes < 0 count as 0)."""
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(sizes, np.int64), 0)), rows)
    return [slice(s, e) for s, e in zip(np.concatenate([[0], ends[:-1]]), ends)]


def _data(seed, shapes, dtype):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s, F32).astype(dtype) for k, s in zip(keys, shapes)]


def _f64(a):
    return np.asarray(jnp.asarray(a, F32), np.float64)


def _matmul_f64(x, w, sizes, transpose_rhs):
    x, w = _f64(x), _f64(w)
    y = np.zeros((x.shape[0], w.shape[1] if transpose_rhs else w.shape[2]))
    for g, rows in enumerate(_rows(sizes, x.shape[0])):
        y[rows] = x[rows] @ (w[g].T if transpose_rhs else w[g])
    return y


def _wgrad_f64(x, dy, sizes):
    x, dy = _f64(x), _f64(dy)
    return np.stack([dy[r].T @ x[r] for r in _rows(sizes, x.shape[0])])


def _close(got, want, dtype):
    got = _f64(got)
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype] * scale)


# ---- ragged_matmul ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("transpose_rhs", [True, False], ids=["w_NK", "w_KN"])
def test_matmul_matches_float64_and_ragged_dot(dtype, transpose_rhs):
    k, n = 24, 20
    fused = jax.jit(functools.partial(ops.ragged_matmul, transpose_rhs=transpose_rhs))
    ref = jax.jit(functools.partial(ops.ragged_matmul_ref, transpose_rhs=transpose_rhs))
    dot = jax.jit(functools.partial(jax.lax.ragged_dot, preferred_element_type=F32))
    for case, sizes in SIZES.items():  # group sizes are run-time operands: one compile
        sizes = np.asarray(sizes, np.int32)
        g = len(sizes)
        x, w = _data(g, [(R, k), (g, n, k) if transpose_rhs else (g, k, n)], dtype)
        y = fused(x, w, sizes)
        assert y.shape == (R, n) and y.dtype == dtype, case
        want = _matmul_f64(x, w, sizes, transpose_rhs)
        _close(y, want, dtype)
        end = min(int(np.maximum(sizes, 0).sum()), R)
        assert np.all(_f64(y)[end:] == 0), case
        _close(y, _f64(dot(x, jnp.swapaxes(w, 1, 2) if transpose_rhs else w, sizes)), dtype)
        _close(ref(x, w, sizes), want, dtype)


def test_matmul_negative_sizes_count_as_zero():
    sizes = np.asarray([4, -3, 6], np.int32)
    x, w = _data(1, [(12, 8), (3, 5, 8)], F32)
    want = _matmul_f64(x, w, sizes, True)
    _close(ops.ragged_matmul(x, w, sizes), want, F32)
    _close(jax.jit(ops.ragged_matmul_ref)(x, w, sizes), want, F32)


def test_matmul_many_rows_in_blocks():
    # 16-bit rows are widened in blocks of 512: a group crossing block boundaries.
    sizes = np.asarray([700, 0, 900], np.int32)
    x, w = _data(2, [(1700, 16), (3, 24, 16)], BF16)
    _close(ops.ragged_matmul(x, w, sizes), _matmul_f64(x, w, sizes, True), BF16)


def test_matmul_vmap():
    sizes = jnp.asarray([[3, 5], [8, 0], [0, 2]], jnp.int32)
    x, w = _data(3, [(3, 9, 6), (2, 4, 6)], F32)
    got = jax.vmap(ops.ragged_matmul, in_axes=(0, None, 0))(x, w, sizes)
    for b in range(3):
        _close(got[b], _matmul_f64(x[b], w, np.asarray(sizes[b]), True), F32)


# ---- ragged_wgrad_accumulate -----------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,acc_dtype", [(F32, F32), (BF16, F32), (F16, F32), (BF16, BF16), (F16, F16)]
)
def test_wgrad_matches_float64(dtype, acc_dtype):
    d_in, d_out = 24, 20
    fused = jax.jit(ops.ragged_wgrad_accumulate)
    ref = jax.jit(ops.ragged_wgrad_accumulate_ref)
    for case, sizes in SIZES.items():
        sizes = np.asarray(sizes, np.int32)
        g = len(sizes)
        x, dy, acc = _data(g, [(R, d_in), (R, d_out), (g, d_out, d_in)], dtype)
        acc = acc.astype(acc_dtype)
        got = fused(x, dy, sizes, acc)
        assert got.shape == acc.shape and got.dtype == acc_dtype, case
        want = _f64(acc) + _wgrad_f64(x, dy, sizes)
        _close(got, want, acc_dtype)
        empty = [i for i, r in enumerate(_rows(sizes, R)) if r.start == r.stop]
        np.testing.assert_array_equal(_f64(got)[empty], _f64(acc)[empty])  # untouched
        _close(ref(x, dy, sizes, acc), want, acc_dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_wgrad_is_the_gradient_of_ragged_dot(dtype):
    sizes = jnp.asarray(SIZES["short"], jnp.int32)
    x, dy, w, acc = _data(5, [(R, 16), (R, 12), (4, 16, 12), (4, 12, 16)], dtype)
    acc = acc.astype(F32)

    def loss(w):
        y = jax.lax.ragged_dot(x, w, sizes, preferred_element_type=F32)
        return jnp.sum(y * dy.astype(F32))

    grad = jax.jit(jax.grad(loss))(w)  # [G, in, out]
    want = _f64(acc) + np.swapaxes(_f64(grad), 1, 2)
    _close(ops.ragged_wgrad_accumulate(x, dy, sizes, acc), want, dtype)


def test_wgrad_flat_bucket_static_offset():
    sizes = np.asarray(SIZES["long"], np.int32)
    x, dy = _data(6, [(R, 8), (R, 6)], F32)
    bucket = jnp.arange(4 * 48 + 11, dtype=F32)
    got = ops.ragged_wgrad_accumulate(x, dy, sizes, bucket, offset=7)
    want = _f64(bucket)
    want[7 : 7 + 192] += _wgrad_f64(x, dy, sizes).ravel()
    _close(got, want, F32)
    ref = jax.jit(functools.partial(ops.ragged_wgrad_accumulate_ref, offset=7))
    _close(ref(x, dy, sizes, bucket), want, F32)


def test_wgrad_traced_offset_in_scan_over_layers():
    # Three layers' expert blocks back to back in one bucket; the scan index picks them.
    layers, block = 3, 4 * 6 * 8
    x, dy = _data(7, [(layers, R, 8), (layers, R, 6)], BF16)
    sizes = jnp.asarray([SIZES["even"], SIZES["short"], SIZES["long"]], jnp.int32)
    bucket = jnp.zeros(5 + layers * block, F32)

    def run(bucket, x, dy, sizes):
        def layer(b, args):
            i, xi, dyi, si = args
            return ops.ragged_wgrad_accumulate(xi, dyi, si, b, offset=5 + i * block), None

        return jax.lax.scan(layer, bucket, (jnp.arange(layers, dtype=jnp.int32), x, dy, sizes))[0]

    got = jax.jit(run, donate_argnums=0)(bucket, x, dy, sizes)
    want = np.zeros(5 + layers * block)
    for i in range(layers):
        want[5 + i * block : 5 + (i + 1) * block] = _wgrad_f64(x[i], dy[i], sizes[i]).ravel()
    _close(got, want, F32)
    # A traced offset past the end is clamped to N - G * out * in.
    late = ops.ragged_wgrad_accumulate(
        x[0], dy[0], sizes[0], jnp.zeros(block + 3), offset=jnp.int32(1000)
    )
    np.testing.assert_array_equal(_f64(late)[:3], 0)


def test_wgrad_vmap_gives_per_example_accumulators():
    sizes = jnp.asarray([[3, 5], [8, 0]], jnp.int32)
    x, dy, acc = _data(8, [(2, 9, 6), (2, 9, 4), (2, 4, 6)], F32)
    got = jax.vmap(ops.ragged_wgrad_accumulate, in_axes=(0, 0, 0, None))(x, dy, sizes, acc)
    for b in range(2):
        _close(got[b], _f64(acc) + _wgrad_f64(x[b], dy[b], np.asarray(sizes[b])), F32)


def test_wgrad_in_place_under_donated_jit():
    x, dy, acc = _data(9, [(R, 24), (R, 20), (4, 20, 24)], F32)
    sizes = jnp.asarray(SIZES["short"], jnp.int32)
    hlo = compiled_text(ops.ragged_wgrad_accumulate, x, dy, sizes, acc, donate_argnums=3)
    assert entry_aliases_param(hlo, 3), hlo.splitlines()[0]
    calls = custom_calls(hlo, handlers.RAGGED_WGRAD_TARGET)
    assert len(calls) == 1 and "output_to_operand_aliasing={{}: (3, {})}" in calls[0]
    assert copies_of(hlo, "f32", (4, 20, 24)) == []


def test_not_donated_leaves_the_input_unchanged():
    x, dy, acc = _data(10, [(R, 8), (R, 6), (4, 6, 8)], F32)
    before = np.asarray(acc).copy()
    out = jax.jit(ops.ragged_wgrad_accumulate)(x, dy, SIZES["even"], acc)
    np.testing.assert_array_equal(np.asarray(acc), before)
    _close(out, before + _wgrad_f64(x, dy, SIZES["even"]), F32)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_no_routed_rows_no_work(dtype):
    # All sizes 0: y is all zeros (whatever the output buffer held) and main_grad stays
    # bitwise what it was, NaNs included.
    x, dy, w, acc = _data(11, [(R, 8), (R, 6), (4, 6, 8), (4, 6, 8)], dtype)
    acc = acc.at[1, 2, 3].set(jnp.nan)
    zeros = jnp.zeros(4, jnp.int32)
    y, out = jax.jit(
        lambda *a: (
            ops.ragged_matmul(a[0], a[2], a[3]),
            ops.ragged_wgrad_accumulate(a[0], a[1], a[3], a[4]),
        )
    )(x, dy, w, zeros, acc)
    assert np.all(_f64(y) == 0)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), np.asarray(acc).view(np.uint8))


def test_named_custom_calls_in_hlo():
    x, w = _data(12, [(R, 8), (4, 6, 8)], F32)
    hlo = jax.jit(ops.ragged_matmul).lower(x, w, SIZES["even"]).as_text()
    assert "ragged_matmul" in hlo and handlers.RAGGED_MATMUL_TARGET in hlo


# ---- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x,w,sizes,match",
    [
        ((5, 4), (2, 3, 5), (2,), r"disagree on K.*x float32\[5, 4\], w float32\[2, 3, 5\]"),
        ((5,), (2, 3, 4), (2,), r"x must be \[R, K\]"),
        ((5, 4), (2, 3, 4), (3,), r"group_sizes must be an integer array \[G\] = \[2\]"),
    ],
)
def test_matmul_bad_shapes(x, w, sizes, match):
    with pytest.raises(ValueError, match=match):
        ops.ragged_matmul(jnp.zeros(x), jnp.zeros(w), jnp.zeros(sizes, jnp.int32))


def test_bad_dtypes_and_offsets():
    x, dy, acc = jnp.zeros((5, 4)), jnp.zeros((5, 3)), jnp.zeros((2, 3, 4))
    sizes = jnp.asarray([2, 3], jnp.int32)
    with pytest.raises(ValueError, match="share one dtype"):
        ops.ragged_matmul(x, acc.astype(BF16), sizes, transpose_rhs=True)
    with pytest.raises(ValueError, match="integer array"):
        ops.ragged_matmul(x, jnp.zeros((2, 3, 4)), sizes.astype(F32))
    with pytest.raises(ValueError, match=r"main_grad must have shape \[G, out, in\] = \[2, 3, 4\]"):
        ops.ragged_wgrad_accumulate(x, dy, sizes, acc.reshape(2, 4, 3))
    with pytest.raises(ValueError, match="main_grad must be float32"):
        ops.ragged_wgrad_accumulate(x, dy, sizes, acc.astype(BF16))
    with pytest.raises(ValueError, match=r"offset=5.*holding the \[G, out, in\] blocks"):
        ops.ragged_wgrad_accumulate(x, dy, sizes, jnp.zeros(28), offset=5)
    with pytest.raises(ValueError, match="int32 scalar"):
        ops.ragged_wgrad_accumulate(x, dy, sizes, jnp.zeros(28), offset=jnp.zeros(2, jnp.int32))


def test_handler_rejects_bad_operands_itself():
    with pytest.raises(Exception, match="group_sizes must be int32"):
        jax.jit(functools.partial(ops.ragged_matmul_p.bind, transpose_rhs=1, precision=0))(
            jnp.zeros((5, 4)), jnp.zeros((2, 3, 4)), jnp.zeros(2, jnp.int16)
        )


def test_unbuilt_target_is_a_compile_time_error(monkeypatch):
    # A handler module built without the target: compiling says so, naming the platform.
    metadata = handlers.handler_metadata("cpu")
    del metadata[handlers.RAGGED_MATMUL_TARGET]
    monkeypatch.setitem(handlers._METADATA, "cpu", metadata)
    x, w, sizes = jnp.zeros((5, 7)), jnp.zeros((2, 3, 7)), jnp.asarray([2, 3], jnp.int32)
    with pytest.raises(
        RuntimeError,
        match="ragged_matmul: the jax_wgrad handler for platform 'cpu' is not available "
        r"\(its cpu handler module was built without jax_wgrad_ragged_matmul",
    ):
        jax.jit(lambda x, w, s: ops.ragged_matmul(x, w, s)).lower(x, w, sizes)
