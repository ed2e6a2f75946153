"""Per-parameter facts carried as NNX variable metadata, read back by models.

A layer states, for every parameter it creates, what the gradient machinery needs to know
about it -- without knowing where it sits in a model:

* ``tensor_axis``: the dim split over the tensor axis, or ``None`` (replicated over tensor
  ranks: counted once in the gradient norm, all-reduced over ``tensor`` under sequence
  parallelism);
* ``weight_decay``: Megatron decays weights and embedding tables, not biases and norms;
* ``fused_wgrad``: the gradient can be accumulated by the fused weight-gradient GEMM (a
  linear layer's weight), when gradient accumulation fusion is on;
* ``expert_axis``: the dim split over the expert-parallel axis (a MoE layer's stacked
  expert weights), or ``None``. When ``tensor_axis`` names the same dim, that dim is split
  over ``(expert, tensor)`` (Megatron's MoE parallel folding).

Read them with ``variable.get_metadata()`` (e.g. over ``nnx.split(module)[1]``).
"""

from __future__ import annotations

__all__ = ["param_facts", "FACT_KEYS"]

FACT_KEYS = ("tensor_axis", "weight_decay", "fused_wgrad", "expert_axis")


def param_facts(
    tensor_axis: int | None,
    *,
    weight_decay: bool = False,
    fused_wgrad: bool = False,
    expert_axis: int | None = None,
) -> dict:
    """The metadata keyword arguments for ``nnx.Param(value, **param_facts(...))``."""
    return {
        "tensor_axis": tensor_axis,
        "weight_decay": weight_decay,
        "fused_wgrad": fused_wgrad,
        "expert_axis": expert_axis,
    }
