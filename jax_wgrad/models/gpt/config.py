"""Shape of the GPT (Megatron's model arguments) and its fit to a parallel layout."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jax_wgrad._validation import check_positive
from jax_wgrad.parallel.config import ParallelConfig

__all__ = ["GPTConfig", "validate"]


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
            check_positive(name, getattr(self, name))
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        check_positive("ffn_hidden_size", self.ffn_hidden_size)
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
