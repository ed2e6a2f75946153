"""Bucket positions past ``2**31`` elements (``jax_wgrad.ops.BlockOffset``).

JAX without x64 computes integer arrays in int32: a position built as
``jnp.asarray(base, jnp.int32) + layer * jnp.int32(size)`` raised an ``OverflowError``
for a base past ``2**31 - 1`` and wrapped silently for ``layer * size`` past it (the
handler then clamped the negative value to 0: layer 19+ of Llama-3-8B's fc1 landed in
layer 0's block). Here:

1. the position type and its exact int32 clamp for the references (small, fast);
2. the fused ops at 64-bit positions on small buckets (bitwise the static offset);
3. real buffers past ``2**31`` elements (bf16, ~4.3 GB each, donated): a static offset,
   a ``lax.scan`` over stacked layers whose ``i * stride`` wraps int32, the ragged wgrad;
4. trace-level at production sizes (abstract shapes, no memory): every fused call of a
   Llama-3-8B stage's layer scan compared with the bucket plan, the sink's chunk offsets,
   and masks / shards of a 3.1e9-element bucket over 8 ranks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_util import jaxpr_eqns
from jax import lax
from jax.extend.core import Literal
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_wgrad import ops
from jax_wgrad.functional import WgradRoutes, linear, scan_layers
from jax_wgrad.grads import GradBuffer, flat_mask, local_mask, shard_buckets
from jax_wgrad.grads.chunks import Window
from jax_wgrad.grads.masks import _rank_run_tables
from jax_wgrad.grads.sink import SinkEntry
from jax_wgrad.grads.spec import LAYERS, STAGE
from jax_wgrad.grads.sync import place_shards
from jax_wgrad.ops.position import INT32_MAX, advance, clamped_start_int32

needs_cpu_handler = pytest.mark.skipif(
    not ops.fusion_available("cpu"), reason="needs the CPU handler"
)
F32, BF16 = jnp.float32, jnp.bfloat16
SDS = jax.ShapeDtypeStruct


def _ints(seed: int, shape: tuple[int, ...], dtype) -> jax.Array:
    """Small integers: every product and sum below is exact in bf16 and fp32."""
    return jnp.asarray(np.random.default_rng(seed).integers(-2, 3, size=shape), dtype)


# ------------------------------------------------------------------ 1. the position type
def test_block_offset_is_a_pytree_of_its_index_and_checks_its_fields():
    o = ops.BlockOffset(2**40, jnp.int32(3), 2**20)
    leaves, treedef = jax.tree.flatten(o)
    assert len(leaves) == 1 and leaves[0] is o.index
    back = jax.tree.unflatten(treedef, [jnp.int32(5)])
    assert (back.base, back.stride, int(back.index)) == (2**40, 2**20, 5)
    assert jax.jit(lambda p: p.index * 2)(o) == 6
    assert ops.BlockOffset(7, 2, 3).index.dtype == np.int32  # a Python int index
    assert o.value_for(3) == 2**40 + 3 * 2**20
    with pytest.raises(ValueError, match=r"\|base\| \+ 2\*\*31 \* \|stride\| <= 2\*\*63 - 1"):
        ops.BlockOffset(0, 0, 2**33)
    with pytest.raises(ValueError, match="base must be a static Python int, got 1.5"):
        ops.BlockOffset(1.5, 0, 1)
    with pytest.raises(ValueError, match=r"index must be an int32 scalar .* got float32\[\]"):
        ops.BlockOffset(0, jnp.float32(1), 1)
    with pytest.raises(ValueError, match="index 2147483648 is outside the int32 range"):
        ops.BlockOffset(0, 2**31, 1)


def test_advance_combines_positions_or_says_why_not():
    i = jnp.int32(4)
    assert advance(2**33, i, 100) == ops.BlockOffset(2**33, i, 100)
    chunk = advance(ops.BlockOffset(2**33, jnp.int32(2), 300), i, 100)  # 300 = 3 * 100
    assert (chunk.base, chunk.stride, int(chunk.index)) == (2**33, 100, 2 * 3 + 4)
    assert int(advance(ops.BlockOffset(9, jnp.int32(7), 0), i, 100).index) == 4
    with pytest.raises(ValueError, match="its stride must be 0 or a multiple of 100"):
        advance(ops.BlockOffset(0, jnp.int32(1), 150), i, 100)
    with pytest.raises(ValueError, match="its stride must be 0 or a multiple of 100"):
        advance(jnp.int32(5), i, 100)  # an int32 offset is BlockOffset(0, o, 1)


@pytest.mark.parametrize(
    "base,stride,max_offset",
    [
        (0, 1, 156),
        (7, 2**31, 1000),
        (2**32 + 7, 2**31, 40),
        (5, -3, 100),
        (-10, 4, 77),
        (2**40, -(2**30), INT32_MAX),
        (3, 0, 100),
        (100, 2**31, 99),
        (0, 117440512, 2**31 - 2),
    ],
)
def test_reference_clamp_is_the_exact_clamp(base, stride, max_offset):
    index = np.array(
        [-(2**31), -(2**31) + 1, -5, -2, -1, 0, 1, 2, 3, 18, 19, 31, 2**20, 2**31 - 2, 2**31 - 1],
        np.int32,
    )
    got = jax.jit(
        jax.vmap(lambda i: clamped_start_int32(ops.BlockOffset(base, i, stride), max_offset))
    )(jnp.asarray(index))
    want = [min(max(base + int(i) * stride, 0), max_offset) for i in index]
    assert np.asarray(got).tolist() == want


# -------------------------------------------------- 2. the fused ops at 64-bit positions
N = 157


@needs_cpu_handler
@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "grouped"])
def test_fused_op_at_a_64bit_position_equals_the_static_offset(grouped):
    lead = (3, 6) if grouped else (6,)
    x, dy = _ints(1, lead + (4,), F32), _ints(2, lead + (5,), F32)
    block = (3 if grouped else 1) * 20
    bucket = _ints(3, (N,), F32)
    op = ops.grouped_wgrad_accumulate if grouped else ops.wgrad_accumulate
    ref = ops.grouped_wgrad_accumulate_ref if grouped else ops.wgrad_accumulate_ref
    # (2**32 + 11) + i * 2**31: 11 for i = -2; int32 arithmetic would wrap every term.
    fused = jax.jit(lambda b, i: op(x, dy, b, offset=ops.BlockOffset(2**32 + 11, i, 2**31)))
    plain = jax.jit(lambda b, i: ref(x, dy, b, offset=ops.BlockOffset(2**32 + 11, i, 2**31)))
    for index, at in ((-2, 11), (-1, N - block), (-3, 0), (2**31 - 1, N - block)):
        got = fused(bucket, jnp.int32(index))
        np.testing.assert_array_equal(got, op(x, dy, bucket, offset=at))
        np.testing.assert_array_equal(plain(bucket, jnp.int32(index)), got)
    # vmap: one index per batch element, one base and stride.
    fn = lambda b, i: op(x, dy, b, offset=ops.BlockOffset(2**32 + 11, i, 2**31))
    got = jax.jit(jax.vmap(fn))(jnp.stack([bucket, bucket]), jnp.array([-2, -1], jnp.int32))
    np.testing.assert_array_equal(got[0], op(x, dy, bucket, offset=11))
    np.testing.assert_array_equal(got[1], op(x, dy, bucket, offset=N - block))


@needs_cpu_handler
def test_ragged_wgrad_at_a_64bit_position_equals_the_static_offset():
    x, dy = _ints(4, (9, 4), F32), _ints(5, (9, 3), F32)
    sizes = jnp.array([3, 0, 5], jnp.int32)
    bucket = _ints(6, (N,), F32)
    pos = lambda i: ops.BlockOffset(2**33 + 17, i, -(2**31))  # 17 at i = 4
    fused = jax.jit(lambda b, i: ops.ragged_wgrad_accumulate(x, dy, sizes, b, offset=pos(i)))
    plain = jax.jit(lambda b, i: ops.ragged_wgrad_accumulate_ref(x, dy, sizes, b, offset=pos(i)))
    for index, at in ((4, 17), (5, 0), (0, N - 36)):
        got = fused(bucket, jnp.int32(index))
        np.testing.assert_array_equal(
            got, ops.ragged_wgrad_accumulate(x, dy, sizes, bucket, offset=at)
        )
        np.testing.assert_array_equal(plain(bucket, jnp.int32(index)), got)


def test_the_references_refuse_buffers_they_cannot_address():
    x, dy = jnp.zeros((2, 4)), jnp.zeros((2, 3))
    big = SDS((2**31 + 64,), F32)
    with pytest.raises(ValueError, match="at most 2147483647 elements"):
        jax.eval_shape(lambda b: ops.wgrad_accumulate_ref(x, dy, b, offset=2**31), big)
    with pytest.raises(ValueError, match="plain-XLA path addresses offsets up to 2147483647"):
        jax.eval_shape(lambda b: ops.bucket_add_ref(b, [x], [2**31]), big)


# ----------------------------------------------------- 3. real buffers past 2**31 elements
BIG = 2**31 + 2**22  # bf16: 4.3 GB


def _zeros_big() -> jax.Array:
    return jax.jit(lambda: jnp.zeros((BIG,), BF16))()


def _check_blocks(bucket: jax.Array, blocks: dict[int, np.ndarray]) -> None:
    """The blocks are where they should be, the 64 elements on either side zero, and
    nothing else in the buffer nonzero. Reads the CPU buffer through a numpy view (no
    copy; XLA:CPU's reductions over 2**31 bf16 elements take half a minute, numpy's
    count over its uint16 bits under a second)."""
    host = np.asarray(bucket)
    assert host.shape == (BIG,)
    nonzero = 0
    for at, want in blocks.items():
        np.testing.assert_array_equal(host[at : at + want.size].astype(np.float64), want.ravel())
        assert (
            not host[max(at - 64, 0) : at].any()
            and not host[at + want.size : at + want.size + 64].any()
        ), at
        nonzero += int(np.count_nonzero(want))
    # +0.0 is the only zero here (a sum starting from +0 never rounds to -0.0).
    assert np.count_nonzero(host.view(np.uint16)) == nonzero


@pytest.mark.slow  # 4.3 GB; the scan case below runs by default
@needs_cpu_handler
def test_fused_add_at_a_static_offset_past_2_31():
    x, dy = _ints(7, (4, 48), BF16), _ints(8, (4, 40), BF16)
    at = 2**31 + 1000  # not 16-byte aligned either
    bucket = jax.jit(lambda b: ops.wgrad_accumulate(x, dy, b, offset=at), donate_argnums=0)(
        _zeros_big()
    )
    _check_blocks(bucket, {at: np.einsum("to,ti->oi", np.float64(dy), np.float64(x))})


@needs_cpu_handler
def test_scan_over_stacked_layers_at_positions_past_2_31():
    # Layer i's block at 16 + i * (2**30 + 64): layer 2 at 2**31 + 144, where int32's
    # 2 * (2**30 + 64) wraps to a negative number (clamped to 0 by the handler).
    layers, t, d_in, d_out = 3, 4, 32, 24
    base, stride = 16, 2**30 + 64
    xs, dys = _ints(9, (layers, t, d_in), BF16), _ints(10, (layers, t, d_out), BF16)

    def run(bucket):
        def step(bk, xs):
            i, x, dy = xs
            return ops.wgrad_accumulate(x, dy, bk, offset=ops.BlockOffset(base, i, stride)), None

        return lax.scan(step, bucket, (jnp.arange(layers, dtype=jnp.int32), xs, dys))[0]

    bucket = jax.jit(run, donate_argnums=0)(_zeros_big())
    want = np.einsum("lto,lti->loi", np.float64(dys), np.float64(xs))
    _check_blocks(bucket, {base + i * stride: want[i] for i in range(layers)})
    assert base + 2 * stride > 2**31


@pytest.mark.slow  # 4.3 GB; the scan case above runs by default
@needs_cpu_handler
def test_ragged_wgrad_past_2_31():
    x, dy = _ints(11, (10, 16), BF16), _ints(12, (10, 8), BF16)
    sizes = jnp.array([4, 0, 6], jnp.int32)
    groups = np.stack(
        [np.float64(dy[r]).T @ np.float64(x[r]) for r in (slice(0, 4), slice(4, 4), slice(4, 10))]
    )
    static, stride = 2**31 + 300, 2**30 + 1024

    def run(bucket, i):
        bucket = ops.ragged_wgrad_accumulate(x, dy, sizes, bucket, offset=static)
        return ops.ragged_wgrad_accumulate(
            x, dy, sizes, bucket, offset=ops.BlockOffset(2048, i, stride)
        )

    bucket = jax.jit(run, donate_argnums=0)(_zeros_big(), jnp.int32(2))
    _check_blocks(bucket, {static: groups, 2048 + 2 * stride: groups})


# ---------------------------------------------- 4. trace level at production sizes
def _fused_positions(jaxpr) -> list[tuple[str, int, int]]:
    return [
        (e.primitive.name, e.params["base"], e.params["stride"])
        for e in jaxpr_eqns(jaxpr)
        if e.primitive.name in ("wgrad_accumulate_at", "ragged_wgrad_accumulate")
    ]


def _int32_products(jaxpr, factors: set[int]) -> list:
    """``mul`` equations of an int32 value by one of ``factors`` (the old wrapping form)."""
    found = []
    for e in jaxpr_eqns(jaxpr):
        if e.primitive.name == "mul" and e.outvars[0].aval.dtype == jnp.int32:
            for v in e.invars:
                if isinstance(v, Literal) and int(v.val) in factors:
                    found.append(e)
    return found


# Llama-3-8B per stage at TP1: hidden 4096, SwiGLU fc1 [2 * 14336, 4096] (gate and up),
# GQA qkv [(32 + 2 * 8) * 128, 4096], 32 layers stacked.
H, F, QKV, LAYERS_8B = 4096, 14336, 6144, 32
LLAMA_LAYERS = {"fc1": (2 * F, H), "fc2": (H, F), "proj": (H, H), "qkv": (QKV, H)}


def _llama_stage_buffer() -> tuple[GradBuffer, dict]:
    params = {
        "layers": {k: SDS((LAYERS_8B, *s), F32) for k, s in LLAMA_LAYERS.items()},
        "embedding": SDS((128256, H), F32),
    }
    return GradBuffer.create(
        params, dp_size=8, bucket_size=None, use_distributed_optimizer=True
    ), params


def _llama_layer(p, h):
    """Shapes of a Llama layer's four fused linears (the arithmetic does not matter)."""
    a = linear(h, p["qkv"])[:, :H]
    h = h + linear(a, p["proj"])
    g = linear(h, p["fc1"])[:, :F]
    return h + linear(g, p["fc2"]), None


def test_llama3_8b_layer_scan_writes_every_block_where_the_plan_puts_it():
    buf, params = _llama_stage_buffer()
    (numel,) = buf.bucket_numels
    assert numel > 2**32  # one 7.5e9-element bucket: most positions overflow int32

    def backward(layers, buckets, x, dy):
        def stage(layers, buckets, x):
            routes = WgradRoutes(buckets)
            layers = {
                k: routes.to_bucket(layers[k], *buf.offset_of(f"['layers']['{k}']"))
                for k in LLAMA_LAYERS
            }
            y, _ = scan_layers(_llama_layer, x, layers)
            return y, routes.close()

        _, vjp_fn = jax.vjp(stage, layers, buckets, x)
        return vjp_fn((dy, buckets))[1]

    jaxpr = jax.make_jaxpr(backward)(
        params["layers"], (SDS((numel,), F32),), SDS((8, H), BF16), SDS((8, H), BF16)
    ).jaxpr
    scans = [e.params["length"] for e in jaxpr_eqns(jaxpr) if e.primitive.name == "scan"]
    assert scans and set(scans) == {LAYERS_8B}
    got = sorted(_fused_positions(jaxpr))
    want = []
    for k, (out, inn) in LLAMA_LAYERS.items():
        slot = buf.slot(f"['layers']['{k}']")
        assert slot.size == LAYERS_8B * out * inn
        want.append(("wgrad_accumulate_at", slot.offset, out * inn))
        # Layer i's block is the plan's: [offset + i * out * in, + out * in) inside the
        # slot, and the last one ends at the slot's end, inside the bucket.
        last = ops.BlockOffset(slot.offset, LAYERS_8B - 1, out * inn).value_for(LAYERS_8B - 1)
        assert last + out * inn == slot.offset + slot.size <= numel
    assert got == sorted(want)
    fc1 = buf.slot("['layers']['fc1']")
    assert 2 * F * H == 117440512 and fc1.offset + 19 * 117440512 > INT32_MAX
    assert _int32_products(jaxpr, {out * inn for out, inn in LLAMA_LAYERS.values()}) == []


def test_sink_chunk_offsets_of_a_stacked_weight_past_2_31():
    # Two model chunks of 16 layers of fc1 (interleaved): chunk v's first block at
    # offset + v * 16 * 117440512, exact; a traced chunk index binds base and stride.
    offset = 3 * 2**30
    entry = SinkEntry(
        name="fc1",
        chunk=STAGE,
        role=LAYERS,
        bucket=0,
        offset=offset,
        shape=(LAYERS_8B, 2 * F, H),
        policy="stash_w",
    )
    chunk = 16 * 2 * F * H
    assert entry.offset_in(Window(1, 2)) == offset + chunk
    traced = jax.make_jaxpr(lambda v: entry.offset_in(Window(v, 2)).index)(jnp.int32(1))
    assert traced.eqns == []  # the index is passed on as it is: no int32 arithmetic
    position = entry.offset_in(Window(jnp.int32(1), 2))
    assert (position.base, position.stride) == (offset, chunk)
    numel = offset + 2 * chunk

    def w_task(bucket, v, x, dy):  # the W task's grouped call on the chunk's 16 layers
        return ops.grouped_wgrad_accumulate(x, dy, bucket, offset=entry.offset_in(Window(v, 2)))

    jaxpr = jax.make_jaxpr(w_task)(
        SDS((numel,), F32), SDS((), jnp.int32), SDS((16, 8, H), BF16), SDS((16, 8, 2 * F), BF16)
    ).jaxpr
    assert _fused_positions(jaxpr) == [("wgrad_accumulate_at", offset, chunk)]


def test_ragged_expert_wgrad_at_production_sizes_binds_64bit_positions():
    # Mixtral-8x7B at EP1: [8, 2 * 14336, 4096] experts per layer, layer i of 32 at
    # base + i * 8 * 117440512 (past 2**31 from layer 3).
    e, per_layer = 8, 8 * 2 * F * H
    base, numel = 2**20, 2**20 + LAYERS_8B * per_layer

    def layers(bucket, x, dy, sizes):
        def step(bk, i):
            return ops.ragged_wgrad_accumulate(
                x, dy, sizes, bk, offset=ops.BlockOffset(base, i, per_layer)
            ), None

        return lax.scan(step, bucket, jnp.arange(LAYERS_8B, dtype=jnp.int32))[0]

    jaxpr = jax.make_jaxpr(layers)(
        SDS((numel,), BF16), SDS((64, H), BF16), SDS((64, 2 * F), BF16), SDS((e,), jnp.int32)
    ).jaxpr
    assert _fused_positions(jaxpr) == [("ragged_wgrad_accumulate", base, per_layer)]
    assert _int32_products(jaxpr, {per_layer}) == []


# ------------------------------------------ masks and shards of a 3.1e9-element bucket
def _union(intervals) -> list[tuple[int, int]]:
    """Sorted ``[start, end)`` intervals with touching ones merged."""
    out: list[list[int]] = []
    for s, e in sorted(intervals):
        if out and out[-1][1] >= s:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _mesh8() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]), ("data",))


def _big_buffer() -> tuple[GradBuffer, dict[str, bool]]:
    """One bucket of ~3.1e9 elements (Llama-3-8B at TP2 without overlap-grad-reduce) with
    runs of flagged weights that cross the 8 ranks' shard bounds."""
    params = {
        "layers": {
            k: SDS((LAYERS_8B, *s), F32)
            for k, s in {
                "fc1": (F, H),
                "fc2": (H, F // 2),
                "norm": (H,),
                "qkv": (QKV // 2, H),
            }.items()
        },
        "final_norm": SDS((H,), F32),
    }
    buf = GradBuffer.create(params, dp_size=8, bucket_size=None, use_distributed_optimizer=True)
    flags = {"layers": {"fc1": True, "fc2": True, "norm": False, "qkv": True}, "final_norm": False}
    return buf, flags


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_masks_and_shards_of_a_bucket_past_2_31_trace_exactly():
    buf, flags = _big_buffer()
    (numel,) = buf.bucket_numels
    assert numel > 3.0e9 and numel % 8 == 0
    shard = numel // 8
    mesh = _mesh8()

    def f(bucket):
        mask = local_mask(buf, flags, axis_name="data")
        (own,) = shard_buckets((bucket,), axis_name="data")
        (back,) = place_shards((bucket,), (own * 2,), axis_name="data")
        return mask, own, back

    fn = jax.shard_map(
        f, mesh=mesh, in_specs=P(), out_specs=(P("data"), P("data"), P()), check_vma=False
    )
    (mask,), own, back = jax.eval_shape(fn, SDS((numel,), F32))
    assert mask.shape == own.shape == (numel,) and back.shape == (numel,)
    jaxpr = jax.make_jaxpr(fn)(SDS((numel,), F32)).jaxpr
    assert _int32_products(jaxpr, {shard}) == []
    # The per-rank run tables: every flagged element of the shard and only those, from
    # Python-int interval arithmetic on the plan's slots.
    (leaves,) = buf.bucket_leaves
    values = buf.flag_values(flags)
    runs = [
        (buf.slots[k].offset, buf.slots[k].offset + buf.slots[k].size) for k in leaves if values[k]
    ]
    starts, ends = _rank_run_tables(_union(runs), 8, shard)
    assert starts.dtype == np.int32 and int(ends.max()) <= shard
    crossing = 0
    for r in range(8):
        lo, hi = r * shard, (r + 1) * shard
        want = [(max(s, lo) - lo, min(e, hi) - lo) for s, e in runs if s < hi and e > lo]
        row = [(int(s), int(e)) for s, e in zip(starts[r], ends[r]) if s < shard]
        assert row == sorted(row) and _union(row) == row and _union(want) == row, r
        crossing += any(s < lo < e for s, e in runs)
    assert crossing >= 4  # flagged runs cut by most shard bounds
    with pytest.raises(ValueError, match=r"bucket 0 is partly flagged .* has 3\d+ elements"):
        local_mask(buf, flags, axis_name=None)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_small_masks_and_shards_match_numpy_across_rank_bounds():
    params = {
        "a": SDS((37,), F32),
        "b": SDS((5, 9), F32),
        "c": SDS((3,), F32),
        "d": SDS((4, 11), F32),
    }
    buf = GradBuffer.create(params, dp_size=8, bucket_size=None, use_distributed_optimizer=True)
    flags = {"a": True, "b": False, "c": True, "d": True}
    (numel,) = buf.bucket_numels
    data = np.arange(numel, dtype=np.float32)

    def f(bucket):
        (own,) = shard_buckets((bucket,), axis_name="data")
        (back,) = place_shards((jnp.zeros_like(bucket),), (own,), axis_name="data")
        return local_mask(buf, flags, axis_name="data")[0], own, back[None]

    mask, own, back = jax.jit(
        jax.shard_map(f, mesh=_mesh8(), in_specs=P(), out_specs=(P("data"), P("data"), P("data")))
    )(data)
    np.testing.assert_array_equal(mask, flat_mask(buf, flags)[0].astype(bool))
    np.testing.assert_array_equal(own, data)
    shard = numel // 8
    for r in range(8):  # rank r's copy holds its own shard only
        want = np.zeros(numel, np.float32)
        want[r * shard : (r + 1) * shard] = data[r * shard : (r + 1) * shard]
        np.testing.assert_array_equal(back[r], want)


# ------------------------------------------------------------- CUDA lowering (no GPU)
@pytest.mark.cuda_handler
@pytest.mark.parametrize(
    "base,acc_dtype,staged",
    [
        (2**32, F32, 0),
        (2**32 + 1, F32, 3 * 20),
        (2**32 + 8, BF16, 0),
        (2**32 + 4, BF16, 3 * 40),
    ],
    ids=["aligned-f32", "unaligned-f32", "aligned-bf16", "unaligned-bf16"],
)
def test_cuda_lowering_passes_int64_base_and_stride_and_sizes_staging(base, acc_dtype, staged):
    # 3 grouped blocks of 80 bytes (fp32: 5 x 4, bf16: 5 x 8 elements), stride 40 elements,
    # a 240-element bucket: every block is 16-byte aligned when base is a multiple of 16
    # bytes (4 fp32 or 8 bf16 elements); otherwise one 80-byte staging slot per block.
    d_in = 4 if acc_dtype == F32 else 8
    x, dy = jnp.ones((3, 8, d_in), BF16), jnp.ones((3, 8, 5), BF16)
    fn = lambda b, i: ops.grouped_wgrad_accumulate(x, dy, b, offset=ops.BlockOffset(base, i, 40))
    text = (
        jax.jit(fn)
        .trace(jnp.zeros(240, acc_dtype), jnp.int32(2))
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    (call,) = [line for line in text.splitlines() if "@jax_wgrad_wgrad_accumulate_at" in line]
    assert f"base = {base} : i64" in call and "stride = 40 : i64" in call, call
    dtype = "f32" if acc_dtype == F32 else "bf16"
    assert f"tensor<{staged}x{dtype}>)" in call, call
