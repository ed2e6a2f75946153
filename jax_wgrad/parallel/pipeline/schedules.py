"""Pipeline schedules as data: a per-tick, per-stage table of tasks.

A schedule is a pure function ``(num_stages, num_microbatches) -> ScheduleTable``. The
executor (:mod:`jax_wgrad.parallel.pipeline.executor`) runs ANY valid table in one
``lax.scan`` over ticks: it reads the table (as arrays indexed by the tick) instead of
re-deriving formulas, so adding a schedule is adding a table.

**Tasks.** ``F``: a microbatch's forward through the stage (on the last stage also the loss
and the head's backward). ``B``: its backward through the stage's layers -- the whole
backward, or with ``split_backward`` only the input gradients. ``W``: with
``split_backward``, the weight-gradient GEMMs of a microbatch whose ``B`` ran (zero-bubble
pipelining, Qi et al., ICLR 2024).

**Tick semantics** (the executor's): all stages advance in lock step. In a tick, a stage
runs its ``F``, then its ``B``, then its ``W`` task, each on the microbatch the table names
(or nothing: ``IDLE``). At the end of the tick every stage sends the output of its ``F`` to
the next stage and the input gradient of its ``B`` to the previous one (two acyclic
``ppermute``\\ s); what a stage receives is kept in a slot until the task that consumes it
runs. A tick lasts as long as the busiest stage's work in it (:meth:`ScheduleTable.makespan`).
:meth:`ScheduleTable.validate` checks the rules: every stage runs each task of every
microbatch once, in microbatch order; ``F(m)`` on stage ``s > 0`` in a later tick than on
``s - 1``; ``B(m)`` on ``s < P - 1`` in a later tick than on ``s + 1``; ``B(m)`` not before
``F(m)`` and ``W(m)`` not before ``B(m)`` on the same stage (the same tick is fine).

**Schedules.** :func:`one_f_one_b` and :func:`zb_h1` come from one list scheduler
(:func:`list_schedule`): each tick a stage runs ONE task: a ready ``B`` first (the critical
path), else an ``F`` if fewer than ``P - s`` microbatches are in flight on it (Megatron's
1F1B activation bound), else (zero bubble) a pending ``W``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

__all__ = ["IDLE", "ScheduleTable", "list_schedule", "one_f_one_b", "zb_h1", "SCHEDULES",
           "get_schedule"]

IDLE = -1
"""Table entry of a stage that has no such task in a tick."""

Task = Literal["F", "B", "W"]


@dataclasses.dataclass(frozen=True, eq=False)
class ScheduleTable:
    """``forward[t, s]`` / ``backward[t, s]`` / ``weight[t, s]``: the microbatch stage ``s``
    runs that task on in tick ``t``, or :data:`IDLE`.

    Attributes:
      name: the schedule's name.
      forward, backward: ``int32 [num_ticks, num_stages]``.
      weight: likewise; all :data:`IDLE` unless ``split_backward``.
      split_backward: ``B`` computes input gradients only and ``W`` the weight gradients.
    """

    name: str
    forward: np.ndarray
    backward: np.ndarray
    weight: np.ndarray | None = None
    split_backward: bool = False

    def __post_init__(self) -> None:
        if self.weight is None:
            object.__setattr__(self, "weight", np.full_like(np.asarray(self.forward), IDLE))
        for field in ("forward", "backward", "weight"):
            value = np.asarray(getattr(self, field), np.int32)
            value.setflags(write=False)
            object.__setattr__(self, field, value)
        self.validate()

    # -------------------------------------------------------------------------- shape

    @property
    def num_ticks(self) -> int:
        return int(self.forward.shape[0])

    @property
    def num_stages(self) -> int:
        return int(self.forward.shape[1])

    @property
    def num_microbatches(self) -> int:
        return int(self.forward.max()) + 1

    def _table(self, task: Task) -> np.ndarray:
        return {"F": self.forward, "B": self.backward, "W": self.weight}[task]

    def ticks(self, task: Task, stage: int) -> np.ndarray:
        """Ticks of ``stage``'s ``task``, indexed by microbatch (-1: never)."""
        col = self._table(task)[:, stage]
        out = np.full(self.num_microbatches, -1, np.int64)
        for t in np.flatnonzero(col != IDLE):
            out[col[t]] = t
        return out

    # -------------------------------------------------------------------------- facts

    def last_grad_tick(self, stage: int) -> int:
        """Tick of ``stage``'s last ``B`` or ``W``: after it the stage's gradients are
        complete and its buckets can be synced (the cooldown sync)."""
        last = int(self.ticks("B", stage).max())
        if self.split_backward:
            last = max(last, int(self.ticks("W", stage).max()))
        return last

    def live_count(self, stage: int, start: Task, end: Task) -> int:
        """Most microbatches ``stage`` has run ``start`` but not yet ``end`` of (both ticks
        included)."""
        a, b = self.ticks(start, stage), self.ticks(end, stage)
        return max(int(((a <= t) & (b >= t)).sum()) for t in range(self.num_ticks))

    def in_flight(self, stage: int) -> int:
        """Most microbatches ``stage`` holds activations of at once: from the tick its
        ``F`` ran through the tick its last task on them ran (``W`` if split, else ``B``)."""
        return self.live_count(stage, "F", "W" if self.split_backward else "B")

    @property
    def num_slots(self) -> int:
        """Residual slots per stage (a microbatch's from its ``F`` to its ``B``): the
        largest count over stages. Stored at ``microbatch % num_slots``, safe because every
        stage runs its microbatches in order (the live ones are consecutive)."""
        return max(self.live_count(s, "F", "B") for s in range(self.num_stages))

    @property
    def weight_slots(self) -> int:
        """W-stash slots per stage (a microbatch's from its ``F``, which records the fused
        linears' inputs, to its ``W``); 0 unless ``split_backward``."""
        if not self.split_backward:
            return 0
        return max(self.live_count(s, "F", "W") for s in range(self.num_stages))

    def inbox_depth(self, task: Task) -> int:
        """Slots needed for what a stage receives before the task consuming it runs:
        activations (``"F"``: from stage ``s - 1``) or gradients (``"B"``: from ``s + 1``;
        on the last stage the loss gradient its own ``F`` produced)."""
        depth = 1
        for s in range(self.num_stages):
            src = s - 1 if task == "F" else s + 1
            if task == "B" and s == self.num_stages - 1:
                arrive = self.ticks("F", s)  # the head's backward runs in the F task
            elif 0 <= src < self.num_stages:
                arrive = self.ticks(task, src) + 1
            else:
                continue
            use = self.ticks(task, s)
            for t in range(self.num_ticks):
                depth = max(depth, int(((arrive <= t) & (use >= t)).sum()))
        return depth

    def work(self, cost_f: float = 1.0, cost_b: float = 1.0, cost_w: float = 1.0) -> np.ndarray:
        """``[num_ticks, num_stages]`` work per stage and tick. A ``B`` that also computes
        weight gradients (not ``split_backward``) costs ``cost_b + cost_w``."""
        b = cost_b if self.split_backward else cost_b + cost_w
        return ((self.forward != IDLE) * cost_f + (self.backward != IDLE) * b
                + (self.weight != IDLE) * cost_w)

    def makespan(self, cost_f: float = 1.0, cost_b: float = 1.0, cost_w: float = 1.0) -> float:
        """Duration under lock-step ticks: each tick lasts as long as the busiest stage's
        work in it."""
        return float(self.work(cost_f, cost_b, cost_w).max(axis=1).sum())

    def bubble_fraction(self, cost_f: float = 1.0, cost_b: float = 1.0,
                        cost_w: float = 1.0) -> float:
        """Share of stage-time spent idle: ``1 - busy / (P * makespan)``."""
        busy = self.work(cost_f, cost_b, cost_w).sum()
        return float(1.0 - busy / (self.num_stages * self.makespan(cost_f, cost_b, cost_w)))

    # -------------------------------------------------------------------------- checks

    def validate(self) -> None:
        """Raises ``ValueError`` naming the first rule (module docstring) it breaks."""
        shapes = {self.forward.shape, self.backward.shape, self.weight.shape}
        if self.forward.ndim != 2 or len(shapes) != 1:
            raise ValueError(f"schedule {self.name!r}: forward, backward and weight must be "
                             f"[ticks, stages] of one shape, got {sorted(shapes)}")
        if not self.split_backward and (self.weight != IDLE).any():
            raise ValueError(f"schedule {self.name!r}: W tasks need split_backward=True")
        p, m = self.num_stages, self.num_microbatches
        tasks = ("F", "B", "W") if self.split_backward else ("F", "B")
        for s in range(p):
            for task in tasks:
                col = self._table(task)[:, s]
                order = col[col != IDLE].tolist()
                if order != list(range(m)):
                    raise ValueError(f"schedule {self.name!r}: stage {s} runs {task} of "
                                     f"microbatches {order}, expected 0..{m - 1} in order")
            f, b = self.ticks("F", s), self.ticks("B", s)
            if (b < f).any():
                raise ValueError(f"schedule {self.name!r}: stage {s} runs B before F of "
                                 f"microbatch {int(np.argmax(b < f))}")
            if self.split_backward and (self.ticks("W", s) < b).any():
                raise ValueError(f"schedule {self.name!r}: stage {s} runs W before B")
            if s > 0 and (f <= self.ticks("F", s - 1)).any():
                raise ValueError(f"schedule {self.name!r}: stage {s} runs F before its input "
                                 "arrives from the previous stage")
            if s < p - 1 and (b <= self.ticks("B", s + 1)).any():
                raise ValueError(f"schedule {self.name!r}: stage {s} runs B before its "
                                 "gradient arrives from the next stage")


def list_schedule(name: str, num_stages: int, num_microbatches: int, *,
                  split_backward: bool) -> ScheduleTable:
    """Builds a table tick by tick; each stage runs ONE task per tick, chosen in this order:
    its next ``B`` if the gradient for it has arrived (on the last stage: its ``F`` ran),
    else its next ``F`` if the input has arrived and fewer than ``P - s`` microbatches are
    in flight on it (held from ``F`` until ``W``, or ``B`` without ``split_backward``),
    else (``split_backward``) its oldest pending ``W``."""
    p, m = _check(num_stages, num_microbatches)
    done = {k: np.full((p, m), -1, np.int64) for k in "FBW"}
    count = {k: [0] * p for k in "FBW"}
    release = "W" if split_backward else "B"
    rows: list[list[tuple[str, int] | None]] = []
    t = 0
    while min(count[release]) < m:
        row: list[tuple[str, int] | None] = []
        for s in range(p):
            b, f = count["B"][s], count["F"][s]
            if b < m and 0 <= done["F"][s, b] < t and (
                    s == p - 1 or 0 <= done["B"][s + 1, b] < t):
                row.append(("B", b))
            elif f < m and f - count[release][s] < p - s and (
                    s == 0 or 0 <= done["F"][s - 1, f] < t):
                row.append(("F", f))
            elif split_backward and count["W"][s] < count["B"][s]:
                row.append(("W", count["W"][s]))
            else:
                row.append(None)
        for s, task in enumerate(row):
            if task is not None:
                done[task[0]][s, task[1]] = t
                count[task[0]][s] += 1
        rows.append(row)
        t += 1
    tables = {k: np.full((len(rows), p), IDLE) for k in "FBW"}
    for tick, row in enumerate(rows):
        for s, task in enumerate(row):
            if task is not None:
                tables[task[0]][tick, s] = task[1]
    return ScheduleTable(name, tables["F"], tables["B"], tables["W"],
                         split_backward=split_backward)


def one_f_one_b(num_stages: int, num_microbatches: int) -> ScheduleTable:
    """Megatron's 1F1B: ``P - s - 1`` warm-up forwards, then one forward one backward, then
    the cool-down backwards; stage ``s`` holds at most ``P - s`` microbatches."""
    return list_schedule("1f1b", num_stages, num_microbatches, split_backward=False)


def zb_h1(num_stages: int, num_microbatches: int) -> ScheduleTable:
    """ZB-H1 (Qi et al.): 1F1B's order and activation bound (``P - s`` from ``F`` to
    ``W``) with each backward split into ``B`` (input gradients, on the critical path) and
    ``W`` (weight gradients), the ``W``\\ s filling the ticks where the stage would idle."""
    return list_schedule("zb-h1", num_stages, num_microbatches, split_backward=True)


SCHEDULES = {"1f1b": one_f_one_b, "zb-h1": zb_h1}
"""Schedules by name (``ParallelConfig.pipeline_schedule``'s values)."""


def get_schedule(name: str, num_stages: int, num_microbatches: int) -> ScheduleTable:
    """The table of schedule ``name``."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {sorted(SCHEDULES)}")
    return SCHEDULES[name](num_stages, num_microbatches)


def _check(num_stages: int, num_microbatches: int) -> tuple[int, int]:
    for name, v in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(num_stages), int(num_microbatches)
