"""Megatron's interleaved 1F1B (virtual pipeline stages) as a schedule table.

With ``V`` model chunks per stage, stage ``s`` holds virtual stages ``s, P + s, ...,
(V - 1) P + s`` (Megatron's layer assignment), and a microbatch passes every stage ``V``
times: from the last stage's chunk ``v`` it goes on to the first stage's chunk ``v + 1``.
Each stage runs its tasks in Megatron's order
(``megatron/core/pipeline_parallel/schedules.py::forward_backward_pipelining_with_interleaving``):

* the *schedule table* of virtual microbatches: microbatches in groups of ``G``
  (``microbatch_group_size_per_vp_stage``, default ``P``), each group through chunk 0,
  then chunk 1, ...; the backward walks the same list with the chunks reversed;
* ``(P - s - 1) * 2 + (V - 1) * G`` warm-up forwards on stage ``s`` (capped at ``M V``),
  then one forward one backward, then the cool-down backwards.

The ticks come from running those per-stage orders under the executor's rules
(:mod:`~jax_wgrad.parallel.pipeline.schedules`): in each tick a stage runs its next task
if what it consumes arrived in an earlier tick, else waits. So the order is Megatron's
and the ticks are the lock-step executor's. With ``split_backward`` (the zero-bubble
variant, ``zb-h1`` with ``V > 1``) ``B`` computes input gradients only and a stage that
would wait runs its oldest pending ``W`` instead (and the rest after its last ``B``); as in
ZB-H1 the activations stay within the non-split bound: a stage holding ``warmup + 1``
microbatches from ``F`` to ``W`` runs a pending ``W`` before its next ``F``.
"""

from __future__ import annotations

import numpy as np

from jax_wgrad.parallel.pipeline.schedules import IDLE, ScheduleTable, source_of

__all__ = ["interleaved_order", "interleaved_schedule", "virtual_microbatches", "warmup_count"]


def virtual_microbatches(
    num_microbatches: int, num_chunks: int, group_size: int
) -> list[tuple[int, int]]:
    """Megatron's schedule table: ``(microbatch, chunk)`` of each forward, in order
    (the last group may be shorter)."""
    out = []
    for start in range(0, num_microbatches, group_size):
        group = range(start, min(start + group_size, num_microbatches))
        out.extend((m, v) for v in range(num_chunks) for m in group)
    return out


def warmup_count(
    stage: int, num_stages: int, num_microbatches: int, num_chunks: int, group_size: int
) -> int:
    """Megatron's warm-up forwards on ``stage``: ``(P - s - 1) * 2 + (V - 1) * G``, at most
    ``M V``; the stage then holds at most one more microbatch-chunk."""
    return min(
        (num_stages - stage - 1) * 2 + (num_chunks - 1) * group_size, num_microbatches * num_chunks
    )


def interleaved_order(
    stage: int, num_stages: int, num_microbatches: int, num_chunks: int, group_size: int
) -> list[tuple[str, int, int]]:
    """Stage ``stage``'s ``("F" | "B", microbatch, chunk)`` tasks in Megatron's order."""
    table = virtual_microbatches(num_microbatches, num_chunks, group_size)
    total = len(table)
    warmup = warmup_count(stage, num_stages, num_microbatches, num_chunks, group_size)
    fwd = [("F", m, v) for m, v in table]
    bwd = [("B", m, num_chunks - 1 - v) for m, v in table]
    order = fwd[:warmup]
    for k in range(total - warmup):
        order += [fwd[warmup + k], bwd[k]]
    return order + bwd[total - warmup :]


def interleaved_schedule(
    num_stages: int,
    num_microbatches: int,
    num_chunks: int,
    *,
    group_size: int | None = None,
    split_backward: bool = False,
) -> ScheduleTable:
    """The interleaved table (module docstring).

    Raises:
      ValueError: ``num_chunks < 2``, one stage, a group smaller than ``P``, or (default
        group size) ``M`` not a multiple of ``P`` -- Megatron's rule and wording.
    """
    p, m, v = num_stages, num_microbatches, num_chunks
    if v < 2:
        raise ValueError(
            f"an interleaved schedule needs at least 2 model chunks per stage, got {v}"
        )
    if p < 2:
        raise ValueError(
            f"the interleaved schedule needs pipeline-model-parallel-size > 1, got {p}"
        )
    if group_size is None:
        if m % p != 0:
            raise ValueError(
                f"number of microbatches ({m}) is not divisible by "
                f"pipeline-model-parallel-size ({p}) when using interleaved "
                "schedule"
            )
        group_size = p
    if group_size < p:
        raise ValueError(
            f"microbatch_group_size_per_vp_stage ({group_size}) must be at "
            f"least pipeline-model-parallel-size ({p})"
        )
    orders = [interleaved_order(s, p, m, v, group_size) for s in range(p)]
    bound = [warmup_count(s, p, m, v, group_size) + 1 for s in range(p)]
    rows = _run_orders(orders, p, m, v, split_backward, bound)
    tables = {k: np.full((len(rows), p), IDLE) for k in "FBW"}
    chunks = {k: np.zeros((len(rows), p), np.int32) for k in "FBW"}
    for t, row in enumerate(rows):
        for s, task in enumerate(row):
            if task is not None:
                kind, mb, chunk = task
                tables[kind][t, s], chunks[kind][t, s] = mb, chunk
    name = "interleaved-zb-h1" if split_backward else "interleaved-1f1b"
    return ScheduleTable(
        name,
        tables["F"],
        tables["B"],
        tables["W"],
        split_backward=split_backward,
        num_chunks=v,
        forward_chunk=chunks["F"],
        backward_chunk=chunks["B"],
        weight_chunk=chunks["W"],
    )


def _run_orders(orders, p: int, m: int, v: int, split_backward: bool, bound: list[int]):
    """Ticks of the per-stage orders: a task runs when its inputs arrived in an earlier
    tick (:meth:`ScheduleTable.source`); with ``split_backward`` an idle stage, or one
    about to exceed ``bound[s]`` pairs from ``F`` to ``W``, runs its oldest pending ``W``."""
    done = {k: np.full((p, v, m), -1, np.int64) for k in "FB"}
    nxt = [0] * p
    pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    held = [0] * p  # F done, W not yet (split backward)
    rows: list[list[tuple[str, int, int] | None]] = []
    t = 0
    while any(nxt[s] < len(orders[s]) or pending[s] for s in range(p)):
        row: list[tuple[str, int, int] | None] = []
        for s in range(p):
            task = orders[s][nxt[s]] if nxt[s] < len(orders[s]) else None
            full = split_backward and task is not None and task[0] == "F" and held[s] >= bound[s]
            if task is not None and not (full and pending[s]) and _ready(task, s, done, p, v, t):
                row.append(task)
            elif split_backward and pending[s]:
                mb, chunk = pending[s].pop(0)
                row.append(("W", mb, chunk))
                held[s] -= 1
            else:
                row.append(None)
        if all(r is None for r in row):
            raise RuntimeError(
                f"interleaved schedule: no stage can run anything at tick {t} "
                f"(next tasks {[o[n] if n < len(o) else None for o, n in zip(orders, nxt)]})"
            )
        for s, task in enumerate(row):
            if task is None or task[0] == "W":
                continue
            kind, mb, chunk = task
            done[kind][s, chunk, mb] = t
            nxt[s] += 1
            held[s] += kind == "F" and split_backward
            if kind == "B" and split_backward:
                pending[s].append((mb, chunk))
        rows.append(row)
        t += 1
    return rows


def _ready(task, s: int, done, p: int, v: int, t: int) -> bool:
    kind, mb, chunk = task
    src = source_of(kind, s, chunk, p, v)
    if src is not None:
        return 0 <= done[kind][src[0], src[1], mb] < t
    if kind == "B":  # the last virtual stage: its own F ran the loss
        return 0 <= done["F"][s, chunk, mb] < t
    return True
