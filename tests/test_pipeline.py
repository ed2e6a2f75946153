"""1F1B pipeline: schedule properties and gradients equal to single-device jax.grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad import fusion_available
from jax_wgrad import GPTConfig, ParallelConfig
from jax_wgrad.models.gpt import validate
from jax_wgrad import GPTStages, init_params, param_specs
from jax_wgrad.testing import reference_loss
from jax_wgrad import make_mesh
from jax_wgrad import pipeline_gradients
from jax_wgrad.parallel.pipeline import IDLE, ScheduleTable, one_f_one_b

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

MESHES = [(8, 1, 1), (4, 2, 1), (2, 2, 2), (2, 1, 4), (1, 2, 4)]


# --------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("p, m", [(1, 3), (2, 2), (4, 1), (4, 3), (4, 8), (3, 16)])
def test_schedule_is_1f1b_with_bounded_in_flight(p, m):
    sched = one_f_one_b(p, m)
    assert sched.num_slots == min(2 * p - 1, m)  # the stage-0 window, at most M
    table = [[(None if f < 0 else int(f), None if b < 0 else int(b)) for f, b in zip(fr, br)]
             for fr, br in zip(sched.forward, sched.backward)]
    assert len(table) == m + 2 * p - 2
    for s in range(p):
        fwd = [row[s][0] for row in table if row[s][0] is not None]
        bwd = [row[s][1] for row in table if row[s][1] is not None]
        assert fwd == list(range(m)) and bwd == list(range(m))
        in_flight = 0
        for t, row in enumerate(table):
            f, b = row[s]
            in_flight += (f is not None) - (b is not None)
            assert 0 <= in_flight <= min(2 * (p - 1 - s) + 1, sched.num_slots)
            assert in_flight <= sched.in_flight(s)
            if b is not None:  # backward needs this stage's forward and the next stage's backward
                assert any(table[u][s][0] == b for u in range(t + 1))
                if s < p - 1:
                    assert table[t - 1][s + 1][1] == b
            if f is not None and s > 0:
                assert table[t - 1][s - 1][0] == f


# --------------------------------------------------------------------------- gradients


def _check_gradients(dp, tp, pp, *, sp, fusion, tied=True, m=2, dtype="float32", table=None):
    if fusion and not fusion_available("cpu"):
        pytest.skip("the CPU wgrad_accumulate handler was not built")
    cfg = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=8,
                    vocab_size=64, untie_embeddings_and_output_weights=not tied,
                    compute_dtype=dtype)
    par = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         micro_batch_size=2, global_batch_size=2 * dp * m,
                         sequence_parallel=sp, gradient_accumulation_fusion=fusion)
    validate(par, cfg)
    mesh = make_mesh(par)
    params = init_params(cfg, seed=0)
    tokens = jax.random.randint(jax.random.key(1), (par.global_batch_size, 9), 0, 64)
    ref_loss, ref_grads = jax.value_and_grad(reference_loss)(params, tokens, cfg)

    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(cfg),
                             is_leaf=lambda x: isinstance(x, P))
    stages = GPTStages(cfg, par)
    grads, loss = jax.jit(lambda p, t: pipeline_gradients(stages, mesh, p, t, table=table))(
        jax.device_put(params, shardings), jax.device_put(tokens, NamedSharding(mesh, P("data"))))
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    return loss, ref_loss, grads, ref_grads


def _assert_equal_grads(loss, ref_loss, grads, ref_grads, tol=1e-5):
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=tol)
    flat, _ = jax.tree_util.tree_flatten_with_path(grads)
    for (path, g), r in zip(flat, jax.tree.leaves(ref_grads)):
        g, r = np.asarray(g), np.asarray(r)
        diff, scale = np.abs(g - r).max(), np.abs(r).max()
        assert scale > 0, jax.tree_util.keystr(path)
        assert diff <= tol * scale, f"{jax.tree_util.keystr(path)}: {diff:.3g} > {tol} x {scale:.3g}"


@pytest.mark.parametrize("dp, tp, pp", MESHES, ids=lambda v: str(v))
@pytest.mark.parametrize("sp, fusion", [
    pytest.param(False, False, id="plain"),
    pytest.param(True, True, id="sp-fused"),
    pytest.param(True, False, id="sp", marks=pytest.mark.slow),
    pytest.param(False, True, id="fused", marks=pytest.mark.slow),
])
def test_gradients_equal_single_device_jax_grad(dp, tp, pp, sp, fusion):
    if sp and tp == 1:
        if not fusion:
            pytest.skip("sequence parallelism needs tensor parallelism (same as 'plain')")
        sp = False  # still covers fusion on this mesh
    _assert_equal_grads(*_check_gradients(dp, tp, pp, sp=sp, fusion=fusion))


@pytest.mark.parametrize("dp, tp, pp", [(2, 2, 2), (1, 2, 4)], ids=str)
def test_untied_output_layer(dp, tp, pp):
    _assert_equal_grads(*_check_gradients(dp, tp, pp, sp=True, fusion=True, tied=False))


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 3, 7])
def test_microbatch_counts(m):
    _assert_equal_grads(*_check_gradients(2, 1, 4, sp=False, fusion=True, m=m))


def test_bf16_runs_close():
    loss, ref_loss, grads, ref_grads = _check_gradients(2, 2, 2, sp=True, fusion=True,
                                                        dtype="bfloat16")
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-2)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_fused_pipeline_calls_the_fused_op():
    if not fusion_available("cpu"):
        pytest.skip("the CPU wgrad_accumulate handler was not built")
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                    vocab_size=64)
    par = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                         micro_batch_size=1, global_batch_size=4,
                         gradient_accumulation_fusion=True)
    mesh = make_mesh(par)
    stages = GPTStages(cfg, par)
    params = jax.eval_shape(lambda: init_params(cfg, 0))
    tokens = jax.ShapeDtypeStruct((4, 9), jnp.int32)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(cfg),
                             is_leaf=lambda x: isinstance(x, P))
    fn = jax.jit(lambda p, t: pipeline_gradients(stages, mesh, p, t),
                 in_shardings=(shardings, NamedSharding(mesh, P("data"))))
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
    assert table.inbox_depth("F") == table.inbox_depth("B") == 1
    assert [table.last_backward_tick(s) for s in range(4)] == [11, 10, 9, 8]
    # Lock-step ticks at unit costs: both take 2 (M + P - 1); GPipe holds all M inputs.
    assert table.makespan() == one_f_one_b(4, 3).makespan() == 12


@pytest.mark.parametrize("dp, tp, pp, sp, fusion", [(2, 2, 2, True, True), (1, 2, 4, False, True),
                                                  (2, 1, 4, False, False)], ids=str)
def test_gpipe_through_the_same_executor_equals_jax_grad(dp, tp, pp, sp, fusion):
    table = gpipe(pp, 3)
    _assert_equal_grads(*_check_gradients(dp, tp, pp, sp=sp, fusion=fusion, m=3, table=table))


@pytest.mark.parametrize("bad, match", [
    ("order", "stage 0 runs F of microbatches \\[1, 0\\]"),
    ("early", "runs F before its input arrives"),
    ("b_first", "runs B before F"),
])
def test_schedule_table_validation(bad, match):
    good = one_f_one_b(2, 2)
    fwd, bwd = good.forward.copy(), good.backward.copy()
    if bad == "order":  # stage 0 forwards microbatch 1 first
        fwd[0, 0], fwd[1, 0] = 1, 0
    elif bad == "early":  # stage 1 forwards microbatch 0 in the tick stage 0 does
        fwd[:, 1] = [0, 1, IDLE, IDLE]
    else:  # stage 1 backwards microbatch 0 before it forwarded it
        bwd[:, 1] = [0, 1, IDLE, IDLE]
    with pytest.raises(ValueError, match=match):
        ScheduleTable("bad", fwd, bwd)
