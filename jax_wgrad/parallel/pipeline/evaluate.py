"""The forward-only pipeline of an evaluation step: no backward, no gradients.

A table of forward tasks only (:func:`forward_table`: stage ``s`` forwards microbatch
``t - s`` in tick ``t``, ``M + P - 1`` ticks), run as one ``lax.scan`` like the training
executor: the first stage embeds, every stage runs its layers and sends the activation on
(one acyclic ``ppermute``), the last stage sums the token losses of its head.

With ``V`` model chunks per stage (interleaved layouts) the table is walked once per chunk
(``V (M + P - 1)`` ticks, chunk ``v`` in pass ``v``): the last stage's chunk-``v`` outputs
go over the ring edge (its own acyclic ``ppermute``) into a ``[M, ...]`` buffer on the
first stage, which its chunk ``v + 1`` reads in the next pass. A program whose ends are
collectives over ``pipeline`` (``ends_over_pipeline``) has ``pre`` / ``post`` run on every
stage in the ticks where the first / last stage needs them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_wgrad.grads.chunks import DeviceTree, Window
from jax_wgrad.parallel.mesh import PIPELINE
from jax_wgrad.parallel.pipeline.program import StageProgram
from jax_wgrad.parallel.schedules import IDLE

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
    nv = program.parallel.num_model_chunks
    micro = setup.microbatches(batch, "eval_loss")
    stage = setup.stage_index()
    act = setup.zero_activation()
    clip = lambda i: jnp.clip(i, 0, m - 1)

    spread = program.ends_over_pipeline
    batch_of = lambda i: lax.dynamic_index_in_dim(micro, clip(i), 0, keepdims=False)
    pre = lambda i: program.pre(params, batch_of(i))[0]
    post = lambda y, i: program.post(params, y, batch_of(i))[0]
    zero = lambda: jnp.float32(0.0)

    def tick(carry, xs):
        x_recv, ring, loss_sum = carry
        row, v = xs
        f = row[stage]
        first, last = jnp.where(v == 0, row[0], -1), jnp.where(v == nv - 1, row[pp - 1], -1)
        x_pre = lax.cond(first >= 0, lambda: pre(first), lambda: act) if spread else None

        def first_input():
            embed = (lambda: x_pre) if spread else (lambda: pre(f))
            if nv == 1:
                return embed()
            return lax.cond(
                v == 0, embed, lambda: lax.dynamic_index_in_dim(ring, clip(f), 0, keepdims=False)
            )

        def forward(x_recv):
            x = lax.cond(stage == 0, first_input, lambda: x_recv)
            y, _ = program.body(params, x, layers=Window(v, nv) if nv > 1 else None)
            loss = (
                zero()
                if spread
                else lax.cond((stage == pp - 1) & (v == nv - 1), lambda: post(y, f), zero)
            )
            return y, loss

        y, loss = lax.cond(f >= 0, forward, lambda x: (act, jnp.float32(0.0)), x_recv)
        if spread:  # every stage its share of the head; the loss counted on the last
            loss = lax.cond(last >= 0, lambda: post(y, last), zero)
            loss = jnp.where(stage == pp - 1, loss, 0.0)
        if pp > 1:
            x_recv = lax.ppermute(y, PIPELINE, [(i, i + 1) for i in range(pp - 1)])
        if nv > 1:  # the ring edge: the last stage's chunk v -> the first stage's v + 1
            sent = row[pp - 1]
            y_ring = lax.ppermute(y, PIPELINE, [(pp - 1, 0)])
            ring = lax.cond(
                (stage == 0) & (sent >= 0) & (v < nv - 1),
                lambda r: lax.dynamic_update_index_in_dim(r, y_ring, clip(sent), 0),
                lambda r: r,
                ring,
            )
        return (x_recv, ring, loss_sum + loss), None

    table = forward_table(pp, m)
    rows = jnp.asarray(np.tile(table, (nv, 1)))
    chunks = jnp.asarray(np.repeat(np.arange(nv, dtype=np.int32), table.shape[0]))
    ring = jnp.zeros((m if nv > 1 else 0, *act.shape), act.dtype)
    (_, _, loss_sum), _ = lax.scan(tick, (act, ring, jnp.float32(0.0)), (rows, chunks))
    return setup.mean_loss(loss_sum)
