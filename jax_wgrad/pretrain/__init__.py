"""The pretraining job of ``examples/pretrain_gpt.py``: Megatron's flags in, a trained GPT out.

:func:`main` runs it in this process (``main(["--tensor-model-parallel-size", "2", ...])``
returns the run's summary); its flags are :mod:`jax_wgrad.training.cli`'s, derived from
the config dataclasses. :mod:`jax_wgrad.pretrain.launch` is what the script adds around
it as a program: jax's platforms chosen before jax is imported, and the exit after a
Ctrl-C.
"""

from jax_wgrad.pretrain.job import main

__all__ = ["main"]
