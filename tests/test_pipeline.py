"""1F1B pipeline: schedule properties and gradients equal to single-device jax.grad."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grad_util import assert_grads_close, pipeline_and_reference
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad import (
    GPTConfig,
    GPTProgram,
    ParallelConfig,
    fusion_available,
    init_params,
    make_mesh,
    param_specs,
    pipeline_gradients,
)
from jax_wgrad.layout import lay_out
from jax_wgrad.models.gpt import validate
from jax_wgrad.parallel.schedules import IDLE, ScheduleTable, get_schedule, one_f_one_b
from jax_wgrad.testing import reference_loss

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

MESHES = [(8, 1, 1), (4, 2, 1), (2, 2, 2), (2, 1, 4), (1, 2, 4)]


# --------------------------------------------------------------------------- schedule


def _task_order(table, s):
    """Stage ``s``'s tasks in tick order, e.g. ``[("F", 0), ("F", 1), ("B", 0), ...]``."""
    order = []
    for t in range(table.num_ticks):
        for task, col in (("F", table.forward), ("B", table.backward), ("W", table.weight)):
            if col[t, s] >= 0:
                order.append((task, int(col[t, s])))
    return order


@pytest.mark.parametrize("p, m", [(1, 3), (2, 2), (4, 1), (4, 3), (4, 8), (3, 16)])
def test_schedule_is_megatron_1f1b_with_p_minus_s_in_flight(p, m):
    sched = one_f_one_b(p, m)
    # One stage: F and B of a microbatch share its tick (no lock step to keep).
    assert sched.num_ticks == (m if p == 1 else 2 * (m + p - 1)) and not sched.split_backward
    for s in range(p):
        assert sched.in_flight(s) == min(p - s, m)
        # Megatron's order: P - s - 1 warm-up forwards, one forward one backward, cool-down.
        warm = min(p - s - 1, m)
        expected = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            expected += [("F", warm + i), ("B", i)]
        expected += [("B", i) for i in range(m - warm, m)]
        assert _task_order(sched, s) == expected, s
    assert sched.num_slots == min(p, m)


# --------------------------------------------------------------------------- gradients


LLAMA = dict(
    normalization="RMSNorm",
    position_embedding_type="rope",
    swiglu=True,
    group_query_attention=True,
    num_attention_heads=8,
    num_query_groups=2,
    add_bias_linear=False,
    rotary_base=500000.0,
)
"""Every Llama option: RMSNorm, RoPE, SwiGLU, GQA 8:2, no bias (and untied below)."""


def _recompute_kw(recompute) -> dict:
    """``recompute``: None, "selective", "full" (Megatron's uniform method, one layer per
    checkpoint), or ``("full", method, num_layers)``."""
    if recompute == "full":
        recompute = ("full", "uniform", 1)
    if isinstance(recompute, tuple):
        return dict(
            recompute_granularity="full",
            recompute_method=recompute[1],
            recompute_num_layers=recompute[2],
        )
    return dict(recompute_granularity=recompute)


def _check_gradients(
    dp,
    tp,
    pp,
    *,
    sp,
    fusion,
    tied=True,
    m=2,
    dtype="float32",
    table=None,
    schedule="1f1b",
    recompute=None,
    arch=None,
    ddp=None,
    **par_kw,
):
    if fusion and not fusion_available("cpu"):
        pytest.skip("the CPU wgrad_accumulate handler was not built")
    cfg = GPTConfig(
        **{
            **dict(
                num_layers=max(4, pp),
                hidden_size=32,
                num_attention_heads=4,
                seq_length=8,
                vocab_size=64,
                untie_embeddings_and_output_weights=not tied,
                compute_dtype=dtype,
            ),
            **(arch or {}),
        }
    )
    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        micro_batch_size=2,
        global_batch_size=2 * dp * m,
        sequence_parallel=sp,
        gradient_accumulation_fusion=fusion,
        pipeline_schedule=schedule,
        **_recompute_kw(recompute),
        **par_kw,
    )
    validate(par, cfg)
    return pipeline_and_reference(cfg, par, ddp=ddp, table=table)


def _mesh_grid():
    # By default only sp-fused on (2,2,2) (the rest: -m slow, suite time); unfused without
    # SP runs by default in test_gpipe_through_the_same_executor_equals_jax_grad[2-1-4-...].
    for sp, fusion, kind in [
        (False, False, "plain"),
        (True, True, "sp-fused"),
        (True, False, "sp"),
        (False, True, "fused"),
    ]:
        for dp, tp, pp in MESHES:
            default = kind == "sp-fused" and (dp, tp, pp) == (2, 2, 2)
            yield pytest.param(
                dp,
                tp,
                pp,
                sp,
                fusion,
                id=f"{kind}-{dp}-{tp}-{pp}",
                marks=() if default else pytest.mark.slow,
            )


@pytest.mark.parametrize("dp, tp, pp, sp, fusion", list(_mesh_grid()))
def test_gradients_equal_single_device_jax_grad(dp, tp, pp, sp, fusion):
    if sp and tp == 1:
        if not fusion:
            pytest.skip("sequence parallelism needs tensor parallelism (same as 'plain')")
        sp = False  # still covers fusion on this mesh
    assert_grads_close(*_check_gradients(dp, tp, pp, sp=sp, fusion=fusion))


def _llama_grid():
    # All -m slow (suite time): the Llama options on (2,2,2)+SP, fused, untied run by default
    # in test_llama_options_with_deferral_and_recomputation (ZB-H1) and
    # test_megatron_recompute_methods_equal_jax_grad (1F1B).
    for dp, tp, pp in MESHES:
        for fusion in (False, True):
            yield pytest.param(
                dp,
                tp,
                pp,
                fusion,
                id=f"{'fused' if fusion else 'plain'}-{dp}-{tp}-{pp}",
                marks=[pytest.mark.slow],
            )


@pytest.mark.parametrize("dp, tp, pp, fusion", list(_llama_grid()))
def test_llama_options_equal_single_device_jax_grad(dp, tp, pp, fusion):
    """RMSNorm, RoPE, SwiGLU, GQA 8:2 (over tensor 2: one kv group per rank), no linear
    bias, untied output layer; sequence parallelism with tensor parallelism (RoPE sees
    the gathered sequence)."""
    assert_grads_close(
        *_check_gradients(dp, tp, pp, sp=tp > 1, fusion=fusion, tied=False, arch=LLAMA)
    )


@pytest.mark.parametrize("schedule", [pytest.param("1f1b", marks=pytest.mark.slow), "zb-h1"])
def test_qwen_and_megatron_only_options_equal_jax_grad(schedule):
    """A qkv bias without other biases (Qwen2), qk-layernorm, kv_channels != H / heads,
    partial rotary, tied embeddings; fused, SP, both schedules."""
    arch = dict(LLAMA, add_qkv_bias=True, qk_layernorm=True, kv_channels=8, rotary_percent=0.5)
    assert_grads_close(
        *_check_gradients(2, 2, 2, sp=True, fusion=True, arch=arch, schedule=schedule)
    )


# -m slow (suite time); the default run's Llama 3.1 RoPE scaling: the transformers-made
# fixture's fp32 logits and (2,2,2)+SP pipeline loss, tests/test_qwen3.py[llama31], and its
# frequency bands, tests/test_hf.py::test_llama31_rope_frequency_bands.
@pytest.mark.slow
@pytest.mark.parametrize("dp, tp, pp", [(1, 1, 1), (2, 2, 2)])
def test_llama31_rope_scaling_equals_single_device_jax_grad(dp, tp, pp):
    """Llama 3.1's RoPE scaling, fused: kv_channels 8 at base 5e5 with an original 256
    positions puts one frequency in each band (kept, interpolated, divided by the factor;
    two divided). The reference applies transformers' formula on its own."""
    arch = dict(
        LLAMA,
        kv_channels=8,
        rope_scaling=True,
        rope_scaling_factor=8.0,
        rope_scaling_original_max_position_embeddings=256,
    )
    loss, ref_loss, grads, ref_grads = _check_gradients(
        dp, tp, pp, sp=tp > 1, fusion=True, tied=False, arch=arch, world_size=dp * tp * pp
    )
    assert_grads_close(loss, ref_loss, grads, ref_grads)
    # the scaling changes the gradients far beyond the tolerance (ignoring it would fail)
    cfg = GPTConfig(
        num_layers=4,
        hidden_size=32,
        seq_length=8,
        vocab_size=64,
        untie_embeddings_and_output_weights=True,
        **arch,
    )
    tokens = jax.random.randint(jax.random.key(1), (4 * dp, 9), 0, 64)
    unscaled = jax.grad(reference_loss)(
        init_params(cfg, seed=0), tokens, dataclasses.replace(cfg, rope_scaling=False)
    )
    diff = max(
        float(np.abs(np.asarray(g) - np.asarray(u)).max() / np.abs(np.asarray(u)).max())
        for g, u in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(unscaled))
    )
    assert diff > 1e-4


@pytest.mark.parametrize(
    "schedule, recompute, mode",
    [
        pytest.param("1f1b", "selective", "stash", marks=pytest.mark.slow),
        ("zb-h1", "full", "recompute"),
    ],
)
def test_llama_options_with_deferral_and_recomputation(schedule, recompute, mode):
    """The Llama options through the deferred output-layer wgrad (both stash modes) and
    recomputation, both schedules, on (2,2,2)+SP with fusion."""
    assert_grads_close(
        *_check_gradients(
            2,
            2,
            2,
            sp=True,
            fusion=True,
            tied=False,
            arch=LLAMA,
            schedule=schedule,
            recompute=recompute,
            defer_embedding_wgrad_compute=True,
            defer_mode=mode,
        )
    )


def test_gqa_groups_must_divide_over_tensor():
    cfg = GPTConfig(**LLAMA, hidden_size=32, num_layers=2)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "num_query_groups (2) must be a multiple of tensor_model_parallel_size (4)"
        ),
    ):
        validate(ParallelConfig(tensor_model_parallel_size=4), cfg)
    with pytest.raises(
        ValueError, match=re.escape("num_query_groups (3) needs group_query_attention")
    ):
        GPTConfig(num_query_groups=3)
    with pytest.raises(
        ValueError,
        match=re.escape("num_attention_heads (8) must be a multiple of num_query_groups (3)"),
    ):
        GPTConfig(**dict(LLAMA, num_query_groups=3), hidden_size=32)


# untied by default: test_llama_options_with_deferral_and_recomputation (2,2,2) and
# test_schedules_and_recompute_equal_jax_grad[default-zb-h1-selective-m3] (1,2,4)
@pytest.mark.slow
@pytest.mark.parametrize("dp, tp, pp", [(2, 2, 2), (1, 2, 4)], ids=str)
def test_untied_output_layer(dp, tp, pp):
    assert_grads_close(*_check_gradients(dp, tp, pp, sp=True, fusion=True, tied=False))


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 3, 7])
def test_microbatch_counts(m):
    assert_grads_close(*_check_gradients(2, 1, 4, sp=False, fusion=True, m=m))


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("zb-h1", marks=pytest.mark.slow)])
def test_unrolled_layer_loop_equals_the_scan(schedule):
    """``layer_scan_unroll`` = the stage's layers (straight-line code, constant block
    offsets) and the scan both equal ``jax.grad`` (not bitwise each other: XLA:CPU fuses
    the straight-line form differently, ulp-level differences)."""
    cfg = GPTConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64
    )
    par = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        micro_batch_size=2,
        global_batch_size=8,
        sequence_parallel=True,
        gradient_accumulation_fusion=True,
        pipeline_schedule=schedule,
    )
    mesh = make_mesh(par)
    params = init_params(cfg, seed=0)
    tokens = jax.random.randint(jax.random.key(1), (par.global_batch_size, 9), 0, 64)
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), param_specs(cfg), is_leaf=lambda x: isinstance(x, P)
    )
    args = (
        jax.device_put(params, shardings),
        jax.device_put(tokens, NamedSharding(mesh, P("data"))),
    )
    out = {}
    for unroll in (1, 2):
        program = lay_out(GPTProgram(dataclasses.replace(cfg, layer_scan_unroll=unroll), par))
        out[unroll] = jax.jit(functools.partial(pipeline_gradients, program, mesh))(*args)
    ref_loss, ref_grads = jax.value_and_grad(reference_loss)(params, tokens, cfg)
    for grads, loss in out.values():
        assert_grads_close(loss, ref_loss, grads, ref_grads)


@pytest.mark.slow  # bf16 compute through the pipeline by default: tests/test_bf16_params.py
def test_bf16_runs_close():
    loss, ref_loss, grads, ref_grads = _check_gradients(
        2, 2, 2, sp=True, fusion=True, dtype="bfloat16"
    )
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-2)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


@pytest.mark.slow  # the fused op in the compiled pipeline by default: tests/test_pipeline_hlo.py
def test_fused_pipeline_calls_the_fused_op():
    if not fusion_available("cpu"):
        pytest.skip("the CPU wgrad_accumulate handler was not built")
    cfg = GPTConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64
    )
    par = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        micro_batch_size=1,
        global_batch_size=4,
        gradient_accumulation_fusion=True,
    )
    mesh = make_mesh(par)
    stages = lay_out(GPTProgram(cfg, par))
    params = jax.eval_shape(lambda: init_params(cfg, 0))
    tokens = jax.ShapeDtypeStruct((4, 9), jnp.int32)
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), param_specs(cfg), is_leaf=lambda x: isinstance(x, P)
    )
    fn = jax.jit(
        lambda p, t: pipeline_gradients(stages, mesh, p, t),
        in_shardings=(shardings, NamedSharding(mesh, P("data"))),
    )
    hlo = fn.lower(params, tokens).compile().as_text()
    assert "jax_wgrad_wgrad_accumulate" in hlo


# --------------------------------------------------------------------------- schedules as data


def gpipe(num_stages: int, num_microbatches: int) -> ScheduleTable:
    """GPipe, test-only: every forward, then every backward. Adding a schedule is adding a
    table: the executor runs it unchanged."""
    p, m = num_stages, num_microbatches
    fwd = np.full((2 * (m + p - 1), p), IDLE)
    bwd = np.full_like(fwd, IDLE)
    for s in range(p):
        for i in range(m):
            fwd[i + s, s] = i
            bwd[m + p - 1 + i + (p - 1 - s), s] = i
    return ScheduleTable("gpipe", fwd, bwd)


def test_gpipe_table_facts():
    table = gpipe(4, 3)
    assert table.num_ticks == 12 and table.num_slots == 3  # every microbatch in flight
    # The last stage keeps its head's loss gradients from its F until its B: all M.
    assert table.inbox_depth("F") == 1 and table.inbox_depth("B") == 3
    assert [table.last_grad_tick(s) for s in range(4)] == [11, 10, 9, 8]
    # Lock-step ticks, F = 1 and a full backward = B + W = 2: GPipe's M + P - 1 forward
    # ticks then M + P - 1 backward ticks (6 + 12), holding all M microbatches on stage 0.
    assert table.makespan() == 18 and table.in_flight(0) == 3


@pytest.mark.parametrize(
    "dp, tp, pp, sp, fusion",
    [
        # (2,2,2)+SP fused through 1F1B's table by default: test_gradients_equal_...[sp-fused-2-2-2]
        pytest.param(2, 2, 2, True, True, marks=pytest.mark.slow),
        pytest.param(1, 2, 4, False, True, marks=pytest.mark.slow),
        # -m slow too (suite time): GPipe differs from 1F1B only in its table, whose facts
        # test_gpipe_table_facts checks; the executor: test_gradients_equal_...[sp-fused-2-2-2]
        pytest.param(2, 1, 4, False, False, marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_gpipe_through_the_same_executor_equals_jax_grad(dp, tp, pp, sp, fusion):
    table = gpipe(pp, 3)
    assert_grads_close(*_check_gradients(dp, tp, pp, sp=sp, fusion=fusion, m=3, table=table))


@pytest.mark.parametrize(
    "bad, match",
    [
        ("order", "stage 0 runs F of microbatches \\[1, 0\\]"),
        ("early", "runs F before its input arrives"),
        ("b_first", "runs B before F"),
    ],
)
def test_schedule_table_validation(bad, match):
    # A valid 2-stage, 2-microbatch table (F and B in one tick on the last stage).
    fwd = np.array([[0, IDLE], [1, 0], [IDLE, 1], [IDLE, IDLE]])
    bwd = np.array([[IDLE, IDLE], [IDLE, 0], [0, 1], [1, IDLE]])
    ScheduleTable("good", fwd, bwd)
    if bad == "order":  # stage 0 forwards microbatch 1 first
        fwd[0, 0], fwd[1, 0] = 1, 0
    elif bad == "early":  # stage 1 forwards microbatch 0 in the tick stage 0 does
        fwd[:, 1] = [0, 1, IDLE, IDLE]
    else:  # stage 1 backwards microbatch 0 before it forwarded it
        bwd[:, 1] = [0, 1, IDLE, IDLE]
    with pytest.raises(ValueError, match=match):
        ScheduleTable("bad", fwd, bwd)


# ---------------------------------------------------- schedules x recompute grid

GRID_MESHES = [
    (8, 1, 1, False),
    (2, 2, 2, True),
    (1, 2, 4, True),
    (2, 1, 4, False),
    (1, 1, 8, False),
]
# (mesh index, schedule, recompute, m, tied): a cross-section with every mesh, schedule and
# recompute mode at least once, with M = 1, M < P and an untied output layer among them.
CROSS_SECTION = [
    (1, "zb-h1", None, 2, True),
    (2, "zb-h1", "selective", 3, False),
    (3, "1f1b", "full", 1, True),
    (4, "zb-h1", None, 3, True),
    (0, "zb-h1", "full", 2, True),
    (2, "1f1b", "selective", 5, True),
]
# Run by default (the rest: -m slow, suite time): ZB-H1, selective recompute, M < P, untied;
# full recompute by default in test_llama_options_with_deferral_and_recomputation and
# test_megatron_recompute_methods_equal_jax_grad.
DEFAULT_GRID = [(2, "zb-h1", "selective", 3, False)]


def _grid_params():
    out = []
    for i, (dp, tp, pp, sp) in enumerate(GRID_MESHES):
        for schedule in ("1f1b", "zb-h1"):
            for recompute in (None, "full", "selective"):
                for m, tied in ((1, True), (3, True), (2, False)):
                    default = (i, schedule, recompute, m, tied) in DEFAULT_GRID
                    out.append(
                        pytest.param(
                            dp,
                            tp,
                            pp,
                            sp,
                            schedule,
                            recompute,
                            m,
                            tied,
                            id=f"{dp}{tp}{pp}{'-sp' if sp else ''}-{schedule}-{recompute}-m{m}"
                            f"{'' if tied else '-untied'}",
                            marks=() if default else pytest.mark.slow,
                        )
                    )
    extra = [
        ((*GRID_MESHES[i][:4], s, r, m, t), (i, s, r, m, t) in DEFAULT_GRID)
        for i, s, r, m, t in CROSS_SECTION
        if (m, t) not in ((1, True), (3, True), (2, False))
    ]
    out += [
        pytest.param(
            *e,
            id=f"default-{e[4]}-{e[5]}-m{e[6]}",
            marks=() if default else pytest.mark.slow,
        )
        for e, default in extra
    ]
    return out


@pytest.mark.parametrize("dp, tp, pp, sp, schedule, recompute, m, tied", _grid_params())
def test_schedules_and_recompute_equal_jax_grad(dp, tp, pp, sp, schedule, recompute, m, tied):
    assert_grads_close(
        *_check_gradients(
            dp, tp, pp, sp=sp, fusion=True, m=m, tied=tied, schedule=schedule, recompute=recompute
        )
    )


@pytest.mark.parametrize(
    "dp, tp, pp, sp, m",
    [(2, 2, 2, True, 5), pytest.param(1, 1, 4, False, 8, marks=pytest.mark.slow)],
    ids=str,
)
def test_paired_1f1b_equals_single_device_jax_grad(dp, tp, pp, sp, m):
    """1F1B with paired ticks: a stage runs a B and an F in the same tick (its slots and
    inboxes as the table says), with the output-layer deferral and the cooldown sync (in
    the tick after each stage's last B), the gradients those of plain jax.grad."""
    from jax_wgrad import DDPConfig

    table = get_schedule("1f1b-paired", pp, m)
    both = (table.forward != IDLE) & (table.backward != IDLE)
    assert both.any(axis=0).all()  # every stage pairs a B with an F (M >= 2P - 1)
    out = _check_gradients(
        dp,
        tp,
        pp,
        sp=sp,
        fusion=True,
        m=m,
        schedule="1f1b-paired",
        defer_embedding_wgrad_compute=True,
        ddp=DDPConfig(overlap_grad_reduce=True),
    )
    assert_grads_close(*out)


# --------------------------------------------------------------------------- interleaved


def _interleaved_grid():
    """The issue's matrix: V = 2, 3 on (1,1,4), (2,2,2)+SP, (1,2,4), M = P and 3P, every
    schedule (1f1b, 1f1b-paired, zb-h1), fused with deferral and the cooldown sync. All -m
    slow (suite time): the default run's interleaved schedules through the executor are
    test_vocab_over_pipeline_equals_single_device_jax_grad[1-2-4-tied-interleaved-zb-h1]
    and test_paired_interleaved_equals_single_device_jax_grad."""
    for mesh in [(1, 1, 4), (2, 2, 2), (1, 2, 4)]:
        for v in (2, 3):
            for times in (1, 3):
                for schedule in ("1f1b", "1f1b-paired", "zb-h1"):
                    yield pytest.param(*mesh, v, times, schedule, marks=pytest.mark.slow)


@pytest.mark.parametrize("dp, tp, pp, v, times, schedule", list(_interleaved_grid()))
def test_interleaved_equals_single_device_jax_grad(dp, tp, pp, v, times, schedule):
    from jax_wgrad import DDPConfig

    out = _check_gradients(
        dp,
        tp,
        pp,
        sp=tp > 1,
        fusion=True,
        m=times * pp,
        schedule=schedule,
        arch=dict(num_layers=pp * v),
        virtual_pipeline_model_parallel_size=v,
        defer_embedding_wgrad_compute=True,
        world_size=dp * tp * pp,
        ddp=DDPConfig(overlap_grad_reduce=True),
    )
    assert_grads_close(*out)


def test_paired_interleaved_equals_single_device_jax_grad():
    """Megatron's interleaved order with a B and an F sharing ticks (V = 2 on (2, 2, 2) +
    SP, M = P), fused with deferral and the cooldown sync; the rest of the grid: -m slow."""
    test_interleaved_equals_single_device_jax_grad(2, 2, 2, 2, 1, "1f1b-paired")


# interleaved by default: test_interleaved_equals_single_device_jax_grad[2-2-2-2-3-zb-h1]
@pytest.mark.parametrize(
    "tied, recompute",
    [
        pytest.param(False, None, marks=pytest.mark.slow),
        pytest.param(True, "full", marks=pytest.mark.slow),
    ],
)
def test_interleaved_unfused_untied_and_recomputed(tied, recompute):
    # no fusion: every gradient through the sink's per-chunk (static-offset) adds
    assert_grads_close(
        *_check_gradients(
            2,
            2,
            2,
            sp=True,
            fusion=False,
            tied=tied,
            m=4,
            recompute=recompute,
            arch=dict(num_layers=8),
            virtual_pipeline_model_parallel_size=2,
        )
    )


@pytest.mark.slow
def test_interleaved_llama_options():
    assert_grads_close(
        *_check_gradients(
            1,
            2,
            4,
            sp=True,
            fusion=True,
            tied=False,
            m=4,
            schedule="zb-h1",
            arch=dict(LLAMA, num_layers=8),
            virtual_pipeline_model_parallel_size=2,
        )
    )


# --------------------------------------------------------------------------- vocabulary


def _vocab_grid():
    """Vocabulary over the pipeline on (1,1,4), (2,2,2)+SP, (1,2,4), tied and untied:
    plain, fused with deferral (stash / recompute), zero bubble, interleaved."""
    cases = [
        ((1, 1, 4), True, "plain"),
        ((1, 1, 4), False, "fused-defer"),
        ((2, 2, 2), True, "fused-defer"),
        ((2, 2, 2), False, "zb-h1"),
        ((1, 2, 4), False, "plain"),
        ((1, 2, 4), True, "interleaved-zb-h1"),
        ((1, 1, 4), True, "recompute-defer"),
        ((2, 2, 2), True, "interleaved"),
        ((1, 2, 4), True, "fused-defer"),
        ((2, 2, 2), False, "plain"),
    ]
    for mesh, tied, kind in cases:
        yield pytest.param(
            *mesh,
            tied,
            kind,
            # by default the case with the most features (the rest: -m slow, suite time)
            marks=() if kind == "interleaved-zb-h1" else pytest.mark.slow,
            id=f"{'-'.join(map(str, mesh))}-{'tied' if tied else 'untied'}-{kind}",
        )


@pytest.mark.parametrize("dp, tp, pp, tied, kind", list(_vocab_grid()))
def test_vocab_over_pipeline_equals_single_device_jax_grad(dp, tp, pp, tied, kind):
    from jax_wgrad import DDPConfig

    v = 2 if kind.startswith("interleaved") else 1
    kw = dict(
        fusion=kind != "plain",
        schedule="zb-h1" if kind.endswith("zb-h1") else "1f1b",
        defer_embedding_wgrad_compute=kind.endswith("defer"),
        defer_mode="recompute" if kind.startswith("recompute") else "stash",
        virtual_pipeline_model_parallel_size=v if v > 1 else None,
    )
    assert_grads_close(
        *_check_gradients(
            dp,
            tp,
            pp,
            sp=tp > 1,
            tied=tied,
            m=pp,
            arch=dict(num_layers=pp * v),
            world_size=dp * tp * pp,
            vocab_parallel_over_pipeline=True,
            ddp=DDPConfig(overlap_grad_reduce=True),
            **kw,
        )
    )


def test_vocab_over_pipeline_shards_and_checks():
    cfg = GPTConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=8,
        vocab_size=64,
        untie_embeddings_and_output_weights=True,
    )
    par = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=4,
        vocab_parallel_over_pipeline=True,
    )
    specs = lay_out(GPTProgram(cfg, par)).param_specs()
    assert specs["embedding"]["word"]["embedding"] == P(("pipeline", "tensor"), None)
    assert specs["head"]["output"]["weight"] == P(("pipeline", "tensor"), None)
    assert specs["embedding"]["position"] == P(None, None)  # replicated: summed over pipeline
    with pytest.raises(
        ValueError,
        match=r"vocab_size \(60\) must be divisible by "
        r"tensor_model_parallel_size x pipeline",
    ):
        validate(par, dataclasses.replace(cfg, vocab_size=60))
    with pytest.raises(ValueError, match="needs pipeline parallelism"):
        ParallelConfig(vocab_parallel_over_pipeline=True, world_size=1)


@pytest.mark.slow
def test_interleaved_with_a_microbatch_group_size_equals_jax_grad():
    # M = 3 is not a multiple of P = 2: allowed with Megatron's group size (G = 2)
    assert_grads_close(
        *_check_gradients(
            2,
            2,
            2,
            sp=True,
            fusion=True,
            m=3,
            arch=dict(num_layers=4),
            virtual_pipeline_model_parallel_size=2,
            microbatch_group_size_per_vp_stage=2,
        )
    )


# --------------------------------------------------------------------------- per-layer recompute


@pytest.mark.parametrize(
    "schedule, recompute",
    [
        ("1f1b", ("full", "uniform", 2)),
        pytest.param("zb-h1", ("full", "block", 1), marks=pytest.mark.slow),
        pytest.param("1f1b", ("full", "block", 2), marks=pytest.mark.slow),
    ],
)
def test_megatron_recompute_methods_equal_jax_grad(schedule, recompute):
    """Megatron's --recompute-method uniform / block with --recompute-num-layers, the
    checkpoints inside the layer scan: 3 layers per stage, so uniform 2 has a group of two
    and a single layer, block 1 one recomputed layer and two that save their activations."""
    assert_grads_close(
        *_check_gradients(
            2,
            2,
            2,
            sp=True,
            fusion=True,
            tied=False,
            schedule=schedule,
            recompute=recompute,
            arch=dict(LLAMA, num_layers=6),
        )
    )


def test_residual_slots_are_allocated_not_zero_filled_on_a_gpu():
    # a slot is read only by the B of the microbatch whose F wrote it, so the buffers are
    # lax.empty: XLA:GPU's AllocateBuffer (no kernel), zeros where the backend has no
    # uninitialised allocation (CPU: what every test here runs on)
    from jax_wgrad.parallel.pipeline.residuals import ResidualStore

    store = ResidualStore.create(
        lambda live, x: jnp.tanh(x @ live), jnp.ones((4, 4)), jnp.ones((2, 4))
    )
    assert store.shapes, "tanh's residuals are stored"
    lowered = lambda platform: jax.export.export(
        jax.jit(lambda: store.buffers(3)), platforms=[platform]
    )().mlir_module()
    assert lowered("cuda").count("custom_call @AllocateBuffer") == len(store.shapes)
    assert "AllocateBuffer" not in lowered("cpu")
    assert all(np.all(np.asarray(b) == 0) for b in store.buffers(3))
    assert [b.shape for b in store.buffers(3)] == [(3, *s.shape) for s in store.shapes]
