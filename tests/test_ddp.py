"""Bucketed gradients in the train step vs a single-device optax reference;
non-finite skip; HLO facts (buckets are the in-place accumulators; one collective per
bucket, in the cooldown or after the schedule)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hlo_util import (
    collective_arrays,
    computations,
    copies_of,
    custom_calls,
    entry_name,
    reachable,
    while_bodies,
)

from jax_wgrad import (
    ByteDataset,
    DDPConfig,
    GPTConfig,
    ParallelConfig,
    TrainPlan,
    build_train_step,
    default_optimizer,
    fusion_available,
    init_train_state,
    make_mesh,
    shard_batch,
)
from jax_wgrad.ops import handlers
from jax_wgrad.testing import reference_loss

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

MODEL = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64)
DATA = ByteDataset(
    np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 200, np.uint8) % 64
)
STEPS, GBS, SEED = 5, 16, 11
# Adam divides by sqrt(v): a gradient entry that is ~0 up to fp32 rounding (e.g. the key
# bias, which softmax ignores) gets an update of +-lr * |noise| / (|noise| + eps) whose
# sign is the rounding's. eps = 1e-4 keeps that far below the tolerance for both sides
# (same AdamW config in the reference); with eps = 1e-8 the worst leaf differs by ~1e-4.
LR, WD, B1, B2, EPS = 1e-3, 0.1, 0.9, 0.95, 1e-4
SMALL_BUCKET = 2000  # elements: several buckets per stage (needs overlap_grad_reduce)


def _batch(i, model=MODEL):
    return DATA.batch(i, GBS, model.seq_length, seed=SEED)


def _decay_mask(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: (
            getattr(path[-1], "key", None) in ("weight", "embedding")
            and not (len(path) >= 2 and getattr(path[-2], "key", None) == "position")
        ),
        params,
    )


def _reference(params, clip, skip=(), model=MODEL):
    """Single device: jax.grad of the plain-jnp GPT, Megatron's clipping coefficient,
    optax.adamw with the same hyperparameters and decay mask."""
    tx = optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, mask=_decay_mask(params))
    state = tx.init(params)
    grad_fn = jax.jit(jax.value_and_grad(reference_loss), static_argnums=2)
    losses, norms = [], []
    for i in range(STEPS):
        loss, g = grad_fn(params, jnp.asarray(_batch(i, model)), model)
        norm = optax.tree.norm(g)
        losses.append(float(loss))
        norms.append(float(norm))
        if i in skip:
            continue
        coeff = clip / (norm + 1e-6) if clip else 1.0
        if clip and coeff < 1.0:
            g = jax.tree.map(lambda x, coeff=coeff: x * coeff, g)
        upd, state = tx.update(g, state, params)
        params = optax.apply_updates(params, upd)
    return params, np.array(losses), np.array(norms)


def _setup(dp_tp_pp, ddp, *, fusion, sp, hook=None, model=MODEL):
    dp, tp, pp = dp_tp_pp
    if fusion and not fusion_available("cpu"):
        fusion = False
    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        micro_batch_size=2,
        global_batch_size=GBS,
        sequence_parallel=sp,
        gradient_accumulation_fusion=fusion,
    )
    mesh = make_mesh(par)
    opt = default_optimizer(LR, weight_decay=WD, b1=B1, b2=B2, eps=EPS)
    plan = TrainPlan.create(model, par, mesh, opt, ddp=ddp)
    state = init_train_state(plan, seed=SEED)
    step = build_train_step(plan, state, debug_grad_hook=hook)
    return plan, mesh, state, step


def _train(dp_tp_pp, ddp, *, fusion, sp, hook=None, model=MODEL):
    plan, mesh, state, step = _setup(dp_tp_pp, ddp, fusion=fusion, sp=sp, hook=hook, model=model)
    init = jax.device_get(state.params)
    history = []
    for i in range(STEPS):
        state, m = step(state, shard_batch(mesh, _batch(i, model)))
        history.append(
            (
                jax.device_get(state.params),
                jax.device_get(state.opt_state),
                {k: float(v) for k, v in m.items()},
            )
        )
    return init, history


def _assert_params_close(got, want, what):
    flat, _ = jax.tree_util.tree_flatten_with_path(want)
    for (path, w), g in zip(flat, jax.tree.leaves(got)):
        w, g = np.asarray(w), np.asarray(g)
        diff, scale = np.abs(g - w).max(), np.abs(w).max()
        assert diff <= 1e-5 * scale, (
            f"{what} {jax.tree_util.keystr(path)}: {diff:.3g} > 1e-5 x {scale:.3g}"
        )


CASES = [  # (dp, tp, pp), distributed optimizer, buckets, clip: every mesh, both optimizers,
    # both bucketings, clipping on and off; the rest of ALL runs with -m slow (suite time)
    ((8, 1, 1), True, "single", 0.5),
    ((2, 2, 2), False, "single", 0.0),
    ((2, 1, 4), True, "small", 0.0),
]
# The default run keeps (2, 2, 2) (TP+PP+DP with SP); the non-finite test below runs it
# with the distributed optimizer, small buckets and clipping against the same reference.
# The other CASES run with -m slow (suite time).
DEFAULT_CASE = ((2, 2, 2), False, "single", 0.0)
ALL = [
    (m, d, b, c)
    for m in [(8, 1, 1), (2, 2, 2), (2, 1, 4)]
    for d in (True, False)
    for b in ("small", "single")
    for c in (0.5, 0.0)
]


def _ddp(dist, buckets, clip, **kw):
    # Megatron: bucket_size only takes effect with overlap_grad_reduce (one bucket without).
    small = buckets == "small"
    return DDPConfig(
        use_distributed_optimizer=dist,
        overlap_grad_reduce=small,
        bucket_size=SMALL_BUCKET if small else None,
        clip_grad=clip,
        **kw,
    )


@pytest.mark.parametrize(
    "mesh_shape, dist, buckets, clip",
    [
        pytest.param(
            *c,
            id=f"{c[0]}-{'dist' if c[1] else 'repl'}-{c[2]}-clip{c[3]}",
            marks=() if c == DEFAULT_CASE else pytest.mark.slow,
        )
        for c in CASES
    ]
    + [
        pytest.param(
            *c, id=f"{c[0]}-{'dist' if c[1] else 'repl'}-{c[2]}-clip{c[3]}", marks=pytest.mark.slow
        )
        for c in ALL
        if c not in CASES
    ],
)
def test_five_steps_equal_single_device_optax(mesh_shape, dist, buckets, clip):
    tp = mesh_shape[1]
    ddp = _ddp(dist, buckets, clip)
    par = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=mesh_shape[2])
    layout = TrainPlan.create(MODEL, par, make_mesh(par), default_optimizer(LR), ddp=ddp).layout
    if buckets == "small":
        assert layout.stage.num_buckets >= 2
    else:
        assert layout.stage.num_buckets == 1
    init, history = _train(mesh_shape, ddp, fusion=True, sp=tp > 1)
    ref, ref_losses, ref_norms = _reference(init, clip)
    if clip:
        assert (ref_norms > clip).any()  # clipping is exercised
    np.testing.assert_allclose([h[2]["loss"] for h in history], ref_losses, rtol=1e-5)
    np.testing.assert_allclose([h[2]["grad_norm"] for h in history], ref_norms, rtol=1e-5)
    assert not any(h[2]["skipped"] for h in history)
    _assert_params_close(history[-1][0], ref, f"{mesh_shape} dist={dist} {buckets} clip={clip}")
    moved = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(init))
    )
    assert moved > 1e-3  # the steps did something (>> the 1e-5-relative tolerance)


DEEP = dataclasses.replace(MODEL, num_layers=8)
UNROLLED = dataclasses.replace(DEEP, layer_scan_unroll=8)


@pytest.mark.parametrize(
    "mesh_shape, dist, model",
    [
        pytest.param((4, 1, 2), True, DEEP, id="(4, 1, 2)-dist"),
        # straight-line layers (what --cuda-graph-scope full_iteration compiles)
        pytest.param((2, 2, 2), True, UNROLLED, id="(2, 2, 2)-dist-unrolled"),
        pytest.param((8, 1, 1), False, MODEL, id="(8, 1, 1)-repl", marks=pytest.mark.slow),
        pytest.param((2, 2, 2), False, DEEP, id="(2, 2, 2)-repl", marks=pytest.mark.slow),
    ],
)
def test_layer_groups_synced_in_the_last_backward_equal_single_device_optax(
    mesh_shape, dist, model
):
    """overlap_grad_reduce_in_backward lays the stage's fused layer weights out in layer
    groups, a bucket each, and the stage's last backward syncs every group's bucket but
    the lowest one's while it differentiates the group below (the backward's third
    branch, on one stage and on two): five steps equal single-device optax."""
    ddp = _ddp(dist, "small", 0.5, overlap_grad_reduce_in_backward=True)
    plan, *_ = _setup(mesh_shape, ddp, fusion=True, sp=mesh_shape[1] > 1, model=model)
    groups = plan.layout.layer_group_buckets
    assert len(groups) == 2, plan.layout.stage.summary()
    init, history = _train(mesh_shape, ddp, fusion=True, sp=mesh_shape[1] > 1, model=model)
    ref, ref_losses, ref_norms = _reference(init, 0.5, model=model)
    np.testing.assert_allclose([h[2]["loss"] for h in history], ref_losses, rtol=1e-5)
    np.testing.assert_allclose([h[2]["grad_norm"] for h in history], ref_norms, rtol=1e-5)
    _assert_params_close(history[-1][0], ref, f"layer groups {mesh_shape} dist={dist}")


def test_layer_groups_fail_loudly_where_they_cannot_work():
    with pytest.raises(ValueError, match="requires overlap_grad_reduce"):
        DDPConfig(overlap_grad_reduce_in_backward=True)
    ddp = _ddp(True, "small", 0.0, overlap_grad_reduce_in_backward=True)
    with pytest.raises(ValueError, match="make fewer than two layer groups"):
        _setup((4, 1, 2), ddp, fusion=True, sp=False)  # 2 layers per stage
    with pytest.raises(ValueError, match=r"needs gradient accumulation fusion"):
        _setup((4, 1, 2), ddp, fusion=False, sp=False, model=DEEP)
    # without the option the layout is the one bucket plan per chunk, as ever
    plan, *_ = _setup((4, 1, 2), _ddp(True, "small", 0.0), fusion=True, sp=False, model=DEEP)
    assert plan.layout.layer_group_buckets == ()


def test_hlo_layer_groups_are_reduce_scattered_inside_the_backward_layer_loop():
    """The compiled structure of the overlap: the reduce-scatter of a completed layer
    group's bucket sits inside the backward loop of the group below (where XLA:GPU's
    scheduler overlaps it with that layer's GEMMs), not after it; the lowest group's and
    the other buckets are reduce-scattered in the cooldown."""
    ddp = _ddp(True, "small", 0.0, overlap_grad_reduce_in_backward=True)
    layout, hlo = _compiled((4, 1, 2), ddp, model=DEEP, text=True)
    comps = computations(hlo)
    bodies = {body: c for c in comps for _, body in while_bodies(comps, c)}
    where = [
        c
        for c, lines in comps.items()
        for line in lines
        if " reduce-scatter(" in line and "grad_sync_in_backward" in line
    ]
    # two groups: the upper group's bucket, in the two iterations of the lower group's loop
    assert len(layout.layer_group_buckets) == 2 and len(where) == 1, where
    (body,) = where
    assert body in bodies and "transpose(jvp(" in "\n".join(comps[body]), body
    schedule = [b for b, c in bodies.items() if c == entry_name(hlo)]
    assert any(body in reachable(comps, b) for b in schedule)


# slow: a non-finite gradient skipping the step stays in the default run at the optimizer
# (test_dist_optimizer.py::test_non_finite_gradient_skips_the_step_and_training_continues)
@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), pytest.param((8, 1, 1), marks=pytest.mark.slow)])
def test_non_finite_gradient_skips_the_step_and_training_continues(mesh_shape):
    bad = 2

    def hook(buckets, step):
        # One device (data rank 0, every stage) gets a NaN in one bucket at step `bad`.
        first = jax.lax.axis_index("data") == 0
        poison = jnp.where((step == bad) & first, jnp.float32(jnp.nan), 0.0)
        return (buckets[0].at[3].add(poison),) + tuple(buckets[1:])

    ddp = _ddp(True, "small", 0.5)
    init, history = _train(mesh_shape, ddp, fusion=True, sp=mesh_shape[1] > 1, hook=hook)
    assert [h[2]["skipped"] for h in history] == [i == bad for i in range(STEPS)]
    assert not np.isfinite(history[bad][2]["grad_norm"])
    # Nothing changed in the skipped step: parameters and optimizer state bit-identical.
    for a, b in zip(jax.tree.leaves(history[bad - 1][:2]), jax.tree.leaves(history[bad][:2])):
        np.testing.assert_array_equal(a, b)
    ref, _, _ = _reference(init, 0.5, skip=(bad,))
    _assert_params_close(history[-1][0], ref, "after the skipped step")
    assert history[-1][2]["loss"] < history[0][2]["loss"]


# ---------------------------------------------------------------------------- HLO facts


def _compiled(dp_tp_pp, ddp, fusion=True, sp=False, model=MODEL, text=False):
    plan, mesh, state, step = _setup(dp_tp_pp, ddp, fusion=fusion, sp=sp, model=model)
    layout = plan.layout
    hlo = step.lower(state, shard_batch(mesh, _batch(0, model))).compile().as_text()
    if text:
        return layout, hlo
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)  # logical ids, (d, e, t, p)
    ranks = ids.reshape(ids.shape[0] * ids.shape[1], -1)  # data-parallel ranks x (t, p)
    data_groups = [ranks[:, j] for j in range(ranks.shape[1])]
    comps = computations(hlo)
    entry = entry_name(hlo)
    # The schedule's scan: the while loop whose state holds every bucket.
    shapes = [f"f32[{n}]" for n in layout.buffer.bucket_numels]
    (loop,) = [
        (line, body)
        for line, body in while_bodies(comps, entry)
        if all(s in line.split(" while(")[0] for s in shapes)
    ]
    inside = reachable(comps, loop[1])
    in_loop = [line for c in inside for line in comps[c]]
    outside = [line for c, lines in comps.items() if c not in inside for line in lines]
    return layout, data_groups, in_loop, outside


@pytest.mark.parametrize(
    "dist",
    [True, pytest.param(False, marks=pytest.mark.slow)],  # suite time; True checks more
)
def test_hlo_buckets_are_updated_in_place_no_copy_per_microbatch(dist):
    ddp = _ddp(dist, "small", 0.0)
    layout, _, in_loop, _ = _compiled((2, 1, 4), ddp)
    # XLA:CPU's all-reduce writes a buffer of its own: the replicated optimizer's cooldown
    # sync copies each all-reduced bucket back into the loop-carried one, once per step in
    # the sync branch. XLA:GPU all-reduces in place (Llama-3-8B TP2 PP2 DP2 replicated,
    # compiled for 8 H100: no bucket-sized copy anywhere). Any other bucket-sized copy in
    # the loop would run per microbatch.
    # an all-reduce's result, or an element of a combined one's tuple
    result = re.compile(r"%([\w.\-]+) = .* (all-reduce\(|get-tuple-element\(%all-reduce)")
    reduced = {m.group(1) for line in in_loop if (m := result.search(line))}
    for n in set(layout.buffer.bucket_numels):
        copies = copies_of("\n".join(in_loop), "f32", (n,))
        sync_copies = [c for c in copies if re.search(r"copy\(%([\w.\-]+)\)", c)[1] in reduced]
        assert len(sync_copies) <= (0 if dist else 1), (n, sync_copies)
        assert [c for c in copies if c not in sync_copies] == [], n
    if fusion_available("cpu"):  # fused linears of the stage's layers and the output layer
        # (the layers' at traced offsets inside the scan over layers)
        assert (
            len(
                custom_calls("\n".join(in_loop), handlers.TARGET)
                + custom_calls("\n".join(in_loop), handlers.TARGET_AT)
            )
            >= 4 + 1
        )
    # Every other gradient goes into its block through the aliased bucket_add call, never
    # a dynamic-update-slice of a bucket at a constant offset (XLA:GPU copies the whole
    # bucket for that, docs/design/h100_findings.md, section 1). The only bucket-sized updates left
    # in the loop are the distributed optimizer's write-back of each stage bucket's
    # reduce-scattered shard in the cooldown, at the rank's (traced) offset: the rank's row
    # of the bucket viewed as [dp, numel / dp] (exact past 2^31 elements, grads/sync.py).
    assert custom_calls("\n".join(in_loop), handlers.BUCKET_ADD_TARGET)
    dp = 2  # of the (2, 1, 4) layout
    dus = [
        re.search(rf"= f32\[(?:{n}|{dp},{n // dp})\]\S* dynamic-update-slice\(([^)]*)\)", line)
        for line in in_loop
        for n in set(layout.buffer.bucket_numels)
    ]
    dus = [m.group(1).split(", ") for m in dus if m]
    assert len(dus) == (layout.stage.num_buckets if dist else 0), dus
    # the offset (1-D) or the rank's row (2-D view) is traced, never a constant
    assert not [ops for ops in dus if ops[2].startswith("%constant")], dus


@pytest.mark.parametrize(
    "overlap, dist, op",
    [  # by default the cooldown placement; the others with -m slow (suite time: the
        # all-reduce's numerics stay in the default run in test_five_steps_equal_single_
        # device_optax[(2, 2, 2)-repl-...], its one-collective-per-bucket HLO here, slow)
        (True, True, "reduce-scatter"),
        pytest.param(False, False, "all-reduce", marks=pytest.mark.slow),
        pytest.param(True, False, "all-reduce", marks=pytest.mark.slow),
        pytest.param(False, True, "reduce-scatter", marks=pytest.mark.slow),
    ],
)
def test_hlo_one_collective_per_bucket_in_cooldown_or_after(dist, op, overlap):
    ddp = _ddp(dist, "small", 0.0)
    if not overlap:
        ddp = dataclasses.replace(ddp, overlap_grad_reduce=False)
    layout, data_groups, in_loop, outside = _compiled((2, 1, 4), ddp)
    dp = 2
    size = (lambda n: n // dp) if dist else (lambda n: n)
    stage = sorted(size(n) for n in layout.stage.bucket_numels)
    shared = sorted(size(n) for n in layout.shared.bucket_numels)
    if overlap:
        assert len(stage) >= 2  # several buckets, each its own collective (not per parameter)
    over_data = lambda lines: collective_arrays(lines, op, replica_groups=data_groups)
    got_in = sorted(n for n in over_data(in_loop) if n in stage + shared)
    got_out = sorted(n for n in over_data(outside) if n in stage + shared)
    if overlap:  # stage buckets: inside the schedule's loop (the cooldown conditional)
        assert got_in == stage and got_out == shared, (got_in, got_out)
        cond_lines = [line for line in in_loop if " conditional(" in line]
        assert cond_lines
    else:  # everything after the schedule
        assert got_in == [] and got_out == sorted(stage + shared), (got_in, got_out)
    # No per-parameter collectives: over `data`, only the buckets (and 0-d scalars: loss,
    # token count, norm pieces, which are not 1-D arrays and not counted here).
    assert sorted(over_data(in_loop + outside)) == sorted(stage + shared)
    # The fp32 buckets go into their collectives unscaled: the 1/dp is folded into the
    # shard-sized token scaling (grads/finalize.py), never a pass over a whole bucket.
    whole = "|".join(str(n) for n in set(layout.buffer.bucket_numels))
    scaled = [
        line
        for line in in_loop + outside
        if re.search(rf"= f32\[({whole})\]\S* multiply\(", line)
        and re.search(r"grad_sync_in_cooldown|data_parallel_sync", line)
    ]
    assert scaled == [], scaled
