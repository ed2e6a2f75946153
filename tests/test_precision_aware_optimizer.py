"""Megatron's precision-aware optimizer: bf16 Adam moments (``--exp-avg-dtype``,
``--exp-avg-sq-dtype``) and int16 parameter remainders instead of fp32 main copies of bf16
parameters (TransformerEngine's ``store_param_remainders``).

References: numpy (float64 Adam, the bit layout of IEEE fp32/bf16), and the optimizer with
fp32 main copies and fp32 moments in the same run.
"""

import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from test_fail_loudly import SMALL as SMALL_ARGV
from test_fail_loudly import usage_error

from jax_wgrad import (
    ByteDataset,
    DDPConfig,
    GPTConfig,
    ParallelConfig,
    TrainPlan,
    build_train_step,
    default_optimizer,
    init_train_state,
    make_mesh,
    shard_batch,
)
from jax_wgrad.grads import GradBuffer
from jax_wgrad.models.gpt.presets import preset
from jax_wgrad.optim import DistributedOptimizer, adamw, join_bf16, scale_by_adam, split_bf16
from jax_wgrad.parallel.mesh import DATA
from jax_wgrad.training.checkpoint import canonical_state, state_from_canonical

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

BF16, F32, I16 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.int16)


# --------------------------------------------------------------------------- remainders


def _fp32_samples() -> np.ndarray:
    """fp32 values of every magnitude and sign, every low half-word pattern around the
    rounding point (ties included), zeros, subnormals and the largest finite values."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    high = rng.integers(0, 0x7F7F, 4096, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    around = (high[:, None] | lows[None, :]).ravel()
    special = np.array(
        [0, 1, 0x007FFFFF, 0x00800000, 0x7F7F7FFF, 0x7F7F8000, 0x3F808000], np.uint32
    )
    bits = np.concatenate([bits, around, special])
    bits = np.concatenate([bits, bits | np.uint32(0x80000000)])  # both signs
    x = bits.view(np.float32)
    return x[np.isfinite(x)]


def test_split_and_join_are_exact_and_round_to_nearest():
    """``join(split(x)) == x`` bit for bit; the bf16 half is the nearest bf16 (numpy's
    float64 distances), equal to ``astype`` (ties to even) but for exact ties, which go
    away from zero; the remainder fits int16."""
    x = _fp32_samples()
    high, rem = jax.jit(split_bf16)(x)
    assert high.dtype == BF16 and rem.dtype == I16
    back = np.asarray(jax.jit(join_bf16)(high, rem))
    np.testing.assert_array_equal(back.view(np.uint32), x.view(np.uint32))

    h = np.asarray(high).astype(np.float64)
    rne = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    tie = (x.view(np.uint32) & 0xFFFF) == 0x8000
    finite = np.isfinite(h)
    np.testing.assert_array_equal(h[~tie & finite], rne[~tie & finite])
    assert np.all(np.abs(h[tie & finite]) > np.abs(x[tie & finite]))  # away from zero
    # nearest: no farther than astype's rounding
    assert np.all(
        np.abs(h[finite] - x[finite].astype(np.float64))
        <= np.abs(rne[finite] - x[finite].astype(np.float64))
    )
    assert tie.sum() > 1000
    # past the largest bf16 (fp32 from 0x7F7F8000 up): infinity, as astype rounds them
    np.testing.assert_array_equal(np.isinf(h), np.isinf(rne))
    assert 0 < (~finite).sum() < 100


def _optimizer_run(remainders: bool, steps: int = 6):
    """A mixed fp32/bf16 tree on 8 data ranks, the distributed optimizer with the same
    random gradient shards each step: ``(params, the whole fp32 main tree after each step,
    kept state)``."""
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "b": jax.random.normal(k1, (40,), F32),
        "w": (jax.random.normal(k2, (24, 72), F32) * 0.05).astype(BF16),
    }
    buf = GradBuffer.create(params, dp_size=8, bucket_size=None, use_distributed_optimizer=True)
    opt = DistributedOptimizer.create(buf, adamw(1e-2), store_param_remainders=remainders)

    def body(p):
        state, mains = opt.init(p), []
        for i in range(steps):
            key = jax.random.fold_in(jax.random.key(i + 1), lax.axis_index(DATA))
            synced = tuple(
                jax.random.normal(jax.random.fold_in(key, b), (n,), F32) * 0.1
                for b, n in enumerate(buf.shard_numels)
            )
            p, state, _ = opt.step(p, synced, state)
            # every step's main parameters are outputs: XLA:CPU compiles the same Adam steps
            # differently when only the last is (measured: the optimizer with fp32 copies,
            # two steps, last-only against every-step outputs, 103 of 1728 elements differ
            # by up to 41 ulp), so the comparison is of materialised steps
            mains.append(opt.state_to_tree(state, p).master)
        return p, mains, state.master

    mesh = make_mesh(ParallelConfig())
    run = jax.shard_map(
        body, mesh=mesh, in_specs=P(), out_specs=(P(), P(), P(DATA)), check_vma=False
    )
    return opt, *jax.jit(run)(params)


def test_remainders_keep_the_fp32_main_parameters_exactly():
    """With the same gradients, the main parameters the remainders rebuild are bit for
    bit those of the optimizer with fp32 copies (Adam reads only the main parameters and
    the gradients); the bf16 parameters are their rounding; the kept state of the bf16
    bucket is int16 (half the bytes), the fp32 bucket keeps none."""
    opt, params, mains, kept = _optimizer_run(remainders=True)
    _, ref_params, ref_mains, ref_kept = _optimizer_run(remainders=False)
    for main, ref_main in zip(mains, ref_mains, strict=True):
        for name in ("b", "w"):
            np.testing.assert_array_equal(
                np.asarray(main[name]).view(np.uint32), np.asarray(ref_main[name]).view(np.uint32)
            )
    main = mains[-1]
    np.testing.assert_array_equal(np.asarray(params["b"]), np.asarray(ref_params["b"]))
    np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(split_bf16(main["w"])[0]))
    differ = np.asarray(params["w"]) != np.asarray(ref_params["w"])  # ties only
    tie = (np.asarray(main["w"]).view(np.uint32) & 0xFFFF) == 0x8000
    assert not np.any(differ & ~tie)
    assert opt.buffer.bucket_param_dtypes == (F32, BF16)
    assert kept[0] is None and ref_kept[0] is None
    assert (kept[1].dtype, ref_kept[1].dtype) == (I16, F32)
    assert kept[1].shape == ref_kept[1].shape


def test_remainders_need_the_distributed_optimizer():
    with pytest.raises(ValueError, match="only supported with distributed optimizer"):
        DDPConfig(use_precision_aware_optimizer=True)
    buf = GradBuffer.create(
        {"w": jnp.ones((8, 8), BF16)}, dp_size=8, bucket_size=None, use_distributed_optimizer=False
    )
    with pytest.raises(ValueError, match="store_param_remainders is only supported with"):
        DistributedOptimizer.create(buf, adamw(1e-3), store_param_remainders=True)


# --------------------------------------------------------------------------- moments


def test_bf16_moments_are_computed_in_fp32_and_stored_rounded():
    """Each of three Adam steps against numpy float64 Adam from the stored bf16 moments:
    the update is the float64 one to fp32 accuracy (the kernel computes in fp32, as
    TransformerEngine's FusedAdam), the new moments are stored as its bf16 rounding (to
    nearest: within bf16's unit roundoff 2**-8 of the float64 value, plus fp32's error); ``None``
    dtypes are optax's own transformation."""
    b1, b2, eps, lr = 0.9, 0.95, 1e-8, 1e-2
    rng = np.random.default_rng(1)
    p = rng.normal(size=(300,)).astype(np.float32)
    grads = [
        rng.normal(size=(300,)).astype(np.float32) * 10.0 ** rng.integers(-6, 2) for _ in range(3)
    ]
    tx = optax.chain(
        scale_by_adam(b1, b2, eps, exp_avg_dtype=jnp.bfloat16, exp_avg_sq_dtype=jnp.bfloat16),
        optax.scale(-lr),
    )
    state = tx.init(jnp.asarray(p))
    assert (state[0].mu.dtype, state[0].nu.dtype) == (BF16, BF16)
    f64 = lambda a: np.asarray(a, np.float64)
    for t, g in enumerate(grads, 1):
        m, v, g64 = f64(state[0].mu), f64(state[0].nu), g.astype(np.float64)
        upd, state = jax.jit(tx.update)(jnp.asarray(g), state)
        m_new, v_new = b1 * m + (1 - b1) * g64, b2 * v + (1 - b2) * g64**2
        want = -lr * (m_new / (1 - b1**t)) / (np.sqrt(v_new / (1 - b2**t)) + eps)
        np.testing.assert_allclose(f64(upd), want, rtol=1e-5)
        for stored, exact in ((state[0].mu, m_new), (state[0].nu, v_new)):
            assert np.all(np.abs(f64(stored) - exact) <= (2**-8 + 2**-22) * np.abs(exact))
    assert scale_by_adam(b1, b2).init(p).mu.dtype == F32  # exactly optax's without dtypes
    with pytest.raises(ValueError, match="exp_avg_sq_dtype must be one of float32, bfloat16"):
        scale_by_adam(exp_avg_sq_dtype=jnp.float16)


# --------------------------------------------------------------------------- the train step

DATA_TEXT = ByteDataset(
    np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 300, np.uint8)
)
SMALL = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=32,
    vocab_size=256,
    compute_dtype="bfloat16",
    params_dtype="bfloat16",
)


def _plan(precision_aware: bool, moments=None) -> TrainPlan:
    par = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        micro_batch_size=2,
        global_batch_size=16,
        sequence_parallel=True,
    )
    return TrainPlan.create(
        GPTConfig(**SMALL),
        par,
        make_mesh(par),
        default_optimizer(3e-3, exp_avg_dtype=moments, exp_avg_sq_dtype=moments),
        ddp=DDPConfig(
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            use_precision_aware_optimizer=precision_aware,
        ),
    )


def _losses(plan: TrainPlan, steps: int, seed: int = 3):
    state = init_train_state(plan, seed=seed)
    step = build_train_step(plan, state)
    losses = []
    for i in range(steps):
        state, m = step(state, shard_batch(plan.mesh, DATA_TEXT.batch(i, 16, 32, seed=1)))
        losses.append(float(m["loss"]))
    return state, np.array(losses)


@pytest.fixture(scope="module")
def precision_run():
    """Two steps of the precision-aware plan (bf16 moments, remainders): ``(plan, state)``."""
    plan = _plan(True, jnp.bfloat16)
    state, _ = _losses(plan, 2)
    return plan, state


@pytest.fixture(scope="module")
def runs():
    """30 steps on (dp 2, tp 2, pp 2) of bf16 parameters: fp32 copies and moments (two
    initialisations, for the spread between runs), and the precision-aware optimizer with
    bf16 moments and parameter remainders."""
    ref_plan = _plan(False)
    _, ref = _losses(ref_plan, 30)
    _, other_seed = _losses(ref_plan, 30, seed=4)
    plan = _plan(True, jnp.bfloat16)
    state, low = _losses(plan, 30)
    return plan, state, ref, other_seed, low


@pytest.mark.slow  # 3 x 30 steps; the example's two steps run by default (below)
def test_bf16_moments_and_remainders_train_as_fp32_state(runs):
    """The loss curve with bf16 moments and remainders stays within the spread of two
    fp32-state runs from different initialisations (mean of the last 10 steps), and
    both fall alike."""
    _, _, ref, other_seed, low = runs
    spread = abs(ref[-10:].mean() - other_seed[-10:].mean())
    assert abs(low[-10:].mean() - ref[-10:].mean()) <= spread
    assert low[-1] < 0.75 * low[0] and ref[-1] < 0.75 * ref[0]


def test_precision_aware_state_and_checkpoint_form(precision_run):
    """int16 remainders and bf16 moments on each rank's shard; the canonical (checkpoint)
    form holds the fp32 main parameters, and reading it back gives the same state bit
    for bit."""
    plan, state = precision_run
    assert {a.dtype for a in jax.tree.leaves(state.opt_state.master)} == {I16}
    moments = state.opt_state.inner[0]
    assert {a.dtype for a in jax.tree.leaves((moments.mu, moments.nu))} == {BF16}
    canon = canonical_state(plan, state)
    assert {a.dtype for a in jax.tree.leaves(canon["opt"].master)} == {F32}
    back = state_from_canonical(plan, state, canon["opt"], int(state.step))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
        assert a.dtype == b.dtype
        raw = lambda x: np.asarray(x).reshape(-1).view(np.uint8)
        np.testing.assert_array_equal(raw(a), raw(b))


@pytest.mark.parametrize(
    "precision_aware, moments, master, optax_bytes",
    [(False, None, 4, 8), (True, None, 2, 8), (True, jnp.bfloat16, 2, 4)],
)
def test_llama3_8b_bytes_per_parameter(precision_aware, moments, master, optax_bytes):
    """Llama-3-8B, bf16 parameters, TP2 PP2 DP2, distributed optimizer (abstract shapes,
    production size): the main copy costs 4/DP bytes a parameter, 2/DP as remainders; Adam
    8/DP, 4/DP with bf16 moments (padding: within 1%)."""
    model = preset("llama3-8b", params_dtype="bfloat16", compute_dtype="bfloat16")
    par = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        micro_batch_size=1,
        global_batch_size=16,
        sequence_parallel=True,
    )
    plan = TrainPlan.create(
        model,
        par,
        make_mesh(par),
        default_optimizer(1e-4, exp_avg_dtype=moments, exp_avg_sq_dtype=moments),
        ddp=DDPConfig(
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            use_precision_aware_optimizer=precision_aware,
        ),
    )
    bpp = plan.bytes_per_parameter()
    assert bpp.master == pytest.approx(master / 2, rel=0.01)
    assert bpp.moments == pytest.approx(optax_bytes / 2, rel=0.01)


# --------------------------------------------------------------------------- the example's flags


PRECISION = ["--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--use-precision-aware-optimizer"],
            "--use-precision-aware-optimizer needs --use-distributed-optimizer (Megatron: "
            "--use-precision-aware-optimizer only supported with distributed optimizer)",
        ),
        (
            ["--exp-avg-dtype", "bf16"],
            "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer (Megatron: "
            "exp_avg_dtype can only be fp32 when not using precision-aware optimizer)",
        ),
        (
            [*PRECISION, "--exp-avg-sq-dtype", "fp8"],
            "--exp-avg-sq-dtype fp8 is not built in jax_wgrad: fp8 moments are stored with "
            "per-tensor scales",
        ),
        (
            [*PRECISION, "--main-grads-dtype", "bf16"],
            "--main-grads-dtype bf16 is not built in jax_wgrad: the gradient buckets",
        ),
        (
            [*PRECISION, "--main-params-dtype", "fp16"],
            "--main-params-dtype fp16 is not built in jax_wgrad: fp16 main parameters",
        ),
        (["--exp-avg-dtype", "bf8"], "argument --exp-avg-dtype: invalid choice: 'bf8'"),
    ],
)
def test_precision_flags_are_megatrons_rules(pretrain, capsys, argv, message):
    usage_error(pretrain, capsys, SMALL_ARGV + argv, message)


def test_the_example_trains_with_the_precision_aware_optimizer(pretrain, capsys, tmp_path):
    """Two steps of the example with bf16 moments and remainders: the log's bytes per
    parameter show the 2-byte main parameters and 4-byte moments over DP 8 (padding
    aside); the first loss is the default optimizer's, and so is the second (the first
    update is computed in fp32 from the same main parameters) but for the bf16
    parameters' ties."""

    def losses(extra):
        path = tmp_path / f"{len(extra)}.jsonl"
        pretrain.main(SMALL_ARGV + ["--metrics-file", str(path), "--bf16"] + extra)
        return [json.loads(line)["loss"] for line in path.read_text().splitlines()]

    low = losses(PRECISION[1:] + ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"])
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("bytes per parameter"))
    main, moments = (
        float(x) for x in re.search(r"main params ([\d.]+), optax ([\d.]+)", line).groups()
    )
    assert main == pytest.approx(2 / 8, abs=0.01) and moments == pytest.approx(4 / 8, abs=0.01)
    ref = losses(["--use-distributed-optimizer"])
    assert low[0] == ref[0] and low[1] == pytest.approx(ref[1], rel=1e-3)
