"""GradBuffer layout, packing, in-place accumulation and per-bucket gradient sync."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_util import compiled_text, copies_of, custom_calls
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_wgrad.grads import GradBuffer, flat_mask, local_mask, shard_buckets, sync_buckets
from jax_wgrad.grads.plan import plan_buckets, shard_range
from jax_wgrad.ops import registry

F32, BF16 = jnp.float32, jnp.bfloat16

needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")


def _params(dtype2=F32):
    # flatten order (sorted keys): a_w [6,4], b_bias [6], c_w [5,6] (dtype2), d_ln [5]
    sds = jax.ShapeDtypeStruct
    return {
        "a_w": sds((6, 4), F32),
        "b_bias": sds((6,), F32),
        "c_w": sds((5, 6), dtype2),
        "d_ln": sds((5,), F32),
    }


def _random_tree(buf, seed, dtype=F32):
    rng = np.random.default_rng(seed)
    leaves = [jnp.asarray(rng.standard_normal(s.shape), dtype) for s in buf.slots]
    return jax.tree.unflatten(buf.treedef, leaves)


def _padding_mask(buf):
    return [m == 0 for m in flat_mask(buf, [True] * len(buf.slots))]


# (True, 30) by default; a non-distributed layout stays in test_one_collective_per_bucket_in_hlo,
# a single bucket in test_dtype_groups_and_casts
@pytest.mark.parametrize(
    "dist,bucket_size",
    [
        (True, 30),
        pytest.param(False, 30, marks=pytest.mark.slow),
        pytest.param(True, None, marks=pytest.mark.slow),
    ],
)
def test_layout_matches_plan_and_round_trips(dist, bucket_size):
    buf = GradBuffer.create(
        _params(), dp_size=4, bucket_size=bucket_size, use_distributed_optimizer=dist
    )
    plan = plan_buckets(
        [24, 6, 30, 5], dp_size=4, bucket_size=bucket_size, use_distributed_optimizer=dist
    )
    assert buf.bucket_numels == tuple(b.numel for b in plan.buckets)
    for k, (start, end, bid) in enumerate(plan.param_ranges):
        assert buf.offset_of(buf.slots[k].path) == (bid, start - plan.buckets[bid].offset)
        assert buf.slots[k].size == end - start
    assert buf.offset_of("['c_w']") == buf.offset_of((jax.tree_util.DictKey("c_w"),))
    if dist:
        assert all(n % 4 == 0 for n in buf.bucket_numels)
        assert buf.shard_numels == tuple(n // 4 for n in buf.bucket_numels)
    tree = _random_tree(buf, 0)
    buckets = buf.from_tree(tree)
    assert [b.dtype for b in buckets] == [jnp.dtype(F32)] * buf.num_buckets
    jax.tree.map(np.testing.assert_array_equal, buf.to_tree(buckets), tree)
    for b, pad in zip(buckets, _padding_mask(buf)):
        np.testing.assert_array_equal(np.asarray(b)[pad], 0)
    # The last leaf (d_ln) sits at offset 0 of bucket 0, as Megatron lays it out.
    assert buf.offset_of("['d_ln']") == (0, 0)


def test_dtype_groups_and_casts():
    buf = GradBuffer.create(
        _params(BF16), dp_size=2, bucket_size=None, use_distributed_optimizer=True
    )
    assert [(g.param_dtype, g.grad_dtype) for g in buf.groups] == [
        (jnp.dtype(F32), jnp.dtype(F32)),
        (jnp.dtype(BF16), jnp.dtype(F32)),
    ]
    assert buf.num_buckets == 2 and buf.bucket_param_dtypes[1] == jnp.dtype(BF16)
    assert buf.slot("['c_w']").bucket == 1 and buf.slot("['c_w']").offset == 0
    tree = _random_tree(buf, 1)
    tree["c_w"] = tree["c_w"].astype(BF16)
    back = buf.to_tree(buf.from_tree(tree))
    assert back["c_w"].dtype == F32  # grads are fp32 buckets
    np.testing.assert_array_equal(back["c_w"], tree["c_w"].astype(F32))
    as_bf16 = buf.to_tree(buf.from_tree(tree, dtype=BF16))
    assert all(leaf.dtype == BF16 for leaf in jax.tree.leaves(as_bf16))
    own = GradBuffer.create(
        _params(BF16), dp_size=2, bucket_size=None, use_distributed_optimizer=False, grad_dtype=None
    )
    assert own.bucket_dtypes == (jnp.dtype(F32), jnp.dtype(BF16))


def test_add_tree_values_and_padding():
    buf = GradBuffer.create(_params(), dp_size=8, bucket_size=30, use_distributed_optimizer=True)
    a, b = _random_tree(buf, 2), _random_tree(buf, 3)
    got = jax.jit(buf.add_tree)(buf.from_tree(a), b)
    want = jax.tree.map(lambda x, y: x + y, a, b)
    jax.tree.map(np.testing.assert_array_equal, buf.to_tree(got), want)
    for g, pad in zip(got, _padding_mask(buf)):
        np.testing.assert_array_equal(np.asarray(g)[pad], 0)


def test_add_tree_in_place_when_donated():
    buf = GradBuffer.create(_params(), dp_size=8, bucket_size=30, use_distributed_optimizer=True)
    buckets, tree = buf.zeros(), _random_tree(buf, 4)
    shapes = set(buf.bucket_numels)
    hlo = compiled_text(buf.add_tree, buckets, tree, donate_argnums=0)
    assert all(copies_of(hlo, "f32", (n,)) == [] for n in shapes), hlo
    # Control: the same check does see the copy XLA needs when the buckets are not donated.
    hlo = compiled_text(buf.add_tree, buckets, tree)
    assert any(copies_of(hlo, "f32", (n,)) for n in shapes)


def test_fused_wgrad_and_add_tree_into_bucket_in_scan_are_in_place():
    if not registry.fusion_available("cpu"):
        pytest.skip("CPU handler not built")
    buf = GradBuffer.create(_params(), dp_size=2, bucket_size=None, use_distributed_optimizer=True)
    (n,) = buf.bucket_numels
    rng = np.random.default_rng(5)
    xa, dya = rng.standard_normal((3, 7, 4)), rng.standard_normal((3, 7, 6))  # a_w [6, 4]
    xc, dyc = rng.standard_normal((3, 7, 6)), rng.standard_normal((3, 7, 5))  # c_w [5, 6]
    small = {"b_bias": rng.standard_normal((3, 6)), "d_ln": rng.standard_normal((3, 5))}
    xs = [jnp.asarray(v, F32) for v in (xa, dya, xc, dyc)]

    def run(buckets, xa, dya, xc, dyc, bias, ln):
        def body(bk, mb):
            xa, dya, xc, dyc, bias, ln = mb
            bk = buf.wgrad_accumulate(bk, "['c_w']", xc, dyc)
            bk = buf.wgrad_accumulate(bk, "['a_w']", xa, dya)
            grads = {"a_w": jnp.zeros((6, 4)), "b_bias": bias, "c_w": jnp.zeros((5, 6)), "d_ln": ln}
            return buf.add_tree(bk, grads), None

        return jax.lax.scan(body, buckets, (xa, dya, xc, dyc, bias, ln))[0]

    args = (buf.zeros(), *xs, jnp.asarray(small["b_bias"], F32), jnp.asarray(small["d_ln"], F32))
    hlo = compiled_text(run, *args, donate_argnums=0)
    assert copies_of(hlo, "f32", (n,)) == [], hlo
    assert len(custom_calls(hlo, registry.TARGET)) == 2
    got = buf.to_tree(jax.jit(run)(*args))
    np.testing.assert_allclose(got["a_w"], np.einsum("mto,mti->oi", dya, xa), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["c_w"], np.einsum("mto,mti->oi", dyc, xc), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["b_bias"], small["b_bias"].sum(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["d_ln"], small["d_ln"].sum(0), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- sync


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def _sync_all_variants(buckets_local):
    shards = sync_buckets(buckets_local, axis_name="data", use_distributed_optimizer=True)
    avg = sync_buckets(
        buckets_local, axis_name="data", use_distributed_optimizer=True, average_in_collective=True
    )
    full = sync_buckets(
        buckets_local,
        axis_name="data",
        use_distributed_optimizer=False,
        gradient_scaling_factor=0.5,
    )
    return shards, avg, full


@needs8
# (4, 2) by default; a data-only mesh stays in test_buckets_as_scan_carry_inside_shard_map
@pytest.mark.parametrize("mesh_shape", [pytest.param((8,), marks=pytest.mark.slow), (4, 2)])
def test_sync_buckets_matches_numpy(mesh_shape):
    names = ("data", "tensor")[: len(mesh_shape)]
    mesh, dp, ndev = _mesh(mesh_shape, names), mesh_shape[0], int(np.prod(mesh_shape))
    buf = GradBuffer.create(_params(), dp_size=dp, bucket_size=30, use_distributed_optimizer=True)
    rng = np.random.default_rng(6)
    # Device-distinct data: leading dim = all devices, so tensor ranks differ too.
    data = [rng.standard_normal((ndev, n)).astype(np.float32) for n in buf.bucket_numels]
    spec = P(names)

    def f(*bks):
        outs = _sync_all_variants(tuple(b[0] for b in bks))
        return jax.tree.map(lambda o: o[None], outs)

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * len(data), out_specs=spec))
    shards, avg, full = fn(*data)
    for i, d in enumerate(data):
        d = d.reshape(mesh_shape + (-1,))  # [data, (tensor,) numel]
        total = d.sum(axis=0)  # reduce over data only
        for dev in range(ndev):
            r, rest = np.unravel_index(dev, mesh_shape)[0], np.unravel_index(dev, mesh_shape)[1:]
            lo, hi = shard_range(buf.groups[0].plan.buckets[i], r, dp)
            base = buf.groups[0].plan.buckets[i].offset
            want = total[rest][lo - base : hi - base]
            np.testing.assert_allclose(shards[i][dev], want / dp, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(avg[i][dev], want / dp, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(full[i][dev], 0.5 * total[rest], rtol=1e-5, atol=1e-6)


def _collective_results(hlo, op):
    """For each ``op`` instruction, the element counts of the f32 arrays it produces.

    XLA may combine several collectives into one tuple-shaped instruction (its combiner
    passes; Megatron's coalescing manager does the same), so count arrays, not lines.
    """
    out = []
    for m in re.finditer(rf"= (\([^)]*\)|\S+) {op}\(", hlo):
        out.append([int(n) for n in re.findall(r"f32\[(\d+)\]", m.group(1))])
    return out


@needs8
def test_one_collective_per_bucket_in_hlo():
    # 6 parameters in 3 buckets: the collectives must be per bucket, not per parameter.
    sds = jax.ShapeDtypeStruct
    tree = [sds((40,), F32) for _ in range(6)]
    mesh = _mesh((8,), ("data",))
    for dist, op, stablehlo_op, numel, result in (
        (True, "reduce-scatter", "reduce_scatter", 128, 16),  # lcm(8, 128) padding
        (False, "all-reduce", "all_reduce", 80, 80),
    ):
        buf = GradBuffer.create(tree, dp_size=8, bucket_size=80, use_distributed_optimizer=dist)
        assert buf.bucket_numels == (numel,) * 3

        def f(*bks, dist=dist, buf=buf):
            buckets = buf.add_tree(tuple(b[0] for b in bks), [jnp.ones((40,))] * 6)
            out = sync_buckets(buckets, axis_name="data", use_distributed_optimizer=dist)
            return tuple(o[None] for o in out)

        fn = jax.shard_map(f, mesh=mesh, in_specs=(P("data"),) * 3, out_specs=P("data"))
        lowered = jax.jit(fn).lower(*[jnp.zeros((8, numel))] * 3)
        assert lowered.as_text().count(f'"stablehlo.{stablehlo_op}"') == 3
        compiled = _collective_results(lowered.compile().as_text(), op)
        assert 1 <= len(compiled) <= 3
        assert sorted(n for c in compiled for n in c) == [result] * 3, compiled
        other = "all-reduce" if dist else "reduce-scatter"
        assert _collective_results(lowered.compile().as_text(), other) == []


@needs8
def test_buckets_as_scan_carry_inside_shard_map():
    # Per-device microbatch gradients accumulated in a scan carry, then reduce-scattered.
    mesh = _mesh((8,), ("data",))
    buf = GradBuffer.create(_params(), dp_size=8, bucket_size=30, use_distributed_optimizer=True)
    rng = np.random.default_rng(8)
    grads = {
        s.path[2:-2]: rng.standard_normal((8, 3) + s.shape).astype(np.float32) for s in buf.slots
    }  # [device, microbatch, ...]

    def f(g):
        g = jax.tree.map(lambda v: v[0], g)
        body = lambda bk, gi: (buf.add_tree(bk, gi), None)
        bk = jax.lax.scan(body, buf.zeros(varying_axes=("data",)), g)[0]
        shards = sync_buckets(bk, axis_name="data", use_distributed_optimizer=True)
        full = jax.lax.all_gather(shards, "data", axis=0, tiled=True)
        return jax.tree.map(lambda x: x[None], buf.to_tree(full))

    got = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(grads)
    for k, v in grads.items():
        for r in range(8):
            np.testing.assert_allclose(got[k][r], v.sum(1).mean(0), rtol=1e-5, atol=1e-6)


@needs8
def test_shard_buckets_is_the_reduce_scatter_slice():
    mesh = _mesh((8,), ("data",))
    buf = GradBuffer.create(_params(), dp_size=8, bucket_size=30, use_distributed_optimizer=True)
    full = buf.from_tree(_random_tree(buf, 7))
    f = lambda *b: tuple(s[None] for s in shard_buckets(b, axis_name="data"))
    got = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P("data")))(*full)
    for i, g in enumerate(got):
        bucket = buf.groups[0].plan.buckets[i]
        for r in range(8):
            lo, hi = shard_range(bucket, r, 8)
            np.testing.assert_array_equal(g[r], full[i][lo - bucket.offset : hi - bucket.offset])


@needs8
def test_local_mask_matches_flat_mask():
    mesh = _mesh((8,), ("data",))
    buf = GradBuffer.create(_params(), dp_size=8, bucket_size=30, use_distributed_optimizer=True)
    flags = {"a_w": True, "b_bias": False, "c_w": True, "d_ln": False}
    f = lambda: tuple(m[None] for m in local_mask(buf, flags, axis_name="data"))
    got = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(), out_specs=P("data")))()
    for g, want in zip(got, flat_mask(buf, flags)):
        np.testing.assert_array_equal(np.asarray(g).reshape(-1), want.astype(bool))
    whole = local_mask(buf, flags, axis_name=None)
    for g, want in zip(whole, flat_mask(buf, flags)):
        np.testing.assert_array_equal(g, want.astype(bool))


# ---------------------------------------------------------------------------- errors


def test_bad_inputs_raise_value_errors():
    sds = jax.ShapeDtypeStruct
    kw = dict(dp_size=2, bucket_size=None, use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="no leaves"):
        GradBuffer.create({}, **kw)
    with pytest.raises(ValueError, match="non-float"):
        GradBuffer.create({"i": sds((3,), jnp.int32)}, **kw)
    with pytest.raises(ValueError, match="no elements"):
        GradBuffer.create({"z": sds((0, 3), F32)}, **kw)
    with pytest.raises(ValueError, match="must be an array"):
        GradBuffer.create({"x": 1.0}, **kw)
    with pytest.raises(ValueError, match="shared_embedding"):
        GradBuffer.create(_params(), shared_embedding={"a_w": True}, **kw)
    with pytest.raises(ValueError, match="dp_size"):
        GradBuffer.create(_params(), dp_size=0, bucket_size=None, use_distributed_optimizer=True)
    buf = GradBuffer.create(_params(), **kw)
    with pytest.raises(ValueError, match="no parameter at path"):
        buf.offset_of("['nope']")
    with pytest.raises(ValueError, match="bucket"):
        buf.to_tree((jnp.zeros((3,)),))
    with pytest.raises(ValueError, match="structure"):
        buf.add_tree(buf.zeros(), {"a_w": jnp.zeros((6, 4))})
    bad = _random_tree(buf, 0)
    bad["d_ln"] = jnp.zeros((4,))
    with pytest.raises(ValueError, match="d_ln"):
        buf.from_tree(bad)
    with pytest.raises(ValueError, match="dy\\^T @ x"):
        buf.wgrad_accumulate(buf.zeros(), "['a_w']", jnp.zeros((2, 3)), jnp.zeros((2, 6)))


@needs8
def test_sync_rejects_indivisible_bucket():
    mesh = _mesh((8,), ("data",))
    f = lambda b: sync_buckets((b[0],), axis_name="data", use_distributed_optimizer=True)[0]
    fn = jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    with pytest.raises(ValueError, match="not divisible by the 8 ranks"):
        jax.jit(fn).lower(jnp.zeros((8, 12)))


def test_concatenate_keeps_each_chunks_plan_and_add_tree_where():
    a = GradBuffer.create(
        [jax.ShapeDtypeStruct((40,), F32)] * 3,
        dp_size=2,
        bucket_size=80,
        use_distributed_optimizer=True,
    )
    b = GradBuffer.create(_params(), dp_size=2, bucket_size=None, use_distributed_optimizer=True)
    ab = GradBuffer.concatenate([a, b])
    assert ab.bucket_numels == a.bucket_numels + b.bucket_numels
    assert ab.num_buckets == a.num_buckets + b.num_buckets
    assert ab.offset_of("[1]['c_w']") == (
        a.num_buckets + b.offset_of("['c_w']")[0],
        b.offset_of("['c_w']")[1],
    )
    assert ab.offset_of("[0][2]") == a.offset_of("[2]")
    assert ab.numel == a.numel + b.numel and ab.param_numel == a.param_numel + b.param_numel
    tree = ([jnp.full((40,), 1.0 + i) for i in range(3)], _random_tree(b, 9))
    back = ab.to_tree(ab.from_tree(tree))
    jax.tree.map(np.testing.assert_array_equal, back, tree)
    where = ([True, False, True], {"a_w": False, "b_bias": True, "c_w": True, "d_ln": False})
    added = ab.to_tree(ab.add_tree(ab.zeros(), tree, where=where))
    for got, want, w in zip(jax.tree.leaves(added), jax.tree.leaves(tree), jax.tree.leaves(where)):
        np.testing.assert_array_equal(got, want if w else np.zeros_like(want))
    with pytest.raises(ValueError, match="share use_distributed_optimizer"):
        GradBuffer.concatenate(
            [
                a,
                GradBuffer.create(
                    _params(), dp_size=2, bucket_size=None, use_distributed_optimizer=False
                ),
            ]
        )
    # Parts synced over different groups (expert buckets over the expert-data-parallel
    # ranks) keep their own data-parallel size per bucket, and their shards follow it.
    c = GradBuffer.create(_params(), dp_size=4, bucket_size=None, use_distributed_optimizer=True)
    ac = GradBuffer.concatenate([a, c])
    assert ac.bucket_dp_sizes == (2,) * a.num_buckets + (4,) * c.num_buckets
    assert ac.shard_numels == a.shard_numels + c.shard_numels
