"""Pipeline schedules as data: a per-tick, per-stage table of tasks.

A schedule is a pure function ``(num_stages, num_microbatches, ...) -> ScheduleTable``.
The executor (:mod:`jax_wgrad.parallel.pipeline.executor`) runs ANY valid table in one
``lax.scan`` over ticks: it reads the table (as arrays indexed by the tick) instead of
re-deriving formulas, so adding a schedule is adding a table.

**Tick semantics** (the executor's): all stages advance in lock step. In a tick, a stage
runs its forward task (``F``), then its backward task (``B``), each on the microbatch the
table names (or nothing: ``IDLE``). At the end of the tick every stage sends the output of
its ``F`` to the next stage and the input gradient of its ``B`` to the previous one (two
acyclic ``ppermute``\\ s); what a stage receives is kept in a slot until the task that
consumes it runs. Hence the rules :meth:`ScheduleTable.validate` checks: every stage runs
``F`` and ``B`` of every microbatch once, in microbatch order; ``F(m)`` on stage ``s > 0``
runs in a later tick than ``F(m)`` on ``s - 1``; ``B(m)`` on stage ``s < P - 1`` in a later
tick than ``B(m)`` on ``s + 1``; ``B(m)`` not before ``F(m)`` on the same stage (the same
tick is fine: ``F`` runs first).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

__all__ = ["IDLE", "ScheduleTable", "one_f_one_b", "SCHEDULES", "get_schedule"]

IDLE = -1
"""Table entry of a stage that has no such task in a tick."""

Task = Literal["F", "B"]


@dataclasses.dataclass(frozen=True, eq=False)
class ScheduleTable:
    """``forward[t, s]`` / ``backward[t, s]``: the microbatch stage ``s`` runs forward /
    backward in tick ``t``, or :data:`IDLE`.

    Attributes:
      name: the schedule's name.
      forward, backward: ``int32 [num_ticks, num_stages]``.
    """

    name: str
    forward: np.ndarray
    backward: np.ndarray

    def __post_init__(self) -> None:
        for field in ("forward", "backward"):
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

    def ticks(self, task: Task, stage: int) -> np.ndarray:
        """Ticks of ``stage``'s ``task``, indexed by microbatch."""
        table = self.forward if task == "F" else self.backward
        col = table[:, stage]
        out = np.full(self.num_microbatches, -1, np.int64)
        for t in np.flatnonzero(col != IDLE):
            out[col[t]] = t
        return out

    # -------------------------------------------------------------------------- facts

    def last_backward_tick(self, stage: int) -> int:
        """Tick of ``stage``'s last backward task: after it the stage's gradients are
        complete and its buckets can be synced (the cooldown sync)."""
        return int(self.ticks("B", stage).max())

    def in_flight(self, stage: int) -> int:
        """Most microbatches whose stored stage input ``stage`` holds at once: counted
        from the tick its forward ran through the tick its backward ran."""
        f, b = self.ticks("F", stage), self.ticks("B", stage)
        return max(int(((f <= t) & (b >= t)).sum()) for t in range(self.num_ticks))

    @property
    def num_slots(self) -> int:
        """Stored-input slots per stage: the largest :meth:`in_flight` over stages. Inputs
        are stored at ``microbatch % num_slots``, safe because every stage runs its
        microbatches in order (the live ones are consecutive)."""
        return max(self.in_flight(s) for s in range(self.num_stages))

    def inbox_depth(self, task: Task) -> int:
        """Slots needed for what a stage receives before the task consuming it runs:
        activations (``"F"``: from stage ``s - 1``) or gradients (``"B"``: from ``s + 1``)."""
        depth = 1
        for s in range(self.num_stages):
            src = s - 1 if task == "F" else s + 1
            if not 0 <= src < self.num_stages:
                continue
            arrive = self.ticks(task, src) + 1
            use = self.ticks(task, s)
            for t in range(self.num_ticks):
                depth = max(depth, int(((arrive <= t) & (use >= t)).sum()))
        return depth

    def makespan(self, cost_f: float = 1.0, cost_b: float = 1.0) -> float:
        """Duration under lock-step ticks: each tick lasts as long as the busiest stage's
        work in it (``cost_f`` per forward, ``cost_b`` per backward)."""
        work = (self.forward != IDLE) * cost_f + (self.backward != IDLE) * cost_b
        return float(work.max(axis=1).sum())

    def bubble_fraction(self, cost_f: float = 1.0, cost_b: float = 1.0) -> float:
        """Share of stage-time spent idle: ``1 - busy / (P * makespan)``."""
        busy = self.num_microbatches * self.num_stages * (cost_f + cost_b)
        return 1.0 - busy / (self.num_stages * self.makespan(cost_f, cost_b))

    # -------------------------------------------------------------------------- checks

    def validate(self) -> None:
        """Raises ``ValueError`` naming the first rule (module docstring) it breaks."""
        if self.forward.ndim != 2 or self.forward.shape != self.backward.shape:
            raise ValueError(f"schedule {self.name!r}: forward {self.forward.shape} and "
                             f"backward {self.backward.shape} must be [ticks, stages]")
        p, m = self.num_stages, self.num_microbatches
        for s in range(p):
            for task, table in (("F", self.forward), ("B", self.backward)):
                col = table[:, s]
                order = col[col != IDLE].tolist()
                if order != list(range(m)):
                    raise ValueError(f"schedule {self.name!r}: stage {s} runs {task} of "
                                     f"microbatches {order}, expected 0..{m - 1} in order")
            f, b = self.ticks("F", s), self.ticks("B", s)
            if (b < f).any():
                raise ValueError(f"schedule {self.name!r}: stage {s} runs B before F of "
                                 f"microbatch {int(np.argmax(b < f))}")
            if s > 0 and (f <= self.ticks("F", s - 1)).any():
                raise ValueError(f"schedule {self.name!r}: stage {s} runs F before its input "
                                 "arrives from the previous stage")
            if s < p - 1 and (b <= self.ticks("B", s + 1)).any():
                raise ValueError(f"schedule {self.name!r}: stage {s} runs B before its "
                                 "gradient arrives from the next stage")


def one_f_one_b(num_stages: int, num_microbatches: int) -> ScheduleTable:
    """Megatron's 1F1B in lock step: stage ``s`` runs ``F(t - s)`` and ``B(t - (2P - 2 -
    s))`` in tick ``t``; ``M + 2P - 2`` ticks; the last stage runs the backward of the
    microbatch it just forwarded. The whole step costs ``(M + P - 1) (F + B)``."""
    p, m = _check(num_stages, num_microbatches)
    t = np.arange(m + 2 * p - 2)[:, None]
    s = np.arange(p)[None, :]
    f, b = t - s, t - (2 * p - 2 - s)
    return ScheduleTable("1f1b", np.where((f >= 0) & (f < m), f, IDLE),
                         np.where((b >= 0) & (b < m), b, IDLE))


SCHEDULES = {"1f1b": one_f_one_b}
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
