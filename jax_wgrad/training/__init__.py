"""Tier: training -- the per-run plan, the jitted train step, data, and the
single-device gradient-accumulation helper."""

from jax_wgrad.training.accumulate import accumulate_gradients
from jax_wgrad.training.data import VOCAB_SIZE, ByteDataset
from jax_wgrad.training.plan import TrainPlan, mesh_shape
from jax_wgrad.training.step import (
    TrainState,
    build_train_step,
    default_optimizer,
    init_train_state,
    shard_batch,
)

__all__ = ["ByteDataset", "TrainPlan", "TrainState", "VOCAB_SIZE", "accumulate_gradients",
           "build_train_step", "default_optimizer", "init_train_state", "mesh_shape",
           "shard_batch"]
