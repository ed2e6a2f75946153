"""The ``jax.named_scope`` names the pipeline gives its parts: the contract with the
compile analyser (:mod:`jax_wgrad.aot`), which finds the schedule's tasks, ends and
collectives in compiled HLO by the ``op_name`` these put there. Defined once here,
re-exported by :mod:`~jax_wgrad.parallel.pipeline.executor`; the modules that open the
scopes and the analyser both import them."""

from __future__ import annotations

__all__ = [
    "BACKWARD",
    "COOLDOWN_SYNC",
    "DEFERRED_DRAIN",
    "DEFERRED_RING",
    "END_SCOPES",
    "FORWARD",
    "POST",
    "PRE_BACKWARD",
    "SEND_RECV",
    "TASK_SCOPES",
    "WEIGHT",
]

FORWARD = "forward"
"""An ``F`` task (the conditional that runs it in a tick)."""
BACKWARD = "backward"
"""A ``B`` task (with layer groups: the switch of idle, a backward, the stage's last)."""
WEIGHT = "weight_gradients"
"""A ``W`` task (split backward)."""
COOLDOWN_SYNC = "grad_sync_in_cooldown"
"""A stage's data-parallel bucket sync in its cooldown tick."""
TASK_SCOPES: tuple[str, ...] = (FORWARD, BACKWARD, WEIGHT, COOLDOWN_SYNC)
"""The conditionals that run one task of a schedule tick."""

POST = "post"
"""``post`` with its backward, nested in the last virtual stage's ``F``."""
PRE_BACKWARD = "pre_backward"
"""``pre``'s backward, nested in the first virtual stage's ``B``."""
END_SCOPES: tuple[str, ...] = (POST, PRE_BACKWARD)
"""The conditionals nested in a task that run one of the pipeline's ends there
(:class:`~jax_wgrad.parallel.pipeline.ends.StageEnds`): the step estimate charges them in
the ticks whose task runs that end, not with every task."""

SEND_RECV = "send_recv"
"""The tick's permutes between neighbouring stages."""
DEFERRED_DRAIN = "deferred_wgrad_drain"
"""The deferred output-layer weight-gradient drain after the schedule."""
DEFERRED_RING = "deferred_wgrad_ring"
"""A step ``k`` of the drain's tensor ring (the scope is ``f"{DEFERRED_RING}{k}"``)."""
