"""Pipeline parallelism: what the executor asks of a program (:mod:`.program`:
:class:`~.program.StageProgram`), the one-program executor that runs any schedule table
(:mod:`.executor`; the pipeline's ends are its strategy: :mod:`.ends`), the named scopes
the compile analyser reads (:mod:`.scopes`) and a step's gradients (:mod:`.gradients`:
:func:`~.gradients.pipeline_gradients`). The schedule tables themselves are data of the
parallel layout (:mod:`jax_wgrad.parallel.schedules`)."""
