"""Logits of a GPT on one device, computed by the library's own layers."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_wgrad.layout.program import lay_out
from jax_wgrad.models.gpt.config import GPTConfig
from jax_wgrad.models.gpt.program import GPTProgram
from jax_wgrad.parallel.config import ParallelConfig
from jax_wgrad.parallel.mesh import AXES

__all__ = ["single_device_logits"]


def single_device_logits(
    cfg: GPTConfig, params: dict[str, Any], ids: jax.Array, *, device: jax.Device | None = None
) -> jax.Array:
    """fp32 logits ``[B, S, V]`` of the model ``cfg`` with canonical ``params`` (as
    :func:`~jax_wgrad.models.gpt.init_params` or :func:`jax_wgrad.interop.import_hf` give
    them) for int token ids ``[B, S]``, on one device (default: the first).

    Computed by the modules the training step runs (:class:`GPTProgram`'s embedding,
    layer scan and output layer, with every parallel size 1, so no collective does
    anything), in ``cfg.compute_dtype`` as training runs them: the library's own forward,
    to compare with another implementation (Hugging Face ``transformers``, a checkpoint's
    source) or to evaluate a trained model. With RoPE any ``S`` works; with learned
    positions ``S`` must be ``cfg.seq_length``.

    Raises:
      ValueError: ``ids`` is not a 2-D integer array, or its length does not fit learned
        positions.
    """
    ids = jnp.asarray(ids)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(
            f"single_device_logits: ids must be int [B, S], got {ids.dtype}{list(ids.shape)}"
        )
    b, s = ids.shape
    if cfg.position_embedding_type == "rope":
        cfg = dataclasses.replace(cfg, seq_length=s)
    elif s != cfg.seq_length:
        raise ValueError(
            f"single_device_logits: learned positions need S = seq_length = {cfg.seq_length}, "
            f"got ids of length {s}"
        )
    device = device if device is not None else jax.devices()[0]
    parallel = ParallelConfig(micro_batch_size=b, global_batch_size=b, world_size=1)
    program = lay_out(GPTProgram(cfg, parallel, platform=device.platform))
    mesh = Mesh(np.array([device]).reshape((1,) * len(AXES)), AXES)
    tree = program.device_tree(program.from_canonical(params))

    def forward(tree, ids):
        batch = jnp.pad(ids, ((0, 0), (0, 1)))  # pre() embeds batch[:, :-1]: these ids
        x, _ = program.pre(tree, batch)
        y, _ = program.body(tree, x)
        # the true vocabulary's columns (a padded one's padding rows are no tokens)
        return program.model.logits(tree, y)[..., : cfg.vocab_size].astype(jnp.float32)

    run = jax.shard_map(forward, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=True)
    return jax.jit(run)(tree, jax.device_put(ids, device))
