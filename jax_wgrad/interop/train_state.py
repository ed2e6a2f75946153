"""A train state started from a Hugging Face model directory: what
``examples/pretrain_gpt.py --load-hf`` starts from."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad.interop.hf import import_hf
from jax_wgrad.training.plan import TrainPlan
from jax_wgrad.training.step import TrainState, init_optimizer_state

__all__ = ["train_state_from_hf"]


def train_state_from_hf(plan: TrainPlan, directory: str | os.PathLike) -> TrainState:
    """A train state at step 0 with the weights of the Hugging Face model in ``directory``
    (its safetensors read shard by shard, :func:`jax_wgrad.interop.import_hf`), cast to
    the plan's parameter dtype and sharded as the plan's, and a fresh optimizer state for
    them: what ``examples/pretrain_gpt.py --load-hf`` starts from.

    Raises:
      ValueError: the directory's config is unsupported or its shards are missing or
        damaged (the message names the field or file), or the plan's model differs from
        the directory's in a shape field (every differing field named with both values).
    """
    cfg, params = import_hf(  # padded as the run pads (the directory has no padding)
        directory,
        seq_length=plan.model.seq_length,
        make_vocab_size_divisible_by=plan.model.make_vocab_size_divisible_by,
    )
    diff = plan.model.shape_differences(dataclasses.asdict(cfg))
    if diff:
        raise ValueError(
            "the run's model differs from the directory's: "
            + "; ".join(f"{k}={a!r} in the directory, {b!r} in this run" for k, a, b in diff)
        )
    like = jax.eval_shape(lambda: plan.program.init_params(0))  # the run's dtypes
    params = jax.tree.map(
        lambda a, l: np.asarray(a, l.dtype), plan.program.from_canonical(params), like
    )
    params = jax.device_put(params, plan.param_shardings)
    step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(plan.mesh, P()))
    return TrainState(step, params, init_optimizer_state(plan, params))
