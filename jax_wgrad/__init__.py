"""jax_wgrad: Megatron-LM's weight-gradient and gradient-buffer optimizations for JAX.

Tiers, bottom up (each imports only the ones before it):

* :mod:`jax_wgrad.ops`: the XLA FFI ops (fused ``wgrad_accumulate``, in-place
  ``bucket_add``) and their registry.
* :mod:`jax_wgrad.functional`: custom_vjp linears routing weight gradients into main grads
  or flat buckets, Megatron's conjugate collectives, vocab-parallel cross entropy.
* :mod:`jax_wgrad.nn`: Flax NNX modules (``Linear``, tensor-parallel layers, LayerNorm).
* :mod:`jax_wgrad.parallel` (mesh, axis names, ``ParallelConfig``) and
  :mod:`jax_wgrad.models` (any ``embed -> layers -> head`` NNX model through
  ``LayerStackConfig``; :mod:`jax_wgrad.models.gpt`, the GPT).
* :mod:`jax_wgrad.grads`: flat padded buckets (Megatron's plan), layouts from parameter
  specs, data-parallel sync and finalization; :mod:`jax_wgrad.optim`: the distributed
  optimizer.
* :mod:`jax_wgrad.parallel.pipeline` (schedules as data, the executor) and
  :mod:`jax_wgrad.parallel.deferred` (deferred output-layer weight gradients).
* :mod:`jax_wgrad.training`: the per-run plan, the train step, data, the CLI;
  :mod:`jax_wgrad.pretrain`: the pretraining job (``examples/pretrain_gpt.py``).
* :mod:`jax_wgrad.testing`: the single-device reference model.
"""

from jax_wgrad import functional, grads, models, nn, ops, optim, parallel, testing, training
from jax_wgrad.functional import WgradRoutes, linear, linear_into_bucket
from jax_wgrad.functional.cross_entropy import vocab_parallel_cross_entropy
from jax_wgrad.grads import DDPConfig, GradBuffer, GradLayout, GradSpec, plan_buckets
from jax_wgrad.models.gpt import (
    GPTConfig,
    GPTProgram,
    init_params,
    param_specs,
    single_device_logits,
)
from jax_wgrad.nn import (
    ColumnParallelLinear,
    LayerNorm,
    Linear,
    MainGrad,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from jax_wgrad.ops import (
    bucket_add,
    fusion_available,
    fusion_status,
    op_status,
    wgrad_accumulate,
)
from jax_wgrad.optim import DistributedOptimizer
from jax_wgrad.parallel import (
    ParallelConfig,
    initialize_distributed,
    make_mesh,
    use_virtual_cpu_devices,
)
from jax_wgrad.parallel.pipeline.gradients import pipeline_gradients
from jax_wgrad.training import (
    ByteDataset,
    TrainPlan,
    TrainState,
    accumulate_gradients,
    build_train_step,
    default_optimizer,
    init_train_state,
    shard_batch,
    train_state_from_hf,
)

__all__ = [
    # configs and the run
    "DDPConfig",
    "GPTConfig",
    "ParallelConfig",
    "TrainPlan",
    "TrainState",
    "make_mesh",
    "initialize_distributed",
    "use_virtual_cpu_devices",
    "init_params",
    "param_specs",
    "GPTProgram",
    "single_device_logits",
    "pipeline_gradients",
    "init_train_state",
    "train_state_from_hf",
    "build_train_step",
    "default_optimizer",
    "shard_batch",
    "ByteDataset",
    # gradients
    "plan_buckets",
    "GradBuffer",
    "GradLayout",
    "GradSpec",
    "DistributedOptimizer",
    # ops and layers
    "wgrad_accumulate",
    "bucket_add",
    "fusion_available",
    "fusion_status",
    "op_status",
    "linear",
    "linear_into_bucket",
    "WgradRoutes",
    "Linear",
    "MainGrad",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "LayerNorm",
    "vocab_parallel_cross_entropy",
    "accumulate_gradients",
    # tiers
    "ops",
    "functional",
    "nn",
    "models",
    "parallel",
    "grads",
    "optim",
    "training",
    "testing",
]
