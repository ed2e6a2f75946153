"""What the gradient machinery needs to know about one parameter (:class:`GradSpec`).

A model hands the gradient tier a tree of :class:`GradSpec` shaped like the per-device
parameters it lays out; nothing in :mod:`jax_wgrad.grads` knows which model, layer or
parameter path it is looking at.

**Chunks** are separately planned groups of buckets (Megatron keeps one buffer per model
chunk): :data:`STAGE` holds a pipeline stage's own layers (synced over ``data`` in the
cooldown once the stage's last backward is done), :data:`EXPERTS` the stage's expert
weights of its MoE layers (Megatron's expert-parallel buffers: synced like the stage chunk,
but over the expert-data-parallel ranks with Megatron's expert scaling; empty for a dense
model), :data:`SHARED` the parameters every pipeline stage holds a replica of (embedding,
head: synced after the schedule, then summed over ``pipeline``).

**Roles** are the parts of a pipeline step whose backward produces gradients:
:data:`INPUT` (the first stage, before the layers: the embedding), :data:`LAYERS` (every
stage) and :data:`OUTPUT` (the last stage, after the layers: the head and loss). A tied word
embedding gets gradients from :data:`INPUT` and :data:`OUTPUT`.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "GradSpec",
    "STAGE",
    "EXPERTS",
    "SHARED",
    "INPUT",
    "LAYERS",
    "OUTPUT",
    "CHUNKS",
    "ROLES",
    "STACKED",
]

STAGE = "stage"
"""Chunk of a pipeline stage's own (dense) parameters."""
EXPERTS = "experts"
"""Chunk of a pipeline stage's expert weights (different on every expert-parallel rank)."""
SHARED = "shared"
"""Chunk of the parameters replicated on every pipeline stage."""
CHUNKS: tuple[str, ...] = (STAGE, EXPERTS, SHARED)
"""Chunks in bucket order."""
STACKED: tuple[str, ...] = (STAGE, EXPERTS)
"""Chunks whose every leaf is stacked over the stage's layers, ``[n, ...]``: with ``V``
model chunks per stage (interleaved schedules) model chunk ``v`` is rows
``[v n / V, (v + 1) n / V)`` of every leaf (a :class:`~jax_wgrad.grads.chunks.Window`)."""

INPUT = "input"
LAYERS = "layers"
OUTPUT = "output"
ROLES: tuple[str, ...] = (INPUT, LAYERS, OUTPUT)


@dataclasses.dataclass(frozen=True)
class GradSpec:
    """The gradient facts of one parameter.

    Attributes:
      chunk: :data:`STAGE` or :data:`SHARED` (see the module docstring).
      roles: the roles whose backward produces a gradient for it.
      fused_in: the role whose fused weight-gradient GEMM accumulates its gradient directly
        into its bucket block when gradient accumulation fusion is on (a linear layer's
        weight); ``None`` if its gradient is always an ordinary array.
      tensor_replicated: the same value on every tensor rank (LayerNorms, row-parallel
        biases, positions): counted once in the norm, all-reduced over ``tensor`` under
        sequence parallelism.
      weight_decay: Megatron decays weights and embedding tables, not biases and norms.
      tied_embedding: the word embedding tied to the output layer (Megatron's
        ``shared_embedding``: a bucket of its own under the distributed optimizer).
      pipeline_sharded: a :data:`SHARED` parameter split over the pipeline stages (the
        vocabulary over the pipeline): each stage's gradient is its own shard's, neither
        summed over ``pipeline`` nor counted once in the norm.
    """

    chunk: str
    roles: frozenset[str]
    fused_in: str | None = None
    tensor_replicated: bool = False
    weight_decay: bool = False
    tied_embedding: bool = False
    pipeline_sharded: bool = False

    def __post_init__(self) -> None:
        if self.chunk not in CHUNKS:
            raise ValueError(f"GradSpec: chunk must be one of {CHUNKS}, got {self.chunk!r}")
        object.__setattr__(self, "roles", frozenset(self.roles))
        unknown = sorted(self.roles - set(ROLES))
        if not self.roles or unknown:
            raise ValueError(
                f"GradSpec: roles must be a non-empty subset of {ROLES}, got {sorted(self.roles)}"
            )
        if self.fused_in is not None and self.fused_in not in self.roles:
            raise ValueError(
                f"GradSpec: fused_in {self.fused_in!r} is not one of its roles {sorted(self.roles)}"
            )

    @property
    def pipeline_shared(self) -> bool:
        """Held by every pipeline stage (counted once in the norm, summed over
        ``pipeline``)."""
        return self.chunk == SHARED and not self.pipeline_sharded

    def added_by(self, role: str, fusion: bool) -> bool:
        """Whether ``role``'s backward adds an ordinary gradient array for this parameter
        (not when the fused GEMM of that role already accumulated it)."""
        return role in self.roles and not (fusion and self.fused_in == role)
