"""What a model supplies (:class:`StageModel` and its optional capabilities) and the
library's stage program built from it (:class:`LaidOutProgram`, :func:`lay_out`).

A model supplies its NNX modules (:meth:`StageModel.parts`: what the layout reads) and
four pure functions of one device's parameters (a
:class:`~jax_wgrad.grads.chunks.DeviceTree`), each returning ``(output, aux)``:
``pre(params, batch)``, ``body(params, x, layers=None)``, ``post(params, y, batch, *,
output_grad_extras=False)`` and ``metrics(aux_sum)``
(:class:`~jax_wgrad.parallel.pipeline.program.StageProgram` says what each does). In the
``params`` the executor hands them, every fused weight is an NNX variable carrying its
gradient's route (:mod:`jax_wgrad.functional.routes`): they merge their modules from it and
never see a bucket.

Capabilities only some models have are small protocols, detected with ``isinstance``:

* :class:`TiedOutputWeight` -- the head's output layer uses an ``embed`` parameter (the
  GPT's tied word embedding);
* :class:`VocabOverPipeline` -- parameters whose vocabulary is split over
  ``(pipeline, tensor)``: ``pre`` and ``post`` are collectives over the pipeline, run by
  every stage;
* :class:`OutputGradRecompute` -- the deferred output-layer weight gradient's ``recompute``
  mode (the drain rebuilds the output layer's ``dy`` from what ``post`` reports);
* :class:`WritesResidualSlots` -- ``body`` writes its layers' saved activations straight
  into the pipeline's residual slots;
* :class:`SplitsContext` -- context parallelism: ``pre`` and ``post`` take this context
  rank's tokens of the (whole) batch and the attention runs over the ``context`` axis.

:class:`LaidOutProgram` joins a model and its :class:`~jax_wgrad.layout.StageLayout` into
the program the executor runs; :func:`lay_out` builds it (and passes through a program
that lays its parameters out itself).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

from jax_wgrad.grads.chunks import DeviceTree, Window
from jax_wgrad.layout.stage import StageLayout
from jax_wgrad.models.parts import ModelParts
from jax_wgrad.parallel.config import ParallelConfig

__all__ = [
    "LaidOutProgram",
    "OutputGradRecompute",
    "PreparedWeights",
    "SplitsContext",
    "StageModel",
    "TiedOutputWeight",
    "VocabOverPipeline",
    "WritesResidualSlots",
    "lay_out",
    "param_specs",
]

PyTree = Any


@runtime_checkable
class StageModel(Protocol):
    """A model as the library lays it out and pipelines it (module docstring).

    Attributes: ``parallel`` (the layout it is built for) and ``fused_op_families`` (the
    op families, :data:`~jax_wgrad.ops.OP_FAMILIES`, its layers call with
    gradient accumulation fusion: what the training plan requires to work)."""

    parallel: ParallelConfig
    fused_op_families: tuple[str, ...]

    def parts(self) -> ModelParts:
        """Its modules and how they are placed (:class:`~jax_wgrad.models.parts.ModelParts`)."""

    def init_params(self, seed: int = 0) -> PyTree:
        """Full CANONICAL parameters from ``seed`` (the same for every parallel layout)."""

    def pre(self, params: DeviceTree, batch: jax.Array) -> tuple[jax.Array, PyTree]: ...

    def body(
        self, params: DeviceTree, x: jax.Array, layers: Window | None = None
    ) -> tuple[jax.Array, PyTree]: ...

    def post(
        self, params: DeviceTree, y: jax.Array, batch: jax.Array, *, output_grad_extras=False
    ) -> tuple[jax.Array, PyTree]: ...

    def metrics(self, aux_sum: PyTree) -> dict[str, jax.Array]: ...


@runtime_checkable
class PreparedWeights(Protocol):
    """A model whose ``body`` reads, besides its parameters, what it computes from them
    once per step: the executor calls :meth:`prepare` on this device's parameters before
    the schedule loop and hands the result to every ``body`` call of the step as
    ``prepared=`` (e.g. the FP8 copies of the weights, which every microbatch's forward
    and backward use: TransformerEngine's FP8 weight cache)."""

    def prepare(self, params: DeviceTree) -> PyTree | None:
        """What ``body`` reads of ``params`` within a step (``None``: nothing), inside
        ``shard_map``; no gradient flows through it (the parameters' own routes say
        where their gradients go)."""


@runtime_checkable
class WritesResidualSlots(Protocol):
    """A model whose ``body`` runs its layers with
    :func:`~jax_wgrad.functional.scan_layers` and hands it ``slots=``: the executor then
    passes every forward's residual slots (a
    :class:`~jax_wgrad.functional.residual_slots.ResidualSlots`) as ``body(...,
    slots=)``, and the layers write what their backward reads straight into the slot
    buffers the pipeline keeps (no copy of the saved activations in or out of them)."""

    def writes_residual_slots(self) -> bool:
        """Whether ``body`` takes ``slots=`` in this configuration."""


@runtime_checkable
class TiedOutputWeight(Protocol):
    """A model whose head may use an ``embed`` parameter as its output layer's weight."""

    def tied_output_weight(self) -> tuple[str, ...] | None:
        """That parameter's canonical path (e.g. ``("embedding", "word", "embedding")``),
        or ``None`` when this configuration unties them."""


@runtime_checkable
class VocabOverPipeline(Protocol):
    """A model that may split its vocabulary over ``(pipeline, tensor)``."""

    def vocab_over_pipeline(self) -> tuple[tuple[str, ...], ...]:
        """The canonical paths of the parameters whose vocabulary dim (their first, split
        over ``tensor``) is split over ``(pipeline, tensor)`` in this configuration (then
        ``pre`` and ``post`` are collectives over the pipeline: every stage runs them);
        ``()``: the vocabulary is not split over the pipeline."""


@runtime_checkable
class OutputGradRecompute(Protocol):
    """A model that can rebuild its output layer's gradient in the deferral drain
    (``ParallelConfig.defer_mode == "recompute"``: Megatron's deferral keeps ``(x, dy)``;
    this keeps ``x`` and what rebuilds ``dy``). ``post`` is then asked for
    ``output_grad_extras``."""

    def defer_extras(self, post_aux: PyTree, batch: jax.Array) -> tuple[jax.Array, ...]:
        """What the stash keeps of one microbatch beside the output layer's input ``x``,
        from ``post``'s aux and the microbatch: arrays ``[mb, S, ...]`` by token (the GPT:
        the logsumexp and the labels)."""

    def recompute_output_grad(
        self, x: jax.Array, extras: tuple[jax.Array, ...], weight: jax.Array
    ) -> jax.Array:
        """The output layer's output gradient ``dy`` (of the token-loss SUM) for its input
        ``x`` ``[mb, s, H]``, from :meth:`defer_extras`' arrays sliced to the same tokens
        and the output layer's ``weight`` (this device's shard)."""


@runtime_checkable
class SplitsContext(Protocol):
    """A model that runs with context parallelism
    (:attr:`~jax_wgrad.parallel.ParallelConfig.context_parallel_size` > 1): every context
    rank gets the whole batch, ``pre`` and ``post`` take its ``S / cp`` tokens (the loss is
    normalized by ``S / cp`` tokens per sequence and context rank), and the layers are
    token-local but for an attention over the ``context`` axis
    (:func:`~jax_wgrad.functional.context_parallel_attention`)."""

    def splits_context(self) -> bool:
        """Whether this configuration runs with context parallelism as described."""


def check_context_parallel(program: Any) -> None:
    """Refuses a program whose layout asks for context parallelism it does not do
    (:class:`SplitsContext`): it would compute every token's loss on every context rank,
    with attention to its own tokens only."""
    cp = program.parallel.context_parallel_size
    if cp > 1 and not (isinstance(program, SplitsContext) and program.splits_context()):
        raise ValueError(
            f"{type(program).__name__} does not support context_parallel_size ({cp}): it "
            "does not split its sequences over the context ranks (SplitsContext); use "
            "context_parallel_size 1"
        )


class LaidOutProgram:
    """A :class:`StageModel` with its :class:`~jax_wgrad.layout.StageLayout`: the stage
    program (:class:`~jax_wgrad.parallel.pipeline.program.StageProgram`) the executor and
    the training plan run. The model's functions and capabilities are its own; every
    parameter form, the gradient specs and the stage set-up are the layout's.

    Attributes:
      model: the model; layout: its layout on ``model.parallel``.
      parallel, fused_op_families, pre, body, post, metrics: the model's.
      ends_over_pipeline: ``pre`` and ``post`` are collectives over the pipeline (the
        model splits its vocabulary over it, :class:`VocabOverPipeline`).
      setup, stacks_layers, canonical_specs, param_specs, to_canonical, from_canonical,
        device_tree, canonical_tree, grad_specs: the layout's
        (:class:`~jax_wgrad.layout.StageLayout`).
      output_grad_recompute: the model when it can rebuild its output layer's gradient
        (:class:`OutputGradRecompute`), else ``None``.
      prepare: the model's :meth:`PreparedWeights.prepare`, else ``None``.
      writes_residual_slots: the model's ``body`` takes ``slots=``
        (:class:`WritesResidualSlots`).
    """

    def __init__(self, model: StageModel):
        self.model = model
        self.layout = StageLayout(
            model.parts(),
            model.parallel,
            tied_output_weight=(
                model.tied_output_weight() if isinstance(model, TiedOutputWeight) else None
            ),
            vocab_over_pipeline=(
                model.vocab_over_pipeline() if isinstance(model, VocabOverPipeline) else ()
            ),
        )
        self.output_grad_recompute = model if isinstance(model, OutputGradRecompute) else None
        self.prepare = model.prepare if isinstance(model, PreparedWeights) else None
        self.writes_residual_slots = (
            isinstance(model, WritesResidualSlots) and model.writes_residual_slots()
        )
        # The model's own functions and the layout's, bound: called directly.
        self.pre, self.body, self.post, self.metrics = (
            model.pre,
            model.body,
            model.post,
            model.metrics,
        )
        self.parallel, self.fused_op_families = model.parallel, model.fused_op_families
        layout = self.layout
        # pre and post are collectives over the pipeline (the vocabulary split over it):
        # every stage runs them.
        self.ends_over_pipeline = bool(layout.vocab_over_pipeline)
        self.setup, self.stacks_layers = layout.setup, layout.stacks_layers
        self.canonical_specs, self.param_specs = layout.canonical_specs, layout.param_specs
        self.to_canonical, self.from_canonical = layout.to_canonical, layout.from_canonical
        self.device_tree, self.canonical_tree = layout.device_tree, layout.canonical_tree
        self.grad_specs = layout.grad_specs
        par, name = model.parallel, type(model).__name__
        if par.vocab_parallel_over_pipeline and not self.layout.vocab_over_pipeline:
            raise ValueError(
                f"{name} does not support vocab_parallel_over_pipeline: it splits no "
                "vocabulary over the pipeline (VocabOverPipeline), its head runs on the last "
                "stage only"
            )
        if (
            par.defer_embedding_wgrad_compute
            and par.defer_mode == "recompute"
            and self.output_grad_recompute is None
        ):
            raise ValueError(
                f"{name} does not support defer_mode='recompute': it cannot rebuild its "
                "output layer's gradient (OutputGradRecompute: defer_extras, "
                "recompute_output_grad); use 'stash'"
            )

    def __repr__(self) -> str:
        return f"LaidOutProgram({self.model!r})"

    def init_params(self, seed: int = 0) -> PyTree:
        """Full parameters from ``seed`` in the layout (the model's canonical ones)."""
        return self.layout.from_canonical(self.model.init_params(seed))


def lay_out(program: StageModel | Any) -> Any:
    """The stage program the executor runs for ``program``: a :class:`StageModel` laid
    out (:class:`LaidOutProgram`), or ``program`` itself when it already lays its
    parameters out (it has ``device_tree``: a hand-written
    :class:`~jax_wgrad.parallel.pipeline.program.StageProgram`, e.g. a model of plain
    arrays without NNX modules)."""
    if hasattr(program, "device_tree"):
        check_context_parallel(program)
        return program
    if not isinstance(program, StageModel):
        raise TypeError(
            f"lay_out: {type(program).__name__} is neither a StageModel (parts, init_params, "
            "pre, body, post, metrics) nor a StageProgram (its own device_tree)"
        )
    check_context_parallel(program)
    return LaidOutProgram(program)


def param_specs(model: Any, parallel: ParallelConfig | None = None) -> PyTree:
    """``PartitionSpec`` of every CANONICAL parameter of the model config ``model`` (e.g. a
    :class:`~jax_wgrad.GPTConfig`) on the ``(data, expert, context, tensor, pipeline)`` mesh of
    ``parallel`` (default: one device's): what :func:`~jax_wgrad.models.gpt.init_params`'s
    parameters are sharded as (layers over ``pipeline`` on their stacked dim, a parameter
    over ``tensor`` / ``expert`` where its metadata says)."""
    return lay_out(model.program(parallel or ParallelConfig())).canonical_specs()
