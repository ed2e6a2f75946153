"""Tier: training -- the per-run plan, the jitted train step, data, and the
single-device gradient-accumulation helper."""

from jax_wgrad.training.accumulate import accumulate_gradients
from jax_wgrad.training.checkpoint import Checkpointer
from jax_wgrad.training.data import VOCAB_SIZE, BlendedDataset, ByteDataset, TokenDataset, load_data
from jax_wgrad.training.plan import TrainPlan, mesh_shape
from jax_wgrad.training.step import (
    TrainState,
    build_eval_step,
    build_train_step,
    default_optimizer,
    init_optimizer_state,
    init_train_state,
    shard_batch,
)

__all__ = [
    "BlendedDataset",
    "ByteDataset",
    "Checkpointer",
    "TokenDataset",
    "TrainPlan",
    "TrainState",
    "VOCAB_SIZE",
    "accumulate_gradients",
    "build_eval_step",
    "build_train_step",
    "default_optimizer",
    "init_optimizer_state",
    "init_train_state",
    "load_data",
    "mesh_shape",
    "shard_batch",
]
