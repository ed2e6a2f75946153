"""jax_wgrad: Megatron-LM's weight-gradient and gradient-buffer optimizations for JAX.

Tiers (bottom up):

* ``ffi/``: C++ (OpenBLAS) and CUDA (cuBLAS) handlers of one XLA FFI target.
* :mod:`jax_wgrad.ops`: the ``wgrad_accumulate`` primitive (``main_grad += dy^T x`` in
  place, optionally into a flat bucket at a static offset).
* :mod:`jax_wgrad.linear`: custom_vjp linears routing weight gradients into fp32 main
  grads (:func:`linear`) or flat gradient buckets (:func:`linear_into_bucket`).
* Flax NNX modules (:mod:`jax_wgrad.nn`, tensor-parallel :mod:`jax_wgrad.layers`, the
  GPT of :mod:`jax_wgrad.gpt`), the 1F1B schedule (:mod:`jax_wgrad.pipeline`), gradient
  buckets (:mod:`jax_wgrad.buckets`, :mod:`jax_wgrad.grad_buffer`, :mod:`jax_wgrad.ddp`),
  the distributed optimizer (:mod:`jax_wgrad.dist_optimizer`), deferred output-layer
  weight gradients (:mod:`jax_wgrad.deferred`) and the train step (:mod:`jax_wgrad.train`).
"""

from jax_wgrad import deferred, ops
from jax_wgrad.accumulate import accumulate_gradients
from jax_wgrad.buckets import plan_buckets
from jax_wgrad.config import DDPConfig, GPTConfig, ParallelConfig
from jax_wgrad.data import ByteDataset
from jax_wgrad.dist_optimizer import DistributedOptimizer
from jax_wgrad.grad_buffer import GradBuffer
from jax_wgrad.layers import (
    ColumnParallelLinear,
    LayerNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from jax_wgrad.linear import BucketSlot, WgradBuckets, linear, linear_into_bucket
from jax_wgrad.mesh import initialize_distributed, make_mesh
from jax_wgrad.nn import Linear, MainGrad
from jax_wgrad.ops import fusion_available, fusion_status, wgrad_accumulate
from jax_wgrad.train import TrainState, build_train_step, init_train_state, shard_batch

__all__ = [
    "BucketSlot",
    "ByteDataset",
    "ColumnParallelLinear",
    "DDPConfig",
    "DistributedOptimizer",
    "GPTConfig",
    "GradBuffer",
    "LayerNorm",
    "Linear",
    "MainGrad",
    "ParallelConfig",
    "RowParallelLinear",
    "TrainState",
    "VocabParallelEmbedding",
    "WgradBuckets",
    "accumulate_gradients",
    "build_train_step",
    "deferred",
    "fusion_available",
    "fusion_status",
    "init_train_state",
    "initialize_distributed",
    "linear",
    "linear_into_bucket",
    "make_mesh",
    "ops",
    "plan_buckets",
    "shard_batch",
    "vocab_parallel_cross_entropy",
    "wgrad_accumulate",
]
