"""grouped_wgrad_accumulate: expert weights [E, out, in] in one call, against numpy
float64, in place (donated, scan carry, flat bucket), vmap, errors, CUDA lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_util import compiled_text, copies_of, custom_calls, entry_aliases_param

from jax_wgrad import ops
from jax_wgrad.ops import handlers

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
DTYPE_COMBOS = [(F32, F32), (BF16, F32), (F16, F32), (BF16, BF16), (F16, F16)]
U = {jnp.dtype(F32): 2.0**-24, jnp.dtype(BF16): 2.0**-8, jnp.dtype(F16): 2.0**-11}


def _data(seed, e, t, n_in, n_out, in_dtype, acc_dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((e, t, n_in)), in_dtype)
    dy = jnp.asarray(rng.standard_normal((e, t, n_out)), in_dtype)
    acc = jnp.asarray(rng.standard_normal((e, n_out, n_in)), acc_dtype)
    return x, dy, acc


def _exact(x, dy, acc):
    """float64 ``acc[e] + dy[e]^T x[e]`` and the fp32-accumulation error bound."""
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    acc64 = np.asarray(acc, np.float64).reshape(x64.shape[0], dy64.shape[2], x64.shape[2])
    exact = acc64 + np.einsum("eto,eti->eoi", dy64, x64)
    magnitude = np.abs(acc64) + np.einsum("eto,eti->eoi", np.abs(dy64), np.abs(x64))
    bound = (x64.shape[1] + 2) * U[jnp.dtype(F32)] * magnitude + U[jnp.dtype(acc.dtype)] * np.abs(
        exact
    )
    return exact, bound


@pytest.mark.parametrize("in_dtype,acc_dtype", DTYPE_COMBOS)
@pytest.mark.parametrize("e,t,n_in,n_out", [(1, 5, 3, 4), (4, 37, 16, 24), (8, 600, 9, 7)])
def test_matches_float64(in_dtype, acc_dtype, e, t, n_in, n_out):
    x, dy, acc = _data(0, e, t, n_in, n_out, in_dtype, acc_dtype)
    got = jax.jit(ops.grouped_wgrad_accumulate)(x, dy, acc)
    assert got.shape == acc.shape and got.dtype == acc.dtype
    exact, bound = _exact(x, dy, acc)
    assert (np.abs(np.asarray(got, np.float64) - exact) - bound).max() <= 0


@pytest.mark.parametrize("in_dtype,acc_dtype", [(F32, F32), (BF16, F32), (BF16, BF16)])
def test_flat_bucket_updates_only_the_experts_blocks(in_dtype, acc_dtype):
    e, t, n_in, n_out, offset = 3, 20, 6, 5, 11
    x, dy, acc = _data(1, e, t, n_in, n_out, in_dtype, acc_dtype)
    bucket = (
        jnp.asarray(np.random.default_rng(2).standard_normal(offset + acc.size + 9), acc_dtype)
        .at[offset : offset + acc.size]
        .set(acc.reshape(-1))
    )
    got = np.asarray(
        jax.jit(functools.partial(ops.grouped_wgrad_accumulate, offset=offset))(x, dy, bucket),
        np.float64,
    )
    exact, bound = _exact(x, dy, acc)
    block = got[offset : offset + acc.size].reshape(exact.shape)
    assert (np.abs(block - exact) - bound).max() <= 0
    before = np.asarray(bucket, np.float64)
    np.testing.assert_array_equal(got[:offset], before[:offset])
    np.testing.assert_array_equal(got[offset + acc.size :], before[offset + acc.size :])


def test_same_as_one_call_per_expert():
    # The grouped call is exactly the per-expert fused calls (same GEMM per expert).
    x, dy, acc = _data(3, 4, 33, 8, 12, F32, F32)
    got = jax.jit(ops.grouped_wgrad_accumulate)(x, dy, acc)
    want = jnp.stack([ops.wgrad_accumulate(x[i], dy[i], acc[i]) for i in range(4)])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_in_place_one_call_under_donated_jit():
    x, dy, acc = _data(4, 8, 64, 48, 40, BF16, F32)
    bucket = jnp.zeros(7 + acc.size, F32)
    fn = functools.partial(ops.grouped_wgrad_accumulate, offset=7)
    hlo = compiled_text(fn, x, dy, bucket, donate_argnums=2)
    assert entry_aliases_param(hlo, 2), hlo.splitlines()[0]
    calls = custom_calls(hlo, handlers.TARGET)
    assert len(calls) == 1 and "output_to_operand_aliasing={{}: (2, {})}" in calls[0]
    assert "bf16[8,64,48]" in calls[0] and copies_of(hlo, "f32", bucket.shape) == []


def test_in_place_as_scan_carry():
    xs = jnp.ones((3, 4, 16, 8))
    dys = jnp.ones((3, 4, 16, 5))
    run = lambda acc, xs, dys: jax.lax.scan(
        lambda a, b: (ops.grouped_wgrad_accumulate(*b, a, offset=0), None), acc, (xs, dys)
    )[0]
    hlo = compiled_text(run, jnp.zeros(4 * 5 * 8), xs, dys, donate_argnums=0)
    assert entry_aliases_param(hlo, 0) and len(custom_calls(hlo, handlers.TARGET)) == 1
    assert copies_of(hlo, "f32", (160,)) == []
    np.testing.assert_array_equal(
        np.asarray(jax.jit(run)(jnp.zeros(160), xs, dys)), np.full(160, 3 * 16.0)
    )


def test_vmap_of_flat_buckets():
    x, dy, _ = _data(5, 3, 9, 4, 2, F32, F32)
    xs, dys = jnp.stack([x, 2 * x]), jnp.stack([dy, dy])
    buckets = jnp.arange(2 * 30, dtype=F32).reshape(2, 30)
    fn = functools.partial(ops.grouped_wgrad_accumulate, offset=5)
    got = jax.jit(jax.vmap(fn))(xs, dys, buckets)
    want = jnp.stack(
        [ops.grouped_wgrad_accumulate_ref(xs[i], dys[i], buckets[i], offset=5) for i in range(2)]
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_reference_agrees():
    # Both within the fp32-accumulation bound of the float64 value. (An element-wise rtol
    # between the two fails where a sum nearly cancels: XLA's dot and the BLAS kernel add
    # the same products in different orders, and the order XLA:CPU's dot uses depends on
    # how it splits the work over threads.)
    x, dy, acc = _data(6, 2, 10, 3, 4, F32, F32)
    exact, bound = _exact(x, dy, acc)
    for fn in (ops.grouped_wgrad_accumulate, ops.grouped_wgrad_accumulate_ref):
        got = np.asarray(fn(x, dy, acc), np.float64)
        assert (np.abs(got - exact) - bound).max() <= 0, fn.__name__


@pytest.mark.parametrize(
    "x,dy,acc,kw,match",
    [
        ((4, 3), (4, 2), (2, 3), {}, r"\[E, T, in\] and \[E, T, out\]"),
        ((2, 4, 3), (3, 4, 2), (2, 2, 3), {}, r"same E and T"),
        ((2, 4, 3), (2, 4, 2), (2, 3, 2), {}, r"\[E, out, in\] = \[2, 2, 3\]"),
        ((2, 4, 3), (2, 4, 2), (20,), {"offset": 9}, r"offset=9.*\[offset, offset \+ 12\)"),
        ((2, 4, 3), (2, 4, 2), (2, 2, 3), {"offset": 0}, r"flat buffer \[N\]"),
    ],
)
def test_bad_shapes(x, dy, acc, kw, match):
    with pytest.raises(ValueError, match=match):
        ops.grouped_wgrad_accumulate(jnp.zeros(x), jnp.zeros(dy), jnp.zeros(acc), **kw)


def test_bad_dtypes():
    with pytest.raises(ValueError, match="float32, bfloat16 or float16; got x int32"):
        ops.grouped_wgrad_accumulate(
            jnp.zeros((1, 2, 3), jnp.int32), jnp.zeros((1, 2, 2), jnp.int32), jnp.zeros((1, 2, 3))
        )
    with pytest.raises(ValueError, match="main_grad must be float32"):
        ops.grouped_wgrad_accumulate(
            jnp.zeros((1, 2, 3)), jnp.zeros((1, 2, 2)), jnp.zeros((1, 2, 3), BF16)
        )


def test_handler_rejects_out_of_range_groups_itself():
    bind = functools.partial(ops.wgrad_accumulate_p.bind, offset=4, precision=0)
    with pytest.raises(Exception, match=r"\[4, 16\) exceeds the flat main_grad"):
        jax.jit(bind)(jnp.zeros((3, 2, 2)), jnp.zeros((3, 2, 2)), jnp.zeros(14))


@pytest.mark.cuda_handler
def test_cuda_lowering_is_one_aliased_call():
    x, dy = jnp.ones((8, 16, 4)), jnp.ones((8, 16, 3))
    text = (
        jax.jit(functools.partial(ops.grouped_wgrad_accumulate, offset=2))
        .trace(x, dy, jnp.zeros(100))
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    calls = [l for l in text.splitlines() if "@jax_wgrad_wgrad_accumulate" in l]
    assert len(calls) == 1 and "tensor<8x16x4xf32>" in calls[0], text
    assert "output_tuple_indices = [0], operand_index = 2" in calls[0]


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype,acc_dtype", DTYPE_COMBOS)
def test_gpu_matches_float64(in_dtype, acc_dtype):
    gpu = jax.devices("gpu")[0]
    x, dy, acc = jax.device_put(_data(7, 8, 257, 33, 24, in_dtype, acc_dtype), gpu)
    bucket = jnp.concatenate([jnp.zeros(5, acc_dtype), acc.reshape(-1)])
    got = jax.jit(functools.partial(ops.grouped_wgrad_accumulate, offset=5, precision="highest"))(
        x, dy, bucket
    )
    exact, bound = _exact(x, dy, acc)
    got = np.asarray(got, np.float64)[5:].reshape(exact.shape)
    assert (np.abs(got - exact) - bound).max() <= 0
