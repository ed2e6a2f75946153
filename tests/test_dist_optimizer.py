"""Distributed optimizer and gradient finalization vs single-device optax on the full tree."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_wgrad.grads import GradBuffer, sync_buckets
from jax_wgrad.optim import DistributedOptimizer, adamw, clip_by_total_norm, global_grad_norm

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

F32 = jnp.float32
STEPS = 5
LR, WD = 3e-2, 0.1
# Full (unsharded) shapes; "w" is split over `tensor` on its last dim in the TP test.
SHAPES = {"b": (6,), "ln": (5,), "w": (6, 8), "w2": (5, 6)}
DECAY = {"b": False, "ln": False, "w": True, "w2": True}


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()).reshape(shape), names)


def _data(seed, dp, nan_at=None):
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    grads = {k: rng.standard_normal((STEPS, dp) + s).astype(np.float32) for k, s in SHAPES.items()}
    if nan_at is not None:  # one rank's gradient of one parameter goes non-finite
        grads["w2"][nan_at, dp - 1, 0, 0] = np.inf
        grads["b"][nan_at, 0, 1] = np.nan
    return params, grads


def _reference(params, grads, clip):
    """Single-device optax.adamw on the full tree with the data-parallel mean gradient."""
    tx = optax.adamw(LR, weight_decay=WD, mask=DECAY)
    state = tx.init(params)
    norms, skipped = [], []
    for s in range(STEPS):
        g = {k: jnp.asarray(v[s].mean(0)) for k, v in grads.items()}
        norm = optax.tree.norm(g)
        norms.append(float(norm))
        skipped.append(not np.isfinite(float(norm)))
        if skipped[-1]:
            continue
        if clip:
            g, _ = clip_by_total_norm(g, clip, norm)
        upd, state = tx.update(g, state, params)
        params = optax.apply_updates(params, upd)
    return params, np.array(norms), np.array(skipped)


def _train(mesh, params, grads, *, dist, bucket_size, clip, tensor_split=False, row_groups=None):
    """STEPS optimizer steps inside one shard_map; returns per-data-rank params and infos.

    ``row_groups``: lay the two leaves with 6 rows ("b", "w") out in these row groups."""
    names = mesh.axis_names
    dp = mesh.shape["data"]
    tp = "tensor" in names
    w_spec = (None, "tensor") if tensor_split else (None,)
    param_specs = {k: P(*w_spec) if k == "w" else P() for k in SHAPES}
    grad_specs = {k: P(None, "data", *w_spec) if k == "w" else P(None, "data") for k in SHAPES}
    local = {
        k: jax.ShapeDtypeStruct(
            (s[0], s[1] // mesh.shape["tensor"]) if (k == "w" and tensor_split) else s, F32
        )
        for k, s in SHAPES.items()
    }
    rows = {}
    if row_groups is not None:
        rows = dict(row_groups=row_groups, split_rows={k: k in ("b", "w") for k in SHAPES})
    buf = GradBuffer.create(
        local, dp_size=dp, bucket_size=bucket_size, use_distributed_optimizer=dist, **rows
    )
    assert buf.slot("['w']").split == (row_groups is not None)
    model_axes = ("tensor",) if tp else ()
    duplicated = {"tensor": {k: not (k == "w" and tensor_split) for k in SHAPES}} if tp else None
    opt = DistributedOptimizer.create(
        buf,
        adamw(LR, weight_decay=WD),
        clip_grad=clip,
        weight_decay_mask=DECAY,
        model_axes=model_axes,
        duplicated=duplicated,
    )

    def body(p, g):
        state = opt.init(p)
        norms, skips, unchanged = [], [], []
        for s in range(STEPS):  # unrolled: tiny shapes, and no scan-carry typing to manage
            local_g = {k: v[s, 0] for k, v in g.items()}
            buckets = buf.add_tree(buf.zeros(), local_g)
            synced = sync_buckets(buckets, axis_name="data", use_distributed_optimizer=dist)
            new_p, new_state, info = opt.step(p, synced, state)
            same = jnp.stack(
                [
                    jnp.array_equal(a, b)
                    for a, b in zip(
                        jax.tree.leaves((p, state)), jax.tree.leaves((new_p, new_state))
                    )
                ]
            ).all()
            p, state = new_p, new_state
            norms.append(info.grad_norm)
            skips.append(info.skipped)
            unchanged.append(same)
        stats = jnp.stack(
            [jnp.stack(norms), jnp.stack(skips).astype(F32), jnp.stack(unchanged).astype(F32)]
        )
        # A leading per-device axis: lets the test check that all ranks agree.
        return jax.tree.map(lambda x: x[None], p), stats[None]

    out_p = {k: P(names, *w_spec[1:]) if k == "w" else P(names) for k in SHAPES}
    if tensor_split:
        out_p["w"] = P("data", None, "tensor")
    fn = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(param_specs, grad_specs), out_specs=(out_p, P(names))
        )
    )
    return fn(params, grads)


def _check(got_params, stats, ref_params, ref_norms, ref_skipped, ndev):
    for k, want in ref_params.items():
        got = np.asarray(got_params[k])
        assert got.shape[0] in (ndev, ndev // 2)
        for copy in got:  # every device (data and tensor rank) holds the same parameters
            tol = 1e-5 * np.abs(want).max()
            assert np.abs(copy - np.asarray(want)).max() <= tol, k
    stats = np.asarray(stats).reshape(ndev, 3, STEPS)
    for dev in range(ndev):
        finite = np.isfinite(ref_norms)
        np.testing.assert_allclose(stats[dev, 0][finite], ref_norms[finite], rtol=1e-5)
        np.testing.assert_array_equal(stats[dev, 1].astype(bool), ref_skipped)
        np.testing.assert_array_equal(stats[dev, 2].astype(bool), ref_skipped)


@pytest.mark.parametrize(
    "dist,bucket_size,clip",
    [
        (True, 40, None),  # several small buckets, no clipping
        (True, None, 0.5),  # one bucket, clipping active
        (False, 40, 0.5),  # replicated optimizer on the full tree
    ],
)
def test_matches_single_device_adamw_dp8(dist, bucket_size, clip):
    params, grads = _data(0, 8)
    ref, norms, skipped = _reference(params, grads, clip)
    if clip:
        assert (norms > clip).all()  # the test exercises clipping
    got, stats = _train(
        _mesh((8,), ("data",)), params, grads, dist=dist, bucket_size=bucket_size, clip=clip
    )
    _check(got, stats, ref, norms, skipped, 8)


@pytest.mark.parametrize(
    "seed, row_groups", [(1, None), (4, (0, 2, 5, 6))], ids=["buckets", "row-groups"]
)
def test_matches_single_device_adamw_data4_tensor2(seed, row_groups):
    # "w" is split over tensor (distinct halves); the others are replicated over tensor
    # and must be counted once in the clipping norm. With row groups "b" and "w" are laid
    # out in three row groups (3 buckets, each with rows of both): sharding, weight-decay
    # and duplicated masks, the step and the all-gather run over pieces of leaves.
    params, grads = _data(seed, 4)
    ref, norms, skipped = _reference(params, grads, 0.5)
    got, stats = _train(
        _mesh((4, 2), ("data", "tensor")),
        params,
        grads,
        dist=True,
        bucket_size=40,
        clip=0.5,
        tensor_split=True,
        row_groups=row_groups,
    )
    _check(got, stats, ref, norms, skipped, 8)


def test_non_finite_gradient_skips_the_step_and_training_continues():
    params, grads = _data(2, 8, nan_at=2)
    ref, norms, skipped = _reference(params, grads, 0.5)
    assert skipped.tolist() == [False, False, True, False, False]
    got, stats = _train(_mesh((8,), ("data",)), params, grads, dist=True, bucket_size=40, clip=0.5)
    _check(got, stats, ref, norms, skipped, 8)


def test_global_grad_norm_and_clip_single_device():
    g = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([[4.0]])}
    assert float(global_grad_norm(g)) == pytest.approx(5.0)
    assert float(global_grad_norm(g, weights={"a": 1.0, "b": 0.0})) == pytest.approx(3.0)
    clipped, coeff = clip_by_total_norm(g, 1.0, jnp.float32(5.0))
    assert float(coeff) == pytest.approx(1.0 / (5.0 + 1e-6))
    same, one = clip_by_total_norm(g, 10.0, jnp.float32(5.0))
    assert float(one) == 1.0
    jax.tree.map(np.testing.assert_array_equal, same, g)


def test_bad_inputs_raise_value_errors():
    local = {k: jax.ShapeDtypeStruct(s, F32) for k, s in SHAPES.items()}
    buf = GradBuffer.create(local, dp_size=8, bucket_size=None, use_distributed_optimizer=True)
    tx = adamw(LR)
    with pytest.raises(ValueError, match="clip_grad"):
        DistributedOptimizer.create(buf, tx, clip_grad=-1.0)
    with pytest.raises(ValueError, match="weight_decay_mask"):
        DistributedOptimizer.create(buf, tx, weight_decay_mask={"w": True})
    with pytest.raises(ValueError, match="not one of model_axes"):
        DistributedOptimizer.create(buf, tx, duplicated={"tensor": DECAY})
    with pytest.raises(ValueError, match="must not contain"):
        DistributedOptimizer.create(buf, tx, model_axes=("data",))
    rows = GradBuffer.create(
        local,
        dp_size=8,
        bucket_size=None,
        use_distributed_optimizer=True,
        row_groups=(0, 3, 6),
        split_rows={k: k in ("b", "w") for k in SHAPES},
    )
    with pytest.raises(ValueError, match=r"\['b'\] is laid out in row groups whose buckets"):
        DistributedOptimizer.create(
            rows, tx, data_axis=("data", "x"), bucket_axes=("data", ("data", "x"), "data")
        )
    # Planned for dp=8, run on a 4-device data axis.
    opt = DistributedOptimizer.create(buf, tx)
    mesh = _mesh((4, 2), ("data", "tensor"))
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    fn = jax.shard_map(
        lambda p: opt.init(p).master[0], mesh=mesh, in_specs=P(), out_specs=P("data")
    )
    with pytest.raises(ValueError, match="dp_size=8"):
        jax.jit(fn).lower(params)


def test_bf16_params_fp32_master_and_bf16_all_gather():
    # Two dtype groups -> two buckets; the bf16 bucket is all-gathered in bf16.
    rng = np.random.default_rng(3)
    params = {
        "b": jnp.asarray(rng.standard_normal(8), F32),
        "w": jnp.asarray(rng.standard_normal((8, 16)), jnp.bfloat16),
    }
    grads = {k: rng.standard_normal((8,) + v.shape).astype(np.float32) for k, v in params.items()}
    buf = GradBuffer.create(params, dp_size=8, bucket_size=None, use_distributed_optimizer=True)
    assert buf.bucket_param_dtypes == (jnp.dtype(F32), jnp.dtype(jnp.bfloat16))
    opt = DistributedOptimizer.create(buf, adamw(LR, weight_decay=WD))

    def body(p, g):
        state = opt.init(p)
        buckets = buf.add_tree(buf.zeros(), jax.tree.map(lambda v: v[0], g))
        synced = sync_buckets(buckets, axis_name="data", use_distributed_optimizer=True)
        new_p, state, _ = opt.step(p, synced, state)
        return jax.tree.map(lambda x: x[None], (new_p, state.master))

    fn = jax.jit(
        jax.shard_map(
            body, mesh=_mesh((8,), ("data",)), in_specs=(P(), P("data")), out_specs=P("data")
        )
    )
    # Checked on the emitted StableHLO: XLA:CPU widens bf16 collectives to f32 when compiling.
    text = fn.lower(params, grads).as_text()
    gathers = [line for line in text.splitlines() if "stablehlo.all_gather" in line]
    assert len(gathers) == 2 and sum("xbf16>) -> tensor<" in g for g in gathers) == 1, gathers
    (got, master) = fn(params, grads)
    assert got["w"].dtype == jnp.bfloat16 and master[1].dtype == F32
    tx = optax.adamw(LR, weight_decay=WD)
    p32 = jax.tree.map(lambda v: v.astype(F32), params)
    upd, _ = tx.update({k: jnp.asarray(v.mean(0)) for k, v in grads.items()}, tx.init(p32), p32)
    ref = optax.apply_updates(p32, upd)
    for r in range(8):
        np.testing.assert_allclose(got["w"][r].astype(F32), ref["w"], rtol=1e-2, atol=1e-2)
        np.testing.assert_allclose(got["b"][r], ref["b"], rtol=1e-5, atol=1e-6)
    # fp32 master of rank 0's bf16-bucket shard carries the exact fp32 update.
    n = buf.shard_numels[1]
    np.testing.assert_allclose(
        master[1][0].reshape(-1)[:n], np.asarray(buf.from_tree(ref)[1])[:n], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("dist", [True, False])
def test_updated_params_are_replicated_over_data(dist):
    # shard_map's type check accepts out_specs=P() for the parameters: they are typed
    # invariant over `data` (all-gathered, or computed from all-reduced gradients).
    params = {"w": jnp.ones((4, 8))}
    buf = GradBuffer.create(params, dp_size=8, bucket_size=None, use_distributed_optimizer=dist)
    opt = DistributedOptimizer.create(buf, adamw(LR))

    def f(p, g):
        synced = sync_buckets(
            buf.add_tree(buf.zeros(), {"w": g[0]}), axis_name="data", use_distributed_optimizer=dist
        )
        new_p, _, info = opt.step(p, synced, opt.init(p))
        return new_p, info.grad_norm

    fn = jax.shard_map(
        f, mesh=_mesh((8,), ("data",)), in_specs=(P(), P("data")), out_specs=(P(), P())
    )
    new_p, norm = jax.jit(fn)(params, jnp.ones((8, 4, 8)))
    assert float(norm) == pytest.approx(np.sqrt(32.0))
    np.testing.assert_allclose(new_p["w"], 1.0 - LR * (1.0 + 1e-4), rtol=1e-5)
