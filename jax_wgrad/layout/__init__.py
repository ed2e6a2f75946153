"""Tier: a model's parameters laid out for the pipeline, derived from its NNX modules.

Between the models (which supply their modules and stage functions:
:class:`~jax_wgrad.layout.program.StageModel`) and the pipeline (which runs stage
programs): :class:`StageLayout` derives the canonical, layout and per-device forms of the
parameters, their sharding and the gradient layout from the modules' parameter metadata;
:func:`lay_out` joins a model and its layout into the program the executor runs;
:mod:`.virtual` regroups layer stacks for interleaved schedules; :mod:`.setup` is the
per-step stage set-up; :mod:`.trees` reads NNX parameter trees.
"""

from jax_wgrad.layout.program import (
    LaidOutProgram,
    OutputGradRecompute,
    PreparedWeights,
    SplitsContext,
    StageModel,
    TiedOutputWeight,
    VocabOverPipeline,
    WritesResidualSlots,
    lay_out,
    param_specs,
)
from jax_wgrad.layout.setup import StageSetup
from jax_wgrad.layout.stage import StageLayout

__all__ = [
    "LaidOutProgram",
    "OutputGradRecompute",
    "PreparedWeights",
    "SplitsContext",
    "StageLayout",
    "StageModel",
    "StageSetup",
    "TiedOutputWeight",
    "VocabOverPipeline",
    "WritesResidualSlots",
    "lay_out",
    "param_specs",
]
