"""Train step: same seed -> same params, batches and loss curves for every layout."""

import jax
import numpy as np
import pytest

from jax_wgrad import (
    ByteDataset,
    GPTConfig,
    ParallelConfig,
    TrainPlan,
    build_train_step,
    default_optimizer,
    fusion_available,
    init_params,
    init_train_state,
    make_mesh,
    shard_batch,
)

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

MODEL = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16)
DATA = ByteDataset(np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 200, np.uint8))


def _train(tp, pp, steps=3, sp=False, fusion=False):
    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        micro_batch_size=2,
        global_batch_size=16,
        sequence_parallel=sp,
        gradient_accumulation_fusion=fusion,
    )
    mesh = make_mesh(par)
    opt = default_optimizer(1e-2)
    plan = TrainPlan.create(MODEL, par, mesh, opt)
    state = init_train_state(plan, seed=7)
    step = build_train_step(plan, state)
    losses, norms = [], []
    for i in range(steps):
        state, m = step(state, shard_batch(mesh, DATA.batch(i, 16, MODEL.seq_length, seed=7)))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return np.array(losses), np.array(norms), jax.device_get(state.params), int(state.step)


def test_batches_depend_only_on_seed_and_step():
    a = DATA.batch(3, 8, 16, seed=1)
    assert a.shape == (8, 17) and a.dtype == np.int32
    np.testing.assert_array_equal(a, DATA.batch(3, 8, 16, seed=1))
    assert not np.array_equal(a, DATA.batch(4, 8, 16, seed=1))
    # windows of the text: consecutive bytes
    text = DATA.data
    assert any(np.array_equal(a[0], text[i : i + 17]) for i in range(len(text) - 16))


def test_init_params_independent_of_layout():
    params = []
    for tp, pp in [(1, 1), (2, 2), (2, 4)]:
        par = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        plan = TrainPlan.create(MODEL, par, make_mesh(par), default_optimizer(1e-3))
        state = init_train_state(plan, seed=7)
        params.append(jax.device_get(state.params))
    for other in params[1:]:  # bitwise identical whatever the layout
        for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(params[0])):
            np.testing.assert_array_equal(a, b)
    # and equal (up to jit-vs-eager rounding) to the unsharded eager init
    for a, b in zip(jax.tree.leaves(params[0]), jax.tree.leaves(init_params(MODEL, seed=7))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


# -m slow (suite time): train steps on (2,2,2)+SP fused equal the single-device ones by
# default in tests/test_ddp.py::test_five_steps_equal_single_device_optax
@pytest.mark.slow
def test_loss_curves_and_params_equal_across_layouts():
    base_loss, base_norm, base_params, n = _train(1, 1)
    assert n == 3
    assert base_loss[-1] < base_loss[0]
    layouts = [(2, 2, True, fusion_available("cpu")), (2, 4, False, False)]
    for tp, pp, sp, fusion in layouts:
        loss, norm, params, _ = _train(tp, pp, sp=sp, fusion=fusion)
        np.testing.assert_allclose(loss, base_loss, rtol=1e-5, err_msg=f"tp={tp} pp={pp}")
        np.testing.assert_allclose(norm, base_norm, rtol=1e-5, err_msg=f"tp={tp} pp={pp}")
        # Parameters are not compared elementwise: Adam divides by sqrt(v), which turns
        # 1e-7-relative gradient rounding differences of near-zero gradient entries into
        # larger relative update differences. Gradients are compared in test_pipeline.


def test_step_donates_state():
    par = ParallelConfig(pipeline_model_parallel_size=2, micro_batch_size=2, global_batch_size=8)
    mesh = make_mesh(par)
    opt = default_optimizer(1e-3)
    plan = TrainPlan.create(MODEL, par, mesh, opt)
    state = init_train_state(plan, seed=0)
    step = build_train_step(plan, state)
    new_state, metrics = step(state, shard_batch(mesh, DATA.batch(0, 8, 16, seed=0)))
    assert set(metrics) == {"loss", "grad_norm", "skipped"}
    assert all(x.is_deleted() for x in jax.tree.leaves(state.params))
    assert jax.tree.map(lambda x: x.sharding, new_state.params) == jax.tree.map(
        lambda x: x.sharding, state.params
    )


@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2])  # 2: TP + SP
def test_bf16_step_has_no_16bit_scatter(tp):
    # Embedding gradients are scatter-added in fp32 (a bf16 scatter-add rounds every partial
    # sum and is ~190x slower on a GPU for text-like ids, docs/design/h100_findings.md, section 2).
    import re

    model = GPTConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, compute_dtype="bfloat16"
    )
    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=2,
        micro_batch_size=2,
        global_batch_size=8,
        sequence_parallel=tp > 1,
        gradient_accumulation_fusion=fusion_available("cpu"),
    )
    mesh = make_mesh(par)
    opt = default_optimizer(1e-3)
    plan = TrainPlan.create(model, par, mesh, opt)
    state = init_train_state(plan, seed=0)
    step = build_train_step(plan, state)
    lowered = step.lower(state, shard_batch(mesh, DATA.batch(0, 8, 16, seed=0)))
    # As jax wrote it (XLA:CPU itself widens a bf16 scatter, XLA:GPU does not) ...
    types = re.findall(
        r'"stablehlo.scatter".*?\}\) : \([^)]*\) -> tensor<[^>]*x(\w+)>', lowered.as_text(), re.S
    )
    assert types and set(types) == {"f32"}, types
    # ... and as compiled.
    hlo = lowered.compile().as_text()
    scatters = [l for l in hlo.splitlines() if re.search(r"= \S+ scatter\(", l)]
    assert scatters and not [l for l in scatters if re.search(r"= \(?(bf16|f16)\[", l)]
