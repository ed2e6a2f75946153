"""FP8 linears (jax_wgrad.functional.fp8 and linear's ``fp8``): the per-tensor power-of-two
scales against float64, the quantized values against ml_dtypes, and every linear form (plain,
main_grad, bucket at a static and at a traced offset in a scan, column- and row-parallel
over 2 tensor ranks with sequence parallelism) against ``jax.grad`` of the same model
written plainly in quantize-dequantize form (numpy-free, float32 at HIGHEST): the same
quantized values, so the tolerance is float32 accumulation only."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_wgrad import ops
from jax_wgrad.functional import WgradRoutes, linear
from jax_wgrad.functional.fp8 import Fp8Gemm, Fp8Recipe, Fp8Weight, quantize, scale_exponent
from jax_wgrad.testing import fp8_reference_linear

pytestmark = pytest.mark.skipif(not ops.fusion_available("cpu"), reason="needs the CPU handler")

E4M3, E5M2, F32 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float32
HYBRID, E4M3_ONLY = Fp8Recipe("hybrid"), Fp8Recipe("e4m3")


# ---------------------------------------------------------------------------- the numbers


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_scale_exponent_is_the_largest_power_of_two_that_fits(dtype):
    top = float(jnp.finfo(dtype).max)
    rng = np.random.default_rng(0)
    amax = np.concatenate(
        [
            np.exp(rng.uniform(-40, 40, 200)),
            [top, top * (1 + 2**-20), top / 2, 1.0, 2.0**-30, 3.0e-12],
        ]
    ).astype(np.float32)
    e = np.asarray(scale_exponent(jnp.asarray(amax), dtype))
    a64 = amax.astype(np.float64)
    assert np.all(a64 * 2.0**e <= top)
    free = np.abs(e) < 63  # not clamped
    assert free.sum() > 150
    assert np.all(a64[free] * 2.0 ** (e[free] + 1) > top)
    assert np.asarray(scale_exponent(jnp.float32(top), dtype, margin=2)) == -2
    for bad in (0.0, np.inf, np.nan):
        assert int(scale_exponent(jnp.float32(bad), dtype)) == 0
    assert int(scale_exponent(jnp.float32(1e-30), dtype)) == 63  # clamped


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_is_the_rounding_of_the_scaled_tensor(dtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((8, 33)) * 3e-3).astype(np.float32)
    q = quantize(jnp.asarray(x), dtype)
    e = int(scale_exponent(jnp.max(jnp.abs(x)), dtype))
    want = (x.astype(np.float64) * 2.0**e).astype(ml_dtypes.finfo(dtype).dtype)
    np.testing.assert_array_equal(np.asarray(q.value), want)
    assert float(q.scale_inv) == 2.0**-e
    assert np.max(np.abs(np.asarray(q.value, np.float32))) > float(jnp.finfo(dtype).max) / 2


def test_recipe_refusals():
    with pytest.raises(ValueError, match="fp8_format must be one of e4m3, hybrid, got 'e5m2'"):
        Fp8Recipe("e5m2")
    with pytest.raises(ValueError, match="fp8_recipe must be one of tensorwise, delayed"):
        Fp8Recipe(recipe="mxfp8")
    with pytest.raises(ValueError, match="'delayed'.*not built"):
        Fp8Recipe(recipe="delayed")
    with pytest.raises(ValueError, match="fp8_margin must be an integer >= 0, got -1"):
        Fp8Recipe(margin=-1)
    with pytest.raises(ValueError, match="fp8_amax_compute_algo must be one of max"):
        Fp8Recipe(amax_compute_algo="mean")


def test_precision_is_refused_with_fp8():
    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    with pytest.raises(ValueError, match="precision .'highest'. is for float GEMMs"):
        linear(x, w, precision="highest", fp8=Fp8Gemm(HYBRID))


# ------------------------------------------------------------------ the plain reference


def _close(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.max(np.abs(want))
    assert scale > 0
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale)


def _data(seed, shape_x=(2, 16, 32), n_out=24):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape_x), F32)
    w = jnp.asarray(rng.standard_normal((n_out, shape_x[-1])) * 0.1, F32)
    b = jnp.asarray(rng.standard_normal(n_out) * 0.1, F32)
    dy = jnp.asarray(rng.standard_normal((*shape_x[:-1], n_out)) * 1e-3, F32)
    return x, w, b, dy


def _ref_grads(x, w, b, dy, recipe):
    y, vjp = jax.vjp(lambda x, w, b: fp8_reference_linear(x, w, b, recipe), x, w, b)
    return y, *vjp(dy)


@pytest.mark.parametrize("recipe", [HYBRID, E4M3_ONLY], ids=["hybrid", "e4m3"])
def test_plain_linear_equals_the_quantize_dequantize_model(recipe):
    x, w, b, dy = _data(2)
    y, vjp = jax.vjp(lambda x, w, b: linear(x, w, b, fp8=Fp8Gemm(recipe)), x, w, b)
    got = vjp(dy)
    want = _ref_grads(x, w, b, dy, recipe)
    for g, r in zip((y, *got), want):
        _close(g, r)
    # Not vacuous: FP8 is not float32.
    y32 = x @ w.T + b
    assert np.max(np.abs(np.asarray(y - y32))) > 1e-3 * np.max(np.abs(np.asarray(y32)))


@pytest.mark.parametrize("recipe", [HYBRID, E4M3_ONLY], ids=["hybrid", "e4m3"])
def test_fused_forms_add_the_fp8_weight_gradient_in_place(recipe):
    x, w, b, dy = _data(3)
    _, dx_ref, dw_ref, db_ref = _ref_grads(x, w, b, dy, recipe)
    acc = jnp.asarray(np.random.default_rng(4).standard_normal(w.shape), F32)
    fp8 = Fp8Gemm(recipe)

    # main_grad
    _, vjp = jax.vjp(lambda x, b, mg: linear(x, w, b, main_grad=mg, fp8=fp8), x, b, acc)
    dx, db, mg = vjp(dy)
    _close(dx, dx_ref)
    _close(db, db_ref)
    want = np.asarray(acc, np.float64) + np.asarray(dw_ref, np.float64)
    bound = 2e-6 * np.max(np.abs(np.asarray(dw_ref))) + 2.0**-23 * np.abs(want)
    assert np.all(np.abs(np.asarray(mg, np.float64) - want) <= bound)

    # a bucket at a static offset
    n = w.size + 7
    bucket = jnp.zeros((n,), F32)

    def into_bucket(x, bucket):
        routes = WgradRoutes([bucket])
        y = linear(x, routes.to_bucket(w, 0, offset=5), b, fp8=fp8)
        return y, routes.close()

    _, vjp = jax.vjp(into_bucket, x, bucket)
    dx, got = vjp((dy, (bucket,)))
    _close(dx, dx_ref)
    _close(got[5 : 5 + w.size].reshape(w.shape), dw_ref)
    assert not np.any(np.asarray(got[:5])) and not np.any(np.asarray(got[5 + w.size :]))


def test_a_weight_quantized_once_gives_the_same_bits_in_every_form():
    """``fp8_weight`` (the weight quantized once, as a step does for every microbatch):
    outputs and gradients bitwise those of quantizing at each use, plain, into main_grad,
    into a bucket at a static and at a traced offset; refused without ``fp8`` or with
    another shape."""
    x, w, b, dy = _data(6)
    fp8 = Fp8Gemm(HYBRID)
    qw = Fp8Weight.of(fp8.weight(w))
    acc = jnp.zeros(w.shape, F32)
    bucket = jnp.zeros((w.size + 3,), F32)

    def forms(cached):
        kw = dict(fp8=fp8, fp8_weight=qw if cached else None)

        def into_bucket(x, w, bucket, offset):
            routes = WgradRoutes([bucket])
            y = linear(x, routes.to_bucket(w, 0, offset=offset), b, **kw)
            return y, routes.close()

        at = ops.BlockOffset(0, jnp.int32(1), 3)
        runs = [
            jax.vjp(lambda x, w: linear(x, w, b, **kw), x, w),
            jax.vjp(lambda x, mg: linear(x, w, b, main_grad=mg, **kw), x, acc),
            jax.vjp(lambda x, bk: into_bucket(x, w, bk, 3), x, bucket),
            jax.vjp(lambda x, bk: into_bucket(x, w, bk, at), x, bucket),
        ]
        out = []
        for k, (y, vjp) in enumerate(runs):
            ct = dy if k < 2 else (dy, (bucket,))
            out.append((y, vjp(ct)))
        return out

    for a, c in zip(jax.tree.leaves(forms(False)), jax.tree.leaves(forms(True))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    with pytest.raises(ValueError, match="fp8_weight .* needs fp8"):
        linear(x, w, b, fp8_weight=qw)
    with pytest.raises(ValueError, match=r"fp8_weight must be an Fp8Weight of the weight's shape"):
        linear(x, w[:4], b[:4], fp8=fp8, fp8_weight=qw)


def test_a_scan_of_fp8_layers_at_traced_offsets():
    """Two stacked layers in a ``lax.scan`` whose weights' blocks are at traced offsets
    (the form every scanned layer of a model uses)."""
    rng = np.random.default_rng(5)
    h, L = 32, 2
    ws = jnp.asarray(rng.standard_normal((L, h, h)) * 0.2, F32)
    x = jnp.asarray(rng.standard_normal((4, 8, h)), F32)
    dy = jnp.asarray(rng.standard_normal((4, 8, h)) * 1e-2, F32)
    fp8 = Fp8Gemm(HYBRID)

    def fused(x, bucket):
        def layer(carry, xs):
            hid, bk = carry
            w, i = xs
            routes = WgradRoutes([bk])
            wr = routes.to_bucket(w, 0, offset=ops.BlockOffset(0, i, h * h))
            hid = jnp.tanh(linear(hid, wr, fp8=fp8))
            return (hid, routes.close()[0]), None

        (y, bucket), _ = jax.lax.scan(layer, (x, bucket), (ws, jnp.arange(L, dtype=jnp.int32)))
        return y, bucket

    def ref(x, ws):
        for i in range(L):
            x = jnp.tanh(fp8_reference_linear(x, ws[i], None, HYBRID))
        return x

    bucket = jnp.zeros((L * h * h,), F32)
    _, vjp = jax.vjp(fused, x, bucket)
    dx, got = vjp((dy, bucket))
    _, rvjp = jax.vjp(ref, x, ws)
    dx_ref, dws_ref = rvjp(dy)
    _close(dx, dx_ref)
    _close(got.reshape(L, h, h), dws_ref)


# ------------------------------------------------------------------ tensor parallelism


def _tp_mesh():
    return Mesh(np.array(jax.devices()[:2]), ("tensor",))


@pytest.mark.parametrize(
    "async_tp",
    [True, pytest.param(False, marks=pytest.mark.slow)],  # composed: -m slow, suite time
    ids=["async", "composed"],
)
def test_column_then_row_parallel_with_sequence_parallelism(async_tp):
    """fc2(gelu(fc1(x))) over 2 tensor ranks, sequence-parallel input and output, both
    weights into one bucket: every shard is scaled by its whole tensor's amax, so the
    numbers are one device's."""
    from jax_wgrad.functional import reduce_scatter_to_sequence_parallel_region

    rng = np.random.default_rng(6)
    h, f, tp = 32, 64, 2
    w1 = jnp.asarray(rng.standard_normal((f, h)) * 0.2, F32)
    w2 = jnp.asarray(rng.standard_normal((h, f)) * 0.1, F32)
    x = jnp.asarray(rng.standard_normal((2, 16, h)), F32)
    dy = jnp.asarray(rng.standard_normal((2, 16, h)) * 1e-2, F32)
    col, row = Fp8Gemm.column(HYBRID, "tensor"), Fp8Gemm.row(HYBRID, "tensor")
    n1, n2 = (f // tp) * h, h * (f // tp)

    def body(x, w1, w2, bucket):
        routes = WgradRoutes([bucket], async_tp=async_tp)
        hid = linear(x, routes.to_bucket(w1, 0, offset=0), fp8=col, gather_axis="tensor")
        y = linear(jax.nn.gelu(hid), routes.to_bucket(w2, 0, offset=n1), fp8=row)
        y = reduce_scatter_to_sequence_parallel_region(y, "tensor", 1)
        return y, routes.close()[0]

    def step(x, w1, w2, dy, bucket):
        _, vjp = jax.vjp(lambda x, bk: body(x, w1, w2, bk), x, bucket)
        return vjp((dy, bucket))

    spec_x = P(None, "tensor", None)
    got_dx, got_bk = jax.jit(
        jax.shard_map(
            step,
            mesh=_tp_mesh(),
            in_specs=(spec_x, P("tensor", None), P(None, "tensor"), spec_x, P("tensor")),
            out_specs=(spec_x, P("tensor")),
        )
    )(x, w1, w2, dy, jnp.zeros((tp * (n1 + n2),), F32))

    def ref(x, w1, w2):
        return fp8_reference_linear(
            jax.nn.gelu(fp8_reference_linear(x, w1, None, HYBRID)), w2, None, HYBRID
        )

    _, vjp = jax.vjp(ref, x, w1, w2)
    dx_ref, dw1_ref, dw2_ref = vjp(dy)
    _close(got_dx, dx_ref)
    bk = np.asarray(got_bk).reshape(tp, n1 + n2)
    dw1 = np.concatenate([bk[r, :n1].reshape(f // tp, h) for r in range(tp)], axis=0)
    dw2 = np.concatenate([bk[r, n1:].reshape(h, f // tp) for r in range(tp)], axis=1)
    _close(dw1, dw1_ref)
    _close(dw2, dw2_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [HYBRID, E4M3_ONLY], ids=["hybrid", "e4m3"])
def test_fused_fp8_linear_on_a_gpu_equals_the_reference(recipe):
    """The bucket form on a GPU (cuBLASLt FP8 forward and data gradient, the fused FP8
    weight gradient) against the quantize-dequantize reference: Hopper's FP8 tensor cores
    add partial sums with fewer than 24 bits before cuBLASLt promotes them, so the bound is
    2**-9 of the largest element, not float32's."""
    gpu = jax.devices("gpu")[0]
    x, w, b, dy = (jax.device_put(a, gpu) for a in _data(7, (4, 64, 256), 128))
    fp8 = Fp8Gemm(recipe)
    bucket = jax.device_put(jnp.zeros((w.size,), F32), gpu)

    def into_bucket(x, bucket):
        routes = WgradRoutes([bucket])
        return linear(x, routes.to_bucket(w, 0, offset=0), b, fp8=fp8), routes.close()

    y, vjp = jax.vjp(into_bucket, x, bucket)
    dx, got = vjp((dy, (bucket,)))
    y_ref, dx_ref, dw_ref, _ = _ref_grads(*(jax.device_get(a) for a in (x, w, b, dy)), recipe)
    for g, r in ((y, y_ref), (dx, dx_ref), (got.reshape(w.shape), dw_ref)):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        np.testing.assert_allclose(g, r, rtol=0, atol=2.0**-9 * np.max(np.abs(r)))
