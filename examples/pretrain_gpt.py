#!/usr/bin/env python
"""Pretrain a small byte-level GPT with tensor, sequence, pipeline (1F1B) and data parallelism.

Runs on CPU by default with 8 virtual devices and trains on the Python standard
library's own source files (present on every machine), or on your text with
``--data-path``. Flags follow Megatron-LM's ``pretrain_gpt.py`` (all of them: ``--help``)::

    python examples/pretrain_gpt.py                                   # dp=8
    python examples/pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --sequence-parallel \\
        --gradient-accumulation-fusion --metrics-file runs/m.jsonl    # dp=2, tp=2, pp=2
    python examples/pretrain_gpt.py --pipeline-model-parallel-size 2 \\
        --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 100000

The same ``--seed`` gives the same initial parameters and batches for every layout, so
``--metrics-file`` loss curves of different layouts can be compared directly.

The job is :func:`jax_wgrad.pretrain.main` (call it in a process of your own:
``main(["--train-iters", "10"])`` returns the run's summary); its flags are derived from
the config dataclasses in :mod:`jax_wgrad.pretrain.cli`. Installed, the same program is
the ``jax-wgrad-pretrain`` console script (:func:`jax_wgrad.pretrain.launch.script`).
"""

from jax_wgrad.pretrain.launch import script  # the standard library only: jax comes later


def main(argv: list[str] | None = None) -> dict:
    """The job in this process, for callers that load this file as a module
    (``benchmarks/compile_time.py``): :func:`jax_wgrad.pretrain.main`."""
    from jax_wgrad.pretrain import main as job

    return job(argv)


if __name__ == "__main__":
    script()
