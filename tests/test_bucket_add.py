"""bucket_add: every gradient into its own block of a flat bucket, in place."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_util import compiled_text, copies_of, custom_calls, entry_aliases_param

from jax_wgrad import ops
from jax_wgrad.ops import handlers

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


def _blocks(seed, shapes, dtype):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def _expected(bucket, grads, offsets):
    """float64 sum of the inputs, rounded once to the bucket dtype (what the op does:
    fp32 add of two already-rounded values, then one rounding)."""
    want = np.asarray(bucket, np.float64).copy()
    for g, o in zip(grads, offsets):
        flat = np.asarray(g, np.float64).ravel()
        want[o : o + flat.size] += flat
    return want


@pytest.mark.parametrize(
    "bucket_dtype,grad_dtype", [(F32, F32), (F32, BF16), (F32, F16), (BF16, BF16), (F16, F32)]
)
def test_matches_numpy(bucket_dtype, grad_dtype):
    bucket = jnp.asarray(np.random.default_rng(0).standard_normal(300), bucket_dtype)
    grads = _blocks(1, [(7,), (3, 4), (2, 2, 5), (1,)], grad_dtype)
    offsets = [0, 100, 40, 299]
    got = jax.jit(ops.bucket_add, static_argnums=2)(bucket, grads, tuple(offsets))
    assert got.dtype == bucket.dtype and got.shape == bucket.shape
    want = _expected(bucket, grads, offsets)
    u = {jnp.dtype(F32): 2.0**-24, jnp.dtype(BF16): 2.0**-8, jnp.dtype(F16): 2.0**-11}
    tol = u[jnp.dtype(bucket_dtype)] * np.abs(want) + 1e-30
    np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), tol + 1e-12)
    untouched = np.ones(300, bool)
    for g, o in zip(grads, offsets):
        untouched[o : o + g.size] = False
    np.testing.assert_array_equal(np.asarray(got)[untouched], np.asarray(bucket)[untouched])
    ref = ops.bucket_add_ref(bucket, grads, offsets)
    np.testing.assert_array_equal(np.asarray(ref, np.float64), np.asarray(got, np.float64))


def test_empty_and_eager():
    bucket = jnp.arange(6, dtype=F32)
    assert ops.bucket_add(bucket, [], []) is bucket
    assert ops.bucket_add(bucket, [jnp.zeros((0, 3))], [6]) is bucket
    np.testing.assert_array_equal(ops.bucket_add(bucket, [jnp.ones(2)], [1]), [0, 2, 3, 3, 4, 5])


def test_in_place_under_donated_jit():
    bucket = jnp.zeros(1 << 12, F32)
    grads = _blocks(2, [(64,), (8, 8)], F32)
    hlo = compiled_text(
        lambda b, g0, g1: ops.bucket_add(b, [g0, g1], [0, 1024]), bucket, *grads, donate_argnums=0
    )
    assert entry_aliases_param(hlo, 0)
    calls = custom_calls(hlo, handlers.BUCKET_ADD_TARGET)
    assert len(calls) == 1 and "output_to_operand_aliasing={{}: (0, {})}" in calls[0]
    assert copies_of(hlo, "f32", (1 << 12,)) == []


def test_in_place_as_scan_carry_with_many_blocks():
    # 20 small gradients per step into one 64k bucket: one call per step, no bucket copy,
    # no dynamic-update-slice of the bucket (what XLA:GPU copies at constant offsets).
    n, k = 1 << 16, 20
    offsets = tuple(1000 * i for i in range(k))
    grads = jnp.asarray(np.random.default_rng(3).standard_normal((5, k, 37)), F32)

    def run(bucket, grads):
        def body(b, g):
            return ops.bucket_add(b, list(g), offsets), None

        return jax.lax.scan(body, bucket, grads)[0]

    hlo = compiled_text(run, jnp.zeros(n), grads, donate_argnums=0)
    assert len(custom_calls(hlo, handlers.BUCKET_ADD_TARGET)) == 1
    assert copies_of(hlo, "f32", (n,)) == []
    assert not [l for l in hlo.splitlines() if f"f32[{n}]" in l and "dynamic-update-slice(" in l]
    got = np.asarray(jax.jit(run)(jnp.zeros(n), grads))
    want = np.zeros(n)
    for i, o in enumerate(offsets):
        want[o : o + 37] = np.asarray(grads[:, i], np.float64).sum(0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.cuda_handler
def test_cuda_lowering_is_the_aliased_custom_call():
    # What a GPU compiles (lowered here without one): the FFI call, aliased, offsets attr.
    bucket, g = jnp.zeros(64), jnp.ones((2, 3))
    text = (
        jax.jit(lambda b, g: ops.bucket_add(b, [g], [10]))
        .trace(bucket, g)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    call = [l for l in text.splitlines() if "stablehlo.custom_call" in l]
    assert len(call) == 1 and "@jax_wgrad_bucket_add" in call[0], text
    assert "operand_index = 0" in call[0] and "offsets = dense<10> : tensor<1xi64>" in call[0]
    assert "dynamic_update_slice" not in text


@pytest.mark.parametrize(
    "bucket,grads,offsets,match",
    [
        ((10, 2), [(2,)], [0], "flat float32"),
        ((10,), [(2,), (2,)], [0], "2 offsets for|1 offsets for 2"),
        ((10,), [(4,)], [7], r"gradient 0 \(float32\[4\] at offset 7\)"),
        ((10,), [(4,)], [-1], "at offset -1"),
        ((10,), [(4,)], [1.0], "static int"),
        ((10,), [(4,), (3,)], [0, 2], r"\[0, 4\) and \[2, \.\.\.\) overlap"),
    ],
)
def test_bad_input(bucket, grads, offsets, match):
    with pytest.raises(ValueError, match=match):
        ops.bucket_add(jnp.zeros(bucket), [jnp.ones(g) for g in grads], offsets)


def test_bad_dtypes():
    with pytest.raises(ValueError, match=r"gradient 0 \(int32\[3\].*must be float32"):
        ops.bucket_add(jnp.zeros(8), [jnp.ones(3, jnp.int32)], [0])
    with pytest.raises(ValueError, match=r"bucket must be a flat float32.*got int32\[8\]"):
        ops.bucket_add(jnp.zeros(8, jnp.int32), [jnp.ones(3)], [0])


def test_handler_rejects_bad_operands_itself():
    # Bypass the Python checks: the C++ handler validates on its own.
    bind = functools.partial(ops.bucket_add_p.bind, offsets=(6,))
    with pytest.raises(Exception, match=r"does not fit in the bucket of 8 elements"):
        jax.jit(bind)(jnp.zeros(8), jnp.ones(3))
    bind = functools.partial(ops.bucket_add_p.bind, offsets=(0, 2))
    with pytest.raises(Exception, match=r"blocks at offsets 0 and 2 overlap"):
        jax.jit(bind)(jnp.zeros(8), jnp.ones(3), jnp.ones(3))
