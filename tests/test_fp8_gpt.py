"""FP8 training of the GPT (``fp8_format``): the pipelined, sharded step's gradients equal
``jax.grad`` of the single-device reference written plainly in quantize-dequantize form
(:func:`jax_wgrad.testing.reference_loss` with FP8: the same quantized values, float32
accumulation only), on (2, 2, 2) with sequence parallelism, fused into the buckets and
not, with the output layer's weight gradient deferred, under 1F1B and zero bubble (ZB-H1);
the options' refusals."""

import dataclasses
import re
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from grad_util import LLAMA, assert_grads_close, pipeline_and_reference

from jax_wgrad import (
    GPTConfig,
    ParallelConfig,
    fusion_available,
    init_params,
)
from jax_wgrad.models.gpt import validate
from jax_wgrad.testing import reference_loss

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")


def _grads(cfg, par):
    validate(par, cfg)
    out = pipeline_and_reference(cfg, par, micro_batch_size=par.micro_batch_size)
    if cfg.num_moe_experts is None:
        return out
    # the step reports the language-model loss only
    params = init_params(cfg, seed=0)
    tokens = jax.random.randint(jax.random.key(1), (par.global_batch_size, 9), 0, 64)
    no_aux = dataclasses.replace(cfg, moe_aux_loss_coeff=0.0)
    ref_loss = reference_loss(params, tokens, no_aux, micro_batch_size=par.micro_batch_size)
    return out[0], ref_loss, out[2], out[3]


def _config(fmt="hybrid", **kw):
    base = dict(num_layers=4, hidden_size=32, seq_length=8, vocab_size=64, fp8_format=fmt)
    return GPTConfig(**{**base, **LLAMA, **kw})


def _parallel(fusion=True, **kw):
    base = dict(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        micro_batch_size=2,
        global_batch_size=8,
        sequence_parallel=True,
        gradient_accumulation_fusion=fusion,
        world_size=8,
    )
    return ParallelConfig(**{**base, **kw})


@pytest.mark.skipif(not fusion_available("cpu"), reason="needs the CPU handler")
@pytest.mark.parametrize(
    "fmt, fusion, extra",
    [
        pytest.param("hybrid", True, {}, id="hybrid-fused", marks=pytest.mark.slow),
        pytest.param(
            "hybrid",
            True,
            dict(defer_embedding_wgrad_compute=True),
            id="hybrid-fused-deferred",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "hybrid",
            True,
            dict(pipeline_schedule="zb-h1", defer_embedding_wgrad_compute=True),
            id="hybrid-zb-h1-deferred",
        ),
        pytest.param("e4m3", False, {}, id="e4m3-unfused", marks=pytest.mark.slow),
        pytest.param(
            "hybrid",
            True,
            dict(
                virtual_pipeline_model_parallel_size=2,
                pipeline_schedule="1f1b-paired",
                recompute_granularity="full",
                recompute_method="uniform",
                recompute_num_layers=1,
            ),
            id="hybrid-interleaved-paired-recompute",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "hybrid",
            True,
            dict(expert_model_parallel_size=2),
            id="hybrid-moe-ep2",
            marks=pytest.mark.slow,
        ),
        # context parallelism: the activations' amax over the context ranks too
        pytest.param(
            "hybrid",
            True,
            dict(context_parallel_size=2),
            id="hybrid-cp2",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_fp8_gradients_equal_the_quantize_dequantize_reference(fmt, fusion, extra):
    """``hybrid-moe-ep2``: MoE layers (4 experts, top-2, a shared expert; EP2 with TP2 SP
    and PP2): attention and the shared expert in FP8, the routed experts in bf16."""
    moe = (
        dict(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_ffn_hidden_size=32,
            moe_grouped_gemm=True,
            moe_shared_expert_intermediate_size=32,
            moe_aux_loss_coeff=1e-2,
        )
        if extra.get("expert_model_parallel_size", 1) > 1
        else {}
    )
    # ZB-H1 (the default case) with one layer per stage: suite time
    layers = 2 if extra.get("pipeline_schedule") == "zb-h1" else 4
    assert_grads_close(*_grads(_config(fmt, num_layers=layers, **moe), _parallel(fusion, **extra)))


@pytest.mark.skipif(not fusion_available("cpu"), reason="needs the CPU handler")
@pytest.mark.parametrize(
    "layers, first, last, extra",
    [
        pytest.param(2, 1, 0, {}, id="2-layers-first-1"),
        pytest.param(4, 1, 1, {}, id="4-layers-first-1-last-1", marks=pytest.mark.slow),
        pytest.param(
            4,
            2,
            0,
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
            id="first-2-full-recompute-2",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_first_last_layers_bf16_equal_the_reference(layers, first, last, extra):
    """``first_last_layers_bf16`` (TP2 SP DP4, no pipeline): the first and last layers'
    linears in bf16, the others in FP8 (one scan cut where the precision changes), against
    the reference keeping the same layers out of FP8 by Megatron's rule."""
    cfg = _config(num_layers=layers, first_last_layers_bf16=True, num_layers_at_start_in_bf16=first)
    cfg = dataclasses.replace(cfg, num_layers_at_end_in_bf16=last)
    par = _parallel(pipeline_model_parallel_size=1, **extra)
    assert_grads_close(*_grads(cfg, par))


def test_first_last_layers_bf16_with_a_pipeline_is_refused_by_the_program_too():
    """Built directly (not through ``validate``), the GPT program refuses it as well: a
    stage's first layers are not the model's with pipeline parallelism."""
    from jax_wgrad import GPTProgram

    cfg = _config(first_last_layers_bf16=True)
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size \(2\) > 1 is not built"):
        GPTProgram(cfg, _parallel(), platform="cpu")


def test_first_last_layers_bf16_reference_keeps_those_layers_out_of_fp8():
    """The reference the test above compares against: layer 0's weight gradients with the
    first layer in bf16 differ from all-FP8 by far more than the tolerance; with it, layer
    0's forward is the float32 model's."""
    tokens = jax.random.randint(jax.random.key(1), (8, 9), 0, 64)
    cfgs = (
        _config("hybrid", num_layers=2, first_last_layers_bf16=True, num_layers_at_end_in_bf16=0),
        _config("hybrid", num_layers=2),
    )
    grads = [
        jax.grad(reference_loss)(init_params(cfg, 0), tokens, cfg, micro_batch_size=2)
        for cfg in cfgs
    ]
    mixed, fp8 = (np.asarray(g["layers"]["qkv"]["weight"][0]) for g in grads)
    assert np.abs(mixed - fp8).max() > 1e-3 * np.abs(fp8).max()


def _amaxes(jaxpr, in_loop=False):
    """``(operand shape, inside a loop)`` of every ``reduce_max`` of ``jaxpr`` and of the
    jaxprs nested in it (a ``while`` or ``scan`` body counts as a loop)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "reduce_max":
            yield tuple(eqn.invars[0].aval.shape), in_loop
        loop = in_loop or eqn.primitive.name in ("while", "scan")
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _amaxes(inner, loop)


def test_fp8_weights_are_quantized_once_per_step_before_the_schedule_loop():
    """The step quantizes every FP8 weight once (their amaxes, vmapped over the stage's
    stacked layers, outside the schedule loop); inside the loop no amax is taken of a
    weight-shaped tensor: every microbatch's forward and backward read the step's FP8
    copies (GPTProgram.prepare)."""
    from jax.sharding import NamedSharding

    from jax_wgrad import GPTProgram, make_mesh, pipeline_gradients
    from jax_wgrad.layout import lay_out

    cfg, par = _config(num_layers=4), _parallel()
    mesh = make_mesh(par, jax.devices()[: par.world_size])
    stages = lay_out(GPTProgram(cfg, par))
    params = jax.eval_shape(lambda: stages.from_canonical(init_params(cfg, seed=0)))
    shard = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))
    params = jax.tree.map(shard, params, stages.param_specs())
    tokens = jax.ShapeDtypeStruct((par.global_batch_size, 9), jax.numpy.int32)
    jaxpr = jax.make_jaxpr(lambda p, t: pipeline_gradients(stages, mesh, p, t))(params, tokens)
    amaxes = list(_amaxes(jaxpr.jaxpr))
    layers = cfg.num_layers // par.pipeline_model_parallel_size
    weights = {shape[1:] for shape, loop in amaxes if not loop and shape[:1] == (layers,)}
    assert len(weights) == 4, amaxes  # qkv, proj, fc1 (gated), fc2 on this stage
    in_loop = {shape for shape, loop in amaxes if loop}
    assert in_loop and not in_loop & weights, (in_loop, weights)


def test_the_fp8_reference_is_not_the_float32_model():
    """What the equalities above compare against is FP8: its gradients differ from the
    float32 model's by far more than the tolerance."""
    tokens = jax.random.randint(jax.random.key(1), (8, 9), 0, 64)
    grads = [
        jax.grad(reference_loss)(init_params(cfg, 0), tokens, cfg, micro_batch_size=2)
        for cfg in (_config("hybrid", num_layers=1), _config(None, num_layers=1))
    ]
    w, w32 = (np.asarray(g["layers"]["qkv"]["weight"]) for g in grads)
    assert np.abs(w - w32).max() > 1e-3 * np.abs(w32).max()


def test_fp8_refusals():
    with pytest.raises(ValueError, match=r"FP8 options \['fp8_margin'\] need fp8_format"):
        GPTConfig(fp8_margin=1)
    with pytest.raises(ValueError, match="fp8_format must be one of e4m3, hybrid"):
        GPTConfig(fp8_format="e5m2")
    with pytest.raises(ValueError, match="fp8_recipe 'delayed'"):
        GPTConfig(fp8_format="hybrid", fp8_recipe="delayed")
    with pytest.raises(
        ValueError, match=r"num_layers_at_end_in_bf16 \(2\) needs first_last_layers_bf16"
    ):
        GPTConfig(fp8_format="hybrid", num_layers_at_end_in_bf16=2)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fp8-format", "hybrid"], r"--fp8-format hybrid needs --bf16"),
        (["--bf16", "--fp8-margin", "1"], r"--fp8-margin 1 needs --fp8-format"),
        (
            ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
            r"--fp8-recipe 'delayed' .* is not built yet",
        ),
        (
            ["--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024"],
            r"--fp8-amax-history-len \(1024\) and --fp8-amax-compute-algo .* are delayed "
            r"scaling's",
        ),
        (["--bf16", "--fp8-format", "e5m2"], r"--fp8-format: invalid choice: 'e5m2'"),
        (
            ["--bf16", "--fp8-format", "hybrid", "--first-last-layers-bf16"]
            + ["--pipeline-model-parallel-size", "2"],
            r"--first-last-layers-bf16 with --pipeline-model-parallel-size \(2\) > 1 is not "
            r"built",
        ),
        (
            ["--bf16", "--fp8-format", "hybrid", "--first-last-layers-bf16"]
            + ["--num-layers-at-end-in-bf16", "9"],
            r"--num-layers-at-end-in-bf16 \(9\) must be between 0 and number of layers per "
            r"pipeline stage \(\d+\)",
        ),
    ],
)
def test_fp8_flags_refused_in_one_line(pretrain, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        pretrain.main(argv + ["--train-iters", "1"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    assert re.search(message, err), err


def test_a_non_finite_fp8_step_stops_the_loop():
    """A skipped (non-finite) step of an FP8 run raises before it is logged; without FP8
    it is counted (the optimizer skipped it)."""
    from jax_wgrad.training.loop import Fp8NonFiniteError, _one_step

    def step(fp8):
        written = []
        metrics = {"loss": float("nan"), "grad_norm": float("nan"), "skipped": True}
        summary = {"losses": [], "times": [], "skipped_steps": 0, "start_step": 0}
        _one_step(
            lambda state, tokens: (state, metrics),
            "state",
            lambda i: np.zeros((2, 9), np.int32),
            2,
            (0, 0),
            SimpleNamespace(profile_dir=None, log_interval=1, train_iters=5),
            summary,
            SimpleNamespace(write=written.append),
            SimpleNamespace(set_postfix=lambda **kw: None),
            lambda msg: None,
            fp8,
        )
        return written, summary

    with pytest.raises(Fp8NonFiniteError, match=r"iteration 3: the gradients are not finite"):
        step("hybrid")
    _, summary = step(None)
    assert summary["skipped_steps"] == 1


@pytest.mark.slow  # a 20 s example run; the loop's refusal runs by default (above)
def test_example_stops_when_fp8_meets_a_nan(pretrain, capsys):
    with pytest.raises(SystemExit) as exc:
        pretrain.main(["--bf16", "--fp8-format", "hybrid", "--lr", "1e30", "--train-iters", "6"])
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "Traceback" not in err, err
    assert "the gradients are not finite" in err and "--fp8-format hybrid" in err, err


def test_fp8_on_a_gpu_refuses_sizes_its_gemms_cannot_take():
    """cuBLASLt's FP8 GEMMs take multiples of 16: a layout whose tokens or widths on a
    tensor rank are not is refused when the program is built for a GPU (also when only
    compiling for one), and built for the CPU."""
    from jax_wgrad import GPTProgram, ParallelConfig

    cfg = _config(hidden_size=40, num_attention_heads=4, num_query_groups=2)
    par = ParallelConfig(world_size=1, micro_batch_size=1)
    with pytest.raises(
        ValueError,
        match=r"multiples of 16 .*not: micro_batch_size x seq_length \(tokens of a GEMM\) = 8; "
        r"hidden_size = 40; num_attention_heads x kv_channels / tensor_model_parallel_size "
        r"= 40$",  # the qkv width, 2 x (2 + 2) x 10 = 80, is one
    ):
        GPTProgram(cfg, par, platform="gpu")
    GPTProgram(cfg, par, platform="cpu")
