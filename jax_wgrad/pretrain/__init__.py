"""The pretraining job of ``examples/pretrain_gpt.py`` (and of the ``jax-wgrad-pretrain``
console script): Megatron's flags in, a trained GPT out.

:func:`main` runs it in this process (``main(["--tensor-model-parallel-size", "2", ...])``
returns the run's summary); its flags are :mod:`jax_wgrad.pretrain.cli`'s, derived from
the config dataclasses. :mod:`jax_wgrad.pretrain.launch` is what the program adds around
it: jax's platforms chosen before jax is imported, and the exit after a Ctrl-C. Importing
this package imports nothing else (:func:`main` is resolved on first use, PEP 562), so
the launcher runs before jax.
"""

from __future__ import annotations

__all__ = ["main"]


def __getattr__(name: str):
    if name == "main":
        from jax_wgrad.pretrain.job import main

        globals()["main"] = main
        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
