"""Frozen configuration dataclasses: parallel layout and GPT model shape.

Names follow Megatron-LM (``tensor_model_parallel_size``, ``micro_batch_size`` ...) so a
Megatron user can read a config without a dictionary. Both classes validate themselves
on construction; :func:`validate` checks the constraints that involve both.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Literal

__all__ = ["ParallelConfig", "GPTConfig", "DDPConfig", "validate"]


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How one training step is laid out over devices.

    The mesh is ``(data, tensor, pipeline)``; the data-parallel size and the number of
    microbatches are derived, as in Megatron.
    """

    tensor_model_parallel_size: int = 1
    """Devices a layer's weights are split over (Megatron TP)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages; the transformer layers are split evenly over them."""
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
    weight-gradient GEMMs after the schedule (issue #4, :mod:`jax_wgrad.deferred`)."""
    wgrad_deferral_limit: int = 0
    """Number of microbatches whose output-layer weight gradient is deferred (the first
    ``min(limit, M)``); 0 defers all of them (Megatron's default)."""
    defer_mode: Literal["stash", "recompute"] = "stash"
    """``stash``: keep ``(x, dy)`` per deferred microbatch (Megatron; ``dy`` is
    ``[T, V/tp]``). ``recompute``: keep ``(x, logsumexp, labels)`` and rebuild ``dy``
    chunk by chunk in the drain (``O(T H)`` instead of ``O(T V/tp)``; one extra GEMM)."""

    def __post_init__(self) -> None:
        _positive("tensor_model_parallel_size", self.tensor_model_parallel_size)
        _positive("pipeline_model_parallel_size", self.pipeline_model_parallel_size)
        _positive("micro_batch_size", self.micro_batch_size)
        if self.world_size is None:
            import jax

            object.__setattr__(self, "world_size", jax.device_count())
        _positive("world_size", self.world_size)
        model_parallel = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if self.world_size % model_parallel != 0:
            raise ValueError(
                f"world size ({self.world_size}) is not divisible by "
                f"tensor_model_parallel_size ({self.tensor_model_parallel_size}) x "
                f"pipeline_model_parallel_size ({self.pipeline_model_parallel_size})"
            )
        dp = self.world_size // model_parallel
        if self.global_batch_size is None:
            object.__setattr__(self, "global_batch_size", self.micro_batch_size * dp)
        _positive("global_batch_size", self.global_batch_size)
        if self.global_batch_size % (self.micro_batch_size * dp) != 0:
            raise ValueError(
                f"global batch size ({self.global_batch_size}) is not divisible by "
                f"micro batch size ({self.micro_batch_size}) times data parallel size ({dp})"
            )
        self._validate_deferral()
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            # Megatron does the same (model_parallel_config.py).
            warnings.warn(
                "Disabling sequence parallelism because tensor model parallelism is disabled",
                stacklevel=2,
            )
            object.__setattr__(self, "sequence_parallel", False)

    def _validate_deferral(self) -> None:
        if not isinstance(self.defer_embedding_wgrad_compute, bool):
            raise ValueError("defer_embedding_wgrad_compute must be a bool, got "
                             f"{self.defer_embedding_wgrad_compute!r}")
        limit = self.wgrad_deferral_limit
        if not isinstance(limit, int) or isinstance(limit, bool):
            raise ValueError(f"wgrad_deferral_limit must be an integer >= 0, got {limit!r}")
        if self.defer_mode not in ("stash", "recompute"):
            raise ValueError(
                f"defer_mode must be 'stash' or 'recompute', got {self.defer_mode!r}")
        if not self.defer_embedding_wgrad_compute:
            return
        # Megatron's checks and wording (model_parallel_config.py), in its order.
        if self.pipeline_model_parallel_size == 1:
            raise ValueError("Cannot defer embedding wgrad when pipeline parallel not used")
        if not self.gradient_accumulation_fusion:
            raise ValueError(
                "Cannot defer embedding wgrad without gradient accumulation fusion")
        if limit < 0:
            raise ValueError(f"Wgrad deferral limit must be >= 0 (got {limit})")

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
        """``world_size // (tp * pp)``."""
        return self.world_size // (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        )

    @property
    def num_microbatches(self) -> int:
        """Microbatches per data-parallel rank per step (``M``)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        """``(data, tensor, pipeline)`` sizes."""
        return (
            self.data_parallel_size,
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
        )


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a pre-LN GPT decoder (learned positions, GELU MLP, causal attention)."""

    vocab_size: int = 256
    """Vocabulary size; 256 for the byte-level data of :mod:`jax_wgrad.data`."""
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 64
    """Tokens per sequence; also the number of learned positions."""
    ffn_hidden_size: int | None = None
    """MLP width; ``None`` means ``4 * hidden_size``."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weight instead of the word embedding table."""
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """Activations and GEMM inputs; parameters and gradients stay fp32."""
    attention_backend: Literal["auto", "xla", "cudnn"] = "auto"
    """The attention core (Megatron's ``--attention-backend``): ``xla`` computes
    ``softmax(Q K^T / sqrt(d)) V`` with plain XLA ops (fp32 softmax); ``cudnn`` is
    :func:`jax.nn.dot_product_attention`'s cuDNN flash attention (CUDA GPUs, bfloat16);
    ``auto`` picks ``cudnn`` on a CUDA GPU with bfloat16 compute and a head size cuDNN
    takes (a multiple of 8, at most 128), ``xla`` otherwise."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "hidden_size", "num_attention_heads",
                     "seq_length"):
            _positive(name, getattr(self, name))
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        _positive("ffn_hidden_size", self.ffn_hidden_size)
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"compute_dtype must be 'float32' or 'bfloat16', got {self.compute_dtype!r}"
            )
        if self.attention_backend not in ("auto", "xla", "cudnn"):
            raise ValueError("attention_backend must be 'auto', 'xla' or 'cudnn', got "
                             f"{self.attention_backend!r}")
        if self.attention_backend == "cudnn" and self.compute_dtype != "bfloat16":
            raise ValueError("attention_backend 'cudnn' needs compute_dtype 'bfloat16' "
                             f"(cuDNN flash attention takes 16-bit inputs), got "
                             f"{self.compute_dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def attention_implementation(self, platform: str) -> Literal["xla", "cudnn"]:
        """``attention_backend`` resolved for a jax platform (``"cpu"``, ``"gpu"``, ...)."""
        if self.attention_backend != "auto":
            return self.attention_backend  # type: ignore[return-value]
        cudnn_ok = (platform in ("gpu", "cuda") and self.compute_dtype == "bfloat16"
                    and self.head_dim % 8 == 0 and self.head_dim <= 128)
        return "cudnn" if cudnn_ok else "xla"


@dataclasses.dataclass(frozen=True)
class DDPConfig:
    """Gradient buffers, their data-parallel sync, and the optimizer step.

    Megatron's ``DistributedDataParallelConfig`` fields (same names and meaning) plus
    ``clip_grad`` (from Megatron's ``OptimizerConfig``), because this library's
    optimizer step (:class:`jax_wgrad.dist_optimizer.DistributedOptimizer`) owns clipping.
    """

    use_distributed_optimizer: bool = False
    """Shard fp32 master weights and optimizer state over ``data``: buckets are
    reduce-scattered, each rank updates its shard, parameters are all-gathered."""
    overlap_grad_reduce: bool = False
    """Sync a pipeline stage's gradient buckets in the cooldown, as soon as the stage's
    last backward is done (inside the schedule); otherwise after the schedule."""
    bucket_size: int | None = None
    """Approximate elements per bucket. As in Megatron: ``None`` means
    ``max(40_000_000, 1_000_000 * dp)`` with ``overlap_grad_reduce`` and is ignored (one
    bucket per buffer) without it; see :meth:`effective_bucket_size`."""
    average_in_collective: bool = False
    """Average in the collective (divide after the sum) instead of pre-scaling by 1/dp."""
    pad_buckets_for_high_nccl_busbw: bool = False
    """Pad bucket ends to a multiple of ``lcm(dp, 128, 2**16)`` (distributed optimizer)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (Megatron's
    ``--clip-grad``, default 1.0)."""

    def __post_init__(self) -> None:
        for name in ("use_distributed_optimizer", "overlap_grad_reduce",
                     "average_in_collective", "pad_buckets_for_high_nccl_busbw"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.bucket_size is not None:
            _positive("bucket_size", self.bucket_size)
        clip = self.clip_grad
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not (
                0.0 <= clip < float("inf")):
            raise ValueError(f"clip_grad must be a finite number >= 0 (0 disables "
                             f"clipping), got {clip!r}")

    def effective_bucket_size(self, data_parallel_size: int) -> int | None:
        """Megatron's rule (``DistributedDataParallel.__init__``): without
        ``overlap_grad_reduce`` a single bucket (``None``); with it ``bucket_size`` or,
        if unset, ``max(40_000_000, 1_000_000 * dp)``."""
        if not self.overlap_grad_reduce:
            return None
        if self.bucket_size is None:
            return max(40_000_000, 1_000_000 * data_parallel_size)
        return self.bucket_size


def validate(parallel: ParallelConfig, model: GPTConfig) -> None:
    """Checks that ``model`` can be split as ``parallel`` asks; raises ``ValueError``."""
    tp = parallel.tensor_model_parallel_size
    pp = parallel.pipeline_model_parallel_size
    for name in ("num_attention_heads", "hidden_size", "ffn_hidden_size", "vocab_size"):
        value = getattr(model, name)
        if value % tp != 0:
            raise ValueError(
                f"{name} ({value}) must be divisible by tensor_model_parallel_size ({tp})"
            )
    if model.num_layers % pp != 0:
        raise ValueError(
            f"num_layers ({model.num_layers}) must be divisible by "
            f"pipeline_model_parallel_size ({pp})"
        )
    if parallel.sequence_parallel and model.seq_length % tp != 0:
        raise ValueError(
            f"seq_length ({model.seq_length}) must be divisible by "
            f"tensor_model_parallel_size ({tp}) with sequence parallelism"
        )
