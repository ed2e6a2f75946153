"""The program-level ``shard_map`` s and jax's type check of mesh axes (``check_vma``).

Where a site runs with ``check_vma=True`` its results are those it gave without the check
(the check only types values; it adds no operation). Where a site still passes
``check_vma=False``, the one-sentence reason beside it is pinned here: the test turns
the check on for that site alone and expects jax's error, so the day the reason goes
away the test fails and the site can turn the check on.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad import (
    DDPConfig,
    GPTConfig,
    ParallelConfig,
    TrainPlan,
    build_train_step,
    default_optimizer,
    init_train_state,
    make_mesh,
    pipeline_gradients,
)
from jax_wgrad.aot.compile import abstract_train_state
from jax_wgrad.interop.logits import single_device_logits
from jax_wgrad.models.gpt import init_params
from jax_wgrad.parallel.mesh import DATA_PARALLEL
from jax_wgrad.parallel.pipeline.gradients import carry_shapes
from jax_wgrad.training.checkpoint import canonical_state, state_from_canonical
from jax_wgrad.training.step import build_eval_step

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

MODEL = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16)


@pytest.fixture(scope="module")
def plan():
    par = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        micro_batch_size=2,
        global_batch_size=8,
        sequence_parallel=True,
    )
    ddp = DDPConfig(use_distributed_optimizer=True)
    return TrainPlan.create(MODEL, par, make_mesh(par), default_optimizer(1e-2), ddp=ddp)


def _check_vma(monkeypatch, *callers: str, value: bool = True) -> set[str]:
    """``jax.shard_map`` called by the functions named ``callers`` gets ``check_vma=value``;
    returns the set of those that called it (filled as they do)."""
    real, seen = jax.shard_map, set()

    def shard_map(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_name
        if caller in callers:
            kwargs["check_vma"] = value
            seen.add(caller)
        return real(*args, **kwargs)

    monkeypatch.setattr(jax, "shard_map", shard_map)
    return seen


def _tokens(plan):
    return jax.ShapeDtypeStruct(
        (plan.parallel.global_batch_size, MODEL.seq_length + 1),
        jnp.int32,
        sharding=NamedSharding(plan.mesh, P(DATA_PARALLEL)),
    )


def _raised_in(excinfo, function: str) -> bool:
    return any(entry.name == function for entry in excinfo.traceback)


# ---- sites that run with check_vma=True -------------------------------------------------


def test_checked_sites_compute_what_they_did_unchecked(plan, monkeypatch):
    # init_optimizer_state (and aot's abstract_train_state, the same body), the restore
    # of a canonical checkpoint, single_device_logits: bitwise the results without it.
    state = init_train_state(plan, seed=7)
    canon = jax.device_get(canonical_state(plan, state))
    restored = state_from_canonical(plan, state, canon["opt"], 3).opt_state
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
    ids = jnp.arange(32).reshape(2, 16) % 200
    logits = single_device_logits(cfg, init_params(cfg, 0), ids)
    shapes = abstract_train_state(plan)
    sites = ("init_optimizer_state", "state_from_canonical", "single_device_logits")
    unchecked_sites = _check_vma(monkeypatch, *sites, value=False)
    unchecked = init_train_state(plan, seed=7)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(unchecked)):
        np.testing.assert_array_equal(a, b)
    again = state_from_canonical(plan, state, canon["opt"], 3).opt_state
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(logits, single_device_logits(cfg, init_params(cfg, 0), ids))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes.opt_state) == jax.tree.map(
        lambda x: (x.shape, x.dtype), unchecked.opt_state
    )
    assert unchecked_sites == set(sites)


# ---- sites that cannot yet, each with its reason ------------------------------------------

SCAN_CARRY = r"scan body function carry input and carry output must have equal types"


def test_train_step_pipeline_state_is_not_typed_by_mesh_axes(plan, monkeypatch):
    # step.py, build_train_step: the layer scan's activation carry starts invariant and
    # comes back varying over the tensor and pipeline axes.
    _check_vma(monkeypatch, "build_train_step")
    state = abstract_train_state(plan)
    with pytest.raises(TypeError, match=SCAN_CARRY) as excinfo:
        build_train_step(plan, state).trace(state, _tokens(plan))
    assert "{V:(tensor,pipeline)}" in str(excinfo.value)
    assert _raised_in(excinfo, "scan_layers")


def test_pipeline_gradients_state_is_not_typed_by_mesh_axes(plan, monkeypatch):
    # gradients.py, pipeline_gradients and carry_shapes: the same pipeline, the same carry.
    state = abstract_train_state(plan)
    _check_vma(monkeypatch, "pipeline_gradients")
    fn = lambda p, b: pipeline_gradients(plan.program, plan.mesh, p, b)
    with pytest.raises(TypeError, match=SCAN_CARRY) as excinfo:
        jax.eval_shape(fn, state.params, _tokens(plan))
    assert _raised_in(excinfo, "scan_layers")
    _check_vma(monkeypatch, "carry_shapes")
    with pytest.raises(TypeError, match=SCAN_CARRY) as excinfo:
        carry_shapes(plan.program, plan.sink, plan.ddp, plan.table, plan.mesh)
    assert _raised_in(excinfo, "scan_layers")


def test_eval_step_tick_carry_is_not_typed_by_mesh_axes(plan, monkeypatch):
    # step.py, build_eval_step: the tick loop's received activation starts invariant, the
    # first stage's embedded input varies, and lax.cond needs both branches alike.
    _check_vma(monkeypatch, "build_eval_step")
    state = abstract_train_state(plan)
    with pytest.raises(TypeError, match="cond branches must have equal output types") as excinfo:
        build_eval_step(plan).trace(state.params, _tokens(plan))
    assert "true_fun is first_input" in str(excinfo.value)


def test_canonical_state_cannot_prove_replicated_copies(plan, monkeypatch):
    # checkpoint.py, canonical_state: each device's optimizer state comes in stacked under
    # P(AXES), so the tensor ranks' copies of a replicated parameter are typed as varying.
    state = init_train_state(plan, seed=0)
    _check_vma(monkeypatch, "canonical_state")
    with pytest.raises(ValueError, match="out_specs which require replication") as excinfo:
        canonical_state(plan, state)
    assert "is P('pipeline', None)" in str(excinfo.value)
    assert "possibly varying over {tensor,pipeline}" in str(excinfo.value)
