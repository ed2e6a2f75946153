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
(:mod:`~jax_wgrad.parallel.schedules`): in each tick a stage runs its next task
if what it consumes arrived in an earlier tick, else waits. So the order is Megatron's
and the ticks are the lock-step executor's. With ``split_backward`` (the zero-bubble
variant, ``zb-h1`` with ``V > 1``) ``B`` computes input gradients only and a stage that
would wait runs its oldest pending ``W`` instead (and the rest after its last ``B``); as in
ZB-H1 the activations stay within the non-split bound: a stage holding ``warmup + 1``
microbatches from ``F`` to ``W`` runs a pending ``W`` before its next ``F``.

**Paired ticks** (``1f1b-paired`` with ``V > 1``): the same order, and a stage that runs its
next task runs the one after it in the same tick too when it is of the other kind and
ready (its input arrived in an earlier tick), as :func:`~.schedules.one_f_one_b_paired`
does for one chunk. Megatron's warm-up covers the lock step's round trips once a tick holds
an ``F`` and a ``B``: under lock step the makespan is the bubble bound
``(M V + P - 1) (F + B) / V`` (``F``, ``B``: a whole stage's forward and backward), with
Megatron's activation bound plus at most one pair (the tick's ``B`` holds its own).
"""

from __future__ import annotations

import numpy as np

from jax_wgrad.parallel.schedules import IDLE, ScheduleTable, source_of

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
    paired: bool = False,
) -> ScheduleTable:
    """The interleaved table (module docstring); ``paired``: a ``B`` and an ``F`` may share
    a tick (not with ``split_backward``).

    Raises:
      ValueError: ``num_chunks < 2``, one stage, a group smaller than ``P``, or (default
        group size) ``M`` not a multiple of ``P`` -- Megatron's rule and wording; ``paired``
        with ``split_backward``.
    """
    p, m, v = num_stages, num_microbatches, num_chunks
    if paired and split_backward:
        raise ValueError("interleaved schedule: paired ticks have no split-backward form")
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
    rows = _run_orders(orders, p, m, v, split_backward, bound, paired)
    tables = {k: np.full((len(rows), p), IDLE) for k in "FBW"}
    chunks = {k: np.zeros((len(rows), p), np.int32) for k in "FBW"}
    for t, row in enumerate(rows):
        for s, tasks in enumerate(row):
            for kind, mb, chunk in tasks:
                tables[kind][t, s], chunks[kind][t, s] = mb, chunk
    name = "interleaved-" + ("zb-h1" if split_backward else "1f1b-paired" if paired else "1f1b")
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


def _run_orders(
    orders, p: int, m: int, v: int, split_backward: bool, bound: list[int], paired: bool = False
):
    """Ticks of the per-stage orders, per tick and stage a list of tasks: a task runs when
    its inputs arrived in an earlier tick (:meth:`ScheduleTable.source`); with
    ``split_backward`` an idle stage, or one about to exceed ``bound[s]`` pairs from ``F``
    to ``W``, runs its oldest pending ``W``; ``paired``: the task after a stage's running
    one runs in the same tick too if it is of the other kind and ready."""
    done = {k: np.full((p, v, m), -1, np.int64) for k in "FB"}
    nxt = [0] * p
    pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    held = [0] * p  # F done, W not yet (split backward)
    rows: list[list[list[tuple[str, int, int]]]] = []
    t = 0
    while any(nxt[s] < len(orders[s]) or pending[s] for s in range(p)):
        row: list[list[tuple[str, int, int]]] = []
        for s in range(p):
            task = orders[s][nxt[s]] if nxt[s] < len(orders[s]) else None
            full = split_backward and task is not None and task[0] == "F" and held[s] >= bound[s]
            if task is not None and not (full and pending[s]) and _ready(task, s, done, p, v, t):
                tasks = [task]
                after = orders[s][nxt[s] + 1] if nxt[s] + 1 < len(orders[s]) else None
                if paired and after is not None and after[0] != task[0]:
                    if _ready(after, s, done, p, v, t):
                        tasks.append(after)
                row.append(tasks)
            elif split_backward and pending[s]:
                mb, chunk = pending[s].pop(0)
                row.append([("W", mb, chunk)])
                held[s] -= 1
            else:
                row.append([])
        if not any(row):
            raise RuntimeError(
                f"interleaved schedule: no stage can run anything at tick {t} "
                f"(next tasks {[o[n] if n < len(o) else None for o, n in zip(orders, nxt)]})"
            )
        for s, tasks in enumerate(row):
            for kind, mb, chunk in tasks:
                if kind == "W":
                    continue
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
