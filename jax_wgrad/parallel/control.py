"""Branches on facts that are static in some layouts and traced in others.

Inside ``shard_map`` a device's pipeline stage is ``lax.axis_index`` (traced) when there
are several stages, and a Python constant when there is one; "this is the last stage" is
then ``True``. :func:`cond` runs the branch itself for a Python ``bool``: no conditional
in the program, so nothing for XLA:GPU to read back on the host (a ``ConditionalThunk``
outside a CUDA graph copies its predicate to the host and waits,
``docs/design/aot.md``), and a traced predicate gets ``lax.cond`` as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax

__all__ = ["Predicate", "cond"]

Predicate = bool | jax.Array
"""A Python ``bool`` (static: known when the program is traced) or a traced ``bool``."""


def cond(pred: Predicate, true_fn: Callable, false_fn: Callable, *operands: Any) -> Any:
    """``lax.cond(pred, true_fn, false_fn, *operands)``, or the branch ``pred`` names when
    it is a Python ``bool`` (the other branch is never traced)."""
    if isinstance(pred, bool):
        return (true_fn if pred else false_fn)(*operands)
    return lax.cond(pred, true_fn, false_fn, *operands)
