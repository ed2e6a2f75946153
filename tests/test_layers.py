"""Tensor-parallel layers inside shard_map against plain unsharded jnp (values and grads)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_wgrad.functional import WgradRoutes, vocab_parallel_cross_entropy
from jax_wgrad.nn import ColumnParallelLinear, LayerNorm, RowParallelLinear, VocabParallelEmbedding

TP = 4
B, S, H, F, V = 2, 8, 16, 32, 64

pytestmark = pytest.mark.skipif(jax.device_count() < TP, reason=f"needs {TP} devices")


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh(
        (TP,), ("tensor",), devices=jax.devices()[:TP], axis_types=(jax.sharding.AxisType.Auto,)
    )


def _close(a, b, rtol=1e-5):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape
    np.testing.assert_array_less(np.abs(a - b).max(), rtol * max(np.abs(b).max(), 1e-30) + 1e-30)


def _spec(v: nnx.Variable, ndim: int) -> P:
    dims = [None] * ndim
    if v.get_metadata().get("tensor_axis") is not None:
        dims[v.get_metadata()["tensor_axis"]] = "tensor"
    return P(*dims)


def _split(module_fn):
    """(graphdef of the TP module, full params from the tp=1 module, specs)."""
    full = module_fn(1, nnx.Rngs(0))
    _, state = nnx.split(full)
    abstract = nnx.eval_shape(lambda: module_fn(TP, nnx.Rngs(0)))
    graphdef, astate = nnx.split(abstract)
    specs = jax.tree.map(
        lambda v, a: _spec(v, a.ndim), astate, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return graphdef, nnx.to_pure_dict(state), dict(specs)


# fused-sp by default, the rest -m slow (suite time; the unfused layers run by default in
# the models' tests, e.g. test_hf.py's pipeline cross entropy)
@pytest.mark.parametrize(
    "sp", [pytest.param(False, marks=pytest.mark.slow), True], ids=["nosp", "sp"]
)
@pytest.mark.parametrize(
    "fusion", [pytest.param(False, marks=pytest.mark.slow), True], ids=["plain", "fused"]
)
def test_column_row_mlp(mesh, sp, fusion):
    kw = dict(sequence_parallel=sp)
    col_def, col_p, col_s = _split(
        lambda tp, r: ColumnParallelLinear(H, F, tp_size=tp, rngs=r, **kw)
    )
    row_def, row_p, row_s = _split(lambda tp, r: RowParallelLinear(F, H, tp_size=tp, rngs=r, **kw))
    # Nonzero biases so their gradients and placement are tested.
    col_p = jax.tree.map(lambda a: a + 0.1 * jnp.arange(a.size).reshape(a.shape) / a.size, col_p)
    row_p = jax.tree.map(lambda a: a - 0.1 * jnp.arange(a.size).reshape(a.shape) / a.size, row_p)
    params, specs = {"col": col_p, "row": row_p}, {"col": col_s, "row": row_s}
    kx, kd = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (B, S, H))
    dy = jax.random.normal(kd, (B, S, H))
    mg0 = {"col": 0.5 * jnp.ones((F, H)), "row": -0.25 * jnp.ones((H, F))}
    mg_specs = {"col": P("tensor", None), "row": P(None, "tensor")}

    def ref(p, x):
        h = jax.nn.gelu(x @ p["col"]["weight"].T + p["col"]["bias"])
        return h @ p["row"]["weight"].T + p["row"]["bias"]

    y_ref, vjp = jax.vjp(ref, params, x)
    g_ref, dx_ref = vjp(dy)

    act = P(None, "tensor") if sp else P()

    def local(p, mg, x, dy):
        def f(p, mg, x):
            # Fused: each weight's gradient goes to its accumulator (a one-block bucket).
            routes = WgradRoutes({k: a.reshape(-1) for k, a in mg.items()})
            if fusion:
                p = {
                    k: {**p[k], "weight": routes.to_bucket(p[k]["weight"], k, 0, name=k)}
                    for k in ("col", "row")
                }
            col, row = nnx.merge(col_def, p["col"]), nnx.merge(row_def, p["row"])
            y = row(jax.nn.gelu(col(x)))
            return y, {k: b.reshape(mg[k].shape) for k, b in routes.close().items()}

        (y, _), f_vjp = jax.vjp(f, p, mg, x)
        g, new_mg, dx = f_vjp((dy, mg))
        if sp:  # tensor-replicated params saw only their sequence chunk
            g["row"]["bias"] = jax.lax.psum(g["row"]["bias"], "tensor")
        return y, g, new_mg, dx

    fn = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(specs, mg_specs, act, act),
            out_specs=(act, specs, mg_specs, act),
            check_vma=False,
        )
    )
    y, g, new_mg, dx = fn(params, mg0, x, dy)
    _close(y, y_ref)
    _close(dx, dx_ref)
    _close(g["col"]["bias"], g_ref["col"]["bias"])
    _close(g["row"]["bias"], g_ref["row"]["bias"])
    for name in ("col", "row"):
        if fusion:
            _close(new_mg[name], mg0[name] + g_ref[name]["weight"])
            assert not np.any(np.asarray(g[name]["weight"]))
        else:
            _close(g[name]["weight"], g_ref[name]["weight"])


@pytest.mark.parametrize(
    "sp", [pytest.param(False, marks=pytest.mark.slow), True], ids=["nosp", "sp"]
)
def test_vocab_parallel_embedding(mesh, sp):
    gdef, p, specs = _split(
        lambda tp, r: VocabParallelEmbedding(V, H, tp_size=tp, sequence_parallel=sp, rngs=r)
    )
    ids = jax.random.randint(jax.random.key(1), (B, S), 0, V)
    dy = jax.random.normal(jax.random.key(2), (B, S, H))
    out_ref, vjp = jax.vjp(lambda p: p["embedding"][ids], p)
    (g_ref,) = vjp(dy)
    act = P(None, "tensor") if sp else P()

    def local(p, ids, dy):
        out, f_vjp = jax.vjp(lambda p: nnx.merge(gdef, p)(ids), p)
        return out, f_vjp(dy)[0]

    out, g = jax.jit(
        jax.shard_map(
            local, mesh=mesh, in_specs=(specs, P(), act), out_specs=(act, specs), check_vma=False
        )
    )(p, ids, dy)
    _close(out, out_ref)
    _close(g["embedding"], g_ref["embedding"])


def test_vocab_parallel_cross_entropy(mesh):
    logits = 3.0 * jax.random.normal(jax.random.key(3), (B, S, V))
    labels = jax.random.randint(jax.random.key(4), (B, S), 0, V)
    g = jax.random.uniform(jax.random.key(5), (B, S))

    def ref(lg):
        return -jnp.take_along_axis(jax.nn.log_softmax(lg), labels[..., None], -1)[..., 0]

    loss_ref, vjp = jax.vjp(ref, logits)
    (dl_ref,) = vjp(g)

    def local(lg, labels, g):
        f = functools.partial(vocab_parallel_cross_entropy, tp_size=TP, axis_name="tensor")
        loss, f_vjp = jax.vjp(lambda lg: f(lg, labels), lg)
        return loss, f_vjp(g)[0]

    loss, dl = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(None, None, "tensor"), P(), P()),
            out_specs=(P(), P(None, None, "tensor")),
            check_vma=False,
        )
    )(logits, labels, g)
    _close(loss, loss_ref)
    _close(dl, dl_ref)
    # tp_size=1 path (no collectives) too.
    _close(vocab_parallel_cross_entropy(logits, labels), loss_ref)


def test_cross_entropy_never_gathers_vocab(mesh):
    def local(lg, labels):
        return vocab_parallel_cross_entropy(lg, labels, tp_size=TP, axis_name="tensor")

    fn = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(None, None, "tensor"), P()),
            out_specs=P(),
            check_vma=False,
        )
    )
    hlo = fn.lower(jnp.zeros((B, S, V)), jnp.zeros((B, S), jnp.int32)).as_text()
    assert "all-gather" not in hlo and "all_gather" not in hlo


def test_layer_norm():
    ln = LayerNorm(H, epsilon=1e-5)
    x = jax.random.normal(jax.random.key(6), (B, S, H)) * 3 + 1
    y = ln(x)
    ref = (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)
    _close(y, ref)
    assert ln(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16


def test_column_tp_must_divide():
    with pytest.raises(
        ValueError,
        match=r"out_features \(10\) must be divisible by "
        r"tensor_model_parallel_size \(4\)",
    ):
        ColumnParallelLinear(H, 10, tp_size=4, rngs=nnx.Rngs(0))
