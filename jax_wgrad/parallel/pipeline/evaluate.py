"""The forward-only pipeline of an evaluation step: no backward, no gradients.

A table of forward tasks only (:func:`forward_table`: stage ``s`` forwards microbatch
``t - s`` in tick ``t``, ``M + P - 1`` ticks), run as one ``lax.scan`` like the training
executor: the first stage embeds, every stage runs its layers and sends the activation on
(one acyclic ``ppermute``), the last stage sums the token losses of its head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_wgrad.parallel.mesh import PIPELINE
from jax_wgrad.parallel.pipeline.schedules import IDLE
from jax_wgrad.grads.chunks import DeviceTree
from jax_wgrad.parallel.pipeline.program import StageProgram

__all__ = ["forward_table", "eval_loss"]


def forward_table(num_stages: int, num_microbatches: int) -> np.ndarray:
    """``int32 [M + P - 1, P]``: the microbatch each stage forwards per tick, or IDLE."""
    t = np.arange(num_microbatches + num_stages - 1)[:, None]
    f = t - np.arange(num_stages)[None, :]
    return np.where((f >= 0) & (f < num_microbatches), f, IDLE).astype(np.int32)


def eval_loss(program: StageProgram, params: DeviceTree, batch: jax.Array) -> jax.Array:
    """Mean token loss of one global batch (inside ``shard_map``; ``params``: the device
    tree; ``batch``: ``[global_batch / dp, ...]`` this data rank's)."""
    setup = program.setup
    pp, m = setup.num_stages, setup.num_microbatches
    micro = setup.microbatches(batch, "eval_loss")
    stage = setup.stage_index()
    act = setup.zero_activation()

    def tick(carry, row):
        x_recv, loss_sum = carry
        f = row[stage]

        def forward(x_recv):
            mb = lax.dynamic_index_in_dim(micro, jnp.clip(f, 0, m - 1), 0, keepdims=False)
            x = lax.cond(stage == 0, lambda: program.pre(params, None, mb)[0], lambda: x_recv)
            y, _ = program.body(params, None, x)
            loss = lax.cond(stage == pp - 1, lambda: program.post(params, None, y, mb)[0],
                            lambda: jnp.float32(0.0))
            return y, loss

        y, loss = lax.cond(f >= 0, forward, lambda x: (act, jnp.float32(0.0)), x_recv)
        if pp > 1:
            y = lax.ppermute(y, PIPELINE, [(i, i + 1) for i in range(pp - 1)])
        return (y, loss_sum + loss), None

    (_, loss_sum), _ = lax.scan(tick, (act, jnp.float32(0.0)),
                                jnp.asarray(forward_table(pp, m)))
    return setup.mean_loss(loss_sum)
