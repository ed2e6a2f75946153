"""Checkpoints of other libraries in and out: :mod:`jax_wgrad.interop.hf` (Hugging Face
Llama, Mistral, Qwen2, Qwen3, Mixtral and Qwen3-MoE directories), and a train state started
from one (:func:`train_state_from_hf`, :mod:`jax_wgrad.interop.train_state`)."""

from jax_wgrad.interop.hf import (
    canonical_arrays,
    export_hf,
    hf_tensors,
    import_hf,
    read_hf_config,
    read_hf_tensors,
)
from jax_wgrad.interop.hf_config import (
    FAMILIES,
    UnsupportedHFConfig,
    config_from_hf,
    hf_config_from,
    hf_to_megatron_aux_loss_coeff,
    megatron_to_hf_aux_loss_coeff,
)
from jax_wgrad.interop.logits import single_device_logits
from jax_wgrad.interop.train_state import train_state_from_hf

__all__ = [
    "FAMILIES",
    "single_device_logits",
    "UnsupportedHFConfig",
    "canonical_arrays",
    "config_from_hf",
    "export_hf",
    "hf_config_from",
    "hf_tensors",
    "hf_to_megatron_aux_loss_coeff",
    "import_hf",
    "megatron_to_hf_aux_loss_coeff",
    "read_hf_config",
    "read_hf_tensors",
    "train_state_from_hf",
]
