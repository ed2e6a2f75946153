"""Traced (int32 array) block offsets: the ``jax_wgrad_wgrad_accumulate_at`` path.

A Python int offset keeps the static path (tests/test_ops.py); an int32 scalar array takes
the operand-offset custom call, clamped like ``lax.dynamic_update_slice`` (without
negative wrapping). The use case: a ``lax.scan`` over stacked ``[L, out, in]`` layers
whose blocks lie back to back in one bucket, the bucket threaded through the carry.
Shapes are small and each test compiles once or twice (the default suite's time budget).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_wgrad import ops
from jax_wgrad.aot import hlo
from jax_wgrad.functional import grouped_linear, linear_into_bucket
from jax_wgrad.ops import handlers

pytestmark = pytest.mark.skipif(not ops.fusion_available("cpu"), reason="needs the CPU handler")

F32, BF16 = jnp.float32, jnp.bfloat16
N = 157  # bucket elements: odd, so that no other array of a test has this size


def _rand(seed, shape, dtype):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _exact(x, dy, grouped: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(dy^T x, sum |dy|^T |x|)`` in float64 from the (already rounded) inputs, flat."""
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    spec = "eto,eti->eoi" if grouped else "to,ti->oi"
    return (np.einsum(spec, dy64, x64).ravel(), np.einsum(spec, np.abs(dy64), np.abs(x64)).ravel())


# ---------------------------------------------------------------- op level: numerics
@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "grouped"])
@pytest.mark.parametrize("in_dtype", [F32, BF16])
def test_traced_equals_static_equals_float64_and_clamps(in_dtype, grouped):
    lead = (3, 9) if grouped else (9,)  # [E, T] or [T]
    x, dy = _rand(1, lead + (6,), in_dtype), _rand(2, lead + (5,), in_dtype)
    block = (3 if grouped else 1) * 5 * 6
    bucket = _rand(3, (N,), F32)
    op = ops.grouped_wgrad_accumulate if grouped else ops.wgrad_accumulate
    traced = jax.jit(lambda b, o: op(x, dy, b, offset=o))  # one compile for every offset
    dw, magnitude = _exact(x, dy, grouped)
    for offset in (0, 7, N - block, -3, N - block + 1, 10_000):
        got = np.asarray(traced(bucket, jnp.int32(offset)), np.float64)
        at = min(max(offset, 0), N - block)
        # The block lands where lax.dynamic_update_slice puts it (no negative wrapping).
        where = jax.lax.dynamic_update_slice(
            jnp.zeros(N, bool),
            jnp.ones(block, bool),
            (jnp.int32(offset),),
            allow_negative_indices=False,
        )
        assert np.flatnonzero(where).tolist() == list(range(at, at + block)), offset
        # Bitwise the static path at the clamped offset (the same GEMMs).
        np.testing.assert_array_equal(got, op(x, dy, bucket, offset=at))
        # ... which is right: float64 within the fp32-accumulation bound, the rest as it was.
        want = np.asarray(bucket, np.float64)
        want[at : at + block] += dw
        bound = (lead[-1] + 2) * 2.0**-24 * (np.abs(want[at : at + block]) + magnitude)
        assert np.all(np.abs(got[at : at + block] - want[at : at + block]) <= bound), offset
        np.testing.assert_array_equal(
            np.delete(got, np.s_[at : at + block]),
            np.delete(np.asarray(bucket, np.float64), np.s_[at : at + block]),
        )
    # The plain-XLA reference takes the traced offset too, clamped the same way.
    ref_op = ops.grouped_wgrad_accumulate_ref if grouped else ops.wgrad_accumulate_ref
    ref = jax.jit(lambda b, o: ref_op(x, dy, b, offset=o))
    for offset in (7, -3, 10_000):
        np.testing.assert_allclose(
            ref(bucket, jnp.int32(offset)), traced(bucket, jnp.int32(offset)), rtol=1e-6, atol=1e-6
        )


def test_vmap_gives_each_batch_element_its_own_offset():
    x, dy = _rand(4, (2, 8, 6), F32), _rand(5, (2, 8, 5), F32)
    buckets = _rand(6, (2, N), F32)
    offsets = jnp.array([3, 200], jnp.int32)  # 200 is clamped to N - 30
    fn = lambda x, dy, b, o: ops.wgrad_accumulate(x, dy, b, offset=o)
    got = jax.vmap(fn)(x, dy, buckets, offsets)
    for i, at in enumerate((3, N - 30)):
        np.testing.assert_array_equal(
            got[i], ops.wgrad_accumulate(x[i], dy[i], buckets[i], offset=at)
        )


def test_bad_traced_offsets_and_buckets_are_trace_time_errors():
    x, dy = jnp.zeros((4, 6)), jnp.zeros((4, 5))
    with pytest.raises(ValueError, match=r"int32 scalar array \(traced\); got int32\[2\]"):
        ops.wgrad_accumulate(x, dy, jnp.zeros(N), offset=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match=r"got float32\[\]"):
        ops.wgrad_accumulate(x, dy, jnp.zeros(N), offset=jnp.float32(3))
    with pytest.raises(ValueError, match=r"flat buffer \[N\] with N >= 30"):
        ops.wgrad_accumulate(x, dy, jnp.zeros(29), offset=jnp.int32(0))
    with pytest.raises(ValueError, match=r"flat buffer \[N\] with N >= 30"):
        ops.wgrad_accumulate(x, dy, jnp.zeros((5, 6)), offset=jnp.int32(0))
    with pytest.raises(ValueError, match="at a traced offset does not fit"):
        linear_into_bucket(x, jnp.zeros((5, 6)), None, jnp.zeros(29), offset=jnp.int32(0))


def test_handler_rejects_a_wrong_offset_operand_itself():
    bind = functools.partial(ops.wgrad_accumulate_at_p.bind, base=0, stride=1, precision=0)
    x, dy = jnp.zeros((4, 6)), jnp.zeros((4, 5))
    with pytest.raises(Exception, match="offset operand must be int32 with one element"):
        jax.jit(bind)(x, dy, jnp.zeros(N), jnp.zeros((2,), jnp.int32))


# ------------------------------------------------- a scan over stacked layers, in place
L, T, D = 3, 8, 16  # layers, tokens, features (square weights chain)
BASE = 5  # the stack's region: [BASE, BASE + L * D * D) of the bucket
NB = BASE + L * D * D + 11


def _stacked(ws, b, bucket, x):
    """``lax.scan`` over ``L`` fused linears with stacked ``ws [L, D, D]``, ``b [L, D]``;
    layer ``i``'s offset ``BASE + i * D * D`` is an ``xs`` entry (traced)."""
    offsets = BASE + jnp.arange(L, dtype=jnp.int32) * (D * D)

    def layer(carry, xs):
        h, bk = carry
        w, bi, off = xs
        h, bk = linear_into_bucket(h, w, bi, bk, offset=off)
        return (jnp.tanh(h), bk), None

    (y, bucket), _ = jax.lax.scan(layer, (x, bucket), (ws, b, offsets))
    return y, bucket


def _plain(ws, b, x):
    def layer(h, wb):
        return jnp.tanh(h @ wb[0].T + wb[1]), None

    return jax.lax.scan(layer, x, (ws, b))[0]


def _backward(ws, b, bucket, x, dy):
    """One microbatch's backward: ``bucket`` comes back with every layer's block added."""
    _, vjp_fn = jax.vjp(_stacked, ws, b, bucket, x)
    dws, db, new_bucket, dx = vjp_fn((dy, bucket))
    return dws, db, new_bucket, dx


@pytest.fixture(scope="module")
def stacked_run():
    """The compiled backward (bucket donated) and its results: one compile for two tests."""
    ws, b = _rand(7, (L, D, D), F32) * 0.3, _rand(8, (L, D), F32)
    x, dy = _rand(9, (T, D), F32), _rand(10, (T, D), F32)
    bucket = _rand(11, (NB,), F32)
    compiled = jax.jit(_backward, donate_argnums=2).lower(ws, b, bucket, x, dy).compile()
    out = compiled(ws, b, jnp.array(bucket), x, dy)
    return compiled.as_text(), (ws, b, bucket, x, dy), out


def test_scan_over_stacked_layers_equals_jax_grad(stacked_run):
    _, (ws, b, bucket, x, dy), (dws, db, new_bucket, dx) = stacked_run
    loss = lambda ws, b, x: jnp.sum(_plain(ws, b, x) * dy)
    rws, rb, rx = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(ws, b, x)
    want = np.asarray(bucket).copy()
    want[BASE : BASE + L * D * D] += np.asarray(rws).ravel()
    np.testing.assert_allclose(new_bucket, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(new_bucket[:BASE], bucket[:BASE])
    np.testing.assert_array_equal(new_bucket[BASE + L * D * D :], bucket[BASE + L * D * D :])
    np.testing.assert_allclose(db, rb, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, rx, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(dws, 0)  # the weight gradient went into the bucket


def test_hlo_scan_backward_accumulates_in_place_inside_the_loop(stacked_run):
    text = stacked_run[0]
    comps = hlo.computations(text)
    bodies = [body for _, body in hlo.while_bodies(comps, hlo.entry_name(text))]
    calls = {
        c: [l for l in comps[c] if f'custom_call_target="{handlers.TARGET_AT}"' in l] for c in comps
    }
    with_calls = [c for c, lines in calls.items() if lines]
    # The fused call runs once per layer inside the backward loop's body, not unrolled.
    assert len(with_calls) == 1 and len(calls[with_calls[0]]) == 1, with_calls
    (loop,) = [body for body in bodies if with_calls[0] in hlo.reachable(comps, body)]
    assert hlo.aliased(calls[with_calls[0]][0]), calls[with_calls[0]][0]
    assert "output_to_operand_aliasing={{}: (2, {})}" in calls[with_calls[0]][0]
    # No bucket-sized copy or kernel in the loop; the static-offset target is not used.
    assert hlo.sized_ops(comps, hlo.reachable(comps, loop), [NB]) == []
    assert not hlo.custom_calls(text, handlers.TARGET)
    # The donated bucket is updated in place across the whole program.
    assert hlo.sized_ops(comps, hlo.reachable(comps, hlo.entry_name(text)), [NB]) == []


def test_grouped_expert_stack_in_a_scan_equals_jax_grad():
    e, c = 2, 4
    ws = _rand(12, (L, e, D, D), F32) * 0.3
    x, dy = _rand(13, (e, c, D), F32), _rand(14, (e, c, D), F32)
    bucket = _rand(15, (BASE + L * e * D * D + 3,), F32)
    offsets = BASE + jnp.arange(L, dtype=jnp.int32) * (e * D * D)

    def stacked(ws, bucket, x):
        def layer(carry, xs):
            h, bk = carry
            h, bk = grouped_linear(h, xs[0], bucket=bk, offset=xs[1])
            return (jnp.tanh(h), bk), None

        return jax.lax.scan(layer, (x, bucket), (ws, offsets))[0]

    def backward(ws, bucket, x):
        _, vjp_fn = jax.vjp(stacked, ws, bucket, x)
        return vjp_fn((dy, bucket))

    dws, new_bucket, dx = jax.jit(backward)(ws, bucket, x)

    def loss(ws, x):
        h = jax.lax.scan(lambda h, w: (jnp.tanh(jnp.einsum("eci,eoi->eco", h, w)), None), x, ws)[0]
        return jnp.sum(h * dy)

    rws, rx = jax.jit(jax.grad(loss, argnums=(0, 1)))(ws, x)
    want = np.asarray(bucket).copy()
    want[BASE : BASE + rws.size] += np.asarray(rws).ravel()
    np.testing.assert_allclose(new_bucket, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, rx, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(dws, 0)


# ---------------------------------------------------------------- CUDA (lowering / GPU)
@pytest.mark.cuda_handler
def test_cuda_lowering_passes_the_offset_as_an_operand():
    x, dy = jnp.ones((3, 8, 4)), jnp.ones((3, 8, 5))
    fn = lambda b, o: ops.grouped_wgrad_accumulate(x, dy, b, offset=o)
    text = (
        jax.jit(fn)
        .trace(jnp.zeros(100), jnp.int32(2))
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    (call,) = [l for l in text.splitlines() if f"@{handlers.TARGET_AT}" in l]
    assert "output_tuple_indices = [0], operand_index = 2" in call
    assert "tensor<i32>" in call  # the offset operand
    # Results: the bucket, the cuBLAS workspace, 4 * 3 GEMM pointer slots, the staging
    # slots (3 blocks of 20 fp32, 80 bytes: already 16-byte multiples).
    assert f"tensor<{ops.WORKSPACE_BYTES + 256}xui8>" in call
    assert "tensor<96xui8>" in call and "tensor<60xf32>" in call, call


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype,acc_dtype", [(F32, F32), (BF16, F32), (BF16, BF16)])
@pytest.mark.parametrize("precision", [None, "highest"])
def test_gpu_traced_equals_static(in_dtype, acc_dtype, precision):
    # Offsets 0 and 4 give 16-byte aligned blocks (in place), 1 and 5 unaligned ones (the
    # staging path), 10_000 is clamped; grouped and plain. The pointer-array GEMM may pick
    # another cuBLAS kernel than the strided one: equal within the rounding of TF32/bf16.
    gpu = jax.devices("gpu")[0]
    exact = in_dtype == acc_dtype == F32 and precision == "highest"
    tol = dict(rtol=1e-5, atol=1e-4) if exact else dict(rtol=1e-2, atol=5e-2)
    for grouped in (False, True):
        lead = (3, 64) if grouped else (64,)
        x, dy = (
            jax.device_put(_rand(s, lead + (f,), in_dtype), gpu) for s, f in ((16, 24), (17, 40))
        )
        bucket = jax.device_put(_rand(18, (4096,), acc_dtype), gpu)
        op = functools.partial(
            ops.grouped_wgrad_accumulate if grouped else ops.wgrad_accumulate, precision=precision
        )
        traced = jax.jit(functools.partial(op, x, dy))  # the offset traced
        static = jax.jit(op, static_argnames="offset")
        block = (3 if grouped else 1) * 24 * 40
        for offset in (0, 1, 4, 5, 10_000):
            at = min(offset, 4096 - block)
            got = np.asarray(traced(bucket, offset=jnp.int32(offset)), np.float64)
            want = np.asarray(static(x, dy, bucket, offset=at), np.float64)
            np.testing.assert_allclose(got[at : at + block], want[at : at + block], **tol)
            np.testing.assert_array_equal(
                np.delete(got, np.s_[at : at + block]), np.delete(want, np.s_[at : at + block])
            )
