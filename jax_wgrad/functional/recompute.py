"""Megatron's activation recomputation for layers run by
:func:`~jax_wgrad.functional.scan_layers` (:class:`LayerRecompute`).

The checkpoint sits on the LAYERS, inside the layer scan (``lax.scan(jax.checkpoint(layer,
policy))``), never around a whole stage: the forward scan then stacks per layer only what
the policy saves, and the backward scan recomputes one layer (or one group of layers) at a
time inside its own iteration. A checkpoint around the stage instead makes the backward
re-run the whole forward scan first, stacking every layer's recomputed activations (and
zero-filling and copying the stacks) before the transposed scan starts.

Per layer, what is saved for the backward:

* ``granularity=None`` (Megatron's default, no recomputation): every GEMM output
  (``dots_saveable``), the outputs of the library's custom-call GEMMs, token exchanges and
  row-parallel reductions (checkpoint name :data:`~jax_wgrad.functional.saved.SAVED`) and
  of the cuDNN attention forward (its output and softmax statistics); only elementwise
  ops, norms and casts are recomputed, inside the layer's backward;
* ``"selective"``: the linear layers' outputs (``dots_with_no_batch_dims_saveable``) and the
  named activations; the attention core (its batched ``QK^T`` and ``PV`` GEMMs, the softmax,
  a cuDNN attention forward) is recomputed -- Megatron's selective recomputation;
* ``"full"`` with Megatron's ``recompute_method`` and ``recompute_num_layers`` ``N``:
  ``"uniform"`` checkpoints the input of every group of ``N`` consecutive layers and
  recomputes the group in its backward (the last group may be shorter); ``"block"``
  checkpoints the input of each of the first ``N`` layers (of the stage, or of the model
  chunk with interleaving) and recomputes it, the remaining layers saving as with ``None``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax

from jax_wgrad._validation import check_recompute
from jax_wgrad.functional.saved import SAVED

__all__ = ["LayerRecompute", "LayerGroup", "ATTENTION_FORWARD_PRIMITIVES", "policy"]

ATTENTION_FORWARD_PRIMITIVES = frozenset(
    {"dot_product_attention_fwd", "dot_product_attention_fwd_wrapper"}
)
"""Names of jax's cuDNN fused-attention forward primitives
(``jax._src.cudnn.fused_attention_stablehlo``; the wrapper is what
:func:`jax.nn.dot_product_attention` binds): their outputs (the attention output and the
softmax statistics its backward reads) are saved unless the attention is recomputed."""


def _attention_forward(prim, *_, **__) -> bool:
    return prim.name in ATTENTION_FORWARD_PRIMITIVES


_NAMED = jax.checkpoint_policies.save_only_these_names(SAVED)
_both = jax.checkpoint_policies.save_from_both_policies
_POLICIES: dict[str | None, Any] = {
    None: _both(_both(jax.checkpoint_policies.dots_saveable, _NAMED), _attention_forward),
    "selective": _both(jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _NAMED),
    "full": jax.checkpoint_policies.nothing_saveable,
}


def policy(granularity: Literal["full", "selective"] | None):
    """The ``jax.checkpoint`` policy of one checkpointed layer (group) at ``granularity``
    (module docstring)."""
    if granularity not in _POLICIES:
        raise ValueError(
            f"recompute granularity must be None, 'full' or 'selective'; got {granularity!r}"
        )
    return _POLICIES[granularity]


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """``count`` consecutive runs of ``size`` layers each, from layer ``first`` on (of the
    layers scanned), each run one ``jax.checkpoint`` with ``policy``."""

    first: int
    size: int
    count: int
    policy: Any


@dataclasses.dataclass(frozen=True)
class LayerRecompute:
    """Megatron's ``recompute_granularity``, ``recompute_method`` and
    ``recompute_num_layers`` for one run of layers (module docstring), checked by
    Megatron's rules (:func:`jax_wgrad._validation.check_recompute`, as ``ParallelConfig``
    checks its fields).

    Attributes:
      granularity: ``None``, ``"selective"`` or ``"full"``.
      method: ``"uniform"`` or ``"block"`` (``"full"`` only, and then required).
      num_layers: ``N`` >= 1 (``"full"`` only, and then required).
    """

    granularity: Literal["full", "selective"] | None = None
    method: Literal["uniform", "block"] | None = None
    num_layers: int | None = None

    def __post_init__(self) -> None:
        check_recompute(self.granularity, self.method, self.num_layers)

    def groups(self, count: int) -> tuple[LayerGroup, ...]:
        """How ``count`` layers are checkpointed, in order (:class:`LayerGroup`\\ s that
        cover ``0 .. count - 1``)."""
        if count < 1:
            raise ValueError(f"LayerRecompute.groups: need at least one layer, got {count}")
        if self.granularity != "full":
            return (LayerGroup(0, 1, count, policy(self.granularity)),)
        n, full = self.num_layers, policy("full")
        if self.method == "block":
            k = min(n, count)
            out = [LayerGroup(0, 1, k, full)]
            if count > k:
                out.append(LayerGroup(k, 1, count - k, policy(None)))
            return tuple(out)
        size = min(n, count)
        out = [LayerGroup(0, size, count // size, full)]
        if count % size:
            out.append(LayerGroup(count - count % size, count % size, 1, full))
        return tuple(out)
