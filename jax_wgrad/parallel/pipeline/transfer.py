"""What pipeline stages send each other at the end of a tick, and where it is kept.

Activations go ``s -> s + 1``, gradients ``s + 1 -> s``: two acyclic ``ppermute``\\ s over
``pipeline``. With ``V > 1`` model chunks per stage (interleaved schedules) the last
stage's chunk ``v`` feeds the first stage's chunk ``v + 1`` (and the gradient goes back):
the ring edge ``P - 1 -> 0`` is its own acyclic permute (one cyclic permute over a mesh
axis with other axes returns zeros on XLA:GPU: docs/design/pipeline_executor.md). Every
device runs every permute every tick (all stages take part in a collective); what a
receiver gets is written at the inbox slot of the (chunk, microbatch) the sender's table
row names, or at the spare last slot (never read) when the sender ran nothing or its
output leaves the pipeline.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_wgrad.parallel.mesh import PIPELINE
from jax_wgrad.parallel.pipeline.scopes import SEND_RECV

__all__ = ["exchange", "inbox_index"]


def inbox_index(depth: int, chunk, microbatch):
    """Slot of (``chunk``, ``microbatch``) in an inbox of ``depth`` slots per chunk."""
    return chunk * depth + microbatch % depth


def exchange(
    inboxes: tuple[jax.Array, jax.Array],
    y: jax.Array,
    dx: jax.Array,
    fwd,
    bwd,
    *,
    stage,
    num_stages: int,
    num_chunks: int,
    depth: tuple[int, int],
) -> tuple[jax.Array, jax.Array]:
    """Sends this tick's ``y`` (forward output) and ``dx`` (input gradient) and files what
    arrives (inside ``shard_map``).

    Args:
      inboxes: ``(activation_inbox, gradient_inbox)``, each ``[V depth + 1, ...]``.
      fwd, bwd: ``(microbatch row, chunk row)`` of the tick's ``F`` / ``B`` tasks,
        ``int32 [P]`` each.
      stage: this device's stage (traced); depth: slots per chunk of the two inboxes.
    Returns:
      The updated inboxes.
    """
    pp, nv = num_stages, num_chunks
    is_first, is_last = stage == 0, stage == pp - 1
    with jax.named_scope(SEND_RECV):
        x_recv = lax.ppermute(y, PIPELINE, [(i, i + 1) for i in range(pp - 1)])
        g_recv = lax.ppermute(dx, PIPELINE, [(i + 1, i) for i in range(pp - 1)])
        if nv > 1:
            x_recv = jnp.where(is_first, lax.ppermute(y, PIPELINE, [(pp - 1, 0)]), x_recv)
            g_recv = jnp.where(is_last, lax.ppermute(dx, PIPELINE, [(0, pp - 1)]), g_recv)
    prev, nxt = (stage - 1) % pp, (stage + 1) % pp
    # The receiver's chunk: the sender's, one on over the ring edge.
    m_x, v_x = fwd[0][prev], fwd[1][prev] + is_first
    m_g, v_g = bwd[0][nxt], bwd[1][nxt] - is_last
    x_slot = jnp.where((m_x >= 0) & (v_x < nv), inbox_index(depth[0], v_x, m_x), nv * depth[0])
    g_slot = jnp.where((m_g >= 0) & (v_g >= 0), inbox_index(depth[1], v_g, m_g), nv * depth[1])
    activation_inbox, gradient_inbox = inboxes
    return (
        lax.dynamic_update_index_in_dim(activation_inbox, x_recv, x_slot, 0),
        lax.dynamic_update_index_in_dim(gradient_inbox, g_recv, g_slot, 0),
    )
