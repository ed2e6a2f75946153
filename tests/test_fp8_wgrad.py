"""fp8_wgrad_accumulate: numerics against numpy float64 of the dequantized values, exact fp8
conversions, flat buckets at static and traced (clamped) offsets, in place in the compiled
HLO, errors; the CUDA lowering without a GPU, and the CUDA handler against the reference on
a GPU. Small shapes: each test compiles once or twice."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hlo_util import compiled_text, copies_of, custom_calls, entry_aliases_param

from jax_wgrad import ops
from jax_wgrad.ops import BlockOffset, handlers

pytestmark = pytest.mark.skipif(not ops.fusion_available("cpu"), reason="needs the CPU handler")

E4M3, E5M2, F32 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float32
DY_DTYPES = [E4M3, E5M2]
U32 = 2.0**-24
N = 157  # bucket elements: odd, so that no other array of a test has this size


def _data(seed, lead, n_in, n_out, dy_dtype, scale_shape=()):
    """fp8 ``x``, ``dy`` (normal values scaled into the fp8 ranges), float32 scales that are
    not powers of two, and an f32 ``[out, in]`` accumulator."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(lead + (n_in,)) * 40, E4M3)
    dy = jnp.asarray(rng.standard_normal(lead + (n_out,)) * 100, dy_dtype)
    sx = jnp.full(scale_shape, 0.0173, F32)
    sg = jnp.full(scale_shape, 3.1e-4, F32)
    acc = jnp.asarray(rng.standard_normal((n_out, n_in)), F32)
    return x, dy, sx, sg, acc


def _exact(x, dy, sx, sg):
    """``(update, magnitude)`` in float64: ``(sg dy)^T (sx x)`` of the dequantized values
    and ``|sg dy|^T |sx x|``, both ``[out, in]``."""
    x64 = np.asarray(x, np.float64).reshape(-1, x.shape[-1]) * float(np.ravel(sx)[0])
    dy64 = np.asarray(dy, np.float64).reshape(-1, dy.shape[-1]) * float(np.ravel(sg)[0])
    return dy64.T @ x64, np.abs(dy64).T @ np.abs(x64)


def _check_block(got, acc_block, update, magnitude, tokens, *, accumulation=0.0):
    """|got - (acc + update)| within fp32 accumulation: the dequantizations (one rounding
    each), K products and sums, the add to the accumulator -- (K + 4) u32 per unit of
    magnitude, plus u32 of the result. ``accumulation``: a further relative error per unit
    of magnitude (a GPU's FP8 tensor cores add partial sums with fewer than 24 bits before
    cuBLASLt promotes them to fp32)."""
    want = np.asarray(acc_block, np.float64) + update
    magnitude = np.abs(np.asarray(acc_block, np.float64)) + magnitude
    bound = ((tokens + 4) * U32 + accumulation) * magnitude + U32 * np.abs(want)
    excess = np.abs(np.asarray(got, np.float64) - want) - bound
    assert excess.max() <= 0, f"max error over bound {excess.max()}"
    # Not vacuous: far below the values themselves (a wrong layout or scale errs by O(1)).
    limit = 1e-3 if accumulation == 0 else 0.1
    assert np.median(bound / np.maximum(np.abs(want), 1e-30)) < limit


@pytest.mark.parametrize("dy_dtype", DY_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(
    "lead,n_in,n_out,scale_shape",
    [((1,), 3, 5, ()), ((37,), 16, 24, (1,)), ((3, 50), 9, 7, ())],
)
def test_matches_float64(dy_dtype, lead, n_in, n_out, scale_shape):
    x, dy, sx, sg, acc = _data(1, lead, n_in, n_out, dy_dtype, scale_shape)
    got = jax.jit(ops.fp8_wgrad_accumulate)(x, dy, sx, sg, acc)
    assert got.dtype == F32 and got.shape == acc.shape
    update, magnitude = _exact(x, dy, sx, sg)
    _check_block(got, acc, update, magnitude, int(np.prod(lead)))
    ref = ops.fp8_wgrad_accumulate_ref(x, dy, sx, sg, acc)
    _check_block(ref, acc, update, magnitude, int(np.prod(lead)))


@pytest.mark.parametrize(
    "dtype,values",
    [(E4M3, ml_dtypes.float8_e4m3fn), (E5M2, ml_dtypes.float8_e5m2)],
    ids=["e4m3", "e5m2"],
)
def test_every_fp8_value_converts_exactly(dtype, values):
    # One token: each result element is one product with 1.0, exact in fp32 -- so the
    # handler's fp8 -> float conversion of all 256 bit patterns is seen as it is (NaNs,
    # e5m2's infinities, subnormals included).
    every = jnp.asarray(np.arange(256, dtype=np.uint8).view(values).reshape(1, 256))
    one, unit = jnp.ones((1, 1), E4M3), jnp.float32(1)
    if dtype == E4M3:  # x = every value: main_grad [1, 256] += 1 * x
        got = jax.jit(ops.fp8_wgrad_accumulate)(every, one, unit, unit, jnp.zeros((1, 256), F32))
    else:  # dy = every value: main_grad [256, 1] += dy^T * 1
        got = jax.jit(ops.fp8_wgrad_accumulate)(one, every, unit, unit, jnp.zeros((256, 1), F32))
    np.testing.assert_array_equal(np.asarray(got).ravel(), np.asarray(every, np.float32).ravel())


def test_static_offset_into_a_flat_bucket():
    x, dy, sx, sg, _ = _data(2, (21,), 6, 5, E5M2)
    bucket = jnp.asarray(np.random.default_rng(3).standard_normal(N), F32)
    update, magnitude = _exact(x, dy, sx, sg)
    for offset in (0, 7, N - 30):
        got = np.asarray(
            jax.jit(functools.partial(ops.fp8_wgrad_accumulate, offset=offset))(
                x, dy, sx, sg, bucket
            )
        )
        outside = np.r_[0:offset, offset + 30 : N]
        np.testing.assert_array_equal(got[outside], np.asarray(bucket)[outside])
        block = np.asarray(bucket)[offset : offset + 30].reshape(5, 6)
        _check_block(got[offset : offset + 30].reshape(5, 6), block, update, magnitude, 21)


def test_traced_offset_is_clamped_like_dynamic_update_slice():
    x, dy, sx, sg, _ = _data(4, (9,), 6, 5, E4M3)
    bucket = jnp.asarray(np.random.default_rng(5).standard_normal(N), F32)
    block = 30
    traced = jax.jit(lambda b, o: ops.fp8_wgrad_accumulate(x, dy, sx, sg, b, offset=o))
    ref = jax.jit(lambda b, o: ops.fp8_wgrad_accumulate_ref(x, dy, sx, sg, b, offset=o))
    update, magnitude = _exact(x, dy, sx, sg)
    for offset in (7, N - block, -3, N - block + 1, 10_000):
        at = min(max(offset, 0), N - block)
        got = np.asarray(traced(bucket, jnp.int32(offset)))
        outside = np.r_[0:at, at + block : N]
        np.testing.assert_array_equal(got[outside], np.asarray(bucket)[outside])
        old = np.asarray(bucket)[at : at + block].reshape(5, 6)
        _check_block(got[at : at + block].reshape(5, 6), old, update, magnitude, 9)
        want = np.asarray(ref(bucket, jnp.int32(offset)))
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), offset


def test_traced_offset_in_scan_carry_updates_the_bucket_in_place():
    # Stacked layers [L, out, in] whose blocks lie back to back from `base` in one bucket,
    # the bucket a scan carry: layer i's block at BlockOffset(base, i, out * in).
    layers, t, n_in, n_out, base = 3, 8, 6, 5, 11
    rng = np.random.default_rng(6)
    xs = jnp.asarray(rng.standard_normal((layers, t, n_in)) * 40, E4M3)
    dys = jnp.asarray(rng.standard_normal((layers, t, n_out)) * 100, E5M2)
    sxs = jnp.asarray(rng.uniform(0.01, 0.02, layers), F32)
    sgs = jnp.asarray(rng.uniform(1e-4, 2e-4, layers), F32)
    bucket = jnp.asarray(rng.standard_normal(N), F32)

    def run(bucket, xs, dys, sxs, sgs):
        def body(b, inputs):
            i, x, dy, sx, sg = inputs
            pos = BlockOffset(base, i, n_out * n_in)
            return ops.fp8_wgrad_accumulate(x, dy, sx, sg, b, offset=pos), None

        index = jnp.arange(layers, dtype=jnp.int32)
        return jax.lax.scan(body, bucket, (index, xs, dys, sxs, sgs))[0]

    got = np.asarray(jax.jit(run)(bucket, xs, dys, sxs, sgs))
    block = n_out * n_in
    for i in range(layers):
        update, magnitude = _exact(xs[i], dys[i], sxs[i], sgs[i])
        at = base + i * block
        old = np.asarray(bucket)[at : at + block].reshape(n_out, n_in)
        _check_block(got[at : at + block].reshape(n_out, n_in), old, update, magnitude, t)
    end = base + layers * block
    np.testing.assert_array_equal(
        got[np.r_[0:base, end:N]], np.asarray(bucket)[np.r_[0:base, end:N]]
    )

    hlo = compiled_text(run, bucket, xs, dys, sxs, sgs, donate_argnums=0)
    assert entry_aliases_param(hlo, 0), hlo.splitlines()[0]
    calls = custom_calls(hlo, handlers.FP8_TARGET_AT)
    assert "while(" in hlo and len(calls) == 1, calls
    assert "output_to_operand_aliasing={{}: (2, {})}" in calls[0]
    assert copies_of(hlo, "f32", (N,)) == []


def test_in_place_under_donated_jit():
    x, dy, sx, sg, acc = _data(7, (64,), 48, 40, E4M3)
    hlo = compiled_text(ops.fp8_wgrad_accumulate, x, dy, sx, sg, acc, donate_argnums=4)
    assert entry_aliases_param(hlo, 4), hlo.splitlines()[0]
    calls = custom_calls(hlo, handlers.FP8_TARGET)
    assert len(calls) == 1 and "output_to_operand_aliasing={{}: (2, {})}" in calls[0]
    assert "%fp8_wgrad_accumulate" in calls[0]  # the named primitive
    assert copies_of(hlo, "f32", (40, 48)) == []
    assert handlers.FP8_TARGET in handlers.WGRAD_TARGETS
    assert handlers.FP8_TARGET_AT in handlers.WGRAD_TARGETS


def test_vmap_and_zero_tokens():
    x, dy, sx, sg, acc = _data(8, (3, 10), 4, 6, E5M2)  # vmapped over the leading 3
    got = jax.jit(jax.vmap(ops.fp8_wgrad_accumulate, in_axes=(0, 0, None, None, None)))(
        x, dy, sx, sg, acc
    )
    for b in range(3):
        update, magnitude = _exact(x[b], dy[b], sx, sg)
        _check_block(got[b], acc, update, magnitude, 10)
    empty = ops.fp8_wgrad_accumulate(jnp.zeros((0, 4), E4M3), jnp.zeros((0, 6), E4M3), sx, sg, acc)
    assert empty is acc


_GOOD = dict(
    x=jnp.zeros((4, 3), E4M3),
    dy=jnp.zeros((4, 2), E5M2),
    x_scale_inv=jnp.float32(1),
    dy_scale_inv=jnp.ones((1,), F32),
    main_grad=jnp.zeros((2, 3), F32),
)


@pytest.mark.parametrize(
    "change,offset,match",
    [
        ({"x": jnp.zeros((4, 3), jnp.bfloat16)}, None, r"x must be float8_e4m3fn; got x bfloat16"),
        ({"x": jnp.zeros((4, 3), E5M2)}, None, r"x must be float8_e4m3fn"),
        ({"dy": jnp.zeros((4, 2), F32)}, None, r"dy must be float8_e4m3fn or float8_e5m2"),
        ({"dy": jnp.zeros((5, 2), E4M3)}, None, r"same leading \(token\) dims"),
        ({"x_scale_inv": jnp.ones((2,), F32)}, None, r"x_scale_inv must be a float32 scalar"),
        ({"dy_scale_inv": jnp.bfloat16(1)}, None, r"dy_scale_inv must be a float32 scalar"),
        ({"dy_scale_inv": 1.0}, None, r"dy_scale_inv must be a float32 scalar"),
        ({"main_grad": jnp.zeros((2, 3), jnp.bfloat16)}, None, r"main_grad must be float32"),
        ({"main_grad": jnp.zeros((3, 2), F32)}, None, r"main_grad must have shape \[out, in\]"),
        ({"main_grad": jnp.zeros(10, F32)}, 5, r"holding the \[out, in\] block"),
        ({"main_grad": jnp.zeros(5, F32)}, jnp.int32(0), r"N >= 6"),
    ],
)
def test_bad_inputs_raise_clear_errors(change, offset, match):
    args = {**_GOOD, **change}
    with pytest.raises(ValueError, match=match):
        ops.fp8_wgrad_accumulate(**args, offset=offset)
    with pytest.raises(ValueError, match=match):
        ops.fp8_wgrad_accumulate_ref(**args, offset=offset)


def test_handler_rejects_bad_operands_itself():
    # Bypass the Python checks: the C++ handler validates on its own.
    bind = functools.partial(ops.fp8_wgrad_accumulate_p.bind, offset=0)
    g = _GOOD
    with pytest.raises(Exception, match="x must be float8_e4m3fn"):
        jax.jit(bind)(
            g["x"].astype(F32), g["dy"], g["main_grad"], g["x_scale_inv"], g["dy_scale_inv"]
        )
    with pytest.raises(Exception, match="float32 scalars"):
        jax.jit(bind)(g["x"], g["dy"], g["main_grad"], jnp.ones(2, F32), g["dy_scale_inv"])
    with pytest.raises(Exception, match="exceeds the flat main_grad"):
        jax.jit(functools.partial(ops.fp8_wgrad_accumulate_p.bind, offset=8))(
            g["x"], g["dy"], jnp.zeros(10, F32), g["x_scale_inv"], g["dy_scale_inv"]
        )


@pytest.mark.cuda_handler
def test_cuda_lowering_has_its_workspace_and_scratch():
    # Without a GPU: the CUDA lowering names the target, aliases the accumulator and adds
    # the cuBLASLt workspace and the transposed-operand scratch (with a staging slot for an
    # unaligned static offset and for every traced position).
    x, dy = jnp.zeros((32, 16), E4M3), jnp.zeros((32, 48), E5M2)
    s, bucket = jnp.float32(1), jnp.zeros(2048, F32)

    def lowered(offset):
        fn = lambda b: ops.fp8_wgrad_accumulate(x, dy, s, s, b, offset=offset)
        return jax.jit(fn).trace(bucket).lower(lowering_platforms=("cuda",)).as_text()

    workspace = ops.WORKSPACE_BYTES + 256
    for offset, target, staged in (
        (16, handlers.FP8_TARGET, False),
        (17, handlers.FP8_TARGET, True),
        (BlockOffset(16, jnp.int32(1), 768), handlers.FP8_TARGET_AT, True),
    ):
        text = lowered(offset)
        assert f"@{target}(" in text, text
        size = ops.fp8.cuda_scratch_bytes(32, 16, 48, staged=staged)
        assert f"tensor<{workspace}xui8>" in text and f"tensor<{size}xui8>" in text, text
        assert "output_operand_aliases" in text


# ---- GPU -----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dy_dtype", DY_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("offset", [None, 32, 33, "traced"])
def test_gpu_matches_reference(dy_dtype, offset):
    gpu = jax.devices("gpu")[0]
    t, n_in, n_out = 256, 64, 48
    x, dy, sx, sg, acc = _data(9, (t,), n_in, n_out, dy_dtype)
    rng = np.random.default_rng(10)
    main = acc if offset is None else jnp.asarray(rng.standard_normal(4096), F32)
    at = None if offset is None else (jnp.int32(1000) if offset == "traced" else offset)
    args = jax.device_put((x, dy, sx, sg, main), gpu)
    fn = functools.partial(ops.fp8_wgrad_accumulate, offset=at)
    ref = functools.partial(ops.fp8_wgrad_accumulate_ref, offset=at)
    got = np.asarray(jax.jit(fn)(*args))
    start = 0 if offset is None else (1000 if offset == "traced" else offset)
    block = n_out * n_in
    flat_got, flat_main = got.ravel(), np.asarray(main).ravel()
    update, magnitude = _exact(x, dy, sx, sg)
    old = flat_main[start : start + block].reshape(n_out, n_in)
    for result in (got, np.asarray(jax.jit(ref)(*args))):  # the handler, XLA's own dot
        flat = result.ravel()
        _check_block(
            flat[start : start + block].reshape(n_out, n_in),
            old,
            update,
            magnitude,
            t,
            accumulation=2.0**-9,
        )
    outside = np.r_[0:start, start + block : flat_main.size]
    np.testing.assert_array_equal(flat_got[outside], flat_main[outside])


@pytest.mark.gpu
def test_gpu_refuses_shapes_that_are_not_multiples_of_16():
    gpu = jax.devices("gpu")[0]
    x, dy, sx, sg, acc = jax.device_put(_data(11, (40,), 16, 24, E4M3), gpu)
    with pytest.raises(Exception, match="multiples of 16"):
        jax.jit(ops.fp8_wgrad_accumulate)(x, dy, sx, sg, acc).block_until_ready()
