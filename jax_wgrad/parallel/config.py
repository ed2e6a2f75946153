"""How one training step is laid out over devices (Megatron's parallel arguments)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Literal

from jax_wgrad._validation import check_positive, check_recompute
from jax_wgrad.parallel.schedules import INTERLEAVED_FORMS, SCHEDULES

__all__ = ["CP_COMM_TYPES", "ParallelConfig"]

CP_COMM_TYPES = ("p2p", "allgather", "a2a")
"""Megatron's ``--cp-comm-type`` values this library runs
(:attr:`ParallelConfig.cp_comm_type`)."""


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How one training step is laid out over devices.

    The mesh is ``(data, expert, context, tensor, pipeline)``; the data-parallel size and
    the number of microbatches are derived, as in Megatron (``dp = world / (tp cp pp)``),
    and expert parallelism is carved out of data parallelism (``data = dp / EP``), or with
    ``expert_tensor_parallel_size`` 1 out of the tensor ranks first (Megatron's MoE parallel
    folding: ``data = dp tp / EP``).
    """

    tensor_model_parallel_size: int = 1
    """Devices a layer's weights are split over (Megatron TP)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages; the transformer layers are split evenly over them."""
    context_parallel_size: int = 1
    """Megatron's ``--context-parallel-size``: devices each sequence is split over (CP).
    The sequence is cut into ``2 cp`` chunks and context rank ``r`` holds chunks ``r`` and
    ``2 cp - 1 - r`` (Megatron's causal load balancing); everything but the attention core
    is token-local, the attention exchanges keys and values over the ``context`` axis
    (``cp_comm_type``). Parameters are replicated over it and their gradients are reduced
    over data x context, as Megatron's; ``seq_length`` must be a multiple of ``2 cp``."""
    cp_comm_type: Literal["p2p", "allgather", "a2a"] = "p2p"
    """Megatron's ``--cp-comm-type`` (one for all layers): ``p2p`` (ring attention: the
    key/value chunks passed around the context ring with ``ppermute``, each step's partial
    attention merged by its log-sum-exp, the next exchange in flight beside it),
    ``allgather`` (keys and values all-gathered over ``context``, then one masked
    attention) or ``a2a`` (DeepSpeed-Ulysses: an all-to-all trades the sequence split for a
    head split around a whole-sequence attention; the query heads and the key/value groups
    per tensor rank must divide by ``cp``)."""
    expert_model_parallel_size: int = 1
    """Devices the experts of every MoE layer are split over (Megatron EP), each holding
    its own tokens and ``E / EP`` experts. With ``expert_tensor_parallel_size = tp`` the EP
    ranks are carved out of the data-parallel ranks (``expert`` axis EP). With
    ``expert_tensor_parallel_size`` 1 and ``tp > 1`` they span the tensor ranks first, then
    data-parallel ranks, as Megatron's rank order puts them (its MoE parallel folding:
    attention split over ``tensor``, experts over ``(expert, tensor)``; EP a multiple of
    tp, the ``expert`` axis ``EP / tp``)."""
    expert_tensor_parallel_size: int | None = None
    """Megatron's ``--expert-tensor-parallel-size``: tensor ranks each expert's weights are
    split over (on its FFN width). ``None``: ``tensor_model_parallel_size`` (Megatron's
    default); ``1``: experts not split, the tensor ranks being expert-parallel ranks
    (parallel folding) when EP > 1, replicated over them when EP is 1. On the ``(data,
    expert, tensor, pipeline)`` mesh the expert-tensor group is the tensor axis: 1 or tp."""
    micro_batch_size: int = 1
    """Sequences per microbatch per data-parallel rank."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all data-parallel ranks. ``None``: one
    microbatch per data-parallel rank (``micro_batch_size * data_parallel_size``)."""
    sequence_parallel: bool = False
    """Shard activations between blocks on the sequence dim over ``tensor``."""
    gradient_accumulation_fusion: bool = False
    """Accumulate every linear weight gradient in an fp32 main-grad buffer through the
    fused ``wgrad_accumulate`` op instead of producing ordinary gradients."""
    world_size: int | None = None
    """Total devices in the mesh; ``None`` means ``jax.device_count()``."""
    defer_embedding_wgrad_compute: bool = False
    """Megatron's option: on the last pipeline stage compute only the output layer's data
    gradient during the schedule, stash what its weight gradient needs, and do the
    weight-gradient GEMMs after the schedule (:mod:`jax_wgrad.parallel.deferred`; needs
    pipeline parallelism and ``gradient_accumulation_fusion``)."""
    wgrad_deferral_limit: int = 0
    """Number of microbatches whose output-layer weight gradient is deferred (the first
    ``min(limit, M)``); 0 defers all of them (Megatron's default)."""
    defer_mode: Literal["stash", "recompute"] = "stash"
    """``stash``: keep ``(x, dy)`` per deferred microbatch (Megatron; ``dy`` is
    ``[T, V/tp]``). ``recompute``: keep ``(x, logsumexp, labels)`` and rebuild ``dy``
    chunk by chunk in the drain (``O(T H)`` instead of ``O(T V/tp)``; one extra GEMM)."""
    pipeline_schedule: Literal["1f1b", "1f1b-paired", "zb-h1"] = "1f1b"
    """The pipeline schedule (:data:`jax_wgrad.parallel.schedules.SCHEDULES`): ``1f1b``
    (Megatron's; stage ``s`` holds at most ``P - s`` microbatches), ``1f1b-paired`` (the
    same order, a stage running a backward and a forward in the same lock-step tick: in
    the steady state every tick is one of each on every stage, the makespan 1F1B's ideal
    ``(M + P - 1) (F + B)``, for up to ``2 (P - s)`` microbatches in flight; with model
    chunks, Megatron's interleaved order paired the same way: ``(M V + P - 1) (F + B) / V``
    for one microbatch-chunk more in flight than interleaved 1F1B) or ``zb-h1`` (zero
    bubble: backward split into input- and
    weight-gradient tasks, the weight-gradient GEMMs filling the bubbles; needs gradient
    accumulation fusion)."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Megatron's interleaved schedule: model chunks per pipeline stage (``V``; ``None``: 1,
    no interleaving). Stage ``s`` holds virtual stages ``s, P + s, ..., (V - 1) P + s`` of
    ``L / (P V)`` layers each; ``pipeline_schedule`` ``1f1b`` becomes Megatron's interleaved
    1F1B, ``1f1b-paired`` the same order with paired ticks and ``zb-h1`` the same order
    with split backwards
    (:mod:`jax_wgrad.parallel.interleaved`). The example also takes Megatron's
    ``--num-layers-per-virtual-pipeline-stage``."""
    microbatch_group_size_per_vp_stage: int | None = None
    """Megatron's option: microbatches each virtual stage runs back to back before the
    next chunk's (``None``: ``P``, and then ``M`` must be a multiple of ``P``)."""
    vocab_parallel_over_pipeline: bool = False
    """Spread the word embedding and the output layer over all pipeline stages ("Vocabulary
    Parallelism", Yeung et al., MLSys 2025; Megatron keeps them on the first and last
    stage): their vocabulary dim is split over ``(pipeline, tensor)``, every stage holds
    ``1 / (P tp)`` of the table, and the embedding lookup, the output GEMMs and the cross
    entropy run on every stage as collectives over ``pipeline`` (and ``tensor``) in the
    ticks where the first / last virtual stage needs them."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """Megatron's activation recomputation, per transformer layer
    (:mod:`jax_wgrad.functional.stacked`): ``None`` (the backward uses what its forward
    saved: no GEMM and no attention is recomputed), ``"selective"`` (save the linear layers'
    outputs, recompute the attention core) or ``"full"`` (save the input of the layers
    ``recompute_method`` names, recompute them in the backward)."""
    recompute_method: Literal["uniform", "block"] | None = None
    """With ``recompute_granularity="full"`` (then required, as in Megatron):
    ``"uniform"``: checkpoint the input of every group of ``recompute_num_layers``
    consecutive layers and recompute the group; ``"block"``: checkpoint the input of each
    of the first ``recompute_num_layers`` layers of each pipeline stage (of each model chunk
    with interleaving), the other layers recompute nothing."""
    recompute_num_layers: int | None = None
    """``N`` of ``recompute_method`` (``"full"`` only, then required)."""

    def __post_init__(self) -> None:
        check_positive("tensor_model_parallel_size", self.tensor_model_parallel_size)
        check_positive("pipeline_model_parallel_size", self.pipeline_model_parallel_size)
        check_positive("expert_model_parallel_size", self.expert_model_parallel_size)
        check_positive("micro_batch_size", self.micro_batch_size)
        if self.world_size is None:
            import jax

            object.__setattr__(self, "world_size", jax.device_count())
        check_positive("world_size", self.world_size)
        check_positive("context_parallel_size", self.context_parallel_size)
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(
                f"cp_comm_type must be one of {list(CP_COMM_TYPES)}, got {self.cp_comm_type!r}"
            )
        model_parallel = (
            self.tensor_model_parallel_size
            * self.context_parallel_size
            * self.pipeline_model_parallel_size
        )
        if self.world_size % model_parallel != 0:
            cp = self.context_parallel_size
            raise ValueError(
                f"world size ({self.world_size}) is not divisible by "
                f"tensor_model_parallel_size ({self.tensor_model_parallel_size}) x "
                f"pipeline_model_parallel_size ({self.pipeline_model_parallel_size})"
                + (f" x context_parallel_size ({cp})" if cp > 1 else "")
            )
        dp = self.world_size // model_parallel
        self._validate_expert_tensor_parallel()
        self._validate_expert_parallel(dp)
        if self.global_batch_size is None:
            object.__setattr__(self, "global_batch_size", self.micro_batch_size * dp)
        check_positive("global_batch_size", self.global_batch_size)
        if self.global_batch_size % (self.micro_batch_size * dp) != 0:
            raise ValueError(
                f"global batch size ({self.global_batch_size}) is not divisible by "
                f"micro batch size ({self.micro_batch_size}) times data parallel size ({dp})"
            )
        self._validate_deferral()
        if self.pipeline_schedule not in SCHEDULES:
            raise ValueError(
                f"pipeline_schedule must be one of {sorted(SCHEDULES)}, got "
                f"{self.pipeline_schedule!r}"
            )
        if self.pipeline_schedule == "zb-h1" and not self.gradient_accumulation_fusion:
            raise ValueError(
                "Cannot use the zb-h1 pipeline schedule without gradient "
                "accumulation fusion (its weight-gradient tasks are the fused "
                "wgrad GEMMs)"
            )
        self._validate_interleaving()
        if self.vocab_parallel_over_pipeline and self.pipeline_model_parallel_size == 1:
            raise ValueError(
                "vocab_parallel_over_pipeline needs pipeline parallelism "
                "(pipeline_model_parallel_size > 1)"
            )
        check_recompute(
            self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            # Megatron does the same (model_parallel_config.py).
            warnings.warn(
                "Disabling sequence parallelism because tensor model parallelism is disabled",
                stacklevel=2,
            )
            object.__setattr__(self, "sequence_parallel", False)

    def _validate_expert_tensor_parallel(self) -> None:
        tp, etp = self.tensor_model_parallel_size, self.expert_tensor_parallel_size
        if etp is None:  # Megatron's default (arguments.py)
            object.__setattr__(self, "expert_tensor_parallel_size", tp)
            return
        check_positive("expert_tensor_parallel_size", etp)
        if etp not in (1, tp):
            raise ValueError(
                f"expert_tensor_parallel_size ({etp}) must be 1 or "
                f"tensor_model_parallel_size ({tp}): the expert-tensor group is "
                "the tensor axis of the (data, expert, tensor, pipeline) mesh"
            )

    def _validate_expert_parallel(self, dp: int) -> None:
        ep, tp = self.expert_model_parallel_size, self.tensor_model_parallel_size
        if not self.folds_experts:
            if dp % ep != 0:
                raise ValueError(
                    f"data parallel size ({dp}) is not divisible by expert_model_parallel_size "
                    f"({ep}): expert parallelism is carved out of data parallelism"
                )
            return
        if ep % tp != 0:
            raise ValueError(
                f"expert_model_parallel_size ({ep}) with expert_tensor_parallel_size 1 must "
                f"be 1 or a multiple of tensor_model_parallel_size ({tp}): the expert-parallel "
                "group spans all the tensor ranks first, then data-parallel ranks (Megatron's "
                "MoE parallel folding on the (data, expert, tensor, pipeline) mesh)"
            )
        if dp % (ep // tp) != 0:  # Megatron's wording (parallel_state.py)
            etp_ep_pp = ep * self.pipeline_model_parallel_size
            raise ValueError(
                f"world_size ({self.world_size}) is not divisible by "
                f"expert_tensor_model_pipeline_parallel size ({etp_ep_pp}): "
                f"expert_tensor_parallel_size (1) x expert_model_parallel_size ({ep}) x "
                f"pipeline_model_parallel_size ({self.pipeline_model_parallel_size})"
            )

    def _validate_deferral(self) -> None:
        if not isinstance(self.defer_embedding_wgrad_compute, bool):
            raise ValueError(
                "defer_embedding_wgrad_compute must be a bool, got "
                f"{self.defer_embedding_wgrad_compute!r}"
            )
        limit = self.wgrad_deferral_limit
        if not isinstance(limit, int) or isinstance(limit, bool):
            raise ValueError(f"wgrad_deferral_limit must be an integer >= 0, got {limit!r}")
        if self.defer_mode not in ("stash", "recompute"):
            raise ValueError(f"defer_mode must be 'stash' or 'recompute', got {self.defer_mode!r}")
        if limit < 0:  # Megatron's wording (model_parallel_config.py); refused with or
            # without deferral (a negative limit is never meant)
            raise ValueError(f"Wgrad deferral limit must be >= 0 (got {limit})")
        if not self.defer_embedding_wgrad_compute:
            return
        # Megatron's checks and wording (model_parallel_config.py), in its order.
        if self.pipeline_model_parallel_size == 1:
            raise ValueError("Cannot defer embedding wgrad when pipeline parallel not used")
        if not self.gradient_accumulation_fusion:
            raise ValueError("Cannot defer embedding wgrad without gradient accumulation fusion")

    def _validate_interleaving(self) -> None:
        v, g = self.virtual_pipeline_model_parallel_size, self.microbatch_group_size_per_vp_stage
        if v is None:
            if g is not None:
                raise ValueError(
                    "microbatch_group_size_per_vp_stage is only used with the "
                    "interleaved schedule (virtual_pipeline_model_parallel_size)"
                )
            return
        check_positive("virtual_pipeline_model_parallel_size", v)
        p, m = self.pipeline_model_parallel_size, self.num_microbatches
        if v > 1 and self.pipeline_schedule not in INTERLEAVED_FORMS:
            raise ValueError(
                f"pipeline_schedule {self.pipeline_schedule!r} has no interleaved form; "
                f"with virtual_pipeline_model_parallel_size ({v}) use one of "
                f"{list(INTERLEAVED_FORMS)}"
            )
        if v > 1 and p == 1:  # Megatron's rule (arguments.py), naming the fields
            raise ValueError(
                f"virtual_pipeline_model_parallel_size ({v}) asks for the "
                "interleaved schedule, which needs pipeline_model_parallel_size "
                f"> 1, got {p}"
            )
        if g is not None:
            check_positive("microbatch_group_size_per_vp_stage", g)
            if g < p:
                raise ValueError(
                    f"microbatch_group_size_per_vp_stage ({g}) must be at least "
                    f"pipeline-model-parallel-size ({p})"
                )
        elif v > 1 and m % p != 0:  # Megatron's wording (schedules.py)
            raise ValueError(
                f"number of microbatches ({m}) is not divisible by "
                f"pipeline-model-parallel-size ({p}) when using interleaved "
                "schedule"
            )

    @property
    def num_model_chunks(self) -> int:
        """Model chunks per pipeline stage: ``virtual_pipeline_model_parallel_size`` or 1."""
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def num_deferred_microbatches(self) -> int:
        """Microbatches whose output-layer wgrad is deferred: ``min(L, M)``, ``M`` for
        ``L = 0``, 0 without deferral."""
        if not self.defer_embedding_wgrad_compute:
            return 0
        m = self.num_microbatches
        return m if self.wgrad_deferral_limit == 0 else min(self.wgrad_deferral_limit, m)

    @property
    def data_parallel_size(self) -> int:
        """``world_size // (tp * cp * pp)`` (Megatron's)."""
        return self.world_size // (
            self.tensor_model_parallel_size
            * self.context_parallel_size
            * self.pipeline_model_parallel_size
        )

    @property
    def folds_experts(self) -> bool:
        """Megatron's MoE parallel folding: the expert-parallel group spans the tensor ranks
        (``expert_tensor_parallel_size`` 1, ``tp > 1``, EP > 1), the experts split over
        ``(expert, tensor)``."""
        return (
            self.expert_tensor_parallel_size == 1
            and self.tensor_model_parallel_size > 1
            and self.expert_model_parallel_size > 1
        )

    @property
    def expert_axis_size(self) -> int:
        """Size of the mesh's ``expert`` axis: EP, or ``EP / tp`` with parallel folding
        (the tensor axis makes up the rest of the expert-parallel group)."""
        ep = self.expert_model_parallel_size
        return ep // self.tensor_model_parallel_size if self.folds_experts else ep

    @property
    def data_context_parallel_size(self) -> int:
        """Megatron's data-parallel size with context parallelism, ``dp cp``: the ranks
        every dense gradient is reduced over
        (:data:`~jax_wgrad.parallel.mesh.DATA_CONTEXT_PARALLEL`)."""
        return self.data_parallel_size * self.context_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """Megatron's expert-data-parallel size: ``world / (etp EP pp)`` replicas of each
        expert (``dp cp / EP``; ``dp tp cp / EP`` with parallel folding): the ``(data,
        context)`` axes."""
        return self.data_context_parallel_size // self.expert_axis_size

    @property
    def num_microbatches(self) -> int:
        """Microbatches per data-parallel rank per step (``M``)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    def context_seq_length(self, seq_length: int) -> int:
        """Tokens of a ``seq_length`` sequence that each context rank holds: ``S / cp``
        (its two load-balanced chunks)."""
        return seq_length // self.context_parallel_size

    def local_seq_length(self, seq_length: int) -> int:
        """Tokens of a ``seq_length`` sequence that each device holds between the blocks:
        ``S / cp``, divided by ``tp`` under sequence parallelism."""
        s = self.context_seq_length(seq_length)
        return s // self.tensor_model_parallel_size if self.sequence_parallel else s

    def check_seq_length(self, seq_length: int) -> None:
        """Megatron's rule and wording (arguments.py): with context parallelism the
        sequence is cut into ``2 cp`` chunks."""
        cp = self.context_parallel_size
        if cp > 1 and seq_length % (2 * cp) != 0:
            raise ValueError(
                f"seq-length ({seq_length}) should be a multiple of 2 * context-parallel-size "
                f"({cp}) if context-parallel-size > 1."
            )

    @property
    def mesh_shape(self) -> tuple[int, int, int, int, int]:
        """``(data, expert, context, tensor, pipeline)`` sizes: ``(dp / EP, EP, cp, tp,
        pp)`` (``(dp tp / EP, EP / tp, cp, tp, pp)`` with parallel folding): the one
        derivation of the mesh's shape (:func:`~jax_wgrad.parallel.mesh.make_mesh`,
        :func:`~jax_wgrad.parallel.mesh.axis_sizes`)."""
        return (
            self.expert_data_parallel_size // self.context_parallel_size,
            self.expert_axis_size,
            self.context_parallel_size,
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
        )
