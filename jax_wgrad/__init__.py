"""jax_wgrad: Megatron-LM's weight-gradient and gradient-buffer optimizations for JAX.

Tiers, bottom up (each imports only the ones before it):

* :mod:`jax_wgrad.ops`: the XLA FFI ops (fused ``wgrad_accumulate``, in-place
  ``bucket_add``) and their registry.
* :mod:`jax_wgrad.functional`: custom_vjp linears routing weight gradients into main grads
  or flat buckets, Megatron's conjugate collectives, vocab-parallel cross entropy.
* :mod:`jax_wgrad.nn`: Flax NNX modules (``Linear``, tensor-parallel layers, LayerNorm).
* :mod:`jax_wgrad.parallel` (mesh, axis names, ``ParallelConfig``, the schedule tables),
  below every tier.
* :mod:`jax_wgrad.models` (the GPT, :mod:`jax_wgrad.models.gpt`, and any ``embed ->
  layers -> head`` NNX model through ``LayerStackConfig``: their modules and stage
  functions) and :mod:`jax_wgrad.grads` (flat padded buckets, Megatron's plan, gradient
  layouts from parameter specs, data-parallel sync and finalization).
* :mod:`jax_wgrad.layout`: a model's parameters laid out for the pipeline, derived from
  its NNX modules' metadata (sharding, canonical / layout / per-device forms, gradient
  specs); :mod:`jax_wgrad.optim`: the distributed optimizer.
* :mod:`jax_wgrad.parallel.pipeline` (schedules as data, the executor) and
  :mod:`jax_wgrad.parallel.deferred` (deferred output-layer weight gradients).
* :mod:`jax_wgrad.training`: the per-run plan, the train step, data, the loop.
* :mod:`jax_wgrad.interop`: Hugging Face checkpoints in and out, a train state started
  from one.
* :mod:`jax_wgrad.pretrain`: the pretraining job and its command line
  (``examples/pretrain_gpt.py``, the ``jax-wgrad-pretrain`` console script);
  :mod:`jax_wgrad.testing`: the single-device reference model.

The names below are resolved on first use (PEP 562): ``import jax_wgrad`` imports neither
jax nor flax, so a launcher can choose jax's platforms after importing the package.
"""

from __future__ import annotations

import importlib

_ORIGINS = {
    "jax_wgrad.functional": ("WgradRoutes", "linear", "linear_into_bucket"),
    "jax_wgrad.functional.cross_entropy": ("vocab_parallel_cross_entropy",),
    "jax_wgrad.grads": ("DDPConfig", "GradBuffer", "GradLayout", "GradSpec", "plan_buckets"),
    "jax_wgrad.interop": ("single_device_logits", "train_state_from_hf"),
    "jax_wgrad.layout": ("lay_out", "param_specs"),
    "jax_wgrad.models.gpt": ("GPTConfig", "GPTProgram", "init_params"),
    "jax_wgrad.nn": (
        "ColumnParallelLinear",
        "LayerNorm",
        "Linear",
        "MainGrad",
        "RowParallelLinear",
        "VocabParallelEmbedding",
    ),
    "jax_wgrad.ops": (
        "bucket_add",
        "fusion_available",
        "fusion_status",
        "op_status",
        "wgrad_accumulate",
    ),
    "jax_wgrad.optim": ("DistributedOptimizer",),
    "jax_wgrad.parallel": (
        "ParallelConfig",
        "initialize_distributed",
        "make_mesh",
        "use_virtual_cpu_devices",
    ),
    "jax_wgrad.parallel.pipeline.gradients": ("pipeline_gradients",),
    "jax_wgrad.training": (
        "ByteDataset",
        "TrainPlan",
        "TrainState",
        "accumulate_gradients",
        "build_train_step",
        "default_optimizer",
        "init_train_state",
        "shard_batch",
    ),
}
"""The module each public name is imported from on first use."""

_SUBMODULES = (
    "functional",
    "grads",
    "layout",
    "models",
    "nn",
    "ops",
    "optim",
    "parallel",
    "testing",
    "training",
)
"""The tiers in ``__all__``: ``jax_wgrad.<tier>`` imports the subpackage."""

_WHERE = {name: module for module, names in _ORIGINS.items() for name in names}

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
    "lay_out",
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
    "layout",
    "optim",
    "training",
    "testing",
]


def __getattr__(name: str):
    if name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    elif name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
