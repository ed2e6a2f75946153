"""What every pipeline program of a step sets up the same way (:class:`StageSetup`).

The training executor (:func:`~jax_wgrad.parallel.pipeline.executor.stage_gradients`),
the forward-only evaluation (:func:`~jax_wgrad.parallel.pipeline.evaluate.eval_loss`) and
the step's finalization (:func:`~jax_wgrad.parallel.pipeline.gradients.reduce_gradients`)
read the same facts: this data rank's token shape and its microbatches, the activation
between stages (its sequence length under sequence parallelism), this device's pipeline
stage, and the number of tokens the loss is normalized by. They are written here once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jax_wgrad.parallel.config import ParallelConfig
from jax_wgrad.parallel.mesh import DATA_CONTEXT_PARALLEL, PIPELINE

__all__ = ["StageSetup"]


@dataclasses.dataclass(frozen=True)
class StageSetup:
    """Static set-up of one device's pipeline program (see the module docstring).

    Attributes:
      num_stages: ``P``; num_microbatches: ``M`` per data rank; micro_batch_size: ``mb``.
      seq_length: ``S`` tokens per sequence (a row of tokens holds ``S + 1``: inputs and
        the shifted labels).
      local_seq_length: ``S / cp``, divided by ``tp`` under sequence parallelism
        (:meth:`ParallelConfig.local_seq_length`).
      context_parallel_size: ``cp``: each device holds ``S / cp`` tokens of a sequence.
      hidden_size: ``H``; dtype: the activations' dtype.
      sample_shape: one sample of the batch (without the leading batch dim); the GPT's is
        ``(S + 1,)`` tokens: its inputs and the shifted labels. sample_dtype: its dtype.
    """

    num_stages: int
    num_microbatches: int
    micro_batch_size: int
    seq_length: int
    local_seq_length: int
    hidden_size: int
    dtype: jnp.dtype
    sample_shape: tuple[int, ...]
    sample_dtype: jnp.dtype
    context_parallel_size: int = 1

    @classmethod
    def create(
        cls,
        parallel: ParallelConfig,
        *,
        seq_length: int,
        hidden_size: int,
        dtype,
        sample_shape: tuple[int, ...] | None = None,
        sample_dtype="int32",
    ) -> StageSetup:
        """``sample_shape`` defaults to ``(seq_length + 1,)``: a row of tokens."""
        return cls(
            num_stages=parallel.pipeline_model_parallel_size,
            num_microbatches=parallel.num_microbatches,
            micro_batch_size=parallel.micro_batch_size,
            seq_length=seq_length,
            local_seq_length=parallel.local_seq_length(seq_length),
            hidden_size=hidden_size,
            dtype=jnp.dtype(dtype),
            sample_shape=(seq_length + 1,) if sample_shape is None else tuple(sample_shape),
            sample_dtype=jnp.dtype(sample_dtype),
            context_parallel_size=parallel.context_parallel_size,
        )

    # ---------------------------------------------------------------------- the batch

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """This data rank's batch: ``[M * mb, *sample_shape]`` (tokens: ``[M * mb, S + 1]``)."""
        return (self.num_microbatches * self.micro_batch_size, *self.sample_shape)

    def global_batch(self, data_parallel_size: int) -> jax.ShapeDtypeStruct:
        """The shape of the whole step's batch (every data rank's)."""
        n, *sample = self.batch_shape
        return jax.ShapeDtypeStruct((n * data_parallel_size, *sample), self.sample_dtype)

    def microbatches(self, batch: jax.Array, who: str) -> jax.Array:
        """``batch [M * mb, ...]`` -> ``[M, mb, ...]``; ``who`` names the caller in the
        ``ValueError`` of a wrong shape."""
        if batch.shape != self.batch_shape:
            raise ValueError(
                f"{who}: expected a local batch of shape "
                f"{list(self.batch_shape)}, got {list(batch.shape)}"
            )
        return batch.reshape(self.num_microbatches, self.micro_batch_size, *self.sample_shape)

    @property
    def num_tokens(self) -> int:
        """Tokens this device's losses cover (``M * mb * S / cp``): the loss and the
        gradients are normalized by their sum over the data x context ranks."""
        return (
            self.num_microbatches
            * self.micro_batch_size
            * self.seq_length
            // self.context_parallel_size
        )

    def mean_loss(self, loss_sum: jax.Array) -> jax.Array:
        """The global mean token loss from every device's token-loss sum (inside
        ``shard_map``; the losses live on the last stage, the tokens on every rank)."""
        return lax.psum(loss_sum, (*DATA_CONTEXT_PARALLEL, PIPELINE)) / lax.psum(
            jnp.float32(self.num_tokens), DATA_CONTEXT_PARALLEL
        )

    # ---------------------------------------------------------------------- activations

    @property
    def activation_shape(self) -> tuple[int, int, int]:
        """``[mb, s(/tp), H]``: what one stage hands the next."""
        return (self.micro_batch_size, self.local_seq_length, self.hidden_size)

    def zero_activation(self) -> jax.Array:
        return jnp.zeros(self.activation_shape, self.dtype)

    def stage_index(self) -> jax.Array:
        """This device's pipeline stage (traced; ``0`` without pipeline parallelism)."""
        return lax.axis_index(PIPELINE) if self.num_stages > 1 else jnp.int32(0)
