"""GradBuffer layout, packing, in-place accumulation and per-bucket gradient sync."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_util import compiled_text, copies_of, custom_calls
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_wgrad.grads import (
    GradBuffer,
    SlotPiece,
    flat_mask,
    local_mask,
    psum_flagged,
    shard_buckets,
    sync_buckets,
)
from jax_wgrad.grads.plan import bucket_end_divisor, plan_buckets, shard_range
from jax_wgrad.ops import handlers, status

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
    if not status.fusion_available("cpu"):
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
    assert len(custom_calls(hlo, handlers.TARGET)) == 2
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


# flatten order: alternating unflagged / flagged leaves whose runs cross the shard
# bounds of 4 data ranks at different places on each rank
_MIXED = {
    f"{i}_{kind}": n
    for i, (kind, n) in enumerate(
        [("w", 100), ("ln", 90), ("w", 50), ("ln", 170), ("w", 20), ("ln", 9)]
    )
}


@needs8
@pytest.mark.parametrize("sharded", [True, False], ids=["shards", "whole"])
@pytest.mark.parametrize("which", ["some", "all", "none"])
def test_psum_flagged_sums_only_the_flagged_elements(sharded, which):
    mesh = _mesh((4, 2), ("data", "tensor"))
    params = {k: jax.ShapeDtypeStruct((n,), F32) for k, n in _MIXED.items()}
    buf = GradBuffer.create(params, dp_size=4, bucket_size=None, use_distributed_optimizer=True)
    flags = {k: {"some": "ln" in k, "all": True, "none": False}[which] for k in _MIXED}
    axis = "data" if sharded else None
    sizes = [n // 4 if sharded else n for n in buf.bucket_numels]
    rng = np.random.default_rng(0)
    grads = [jnp.asarray(rng.standard_normal((8, n)), F32) for n in sizes]
    row = P(("data", "tensor"))

    def f(*gs):
        gs = [g[0] for g in gs]
        got = psum_flagged(buf, gs, flags, "tensor", axis_name=axis)
        masks = local_mask(buf, flags, axis_name=axis)
        want = [
            jnp.where(m, lax.psum(jnp.where(m, g, 0.0), "tensor"), g) for g, m in zip(gs, masks)
        ]
        return tuple(x[None] for x in (*got, *want))

    specs = (row,) * len(grads)
    out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=row))(*grads)
    got, want = out[: len(grads)], out[len(grads) :]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # the reference itself: flagged elements are the pair's sum, the others untouched
    (g,), (x,), (m,) = got, grads, flat_mask(buf, flags)
    g, x = np.asarray(g).reshape(4, 2, -1), np.asarray(x).reshape(4, 2, -1)
    m = m.reshape(4, -1).astype(bool) if sharded else np.broadcast_to(m.astype(bool), (4, m.size))
    summed = x.sum(axis=1)
    for t in range(2):
        np.testing.assert_array_equal(g[:, t][m], summed[m])
        np.testing.assert_array_equal(g[:, t][~m], x[:, t][~m])
    assert m.any() == (which != "none")


def test_psum_flagged_names_buckets_of_the_wrong_size():
    params = {k: jax.ShapeDtypeStruct((n,), F32) for k, n in _MIXED.items()}
    buf = GradBuffer.create(params, dp_size=4, bucket_size=None, use_distributed_optimizer=True)
    flags = {k: "ln" in k for k in _MIXED}
    (n,) = buf.bucket_numels
    with pytest.raises(ValueError, match=rf"psum_flagged.*\[\({n},\)\], got \[\({n - 1},\)\]"):
        psum_flagged(buf, [jnp.zeros((n - 1,))], flags, "tensor", axis_name=None)
    with pytest.raises(ValueError, match=r"psum_flagged.*expected 1 bucket"):
        psum_flagged(buf, [], flags, "tensor", axis_name=None)


# ---------------------------------------------------------------------------- row groups

ROWS = (0, 1, 3, 4)  # three row groups of the stacked [4, ...] leaves: rows 0..1, 1..3, 3..4
# Flatten order (sorted keys); the flagged leaves are interleaved with unflagged ones (an
# unflagged stacked [4, 5] among them, and one of another dtype).
STACKED = {
    "a_emb": ((7, 3), F32, False),
    "b_w1": ((4, 3, 5), F32, True),
    "c_head": ((9,), BF16, False),
    "d_w2": ((4, 6), F32, True),
    "e_ln": ((4, 5), F32, False),
    "f_w3": ((4, 2, 2), F32, True),
}
SPLIT = {k: f for k, (_, _, f) in STACKED.items()}


def _stacked_buffer(dp, dist, *, bucket_size=20, **kw):
    params = {k: jax.ShapeDtypeStruct(shape, dt) for k, (shape, dt, _) in STACKED.items()}
    return GradBuffer.create(
        params,
        dp_size=dp,
        bucket_size=bucket_size,
        use_distributed_optimizer=dist,
        row_groups=ROWS,
        split_rows=SPLIT,
        **kw,
    )


def _buckets_ref(buf, tree):
    """numpy buckets of ``tree``: every piece's rows, row-major, at its offset; zeros
    elsewhere (built from the slots alone, without the buffer's packing code)."""
    out = [np.zeros((n,), np.float32) for n in buf.bucket_numels]
    for s, leaf in zip(buf.slots, jax.tree.leaves(tree)):
        leaf = np.asarray(leaf, np.float32)
        for p in s.pieces:
            block = leaf if p.rows is None else leaf[p.rows[0] : p.rows[1]]
            assert out[p.bucket][p.offset : p.offset + p.size].tolist() == [0.0] * p.size
            out[p.bucket][p.offset : p.offset + p.size] = block.ravel()
    return out


@pytest.mark.parametrize("dist,dp", [(True, 2), (True, 4), (False, 2), (False, 4)])
def test_row_group_layout_matches_plans(dist, dp):
    buf = _stacked_buffer(dp, dist)
    flagged, plain = [1, 3, 5], [0, 4]
    shapes = [s.shape for s in buf.slots]
    kw = dict(dp_size=dp, use_distributed_optimizer=dist)
    # Bucket j = row group G-1-j (the backward finishes the last layers first), each one
    # plan_buckets over the flagged leaves' row blocks, the last flagged leaf at offset 0.
    for j, (start, stop) in enumerate([(3, 4), (1, 3), (0, 1)]):
        plan = plan_buckets(
            [(stop - start) * math.prod(shapes[k][1:]) for k in flagged], bucket_size=None, **kw
        )
        assert buf.groups[0].row_plans[j] == plan
        assert buf.bucket_numels[j] == plan.numel
        assert buf.bucket_leaves[j] == (5, 3, 1)
        pieces = buf.bucket_pieces(j)
        assert [k for k, _ in pieces] == [5, 3, 1] and pieces[0][1].offset == 0
        for (_, piece), (lo, hi, bid) in zip(pieces, [plan.param_ranges[m] for m in (2, 1, 0)]):
            assert (piece.bucket, piece.offset, piece.size, piece.rows) == (
                j,
                lo,
                hi - lo,
                (start, stop),
            )
            assert bid == 0
    # The unflagged fp32 leaves follow, planned as without row groups (bucket_size 20: two
    # buckets); then the bf16 group, unchanged.
    plan = plan_buckets([21, 20], bucket_size=20, **kw)
    assert len(plan.buckets) == 2 and buf.groups[0].plan == plan
    assert buf.bucket_numels[3:5] == tuple(b.numel for b in plan.buckets)
    for k, (lo, _, bid) in zip(plain, plan.param_ranges):
        assert buf.offset_of(buf.slots[k].path) == (3 + bid, lo - plan.buckets[bid].offset)
    assert buf.bucket_leaves[3:5] == tuple(
        tuple(plain[m] for m in b.param_indices) for b in plan.buckets
    )
    assert (
        buf.groups[1].plan == plan_buckets([9], bucket_size=20, **kw)
        and buf.groups[1].row_plans == ()
    )
    assert [g.first_bucket for g in buf.groups] == [0, 5] and buf.num_buckets == 6
    assert buf.groups[0].leaf_indices == (0, 1, 3, 4, 5)
    assert buf.bucket_param_dtypes == (jnp.dtype(F32),) * 5 + (jnp.dtype(BF16),)
    # Slots: pieces in row order, buckets 2, 1, 0; the whole leaf's size.
    for k in flagged:
        s = buf.slots[k]
        assert s.split and [p.rows for p in s.pieces] == [(0, 1), (1, 3), (3, 4)]
        assert [p.bucket for p in s.pieces] == [2, 1, 0]
        assert s.size == sum(p.size for p in s.pieces) == math.prod(s.shape)
    assert not any(buf.slots[k].split for k in (0, 2, 4))
    assert buf.param_numel == sum(math.prod(shape) for shape, _, _ in STACKED.values())
    if dist:
        assert all(n % bucket_end_divisor(dp) == 0 for n in buf.bucket_numels)
    text = buf.summary().splitlines()
    assert [line.split(":")[0] for line in text if line.startswith("group")] == [
        "group float32->float32, bucket 0",
        "group float32->float32, bucket 1",
        "group float32->float32, bucket 2",
        "group float32->float32, buckets from 3",
        "group bfloat16->float32, buckets from 5",
    ]
    assert "row group rows 3..4" in text[1] and "row group rows 0..1" in text[5]


def test_row_groups_of_a_group_without_other_leaves():
    # Every leaf of the fp32 group flagged: it has only the row-group buckets (plan None).
    params = {"w": jax.ShapeDtypeStruct((4, 3), F32), "x": jax.ShapeDtypeStruct((2,), BF16)}
    buf = GradBuffer.create(
        params,
        dp_size=2,
        bucket_size=None,
        use_distributed_optimizer=True,
        row_groups=(0, 2, 4),
        split_rows={"w": True, "x": False},
    )
    assert buf.groups[0].plan is None and len(buf.groups[0].row_plans) == 2
    assert buf.num_buckets == 3 and buf.groups[1].first_bucket == 2
    assert [p.rows for p in buf.slot("['w']").pieces] == [(0, 2), (2, 4)]
    assert "buckets from" not in buf.summary().splitlines()[1]
    tree = _random_tree(buf, 11)
    jax.tree.map(np.testing.assert_array_equal, buf.to_tree(buf.from_tree(tree)), tree)


@pytest.mark.parametrize("dist", [True, False])
def test_row_groups_round_trip_exactly(dist):
    buf = _stacked_buffer(4, dist)
    tree = _random_tree(buf, 12)
    buckets = jax.jit(buf.from_tree)(tree)
    for got, want in zip(buckets, _buckets_ref(buf, tree)):
        np.testing.assert_array_equal(got, want)  # blocks and zero padding
    jax.tree.map(np.testing.assert_array_equal, jax.jit(buf.to_tree)(buckets), tree)
    as_bf16 = jax.jit(lambda t: buf.to_tree(buf.from_tree(t, dtype=BF16)))(tree)
    jax.tree.map(lambda g, t: np.testing.assert_array_equal(g, t.astype(BF16)), as_bf16, tree)


def test_row_groups_add_tree_values_and_in_place():
    buf = _stacked_buffer(2, True)
    a, b = _random_tree(buf, 13), _random_tree(buf, 14)
    where = {k: k not in ("d_w2", "e_ln") for k in STACKED}  # skips a split leaf too
    add = lambda bk, t: buf.add_tree(bk, t, where=where)
    got = jax.jit(add)(buf.from_tree(a), b)
    want = {k: a[k] + b[k] if where[k] else a[k] for k in STACKED}
    for g, w in zip(got, _buckets_ref(buf, want)):
        np.testing.assert_array_equal(g, w)
    # One in-place bucket_add per bucket touched; no bucket is copied.
    hlo = compiled_text(add, buf.zeros(), b, donate_argnums=0)
    assert all(copies_of(hlo, "f32", (n,)) == [] for n in set(buf.bucket_numels)), hlo
    if status.fusion_available("cpu"):  # buckets 0..2 (rows), 4 (a_emb), 5 (c_head)
        assert len(custom_calls(hlo, handlers.BUCKET_ADD_TARGET)) == buf.num_buckets - 1


@needs8
def test_row_groups_local_mask_matches_flat_mask():
    mesh = _mesh((4,), ("data",))
    buf = _stacked_buffer(4, True, bucket_size=None)
    flags = {
        "a_emb": False,
        "b_w1": True,
        "c_head": True,
        "d_w2": False,
        "e_ln": True,
        "f_w3": True,
    }
    # flat_mask marks exactly the flagged leaves' pieces (packing a 0/1 tree).
    ones = jax.tree.map(lambda x, f: jnp.full(x.shape, float(f)), _random_tree(buf, 0), flags)
    masks = flat_mask(buf, flags)
    for m, want in zip(masks, buf.from_tree(ones)):
        np.testing.assert_array_equal(m, want)
    f = lambda: tuple(m[None] for m in local_mask(buf, flags, axis_name="data"))
    got = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(), out_specs=P("data")))()
    for g, want in zip(got, masks):
        np.testing.assert_array_equal(np.asarray(g).reshape(-1), want.astype(bool))


def test_row_groups_concatenate_shifts_pieces():
    split = _stacked_buffer(2, True)
    plain = GradBuffer.create(_params(), dp_size=2, bucket_size=30, use_distributed_optimizer=True)
    for parts in ((plain, split), (split, plain)):
        ab = GradBuffer.concatenate(parts)
        shift, first = (0, 0) if parts[0] is split else (plain.num_buckets, len(plain.slots))
        moved = lambda p, d=shift: SlotPiece(p.bucket + d, p.offset, p.size, p.rows)
        for s in split.slots:
            assert ab.slots[first + s.index].pieces == tuple(map(moved, s.pieces))
        for i in range(split.num_buckets):
            assert ab.bucket_pieces(shift + i) == tuple(
                (first + k, moved(p)) for k, p in split.bucket_pieces(i)
            )
        assert [g.first_bucket for g in ab.groups if g.row_plans] == [shift]
        tree = tuple(_random_tree(b, 15 + n) for n, b in enumerate(parts))
        jax.tree.map(np.testing.assert_array_equal, ab.to_tree(ab.from_tree(tree)), tree)
        added = ab.to_tree(ab.add_tree(ab.from_tree(tree), tree))
        jax.tree.map(lambda g, t: np.testing.assert_array_equal(g, 2 * t), added, tree)


def test_row_group_errors():
    sds = jax.ShapeDtypeStruct
    params = {
        "w": sds((4, 3), F32),
        "v": sds((4,), F32),
        "x": sds((3, 3), F32),
        "y": sds((4, 2), BF16),
    }
    kw = dict(dp_size=2, bucket_size=None, use_distributed_optimizer=True)
    only_w = {"w": True, "v": False, "x": False, "y": False}
    for bad in ((1, 4), (0, 2, 2, 4), (0, 3, 2, 4), (0,), (0, 1.5, 4)):
        with pytest.raises(ValueError, match=re.escape("row_groups must be")):
            GradBuffer.create(params, row_groups=bad, split_rows=only_w, **kw)
    with pytest.raises(ValueError, match=r"\['w'\].*shape \(4, 3\).*row_groups\[-1\] = 5"):
        GradBuffer.create(params, row_groups=(0, 2, 5), split_rows=only_w, **kw)
    with pytest.raises(ValueError, match=r"\['x'\].*shape \(3, 3\).*= 4 rows"):
        GradBuffer.create(params, row_groups=(0, 2, 4), split_rows={**only_w, "x": True}, **kw)
    with pytest.raises(
        ValueError,
        match=r"\['y'\].*bfloat16.*one group: \(param float32, grad float32\), that of \['w'\]",
    ):
        GradBuffer.create(params, row_groups=(0, 2, 4), split_rows={**only_w, "y": True}, **kw)
    with pytest.raises(ValueError, match=r"\['v'\] is flagged both split_rows and shared_emb"):
        GradBuffer.create(
            params,
            row_groups=(0, 2, 4),
            split_rows={**only_w, "v": True},
            shared_embedding={"w": False, "v": True, "x": False, "y": False},
            **kw,
        )
    with pytest.raises(ValueError, match="flags no leaf"):
        GradBuffer.create(params, row_groups=(0, 4), split_rows=dict.fromkeys(params, False), **kw)
    with pytest.raises(ValueError, match="row_groups and split_rows go together"):
        GradBuffer.create(params, row_groups=(0, 2, 4), **kw)
    with pytest.raises(ValueError, match="row_groups and split_rows go together"):
        GradBuffer.create(params, split_rows=only_w, **kw)
    with pytest.raises(ValueError, match="split_rows must have the parameter tree"):
        GradBuffer.create(params, row_groups=(0, 2, 4), split_rows={"w": True}, **kw)
    buf = GradBuffer.create(params, row_groups=(0, 2, 4), split_rows=only_w, **kw)
    msg = re.escape("['w'] is laid out in 2 row groups; read slot.pieces")
    with pytest.raises(ValueError, match=msg):
        _ = buf.slot("['w']").offset
    with pytest.raises(ValueError, match=msg):
        _ = buf.slot("['w']").bucket
    with pytest.raises(ValueError, match=msg):
        buf.offset_of("['w']")
    assert buf.offset_of("['v']") == (buf.slot("['v']").bucket, buf.slot("['v']").offset)
    with pytest.raises(ValueError, match="laid out in 2 row groups, not one block"):
        buf.wgrad_accumulate(buf.zeros(), "['w']", jnp.zeros((2, 3)), jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="bucket 9 not in"):
        buf.bucket_pieces(9)


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
