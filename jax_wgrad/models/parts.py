"""What a model hands the library so that it can be laid out and pipelined: its NNX
modules and how they are placed (:class:`ModelParts`).

A model built as ``embed -> layers -> head`` names, for the library's layout
(:class:`jax_wgrad.layout.StageLayout`), everything the layout cannot read from the
modules themselves:

* its three parts as NNX module constructors (zero-argument callables the layout calls
  only abstractly, under ``nnx.eval_shape`` / ``jax.eval_shape``: shapes, variable metadata
  and the order ``__init__`` registers the parameters in, no arrays), each building the
  part for ONE tensor rank, with the key of its parameters in the canonical form (what
  checkpoints and Hugging Face files hold);
* its layer kinds (:class:`LayerKind`: a dense and an MoE layer, say), which kind each
  layer is, and the period of layer kinds a pipeline stage holds whole copies of;
* the activation between stages (its width and dtype) and the sequence length.

Everything else -- the sharding of every parameter over the mesh, the canonical, layout
and per-device forms of the parameters, the gradient layout (which bucket chunk, which role
produces the gradient, fused or not, decayed or not, replicated over tensor or not) -- the
layout derives from the modules' parameter metadata (:mod:`jax_wgrad.nn.facts`).

Capabilities some models have and others do not (a tied output weight, the vocabulary
split over the pipeline, the deferred output-layer gradient's recompute mode) are small
optional protocols of :mod:`jax_wgrad.layout.program`, detected by ``isinstance``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from flax import nnx

__all__ = ["LayerKind", "ModelParts"]


@dataclasses.dataclass(frozen=True, eq=False)
class LayerKind:
    """One kind of layer: its stack's key in the canonical form (all layers of the kind,
    stacked ``[n, ...]`` in model order) and how to build one such layer.

    Attributes:
      key: e.g. ``"layers"``, ``"moe_layers"``.
      build: builds one layer for one tensor rank (called abstractly only).
      experts: the attribute of the layer whose parameters are expert weights (an MoE
        layer's ``"experts"``): they go to the ``experts`` gradient chunk, synced over the
        expert-data-parallel ranks; ``None``: none.
    """

    key: str
    build: Callable[[], nnx.Module]
    experts: str | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class ModelParts:
    """A model's modules as the layout places them (module docstring).

    Attributes:
      embed: ``(canonical key, constructor)`` of the first stage's input part (held by
        every stage in the shared gradient chunk; its gradient produced by ``pre``'s
        backward).
      kinds: the layer kinds.
      pattern: the kind (index into ``kinds``) of every layer of the model, in order.
      period: the kinds of the layers a stage holds whole copies of, in order (``(0,)``
        for a model of one kind): a stage's layers are ``L / (P V len(period))`` periods,
        each leaf of the device tree stacked over them.
      head: ``(canonical key, constructor)`` of the last stage's loss part (shared
        chunk; its gradient produced by ``post``'s backward, its linear weights fused
        there).
      seq_length: tokens per sequence; hidden_size: the activation's width between
        stages; compute_dtype: its dtype.
      sample_shape: one sample of the batch (default ``(seq_length + 1,)``, a row of
        tokens: the inputs and the shifted labels); sample_dtype: its dtype.
    """

    embed: tuple[str, Callable[[], nnx.Module]]
    kinds: tuple[LayerKind, ...]
    pattern: tuple[int, ...]
    period: tuple[int, ...]
    head: tuple[str, Callable[[], nnx.Module]]
    seq_length: int
    hidden_size: int
    compute_dtype: str = "float32"
    sample_shape: tuple[int, ...] | None = None
    sample_dtype: str = "int32"

    def __post_init__(self) -> None:
        n = len(self.kinds)
        if not self.kinds or any(not 0 <= k < n for k in (*self.pattern, *self.period)):
            raise ValueError(
                f"ModelParts: pattern {self.pattern} and period {self.period} must name "
                f"kinds 0..{n - 1}"
            )
        if not self.period or len(self.pattern) % len(self.period):
            raise ValueError(
                f"ModelParts: the {len(self.pattern)} layers are not whole periods of {self.period}"
            )

    @property
    def present(self) -> tuple[LayerKind, ...]:
        """The kinds the model has layers of (those with a stack in the canonical form)."""
        return tuple(k for i, k in enumerate(self.kinds) if i in self.pattern)
