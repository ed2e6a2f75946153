"""bf16 parameters (Megatron's ``--bf16``: ``GPTConfig.params_dtype``) and the optimizer's
memory per parameter.

With bf16 parameters the train state holds the bf16 parameters, fp32 gradient buckets and,
in the optimizer, fp32 main parameters (only this rank's shard of them with the
distributed optimizer: Megatron's ``2 + 4 + 12/DP`` bytes per parameter); with fp32
parameters the optimizer keeps no second fp32 copy (``4 + 4 + 8/DP``). Checked at
Llama-3-8B's size on abstract shapes, on a small model's gradients against a plain
single-device bf16 model, on the lowered step's parameter all-gathers, and through
checkpoints. (That fp32 runs are bitwise unchanged by this option was checked by running
existing layouts' loss curves, parameters and checkpointed state before and after it.)
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad import (
    ByteDataset,
    DDPConfig,
    GPTConfig,
    GPTProgram,
    ParallelConfig,
    TrainPlan,
    build_train_step,
    default_optimizer,
    fusion_available,
    init_params,
    init_train_state,
    make_mesh,
    pipeline_gradients,
    shard_batch,
)
from jax_wgrad.grads import GradBuffer
from jax_wgrad.layout import lay_out
from jax_wgrad.models.gpt.config import RUN_OPTIONS
from jax_wgrad.models.gpt.presets import preset
from jax_wgrad.optim import DistributedOptimizer, adamw, bytes_per_parameter
from jax_wgrad.pretrain import cli
from jax_wgrad.testing.reference import reference_logits, reference_loss
from jax_wgrad.training import Checkpointer, init_optimizer_state
from jax_wgrad.training.checkpoint import canonical_state

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
GiB = 2**30
SMALL = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16)
DATA = ByteDataset(np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 200, np.uint8))
LLAMA = dict(
    normalization="RMSNorm",
    position_embedding_type="rope",
    swiglu=True,
    group_query_attention=True,
    num_attention_heads=8,
    num_query_groups=2,
    add_bias_linear=False,
    rotary_base=500000.0,
    untie_embeddings_and_output_weights=True,
)
FUSION = fusion_available("cpu")


def _bf16(**kw) -> GPTConfig:
    return GPTConfig(**{**SMALL, "compute_dtype": "bfloat16", "params_dtype": "bfloat16", **kw})


def _plan(model, *, tp=2, pp=2, dist=True, sp=None, mb=2, gb=16, **par_kw):
    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        micro_batch_size=mb,
        global_batch_size=gb,
        sequence_parallel=tp > 1 if sp is None else sp,
        gradient_accumulation_fusion=FUSION,
        **par_kw,
    )
    return TrainPlan.create(
        model,
        par,
        make_mesh(par),
        default_optimizer(1e-2),
        ddp=DDPConfig(use_distributed_optimizer=dist, overlap_grad_reduce=dist),
    )


def _batch(plan, i):
    return shard_batch(
        plan.mesh, DATA.batch(i, plan.parallel.global_batch_size, plan.model.seq_length, seed=7)
    )


def _per_device_bytes(tree, leading_device_axis=False) -> int:
    if leading_device_axis:  # the optimizer state: [devices, ...] per leaf
        return sum(math.prod(a.shape[1:]) * a.dtype.itemsize for a in jax.tree.leaves(tree))
    return sum(
        math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree)
    )


# --------------------------------------------------------------------------- config


def test_params_dtype_is_checked_and_is_a_run_option():
    with pytest.raises(
        ValueError, match="params_dtype must be 'float32' or 'bfloat16', got 'float16'"
    ):
        GPTConfig(params_dtype="float16")
    with pytest.raises(
        ValueError,
        match="params_dtype 'bfloat16' needs compute_dtype 'bfloat16'.*got compute_dtype 'float32'",
    ):
        GPTConfig(params_dtype="bfloat16")
    # Not a shape: a bf16 run resumes an fp32 checkpoint and the other way round.
    assert "params_dtype" in RUN_OPTIONS and "params_dtype" not in GPTConfig.SHAPE_FIELDS


def test_bf16_init_is_the_fp32_init_rounded():
    cfg = _bf16(**LLAMA)
    p16 = init_params(cfg, seed=3)
    p32 = init_params(GPTConfig(**{**SMALL, **LLAMA}), seed=3)
    assert {a.dtype for a in jax.tree.leaves(p16)} == {BF16}
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b.astype(BF16)), p16, p32)


def test_example_bf16_flag_is_megatrons():
    """``--bf16`` sets bf16 parameters and compute (Megatron's ``params_dtype``)."""
    parser = cli.make_parser()
    for flags, dtype in ((["--bf16"], "bfloat16"), (["--fp32"], "float32"), ([], "float32")):
        model, _, _ = cli.build_configs(parser.parse_args(flags), 256, parser)
        assert (model.params_dtype, model.compute_dtype) == (dtype, dtype), flags


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("params_dtype", ["bfloat16", "float32"])
def test_llama3_8b_state_per_device_at_tp2_pp2_dp2(params_dtype):
    """Llama-3-8B on (dp 2, tp 2, pp 2) with the distributed optimizer, abstract shapes:
    bf16 parameters + fp32 main-parameter and Adam shards (2 + 4 + 12/2 bytes per
    parameter), or fp32 parameters and Adam shards only -- never an fp32 copy of fp32
    parameters (it was 4.23 GiB per device)."""
    model = preset(
        "llama3-8b", seq_length=4096, compute_dtype="bfloat16", params_dtype=params_dtype
    )
    plan = _plan(model, mb=1, gb=16)
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        jax.eval_shape(plan.program.init_params),
        plan.param_shardings,
    )
    opt = jax.eval_shape(lambda p: init_optimizer_state(plan, p), params)
    n = plan.layout.buffer.param_numel  # parameters per device: 2.27e9
    assert n == 2_270_302_208
    width = jnp.dtype(params_dtype).itemsize
    assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype(params_dtype)}
    assert _per_device_bytes(params) == width * n
    master = jax.tree.leaves(opt.master)
    shards = plan.layout.buffer.shard_numels
    if params_dtype == "bfloat16":  # one fp32 shard per bucket: 4 / DP bytes per parameter
        assert [(a.dtype, a.shape[1:]) for a in master] == [(F32, (k,)) for k in shards]
    else:
        assert master == []
    adam = 2 * 4 * sum(shards)  # two fp32 moments of this rank's shards
    assert _per_device_bytes(opt.inner, True) == adam + 4  # + Adam's int32 count
    bpp = plan.bytes_per_parameter()
    assert bpp == bytes_per_parameter(plan.optimizer) and bpp.num_params == n
    assert bpp.params == width and bpp.grads == 4.0 and bpp.moments == pytest.approx(4.0)
    assert bpp.master * n == _per_device_bytes(opt.master, True)
    assert bpp.megatron == 12.0 and bpp.total == pytest.approx(12.0)
    assert bpp.formula == ("2 + 4 + 12/2" if params_dtype == "bfloat16" else "4 + 4 + 8/2")
    assert (params_dtype == "bfloat16") == (bpp.master == pytest.approx(2.0))
    state = (_per_device_bytes(params) + _per_device_bytes(opt, True)) / GiB
    assert state == pytest.approx(
        4.23 + 12.69 if params_dtype == "bfloat16" else 8.46 + 8.46, abs=0.01
    )


@pytest.mark.parametrize(
    "params_dtype, dist, figures",
    [
        ("bfloat16", False, (2, 4, 4, 8, 18.0, "2 + 4 + 12")),
        ("float32", False, (4, 4, 0, 8, 16.0, "4 + 4 + 8")),
        ("bfloat16", True, (2, 4, 2, 4, 12.0, "2 + 4 + 12/2")),
    ],
)
def test_bytes_per_parameter_match_megatrons_table(params_dtype, dist, figures):
    """Megatron's table (replicated: 18 bf16, 16 fp32), on a small model: the replicated
    buckets are not padded; the distributed ones are (to 128 x DP), so the measured
    figures sit a little above Megatron's there."""
    model = GPTConfig(**SMALL, compute_dtype="bfloat16", params_dtype=params_dtype)
    bpp = _plan(model, dist=dist).bytes_per_parameter()
    params, grads, master, moments, megatron, formula = figures
    assert (bpp.megatron, bpp.formula, bpp.params) == (megatron, formula, params)
    padding = 1.0 if not dist else 1.0 + 0.03
    assert grads <= bpp.grads <= grads * padding
    assert master <= bpp.master <= master * padding
    assert moments <= bpp.moments <= moments * padding + 1e-3  # + Adam's count
    assert f"{formula} = {megatron:.2f}" in bpp.summary()


@pytest.mark.parametrize("dist", [True, False])
def test_optimizer_keeps_fp32_copies_of_bf16_parameters_only(dist):
    """Mixed trees (two dtype groups): only the bf16 leaves / bucket get an fp32 copy;
    parameters of another dtype than the buckets were planned for are refused."""
    params = {"b": jnp.ones((8,), F32), "w": jnp.ones((8, 16), BF16)}
    buf = GradBuffer.create(params, dp_size=8, bucket_size=None, use_distributed_optimizer=dist)
    opt = DistributedOptimizer.create(buf, adamw(1e-3))
    mesh = make_mesh(ParallelConfig())
    init = lambda p: opt.init(p).master
    master = jax.eval_shape(
        jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False), params
    )
    if dist:  # buckets: fp32 group, then bf16 group
        assert buf.bucket_param_dtypes == (F32, BF16)
        assert master[0] is None and (master[1].dtype, master[1].shape) == (
            F32,
            (buf.shard_numels[1],),
        )
    else:
        assert master["b"] is None and (master["w"].dtype, master["w"].shape) == (F32, (8, 16))
    wrong = {"b": params["b"], "w": params["w"].astype(F32)}
    with pytest.raises(
        ValueError,
        match=r"parameter \['w'\] is float32, but the buckets "
        "were planned for bfloat16",
    ):
        jax.eval_shape(
            jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False), wrong
        )


# --------------------------------------------------------------------------- numerics


def _reference_ce(params, tokens, cfg):
    """Mean token cross entropy of the plain single-device model (no pipeline, no
    buckets) in ``cfg.compute_dtype`` on ``params`` as given."""
    logits = reference_logits(params, tokens[:, :-1], cfg)
    lp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(lp, tokens[:, 1:, None], -1))


def _max_rel_errors(got, want) -> dict[str, float]:
    """Per leaf: max |got - want| over max |want| (fp32)."""
    out = {}
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        out[jax.tree_util.keystr(path)] = float(np.abs(g - w).max() / np.abs(w).max())
    return out


@pytest.mark.parametrize(
    "arch", [pytest.param({}, marks=pytest.mark.slow), LLAMA], ids=["gpt", "llama"]
)
def test_bf16_params_gradients_as_close_as_a_single_device_bf16_model(arch):
    """(dp 2, tp 2, pp 2), sequence parallel, fused, bf16 parameters: every leaf's
    gradient is as close to the exact (fp32) gradient of the same parameter values as a
    plain single-device model with bf16 parameters and compute is (its worst leaf:
    1.7e-2 / 2.3e-2 of the leaf's largest gradient here -- bf16's 2^-8 rounding through
    a few layers), and the two bf16 computations agree to within their two distances
    from it. The loss is within bf16's unit roundoff 2^-8 of the exact one."""
    cfg = GPTConfig(
        **{
            **SMALL,
            "seq_length": 8,
            "vocab_size": 64,
            **arch,
            "compute_dtype": "bfloat16",
            "params_dtype": "bfloat16",
        }
    )
    par = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        micro_batch_size=2,
        global_batch_size=8,
        sequence_parallel=True,
        gradient_accumulation_fusion=FUSION,
    )
    mesh = make_mesh(par)
    program = lay_out(GPTProgram(cfg, par))
    params = init_params(cfg, seed=0)
    tokens = jax.random.randint(jax.random.key(1), (8, 9), 0, 64)
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), program.param_specs(), is_leaf=lambda x: isinstance(x, P)
    )
    grads, loss = jax.jit(lambda p, t: pipeline_gradients(program, mesh, p, t))(
        jax.device_put(params, shardings), jax.device_put(tokens, NamedSharding(mesh, P("data")))
    )
    exact_cfg = GPTConfig(**{**SMALL, "seq_length": 8, "vocab_size": 64, **arch})
    as_f32 = jax.tree.map(lambda a: a.astype(F32), params)  # the same values, in fp32
    exact_loss, exact = jax.value_and_grad(reference_loss)(as_f32, tokens, exact_cfg)
    _, plain = jax.value_and_grad(_reference_ce)(params, tokens, cfg)  # bf16 grads
    assert {g.dtype for g in jax.tree.leaves(plain)} == {BF16}
    ours, theirs = _max_rel_errors(grads, exact), _max_rel_errors(plain, exact)
    yardstick = max(theirs.values())
    assert 2**-8 < yardstick < 2**-5, theirs  # bf16 noise: a few roundings of 2^-8
    assert max(ours.values()) <= yardstick, (ours, yardstick)
    between = _max_rel_errors(grads, plain)
    assert all(between[k] <= ours[k] + theirs[k] + 1e-6 for k in between), between
    np.testing.assert_allclose(float(loss), float(exact_loss), rtol=2**-8)


@pytest.fixture(scope="module")
def bf16_run():
    """A bf16-parameter run on (dp 2, tp 2, pp 2), sequence parallel, fused, distributed
    optimizer: ``(plan, jitted step, lowered StableHLO text, state after 2 steps, their
    losses)``."""
    plan = _plan(_bf16(num_layers=2))
    state = init_train_state(plan, seed=7)
    step = build_train_step(plan, state)
    text = step.lower(state, _batch(plan, 0)).as_text()
    state, losses = _steps(plan, state, step, 0, 2)
    return plan, step, text, state, losses


def _steps(plan, state, step, start, count):
    losses = []
    for i in range(start, start + count):
        state, m = step(state, _batch(plan, i))
        losses.append(float(m["loss"]))
    return state, losses


def test_bf16_param_all_gather_is_in_bf16(bf16_run):
    """The distributed optimizer all-gathers the updated parameters in bf16: one
    all-gather per bucket, none in fp32 (half the bytes of fp32 parameters)."""
    plan, _, text, _, _ = bf16_run
    # As jax wrote it (XLA:CPU widens 16-bit collectives when compiling; XLA:GPU does not).
    gathers = re.findall(r'"stablehlo.all_gather".*?\) -> tensor<(\d+)x(\w+)>', text)
    numels = plan.layout.buffer.bucket_numels
    assert sorted((int(k), t) for k, t in gathers if int(k) in set(numels)) == sorted(
        (k, "bf16") for k in numels
    )


def test_bf16_train_state(bf16_run):
    """bf16 parameters, the rounding of the fp32 main parameters; one fp32 main-parameter
    shard per bucket in the optimizer state."""
    plan, _, _, state, losses = bf16_run
    assert losses[1] < losses[0]
    assert {a.dtype for a in jax.tree.leaves(state.params)} == {BF16}
    assert [(a.dtype, a.shape[1]) for a in state.opt_state.master] == [
        (F32, k) for k in plan.layout.buffer.shard_numels
    ]
    canon = canonical_state(plan, state)  # the fp32 main parameters, gathered
    assert {a.dtype for a in jax.tree.leaves(canon["opt"].master)} == {F32}
    jax.tree.map(
        lambda p, m: np.testing.assert_array_equal(p, m.astype(BF16)),
        canon["params"],
        canon["opt"].master,
    )


def test_bf16_params_step_has_no_16bit_scatter(bf16_run):
    """The word embedding's gradient of bf16 parameters is scatter-added in fp32
    (``nn.tensor_parallel.take_rows``): a 16-bit scatter-add rounds every partial sum and
    is ~190x slower on an H100 for text-like ids."""
    types = re.findall(
        r'"stablehlo.scatter".*?\}\) : \([^)]*\) -> tensor<[^>]*x(\w+)>', bf16_run[2], re.S
    )
    assert types and set(types) == {"f32"}, types


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.slow  # a resume test runs by default: tests/test_checkpoint.py
def test_bf16_checkpoint_resume_is_bitwise_and_loads_across_dtypes(bf16_run, tmp_path):
    """Saved after 2 steps and resumed, 2 more steps: the same losses and state bitwise as
    straight on. The checkpoint's fp32 main parameters are what a resume starts from: a
    run with fp32 parameters (replicated optimizer, dp 8) loads them exactly;
    ``load_optim=False`` takes the saved bf16 parameters."""
    plan, step, _, state, _ = bf16_run
    state = jax.tree.map(jnp.copy, state)  # the step donates it; the fixture's stays
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(plan, state, step=2, data_step=2, seed=7)
    ckpt.wait()
    saved = jax.device_get(canonical_state(plan, state))
    resumed, meta = ckpt.restore(plan, init_train_state(plan, seed=1))
    assert meta["step"] == 2 and int(resumed.step) == 2
    straight, rest = _steps(plan, state, step, 2, 2)  # donates state
    resumed, again = _steps(plan, resumed, step, 2, 2)
    assert again == rest  # bitwise
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), jax.device_get(straight))

    plan32 = _plan(
        GPTConfig(**{**SMALL, "num_layers": 2}, compute_dtype="bfloat16"), tp=1, pp=1, dist=False
    )
    loaded, _ = ckpt.restore(plan32, init_train_state(plan32, seed=1))
    assert {a.dtype for a in jax.tree.leaves(loaded.params)} == {F32}
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(loaded.params), saved["opt"].master)
    only, _ = ckpt.restore(plan, init_train_state(plan, seed=1), load_optim=False)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(only.params), saved["params"])
    ckpt.close()


@pytest.mark.slow
def test_load_hf_into_a_bf16_run(pretrain, tmp_path, capsys):
    """The example's ``--load-hf`` (fp32 values from safetensors) with ``--bf16``: the
    parameters are the directory's values rounded to bf16, the optimizer's fp32 main
    parameters those rounded values; the run trains from them."""
    from pathlib import Path

    from jax_wgrad.interop import import_hf

    fixture = Path(__file__).parent / "fixtures" / "hf" / "llama"
    cfg, values = import_hf(
        fixture, seq_length=16, compute_dtype="bfloat16", params_dtype="bfloat16"
    )
    assert {v.dtype for v in jax.tree.leaves(values)} == {np.dtype(np.float32)}
    plan = _plan(cfg, mb=2, gb=8)
    state = pretrain.start_from_hf(cli.make_parser(), str(fixture), plan)
    jax.tree.map(
        lambda p, v: np.testing.assert_array_equal(p, v.astype(BF16)),
        jax.device_get(state.params),
        values,
    )
    canon = canonical_state(plan, state)
    jax.tree.map(
        lambda m, v: np.testing.assert_array_equal(m, v.astype(BF16).astype(F32)),
        jax.device_get(canon["opt"].master),
        values,
    )
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 400)  # ASCII: ids < the fixture's vocab 128
    out = pretrain.main(
        [
            "--load-hf",
            str(fixture),
            "--bf16",
            "--data-path",
            str(text),
            "--seq-length",
            "16",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "8",
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--use-distributed-optimizer",
            "--train-iters",
            "2",
            "--no-progress",
        ]
    )
    assert "starting from the Hugging Face model in" in capsys.readouterr().out
    assert out["steps"] == 2 and np.isfinite([out["first_loss"], out["last_loss"]]).all()
