"""A user's own Flax NNX model through the pipeline: ``examples/custom_model.py``'s Llama.

The model is plain NNX (``model(tokens)`` is its single-device loss); its config
subclasses :class:`~jax_wgrad.models.LayerStackConfig`. Trained through 1F1B, interleaved
or ZB-H1 with fused wgrad into Megatron buckets, deferral, the cooldown sync and the
distributed optimizer, one SGD step equals ``params - lr * nnx.grad`` of the same module
on one device.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_wgrad import DDPConfig, ParallelConfig, TrainPlan, fusion_available
from jax_wgrad.functional import WgradRoutes, linear
from jax_wgrad.layout import StageModel, lay_out
from jax_wgrad.models import LayerStackProgram
from jax_wgrad.parallel.mesh import make_mesh
from jax_wgrad.parallel.pipeline.program import StageProgram
from jax_wgrad.training import build_train_step, init_train_state, shard_batch

ROOT = Path(__file__).resolve().parents[1]
needs_fusion = pytest.mark.skipif(not fusion_available("cpu"), reason="needs the CPU handler")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("custom_model", ROOT / "examples/custom_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["custom_model"] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


def _tokens(cfg, n: int) -> np.ndarray:
    return np.asarray(
        jax.random.randint(jax.random.key(3), (n, cfg.seq_length + 1), 0, cfg.vocab_size)
    )


def test_the_model_is_plain_nnx_and_its_program_a_stage_program(example):
    cfg = example.LlamaConfig()
    model = cfg.build(tp_size=1, sequence_parallel=False, rngs=nnx.Rngs(0))
    loss = model(jnp.asarray(_tokens(cfg, 2)))
    assert loss.shape == () and np.isfinite(float(loss))
    model = LayerStackProgram(cfg, ParallelConfig())
    assert isinstance(model, StageModel) and not hasattr(model, "device_tree")
    assert isinstance(lay_out(model), StageProgram)  # the library lays it out
    params = cfg.init_params(0)
    assert params["layers"]["mlp"]["fc1"]["weight"].shape == (cfg.num_layers, 2, 128, 64)


def test_a_model_without_context_parallelism_is_refused(example):
    """A model that does not take its context rank's tokens (SplitsContext) would train
    every token on every context rank, attending within its copy: the layout refuses."""
    model = LayerStackProgram(
        example.LlamaConfig(), ParallelConfig(world_size=8, context_parallel_size=2)
    )
    with pytest.raises(ValueError, match=r"does not support context_parallel_size \(2\)"):
        lay_out(model)


LAYOUTS = [
    # (dp, tp, pp), sequence parallel, schedule
    ((2, 2, 2), True, "1f1b"),
    pytest.param((1, 2, 4), False, "interleaved", marks=pytest.mark.slow),
    pytest.param((2, 2, 2), True, "zb-h1", marks=pytest.mark.slow),
    pytest.param((1, 2, 4), True, "1f1b", marks=pytest.mark.slow),
]


@needs_fusion
@pytest.mark.parametrize("layout, sp, schedule", LAYOUTS, ids=str)
def test_one_step_equals_single_device_nnx_grad(example, layout, sp, schedule):
    dp, tp, pp = layout
    # Interleaved over 4 stages: 2 model chunks of 1 layer each per stage.
    cfg = example.LlamaConfig(num_layers=8 if schedule == "interleaved" else 4)
    par = ParallelConfig(
        world_size=dp * tp * pp,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sp,
        micro_batch_size=1,
        global_batch_size=4 * dp,
        gradient_accumulation_fusion=True,
        defer_embedding_wgrad_compute=schedule != "zb-h1",
        pipeline_schedule="zb-h1" if schedule == "zb-h1" else "1f1b",
        virtual_pipeline_model_parallel_size=2 if schedule == "interleaved" else None,
    )
    mesh = make_mesh(par)
    lr = 0.5
    plan = TrainPlan.create(
        cfg,
        par,
        mesh,
        optax.sgd(lr),
        ddp=DDPConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, clip_grad=0.0),
    )
    state = init_train_state(plan, seed=0)
    tokens = _tokens(cfg, par.global_batch_size)
    state, metrics = build_train_step(plan, state)(state, shard_batch(mesh, tokens))

    model = cfg.build(tp_size=1, sequence_parallel=False, rngs=nnx.Rngs(0))  # init_params' seed
    n = tokens.shape[0] * cfg.seq_length
    loss, grads = nnx.value_and_grad(lambda m: m(jnp.asarray(tokens)) / n)(model)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
    want = jax.tree.map(
        lambda p, g: p - lr * g, cfg.canonical_params(model), cfg.canonical_params(grads)
    )
    got = plan.program.to_canonical(state.params)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path)
        )


@needs_fusion
def test_weights_cast_to_bf16_keep_their_fused_gradients(example):
    """``--cast-weights bf16``: each block casts its weights to bf16 before its GEMMs,
    mapping the cast over its variables, and the fused weights keep their routes (the step
    refuses to lose one: ``WgradRoutes.close``). The pipeline's gradients on (2, 2, 2)
    with sequence parallelism equal ``nnx.grad`` of the same model: to fp32 rounding for
    every parameter but the fused weights, whose fp32 buckets hold ``dy^T x`` unrounded
    where ``nnx.grad`` rounds a bf16 weight's gradient to bf16 -- within half a bf16 ulp of
    it (2**-8 relative)."""
    from jax_wgrad.parallel.pipeline.gradients import pipeline_gradients

    cfg = example.LlamaConfig(num_layers=4, cast_weights="bfloat16")
    par = ParallelConfig(
        world_size=8,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        sequence_parallel=True,
        micro_batch_size=1,
        global_batch_size=8,
        gradient_accumulation_fusion=True,
        defer_embedding_wgrad_compute=True,
    )
    mesh = make_mesh(par)
    program = lay_out(cfg.program(par))
    tokens = _tokens(cfg, par.global_batch_size)
    params = jax.tree.map(
        lambda a, s: jax.device_put(a, jax.sharding.NamedSharding(mesh, s)),
        program.init_params(0),
        program.param_specs(),
    )
    grads, _ = jax.jit(lambda p, t: pipeline_gradients(program, mesh, p, t))(
        params, shard_batch(mesh, tokens)
    )
    got = program.to_canonical(grads)

    model = cfg.build(tp_size=1, sequence_parallel=False, rngs=nnx.Rngs(0))
    n = tokens.shape[0] * cfg.seq_length
    want = cfg.canonical_params(nnx.grad(lambda m: m(jnp.asarray(tokens)) / n)(model))
    fused = {"['layers']['attn']['qkv']['weight']", "['layers']['attn']['proj']['weight']"}
    fused |= {"['layers']['mlp']['fc1']['weight']", "['layers']['mlp']['fc2']['weight']"}
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        name = jax.tree_util.keystr(path)
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if name in fused:
            assert np.all(np.abs(g - w) <= 2**-8 * np.abs(w) + 1e-7), name
            assert not np.array_equal(g, w), name  # the buckets' are not bf16-rounded
        else:
            np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-6, err_msg=name)


@needs_fusion
@pytest.mark.slow  # its layout's step is compiled and checked by the (2, 2, 2) case above
def test_the_example_runs_and_learns(example):
    losses = example.main(["--steps", "6"])
    assert losses[-1] < losses[0]


def test_a_weight_that_misses_its_linear_fails_loudly():
    # A routed weight whose variable no library linear receives: the gradient would be
    # lost, so the call fails naming it (here: the layer casts the weight's VALUE and
    # hands that array to the linear).
    w, x = jnp.ones((3, 4)), jnp.ones((2, 4))
    routes = WgradRoutes((jnp.zeros(12),))
    w = routes.to_bucket(w, 0, 0, name="['layer']['weight']")
    linear(x, w[...].astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"\['layer'\]\['weight'\].*would be lost"):
        routes.close()


def test_a_cast_of_the_variable_keeps_its_route():
    # Mixed precision done to the variable (a pytree whose metadata rides along) keeps the
    # destination: the bucket gets dy^T x of the bf16 weight's GEMM.
    w, x = jnp.arange(12.0).reshape(3, 4), jnp.ones((2, 4))

    def f(bucket):
        routes = WgradRoutes((bucket,))
        v = routes.to_bucket(w, 0, 0, name="w")
        y = linear(x, jax.tree.map(lambda a: a.astype(jnp.bfloat16), v))
        return jnp.sum(y), routes.close()[0]

    (_, _), vjp = jax.vjp(f, jnp.zeros(12))
    (bucket,) = vjp((jnp.float32(1.0), jnp.zeros(12)))
    np.testing.assert_array_equal(bucket, np.full(12, 2.0))  # dy^T x: ones [2, 3]^T ones
