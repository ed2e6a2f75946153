"""Pipeline parallelism: schedules as data (:mod:`.schedules`, imported here), what the
executor asks of a model (:mod:`.program`: :class:`~.program.StageProgram`), the
one-program executor that runs any schedule table (:mod:`.executor`; the pipeline's ends
are its strategy: :mod:`.ends`) and a step's gradients (:mod:`.gradients`:
:func:`~.gradients.pipeline_gradients`)."""

from jax_wgrad.parallel.pipeline.schedules import (
    IDLE,
    SCHEDULES,
    ScheduleTable,
    get_schedule,
    one_f_one_b,
)

__all__ = ["IDLE", "SCHEDULES", "ScheduleTable", "get_schedule", "one_f_one_b"]
