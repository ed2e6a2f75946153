"""What the pipeline executor runs: a stage program (:class:`StageProgram`).

The executor (:mod:`.executor`) and the forward-only evaluation (:mod:`.evaluate`) know no
vocabulary, embedding, head or MoE. A program hands them three pure functions of one
device's parameters (a :class:`~jax_wgrad.grads.chunks.DeviceTree`), each returning
``(output, aux)``:

* ``pre(params, batch)``: the first stage's input, ``[mb, s(/tp), H]``, from one
  microbatch of the batch (the GPT: its embedding of the tokens);
* ``body(params, x)``: a stage's layers, ``[mb, s(/tp), H]`` to the same; its ``aux`` (any
  pytree of arrays, e.g. MoE statistics summed over the stage's layers) is summed over the
  device's microbatches and handed to :meth:`StageProgram.metrics`;
* ``post(params, y, batch, *, output_grad_extras=False)``: the last stage's fp32 scalar
  loss SUM over the microbatch's tokens (the GPT: final norm, output layer, cross
  entropy); asked for ``output_grad_extras`` only under recompute-mode deferral.

The deferred output-layer wgrad in recompute mode (Megatron's deferral keeps ``(x, dy)``;
``ParallelConfig.defer_mode == "recompute"`` keeps ``x`` and what rebuilds ``dy``) needs
the program's :attr:`StageProgram.output_grad_recompute`
(:class:`~jax_wgrad.layout.program.OutputGradRecompute`: what the stash keeps beside ``x``,
and ``dy`` rebuilt from it in the drain). A model reads no deferral option: the executor
asks for what it needs.

The programs never see a gradient bucket: where each fused weight's gradient goes is a
property of the parameter -- in the ``params`` the executor hands a program, each fused
weight is an NNX variable whose ``wgrad`` metadata is its route
(:mod:`jax_wgrad.functional.routes`) -- so a program merges its modules from ``params``
and its layers hand their weight variables to the library's linears
(:mod:`jax_wgrad.nn`).

A program also gives its layout facts: the device tree's per-device shapes and its
:class:`~jax_wgrad.grads.GradSpec`\\ s (:meth:`StageProgram.grad_specs`), the conversion
between its canonical parameters and the device tree, and the per-step
:class:`~jax_wgrad.layout.setup.StageSetup` (microbatch shapes, activation, loss
normalization). For a model of NNX modules the library derives all of these
(:class:`~jax_wgrad.layout.LaidOutProgram`: the GPT, a
:class:`~jax_wgrad.models.LayerStackConfig` model); the tests also run the executor on a
program of plain arrays that lays out its parameters itself.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

from jax_wgrad.grads.chunks import DeviceTree, Window
from jax_wgrad.layout.program import OutputGradRecompute
from jax_wgrad.layout.setup import StageSetup
from jax_wgrad.parallel.config import ParallelConfig

__all__ = ["StageProgram"]

PyTree = Any


@runtime_checkable
class StageProgram(Protocol):
    """A model as the pipeline runs it (module docstring). Attributes: ``parallel`` (the
    layout it is built for) and ``setup`` (its :class:`StageSetup`)."""

    parallel: ParallelConfig
    setup: StageSetup
    ends_over_pipeline: bool
    """``pre`` and ``post`` are collectives over ``pipeline`` (e.g. the vocabulary split
    over the stages): the executor runs them on EVERY stage in the ticks where the first /
    last virtual stage needs them (:class:`~jax_wgrad.parallel.pipeline.ends.SpreadEnds`);
    ``post``'s loss and gradient count on the last stage, ``pre``'s backward is seeded with
    the first stage's input gradient (zeros on the others)."""
    stacks_layers: bool
    """``body`` runs the stage chunk's layers with
    :func:`~jax_wgrad.functional.scan_layers` over their stacked ``[n, ...]`` leaves,
    all ``n`` at once (one model chunk): their gradients can then be laid out in layer
    groups, each group's bucket synced while the stage's last backward runs the layers
    below (Megatron's ``overlap_grad_reduce``; :func:`~.gradients.layer_groups`).
    ``False``: one bucket layout as ever, synced after the backward."""
    fused_op_families: tuple[str, ...]
    """The op families (:data:`~jax_wgrad.ops.OP_FAMILIES`) its layers call with
    ``gradient_accumulation_fusion``: what :meth:`~jax_wgrad.training.TrainPlan.create`
    requires to work (:func:`~jax_wgrad.ops.require_fusion`) before it builds a fused
    plan. A dense model: :data:`~jax_wgrad.ops.DENSE_FAMILIES`; an MoE model adds
    its experts' (``"ragged"`` dropless, ``"grouped"`` with capacity buffers)."""

    # -- the stage programs

    def pre(self, params: DeviceTree, batch: jax.Array) -> tuple[jax.Array, PyTree]:
        """First stage: one microbatch ``[mb, ...]`` -> ``([mb, s(/tp), H], aux)``."""

    def body(
        self, params: DeviceTree, x: jax.Array, layers: Window | None = None
    ) -> tuple[jax.Array, PyTree]:
        """Every stage: ``[mb, s(/tp), H]`` -> ``(same shape, aux)``; with ``layers``
        (interleaved schedules, ``V > 1``) only model chunk ``layers.index``'s layers: rows
        ``[index n / V, (index + 1) n / V)`` of the stacked chunks' leaves
        (:data:`~jax_wgrad.grads.spec.STACKED`), read in place from the full stacks by
        :func:`~jax_wgrad.functional.scan_layers` ``(rows=...)``. A program that does not
        stack its layers runs only ``layers=None``. A program with an attribute
        ``prepare`` (``params -> PyTree | None``, :class:`~jax_wgrad.layout.PreparedWeights`)
        has it called once per step before the schedule loop, and a result that is not
        ``None`` handed to every ``body`` call as ``prepared=``."""

    def post(
        self,
        params: DeviceTree,
        y: jax.Array,
        batch: jax.Array,
        *,
        output_grad_extras: bool = False,
    ) -> tuple[jax.Array, PyTree]:
        """Last stage: ``(fp32 scalar sum of the microbatch's token losses, aux)``. ``aux``
        is ``()`` unless ``output_grad_extras`` (the executor asks under recompute-mode
        deferral only), then what :attr:`output_grad_recompute`'s ``defer_extras`` turns
        into the stash's extras, never differentiated (the GPT: the per-token logsumexp of
        the logits ``[mb, S]``)."""

    def metrics(self, aux_sum: PyTree) -> dict[str, jax.Array]:
        """The step's figures from this device's sums of ``body``'s aux over its
        microbatches (inside ``shard_map``: reduce over the mesh here); ``{}`` if none."""

    output_grad_recompute: OutputGradRecompute | None
    """What rebuilds the output layer's gradient in the deferral drain (recompute mode),
    or ``None`` when the program cannot."""

    # -- parameters and their layout

    def init_params(self, seed: int = 0) -> PyTree:
        """Full parameters from ``seed`` in the program's layout (the same values for
        every layout; with interleaving the layer stacks are split by model chunk:
        :mod:`~jax_wgrad.layout.virtual`)."""

    def param_specs(self) -> PyTree:
        """``PartitionSpec`` of every parameter of the layout on the mesh."""

    def canonical_specs(self) -> PyTree:
        """``PartitionSpec`` of every canonical parameter (:meth:`to_canonical`'s)."""

    def to_canonical(self, params: PyTree) -> PyTree:
        """The layout's (global) parameters in the layout-independent canonical form
        (what checkpoints hold); the identity unless the layout differs from it."""

    def from_canonical(self, params: PyTree) -> PyTree:
        """Inverse of :meth:`to_canonical`."""

    def device_tree(self, params: PyTree) -> DeviceTree:
        """Per-device layout parameters -> the device tree (registration order). With
        ``V > 1`` model chunks, every leaf of its stacked chunks
        (:data:`~jax_wgrad.grads.spec.STACKED`) is ``[n, ...]`` with model chunk ``v`` at
        rows ``v n / V ...`` (:class:`~jax_wgrad.grads.chunks.Window`)."""

    def canonical_tree(self, tree: DeviceTree) -> PyTree:
        """Inverse of :meth:`device_tree`."""

    def grad_specs(self) -> DeviceTree:
        """A :class:`~jax_wgrad.grads.GradSpec` per leaf of the device tree."""
