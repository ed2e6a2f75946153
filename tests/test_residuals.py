"""What the pipeline stores per in-flight microbatch: activations only, never a weight or
a gradient bucket, and less with more recomputation (checkpointed per layer inside the
layer scan, Megatron's recompute options)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_util import jaxpr_eqns

from jax_wgrad import (
    GPTConfig,
    GPTProgram,
    ParallelConfig,
    TrainPlan,
    build_train_step,
    default_optimizer,
    fusion_available,
    init_train_state,
    make_mesh,
    shard_batch,
)
from jax_wgrad.functional import scan_layers
from jax_wgrad.functional.stacked import LayerRecompute
from jax_wgrad.grads.config import DDPConfig
from jax_wgrad.layout import lay_out
from jax_wgrad.parallel.pipeline.executor import ScheduleRun
from jax_wgrad.parallel.pipeline.gradients import grad_layout, grad_sink, schedule_of

MODEL = GPTConfig(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=64,
    compute_dtype="bfloat16",
)
LAYERS = 4  # one stage: all layers


def _store(recompute, schedule="1f1b", method=None, num_layers=None, model=MODEL):
    par = ParallelConfig(
        micro_batch_size=2,
        global_batch_size=4,
        world_size=1,
        gradient_accumulation_fusion=True,
        recompute_granularity=recompute,
        recompute_method=method,
        recompute_num_layers=num_layers,
        pipeline_schedule=schedule,
    )
    program = lay_out(GPTProgram(model, par, platform="cpu"))
    layout, table = grad_layout(program, DDPConfig()), schedule_of(program)
    params = program.device_tree(program.init_params(0))
    run = ScheduleRun(
        program,
        grad_sink(program, layout, table),
        DDPConfig(),
        table,
        params,
        jnp.zeros((4, 17), jnp.int32),
    )
    weights = {tuple(x.shape) for x in jax.tree.leaves(params)}
    buckets = {(n,) for n in layout.buffer.bucket_numels}
    weights |= {w[1:] for w in weights}  # and a layer's slice of a stack
    return run, weights, buckets


def _bytes(shapes) -> int:
    return sum(s.size * s.dtype.itemsize for s in shapes)


def _per_layer_pass(run) -> list:
    """What a microbatch stores, each array of the layers' residual slots as one
    iteration of its scan stores it (without the leading ``[iterations]``)."""
    slots = [s for scan in run.slot_layouts or () for s in scan]
    return [*run.store.shapes, *(jax.ShapeDtypeStruct(s.shape[1:], s.dtype) for s in slots)]


FULL = [("uniform", 1), ("uniform", 2), ("uniform", 3), ("uniform", 4), ("block", 1), ("block", 4)]


@pytest.mark.skipif(not fusion_available("cpu"), reason="needs the CPU handler")
@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("zb-h1", marks=pytest.mark.slow)])
def test_residuals_are_activations_only(schedule):
    sizes = {}
    for recompute, method, n in [
        (None, None, None),
        ("selective", None, None),
        *[("full", m, k) for m, k in FULL],
    ]:
        run, weights, buckets = _store(recompute, schedule, method, n)
        stored = _per_layer_pass(run)  # the stage's residuals and its layers' slots
        # besides activations, only the scan's int32 layer indices (scalars, [layers])
        shapes = [tuple(s.shape) for s in stored if not (s.dtype == jnp.int32 and s.ndim <= 1)]
        assert shapes and not set(shapes) & (weights | buckets), shapes
        assert sum(i is not None for i in run.store.live_index) > 0  # the weights, read live
        # every stored residual is an activation of the microbatch: [(layers,) mb 2, ...]
        assert all(s[0] == 2 or (s[0] <= LAYERS and s[1] == 2) for s in shapes), shapes
        sizes[(recompute, method, n)] = _bytes(run.stored_per_microbatch)
        # (zb-h1 with grouped recompute also stores its zero probes regrouped: see
        # functional/stacked.py)
        if (
            recompute == "full"
            and (method, n) in [("uniform", 4), ("block", 4)]
            and schedule == "1f1b"
        ):
            # every layer recomputed: the input of the group (uniform 4) or of each layer
            act = (2, 16, 32)
            whole = [tuple(s.shape) for s in run.stored_per_microbatch if s.dtype != jnp.int32]
            assert whole == ([act] if method == "uniform" else [(LAYERS, *act)]), whole
            assert all(s.dtype == jnp.bfloat16 for s in stored if s.ndim > 1)
    if schedule != "1f1b":
        return
    none, sel = sizes[(None, None, None)], sizes[("selective", None, None)]
    uni = [sizes[("full", "uniform", k)] for k in (1, 2, 4)]
    assert uni[2] < uni[1] < uni[0] < sel < none, sizes
    # block 1 recomputes one layer of four: between full recompute and none
    assert uni[0] < sizes[("full", "block", 1)] < none, sizes
    assert sizes[("full", "block", 4)] == uni[0]  # each layer's input, both ways


@pytest.mark.skipif(not fusion_available("cpu"), reason="needs the CPU handler")
@pytest.mark.parametrize("recompute", [None, "selective"])
def test_fp8_weight_copies_are_read_live_not_stored(recompute):
    """With FP8 the step's quantized weight copies (GPTProgram.prepare: every FP8 weight
    and its transpose, stacked over the layers) are read live like the parameters: what a
    microbatch stores is activations only (before, every in-flight microbatch stored its
    own copy of the whole stack)."""
    fp8 = dataclasses.replace(MODEL, fp8_format="hybrid", params_dtype="bfloat16")
    run, weights, buckets = _store(recompute, model=fp8)
    stored = _per_layer_pass(run)
    shapes = [tuple(s.shape) for s in stored if not (s.dtype == jnp.int32 and s.ndim <= 1)]
    assert all(s[0] == 2 or (s[0] <= LAYERS and s[1] == 2) for s in shapes), shapes
    assert not any(s.dtype == jnp.float8_e4m3fn for s in stored), stored
    assert sum(i is not None for i in run.store.live_index) > 0


@pytest.mark.parametrize(
    "layers, method, unroll", [(1, "block", 1), (3, "block", 1), (3, "uniform", 3)]
)
def test_layers_recomputed_without_a_loop_keep_their_recomputation(layers, method, unroll):
    """``jax.checkpoint(prevent_cse=False)`` is only safe inside a loop (JAX's docs):
    layers checkpointed without a scan around them -- a run of ONE iteration (Megatron's
    block method over the first layer, the remainder of the uniform method) or a scan
    unrolled whole (``--layer-scan-unroll``) -- need the recomputation fenced by an
    optimization barrier, or XLA may merge it into the forward and keep the activations
    the user asked to recompute (an H100 compile of Llama-3-8B TP4 with every layer run as
    one iteration: without the barrier ~10% of the GEMM work, the recomputation, was gone
    and the peak memory 8 GiB higher)."""

    def layer(p, h):
        return jnp.tanh(h @ p["w"]), None

    params = {"w": jnp.ones((layers, 8, 8)) / 8}
    full = LayerRecompute("full", method, 1)

    def loss(p, x):
        return scan_layers(layer, x, p, recompute=full, unroll=unroll)[0].sum()

    text = jax.jit(jax.value_and_grad(loss)).lower(params, jnp.ones((4, 8))).as_text()
    assert "optimization_barrier" in text
    if method == "uniform":
        assert "while" not in text  # unrolled whole


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")
@pytest.mark.skipif(not fusion_available("cpu"), reason="needs the CPU handler")
@pytest.mark.parametrize("recompute, repeated", [(None, 0), ("selective", 0), ("full", 1)])
def test_the_backward_repeats_no_tensor_parallel_reduction_unless_recomputed_in_full(
    recompute, repeated
):
    """A row-parallel linear's reduce-scatter (TP 2, sequence parallel) is kept for the
    backward: recomputed (from the saved partial product, TP times larger) it was one more
    collective per layer and microbatch in every backward, which Megatron never runs --
    the attention's, whose output the MLP's norm reads (Llama-3-8B TP4 on 8 H100s: about
    4 ms exposed per microbatch). Full recomputation repeats the forward, collectives
    included, as in Megatron."""
    par = ParallelConfig(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        micro_batch_size=2,
        global_batch_size=8,
        gradient_accumulation_fusion=True,
        recompute_granularity=recompute,
        **(dict(recompute_method="uniform", recompute_num_layers=1) if recompute == "full" else {}),
    )
    mesh = make_mesh(par)
    plan = TrainPlan.create(MODEL, par, mesh, default_optimizer(1e-3))
    state = init_train_state(plan, 0)
    tokens = shard_batch(mesh, np.zeros((8, 17), np.int32))
    jaxpr = jax.make_jaxpr(build_train_step(plan, state))(state, tokens).jaxpr
    rematted = [
        str(e.source_info.name_stack)
        for e in jaxpr_eqns(jaxpr)
        if e.primitive.name == "reduce_scatter"
        and "rematted_computation" in str(e.source_info.name_stack)
    ]
    assert len(rematted) == repeated, rematted
