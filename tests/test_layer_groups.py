"""Stacked weights whose gradients live in layer groups (row pieces, one bucket per group):
``scan_layers`` cuts its scan at the groups, each part adding its rows to its own bucket,
and a completed group's bucket can be synced chunk by chunk inside the backward of the
group below (``WgradRoutes(on_complete=...)``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_util import jaxpr_eqns
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_wgrad.functional import WgradRoutes, linear, scan_layers
from jax_wgrad.functional.routes import RowPiece
from jax_wgrad.functional.stacked import LayerRecompute
from jax_wgrad.grads import DDPConfig
from jax_wgrad.grads.finalize import chunk_syncable, sync_bucket_chunk, sync_stage_buckets
from jax_wgrad.grads.spec import STAGE
from jax_wgrad.parallel.mesh import DATA_CONTEXT_PARALLEL

N, H, F, T = 6, 8, 12, 5
CUTS = ((0, 2), (2, 4), (4, 6))  # three groups of two layers


def _params(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return {
        "up": 0.3 * jax.random.normal(k1, (N, F, H), jnp.float32),
        "down": 0.3 * jax.random.normal(k2, (N, H, F), jnp.float32),
        "scale": 1.0 + 0.1 * jax.random.normal(k3, (N, H), jnp.float32),
    }


def _layer(p, h):
    u = jax.nn.gelu(linear(h, p["up"]))
    return h + linear(u, p["down"]) * p["scale"], ()


def _loss_plain(params, x):
    def body(h, p):
        return _layer(p, h)[0], None

    y, _ = lax.scan(body, x, params)
    return jnp.sum(y**2)


def _float64_grads(params, x) -> dict[str, np.ndarray]:
    """``jax.grad`` of the plain loss computed in float64."""
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a), jnp.float64), params)
        grads = jax.grad(_loss_plain)(p64, jnp.asarray(np.asarray(x), jnp.float64))
        return {k: np.asarray(v) for k, v in grads.items()}


def _layout():
    """Bucket g holds rows CUTS[-1 - g] of 'down' then 'up' (reverse order): group 0 the
    top layers. Returns (bucket sizes, pieces per weight)."""
    per_row = {"up": F * H, "down": H * F}
    sizes, pieces = [], {"up": [], "down": []}
    for g, (a, b) in enumerate(reversed(CUTS)):
        offset = 0
        for name in ("down", "up"):
            pieces[name].append(RowPiece(g, offset, (a, b)))
            offset += (b - a) * per_row[name]
        sizes.append(offset + 4)  # some padding at the end
    return sizes, {k: sorted(v, key=lambda p: p.rows) for k, v in pieces.items()}


def _grads_from_buckets(buckets, pieces):
    out = {}
    for name, shape in (("up", (F, H)), ("down", (H, F))):
        rows = []
        for p in pieces[name]:
            n = (p.rows[1] - p.rows[0]) * shape[0] * shape[1]
            rows.append(buckets[p.key][p.offset : p.offset + n].reshape(-1, *shape))
        out[name] = jnp.concatenate(rows)
    return out


def _run(params, x, buckets, pieces, *, recompute=None, on_complete=None, unroll=1):
    """``(loss, buckets after the backward, scale's ordinary gradient)``."""

    def f(params, buckets, x):
        routes = WgradRoutes(dict(enumerate(buckets)), on_complete=on_complete)
        params = {
            **params,
            **{name: routes.to_pieces(params[name], pieces[name], name=name) for name in pieces},
        }
        y, _ = scan_layers(_layer, x, params, recompute=recompute, unroll=unroll)
        return jnp.sum(y**2), tuple(routes.close().values())

    (loss, _), pullback = jax.vjp(f, params, tuple(buckets), x)
    dparams, out, _ = pullback((jnp.float32(1.0), tuple(buckets)))
    return loss, out, dparams["scale"]


@pytest.mark.parametrize("unroll", [1, N], ids=["scans", "unrolled"])
@pytest.mark.parametrize(
    "recompute",
    [None, LayerRecompute("selective"), LayerRecompute("full", "uniform", 2)],
    ids=["none", "selective", "full-uniform-2"],
)
def test_row_pieces_equal_jax_grad(recompute, unroll):
    params, x = _params(), jax.random.normal(jax.random.key(1), (T, H), jnp.float32)
    sizes, pieces = _layout()
    start = [jnp.zeros((n,), jnp.float32) for n in sizes]
    run = lambda p, x, b: _run(p, x, b, pieces, recompute=recompute, unroll=unroll)
    loss, buckets, dscale = jax.jit(run)(params, x, start)
    if unroll == N:  # each layer traced on its own: no loop, no residual stacked per group
        assert "scan" not in {
            e.primitive.name for e in jaxpr_eqns(jax.make_jaxpr(run)(params, x, start).jaxpr)
        }
    want_loss, want = jax.value_and_grad(_loss_plain)(params, x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    got = {**_grads_from_buckets(buckets, pieces), "scale": dscale}
    # against jax.grad in float64, as close as jax.grad in float32 gets: float32 sums in
    # another order (the fused wgrad's, or another jax's dot) differ from float32
    # jax.grad by about its own error (6e-5 here, gradients up to 130)
    exact = _float64_grads(params, x)
    for name in ("up", "down", "scale"):
        own = np.abs(np.asarray(want[name], np.float64) - exact[name]).max()
        np.testing.assert_allclose(got[name], exact[name], rtol=2e-5, atol=2 * own)
    for b, n in zip(buckets, sizes):  # the padding is untouched
        np.testing.assert_array_equal(b[n - 4 :], 0.0)


def test_completed_bucket_synced_in_chunks_inside_the_group_below():
    """A hook that doubles its chunk: every bucket but the lowest group's comes out as
    exactly twice (what it held before + this backward's rows), chunk by chunk, so each
    hook saw its bucket complete and each chunk was synced once."""
    params, x = _params(2), jax.random.normal(jax.random.key(3), (T, H), jnp.float32)
    sizes, pieces = _layout()
    start = [
        jax.random.normal(jax.random.key(10 + g), (n,), jnp.float32) for g, n in enumerate(sizes)
    ]
    asked = []

    def on_complete(key, k):
        asked.append((key, k))
        n = sizes[key]
        if n % k:
            return None

        def sync(ct, i):
            c = n // k
            chunk = lax.dynamic_slice_in_dim(ct, i * c, c)
            return lax.dynamic_update_slice_in_dim(ct, 2.0 * chunk, i * c, 0)

        return sync

    plain = jax.jit(lambda p, x, b: _run(p, x, b, pieces))(params, x, start)[1]
    hooked = jax.jit(lambda p, x, b: _run(p, x, b, pieces, on_complete=on_complete))(
        params, x, start
    )[1]
    # Bucket 0 (top group) completes first, synced in group 1's two iterations; bucket 1
    # in group 2's; bucket 2 (the lowest group) is never complete inside the scan.
    assert sorted(asked) == [(0, 2), (1, 2)]
    for g in range(3):
        want = plain[g] if g == 2 else 2.0 * plain[g]
        np.testing.assert_allclose(hooked[g], want, rtol=1e-6)


def test_a_chunk_is_cut_after_the_data_gradient_and_written_back_after_the_weight_gradients():
    """Where the backward puts a chunk's sync (``sync_when_complete``): the chunk is cut
    from the bucket joined (optimization barrier) with the layer's data gradient
    ``[T, H]``, and the synced bucket is joined with the group's own bucket and the data
    gradient before either goes on -- so on XLA:GPU the collective runs beside that
    layer's weight-gradient GEMMs. In the backward that does not sync, no barrier."""
    params, x = _params(2), jnp.ones((T, H), jnp.float32)
    sizes, pieces = _layout()
    start = [jnp.zeros((n,), jnp.float32) for n in sizes]

    def on_complete(key, k):
        c = sizes[key] // k

        def sync(ct, i):
            chunk = lax.dynamic_slice_in_dim(ct, i * c, c)
            return lax.dynamic_update_slice_in_dim(ct, 2.0 * chunk, i * c, 0)

        return sync

    def eqns(hook):
        jaxpr = jax.make_jaxpr(lambda p, x, b: _run(p, x, b, pieces, on_complete=hook))
        return list(jaxpr_eqns(jaxpr(params, x, start).jaxpr))

    assert not [e for e in eqns(None) if e.primitive.name == "optimization_barrier"]
    found = eqns(on_complete)
    barriers = [e for e in found if e.primitive.name == "optimization_barrier"]
    made_by = {id(v): e for e in barriers for v in e.outvars}
    is_bucket = lambda v: v.aval.ndim == 1 and v.aval.shape[0] in sizes
    cuts = [e for e in found if e.primitive.name == "dynamic_slice" and is_bucket(e.invars[0])]
    writes = [
        e for e in found if e.primitive.name == "dynamic_update_slice" and is_bucket(e.invars[0])
    ]
    # the two upper groups' buckets, each synced in the scan body of the group below
    assert len(cuts) == len(writes) == 2, (cuts, writes)
    for cut in cuts:
        joined = made_by[id(cut.invars[0])]
        assert [v.aval.shape for v in joined.invars] == [cut.invars[0].aval.shape, (T, H)]
    for write in writes:
        (joined,) = [e for e in barriers if any(v is write.outvars[0] for v in e.invars)]
        own, h = [v for v in joined.invars if v is not write.outvars[0]]
        assert is_bucket(own) and h.aval.shape == (T, H), joined


def _layer_relu(p, h):
    """Another function of the same parameters (as FP8's first and last layers in bf16)."""
    u = jax.nn.relu(linear(h, p["up"]))
    return h + linear(u, p["down"]) * p["scale"], ()


RUNS = ((1, _layer_relu), (4, _layer), (1, _layer_relu))
"""Layer 0 and layer 5 by ``_layer_relu``: cuts at 1 and 5, across the row pieces'."""


@pytest.mark.parametrize(
    "recompute", [None, LayerRecompute("full", "block", 3)], ids=["none", "full-block-3"]
)
def test_runs_of_layer_functions_equal_jax_grad(recompute):
    """``scan_layers`` with a layer function per run of layers, the runs cut across the
    gradient layout's layer groups: the loss and every gradient of the plain loop."""
    params, x = _params(), jax.random.normal(jax.random.key(1), (T, H), jnp.float32)
    sizes, pieces = _layout()
    start = [jnp.zeros((n,), jnp.float32) for n in sizes]

    def f(params, buckets, x):
        routes = WgradRoutes(dict(enumerate(buckets)))
        params = {
            **params,
            **{name: routes.to_pieces(params[name], pieces[name], name=name) for name in pieces},
        }
        y, _ = scan_layers(RUNS, x, params, recompute=recompute)
        return jnp.sum(y**2), tuple(routes.close().values())

    def plain(params, x):
        fns = [fn for k, fn in RUNS for _ in range(k)]
        for i, fn in enumerate(fns):
            x = fn(jax.tree.map(lambda a, i=i: a[i], params), x)[0]
        return jnp.sum(x**2)

    (loss, _), pullback = jax.vjp(f, params, tuple(start), x)
    dparams, buckets, _ = pullback((jnp.float32(1.0), tuple(start)))
    want_loss, want = jax.value_and_grad(plain)(params, x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    got = {**_grads_from_buckets(buckets, pieces), "scale": dparams["scale"]}
    with jax.enable_x64(True):  # as test_row_pieces_equal_jax_grad: against float64
        p64 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a), jnp.float64), params)
        exact = jax.grad(plain)(p64, jnp.asarray(np.asarray(x), jnp.float64))
        exact = {k: np.asarray(v) for k, v in exact.items()}
    for name in ("up", "down", "scale"):
        own = np.abs(np.asarray(want[name], np.float64) - exact[name]).max()
        np.testing.assert_allclose(got[name], exact[name], rtol=2e-5, atol=2 * own)


def test_runs_must_cover_the_layers_and_keep_recompute_groups_whole():
    params, x = _params(), jnp.ones((T, H), jnp.float32)
    with pytest.raises(ValueError, match=r"layer runs \[1, 4\] must cover the 6 layers"):
        scan_layers(RUNS[:2], x, params)
    with pytest.raises(
        ValueError, match="a run of layers of one function 0..1 cuts through a run of 2 layers"
    ):
        scan_layers(RUNS, x, params, recompute=LayerRecompute("full", "uniform", 2))


def test_misaligned_recompute_groups_are_rejected():
    params, x = _params(), jnp.ones((T, H), jnp.float32)
    sizes, pieces = _layout()
    start = [jnp.zeros((n,), jnp.float32) for n in sizes]
    with pytest.raises(ValueError, match="cuts through a run of 3 layers"):
        _run(params, x, start, pieces, recompute=LayerRecompute("full", "uniform", 3))


def test_pieces_outside_scan_layers_are_rejected():
    w = jnp.ones((2, 4), jnp.float32)  # rows 0..2 of a stacked [2, 4] used as a linear
    routes = WgradRoutes({0: jnp.zeros((8,), jnp.float32)})
    w = routes.to_pieces(w, [RowPiece(0, 0, (0, 2))], name="w")
    with pytest.raises(ValueError, match="only scan_layers"):
        linear(jnp.ones((5, 4)), w)


def test_pieces_must_cover_the_rows():
    routes = WgradRoutes({0: jnp.zeros((24,), jnp.float32)})
    with pytest.raises(ValueError, match="must cover its rows 0..2"):
        routes.to_pieces(jnp.ones((2, 3, 4)), [RowPiece(0, 0, (0, 1))], name="w")


@pytest.mark.parametrize("dist", [True, False], ids=["reduce-scatter", "all-reduce"])
def test_a_bucket_synced_chunk_by_chunk_equals_the_whole_bucket_synced(dist):
    """``sync_bucket_chunk`` over its ``k`` chunks leaves each rank what the cooldown's
    whole-bucket sync leaves (its own shard of the sum in place, or the whole sum), over a
    4-rank data axis; ``chunk_syncable`` says when the chunks divide the bucket."""
    ddp = DDPConfig(use_distributed_optimizer=dist, overlap_grad_reduce=True)
    dp, k, n = 4, 3, 4 * 3 * 5
    assert chunk_syncable(n, dp, k, ddp) and not chunk_syncable(n + 4, dp, k, ddp)
    local = jax.random.normal(jax.random.key(0), (dp, n), jnp.float32)
    # data, expert, context: the group dense buckets sync over
    mesh = Mesh(np.array(jax.devices()[:dp]).reshape(dp, 1, 1), DATA_CONTEXT_PARALLEL)

    def chunked(b):
        b = b[0]
        for i in range(k):
            b = sync_bucket_chunk(b, jnp.int32(i), k, ddp, STAGE)
        return b[None]

    def whole(b):
        return sync_stage_buckets((b[0],), ddp, STAGE)[0][None]

    run = lambda f: jax.jit(
        jax.shard_map(
            f, mesh=mesh, in_specs=P(DATA_CONTEXT_PARALLEL), out_specs=P(DATA_CONTEXT_PARALLEL)
        )
    )(local)
    got, want = np.asarray(run(chunked)), np.asarray(run(whole))
    total = np.asarray(local).sum(0)
    for r in range(dp):
        mine = slice(r * n // dp, (r + 1) * n // dp) if dist else slice(0, n)
        np.testing.assert_allclose(got[r][mine], total[mine], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[r][mine], want[r][mine], rtol=1e-6, atol=1e-6)
