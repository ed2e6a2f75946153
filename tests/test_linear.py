"""Fused linear (custom_vjp), NNX Linear and accumulate_gradients vs plain jax.grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hlo_util import jaxpr_eqns
from jax.test_util import check_grads

import jax_wgrad
from jax_wgrad import Linear, MainGrad, accumulate_gradients, linear
from jax_wgrad.functional import WgradRoutes, linear_into_bucket
from jax_wgrad.ops import handlers


def _ref_linear(x, w, b):
    return x @ w.T + b


def _inputs(seed=0, lead=(4, 6), n_in=5, n_out=7):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], lead + (n_in,))
    w = jax.random.normal(k[1], (n_out, n_in))
    b = jax.random.normal(k[2], (n_out,))
    return x, w, b


def test_plain_linear_check_grads():
    x, w, b = _inputs()
    check_grads(lambda x, w, b: linear(x, w, b), (x, w, b), order=2, modes=["rev"])


def test_fused_linear_grads_equal_plain_jax_grad():
    x, w, b = _inputs()
    dy = jax.random.normal(jax.random.key(9), (4, 6, 7))
    acc0 = jax.random.normal(jax.random.key(8), (7, 5))

    def loss_fused(x, w, b, acc):
        return jnp.sum(linear(x, w, b, main_grad=acc) * dy)

    def loss_ref(x, w, b):
        return jnp.sum(_ref_linear(x, w, b) * dy)

    gx, gw, gb, new_acc = jax.jit(jax.grad(loss_fused, argnums=(0, 1, 2, 3)))(x, w, b, acc0)
    rx, rw, rb = jax.grad(loss_ref, argnums=(0, 1, 2))(x, w, b)
    np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gb, rb, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(gw, np.zeros_like(rw))  # the weight gets no gradient
    np.testing.assert_allclose(new_acc, acc0 + rw, rtol=1e-5, atol=1e-5)
    # The data/bias gradients of the fused path pass jax's numerical check too.
    check_grads(lambda x, b: linear(x, w, b, main_grad=acc0), (x, b), order=1, modes=["rev"])


def test_fused_linear_no_bias_and_bf16():
    x, w, _ = _inputs(lead=(9,))
    xb = x.astype(jnp.bfloat16)
    acc = jnp.zeros((7, 5), jnp.float32)
    dx, new_acc = jax.grad(
        lambda x, a: jnp.sum(linear(x, w, main_grad=a).astype(jnp.float32)), argnums=(0, 1)
    )(xb, acc)
    assert dx.dtype == jnp.bfloat16 and new_acc.dtype == jnp.float32
    ref = np.ones((9, 7)).T @ np.asarray(xb, np.float64)
    np.testing.assert_allclose(new_acc, ref, rtol=1e-6)


def test_fused_linear_in_place_in_compiled_grad():
    from hlo_util import compiled_text, copies_of

    x, w, b = _inputs(lead=(32,), n_in=48, n_out=40)

    def step(acc, x):
        return jax.grad(lambda a: jnp.sum(linear(x, w, b, main_grad=a) ** 2))(acc)

    hlo = compiled_text(step, jnp.zeros((40, 48)), x, donate_argnums=0)
    assert "jax_wgrad_wgrad_accumulate" in hlo
    assert copies_of(hlo, "f32", (40, 48)) == []


@pytest.mark.parametrize(
    "args,match",
    [
        (((3, 5), (7, 4), None, None), "do not match"),
        (((3, 5), (7, 5), (6,), None), "bias must have shape"),
        (((3, 5), (7, 5), None, (5, 7)), "main_grad shape"),
        (((3, 5), (7, 5, 1), None, None), r"weight must be \[out, in\]"),
    ],
)
def test_linear_bad_input(args, match):
    x, w, b, acc = (None if s is None else jnp.zeros(s) for s in args)
    with pytest.raises(ValueError, match=match):
        linear(x, w, b, main_grad=acc)


class _MLP(nnx.Module):
    def __init__(self, fuse: bool, rngs: nnx.Rngs):
        self.fc1 = Linear(5, 16, gradient_accumulation_fusion=fuse, rngs=rngs)
        self.fc2 = Linear(16, 3, use_bias=False, gradient_accumulation_fusion=fuse, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


def _mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _microbatches(m=4):
    k = jax.random.split(jax.random.key(3), 2)
    return {"x": jax.random.normal(k[0], (m, 6, 5)), "y": jax.random.normal(k[1], (m, 6, 3))}


def test_nnx_linear_has_main_grad_only_when_fused():
    fused, plain = _MLP(True, nnx.Rngs(0)), _MLP(False, nnx.Rngs(0))
    assert isinstance(fused.fc1.main_grad, MainGrad) and plain.fc1.main_grad is None
    assert fused.fc1.weight.shape == (16, 5) and fused.fc1.main_grad.shape == (16, 5)
    np.testing.assert_array_equal(fused.fc1.weight[...], plain.fc1.weight[...])


@pytest.mark.parametrize("fuse", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_accumulate_gradients_equals_jax_grad_of_mean(fuse):
    model, ref_model = _MLP(fuse, nnx.Rngs(0)), _MLP(False, nnx.Rngs(0))
    batches = _microbatches()

    @jax.jit
    def run(batches):
        return accumulate_gradients(model, _mse, batches)

    loss, grads = run(batches)
    ref_loss, ref_grads = nnx.value_and_grad(
        lambda m: jnp.mean(jax.vmap(lambda b: _mse(m, b))(batches))
    )(ref_model)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    flat, ref_flat = nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)
    assert [p for p, _ in flat] == [p for p, _ in ref_flat]
    for (path, g), (_, r) in zip(flat, ref_flat):
        assert g[...].dtype == jnp.float32
        scale = np.abs(np.asarray(r[...])).max()
        assert np.abs(np.asarray(g[...]) - np.asarray(r[...])).max() <= 1e-5 * scale, path
    if fuse:
        hlo = run.lower(batches).compile().as_text()
        assert hlo.count('custom_call_target="jax_wgrad_wgrad_accumulate"') == 2


def test_accumulate_gradients_bad_microbatches():
    model = _MLP(False, nnx.Rngs(0))
    with pytest.raises(ValueError, match="same leading axis"):
        accumulate_gradients(model, _mse, {"x": jnp.zeros((4, 6, 5)), "y": jnp.zeros((3, 6, 3))})


def test_public_api():
    for name in [
        "ops",
        "linear",
        "Linear",
        "MainGrad",
        "accumulate_gradients",
        "fusion_available",
        "wgrad_accumulate",
    ]:
        assert hasattr(jax_wgrad, name), name


# ----------------------------------------------------------------------------- threaded


def _needs_handler():
    if not jax_wgrad.fusion_available("cpu"):
        pytest.skip("the CPU wgrad_accumulate handler was not built")


def _two_layer_threaded(x, w1, b1, w2, bucket, offsets):
    """Two fused linears writing into ONE flat bucket, threaded: f(x, bucket) -> (y, bucket)."""
    routes = WgradRoutes((bucket,))
    w1 = routes.to_bucket(w1, 0, offsets[0])
    w2 = routes.to_bucket(w2, 0, offsets[1])
    h = jax.nn.gelu(linear(x, w1, b1))
    y = linear(h, w2)
    return y, routes.close()[0]


def test_threaded_linears_share_one_bucket_and_add_each_block_once():
    _needs_handler()
    x, w1, b1 = _inputs(lead=(3, 4), n_in=5, n_out=7)
    w2 = jax.random.normal(jax.random.key(4), (6, 7))
    dy = jax.random.normal(jax.random.key(5), (3, 4, 6))
    offsets = (64, 8)  # w2's [6, 7] block at [8, 50), w1's [7, 5] block at [64, 99)
    carried = jax.random.normal(jax.random.key(6), (128,))  # "accumulated so far"

    def run(x, w1, b1, w2, bucket):
        (y, tok), vjp_fn = jax.vjp(
            lambda x, w1, b1, w2, bk: _two_layer_threaded(x, w1, b1, w2, bk, offsets),
            x,
            w1,
            b1,
            w2,
            bucket,
        )
        return (y, tok), vjp_fn((dy, carried))

    (y, tok), (dx, dw1, db1, dw2, new_bucket) = jax.jit(run)(x, w1, b1, w2, jnp.zeros(128))
    np.testing.assert_array_equal(tok, np.zeros(128))  # forward: the bucket passes through

    def ref(x, w1, b1, w2):
        return jnp.sum(jax.nn.gelu(_ref_linear(x, w1, b1)) @ w2.T * dy)

    y_ref = jax.nn.gelu(_ref_linear(x, w1, b1)) @ w2.T
    # The reference is jitted like the fused run: XLA:CPU 0.12 compiles this MLP's
    # backward so that a jitted gradient differs from the eager one by up to 5e-5 (both
    # plain JAX; float64 puts the jitted one 5e-5 off, the eager one 7e-6), which is not
    # what this test is about.
    rx, rw1, rb1, rw2 = jax.jit(jax.grad(ref, argnums=(0, 1, 2, 3)))(x, w1, b1, w2)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, rx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db1, rb1, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(dw1, 0)
    np.testing.assert_array_equal(dw2, 0)
    want = np.array(carried)
    want[64:99] += np.asarray(rw1).ravel()
    want[8:50] += np.asarray(rw2).ravel()
    np.testing.assert_allclose(new_bucket, want, rtol=1e-5, atol=1e-5)


def test_threaded_bucket_in_place_in_a_scan_over_microbatches():
    # The bucket is a scan carry; each microbatch's vjp adds both blocks: no bucket copy.
    _needs_handler()
    from hlo_util import compiled_text, copies_of, custom_calls

    x, w1, b1 = _inputs(lead=(4, 16), n_in=24, n_out=40)
    w2 = jax.random.normal(jax.random.key(4), (32, 40))
    dys = jax.random.normal(jax.random.key(5), (4, 16, 32))
    offsets, n = (1280, 0), 2304  # w2 [32, 40] at [0, 1280); w1 [40, 24] at [1280, 2240)

    def accumulate(bucket, x, dys):
        def body(bk, xs):
            xi, dyi = xs
            _, vjp_fn = jax.vjp(lambda bk: _two_layer_threaded(xi, w1, b1, w2, bk, offsets), bk)
            return vjp_fn((dyi, bk))[0], None

        return jax.lax.scan(body, bucket, (x, dys))[0]

    hlo = compiled_text(accumulate, jnp.zeros(n), x, dys, donate_argnums=0)
    assert len(custom_calls(hlo, handlers.TARGET)) == 2
    assert copies_of(hlo, "f32", (n,)) == [], hlo
    got = jax.jit(accumulate)(jnp.zeros(n), x, dys)

    def ref(w1, w2):
        h = jax.nn.gelu(_ref_linear(x, w1, b1))
        return jnp.sum(h @ w2.T * dys)

    rw1, rw2 = jax.grad(ref, argnums=(0, 1))(w1, w2)
    np.testing.assert_allclose(got[1280:2240], np.asarray(rw1).ravel(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[:1280], np.asarray(rw2).ravel(), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[2240:], 0)


def test_linear_into_bucket_bad_input():
    x, w, _ = _inputs(lead=(3,))
    with pytest.raises(ValueError, match="does not fit"):
        linear_into_bucket(x, w, None, jnp.zeros(40), offset=8)
    with pytest.raises(ValueError, match="does not fit"):
        linear_into_bucket(x, w, None, jnp.zeros((7, 5)), offset=0)
    with pytest.raises(ValueError, match="float32"):
        linear_into_bucket(x, w, None, jnp.zeros(64, jnp.bfloat16), offset=0)
    with pytest.raises(ValueError, match="out of range"):
        WgradRoutes((jnp.zeros(64),)).to_bucket(w, 1, 0)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (virtual) devices")
@pytest.mark.parametrize("async_tp", [True, False])
def test_sequence_parallel_column_linear_into_a_bucket(async_tp):
    """``linear(x, w, gather_axis=...)`` into a bucket, TP 2: Megatron's asynchronous
    column-parallel backward (the shard re-gathered beside the data-gradient GEMM, ``dx``
    reduce-scattered beside the weight-gradient GEMM, each tied by an optimization
    barrier), or, with ``async_tp=False`` (a backward that syncs layer groups' chunks), the
    gather and the linear composed as two ops -- the same values, against float64."""
    _needs_handler()
    tp, b, s, n_in, n_out, off = 2, 3, 8, 5, 7, 8
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:tp]), ("tensor",))
    P = jax.sharding.PartitionSpec
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (b, s, n_in))
    w = jax.random.normal(k[1], (tp, n_out, n_in))
    dy = jax.random.normal(k[2], (b, s, tp * n_out))

    def per_device(x, w, dy, bucket):
        w0 = w[0]

        def fwd(x, bk):
            routes = WgradRoutes((bk,), async_tp=async_tp)
            y = linear(x, routes.to_bucket(w0, 0, off), gather_axis="tensor")
            return y, routes.close()[0]

        (y, _), vjp_fn = jax.vjp(fwd, x, bucket)
        dx, new_bucket = vjp_fn((dy, bucket))
        return y, dx, new_bucket

    run = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(None, "tensor"), P("tensor"), P(None, None, "tensor"), P("tensor")),
            out_specs=(P(None, None, "tensor"), P(None, "tensor"), P("tensor")),
            check_vma=False,
        )
    )
    args = (x, w, dy, jnp.zeros(tp * 64))
    y, dx, bucket = run(*args)

    x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
    dy_r = dy64.reshape(b, s, tp, n_out)
    np.testing.assert_allclose(
        y, np.concatenate([x64 @ w64[r].T for r in range(tp)], -1), 1e-5, 1e-5
    )
    np.testing.assert_allclose(dx, sum(dy_r[:, :, r] @ w64[r] for r in range(tp)), 1e-5, 1e-5)
    for r in range(tp):
        block = np.asarray(bucket[r * 64 + off : r * 64 + off + n_out * n_in])
        np.testing.assert_allclose(
            block, np.einsum("bso,bsi->oi", dy_r[:, :, r], x64).reshape(-1), 1e-5, 1e-5
        )

    eqns = [e.primitive.name for e in jaxpr_eqns(jax.make_jaxpr(run)(*args).jaxpr)]
    assert eqns.count("optimization_barrier") == (2 if async_tp else 0), eqns
    # asynchronous: only the shard is saved, and the backward gathers it again
    assert eqns.count("all_gather") == (2 if async_tp else 1), eqns
    assert eqns.count("reduce_scatter") == 1, eqns
