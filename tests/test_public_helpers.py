"""Public helpers for users of the Python API: a train state from a Hugging Face directory
(:func:`jax_wgrad.train_state_from_hf`)."""

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

from jax_wgrad import (
    DDPConfig,
    ParallelConfig,
    TrainPlan,
    default_optimizer,
    make_mesh,
    train_state_from_hf,
)
from jax_wgrad.interop import import_hf
from jax_wgrad.training import init_optimizer_state

LLAMA = Path(__file__).parent / "fixtures" / "hf" / "llama"


def _plan(cfg, **par):
    parallel = ParallelConfig(micro_batch_size=2, global_batch_size=16, **par)
    return TrainPlan.create(
        cfg, parallel, make_mesh(parallel), default_optimizer(1e-3), ddp=DDPConfig()
    )


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")
def test_train_state_from_hf_holds_the_directorys_weights_sharded_at_step_0():
    cfg, values = import_hf(LLAMA, seq_length=16)
    plan = _plan(cfg, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    state = train_state_from_hf(plan, LLAMA)
    assert int(state.step) == 0
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), values)
    jax.tree.map(
        lambda p, s: (p.sharding == s) or pytest.fail(f"{p.sharding} != {s}"),
        state.params,
        plan.param_shardings,
    )
    fresh = init_optimizer_state(plan, state.params)  # a fresh optimizer for these weights
    jax.tree.map(np.testing.assert_array_equal, *jax.device_get((state.opt_state, fresh)))


def test_train_state_from_hf_refuses_another_model_naming_the_field():
    cfg, _ = import_hf(LLAMA, seq_length=16)
    other = dataclasses.replace(cfg, hidden_size=cfg.hidden_size // 2)
    with pytest.raises(
        ValueError,
        match=rf"hidden_size={cfg.hidden_size} in the directory, {other.hidden_size} in this run",
    ):
        train_state_from_hf(_plan(other), LLAMA)
