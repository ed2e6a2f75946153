"""Shape of the GPT (Megatron's model arguments) and its fit to a parallel layout."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Literal

from jax_wgrad._validation import check_positive
from jax_wgrad.functional.attention import RopeScaling
from jax_wgrad.functional.context_parallel import runs_cudnn
from jax_wgrad.functional.fp8 import Fp8Recipe
from jax_wgrad.functional.moe import MoEConfig
from jax_wgrad.nn.norm import NORMALIZATIONS
from jax_wgrad.parallel.config import ParallelConfig

__all__ = ["GPTConfig", "RUN_OPTIONS", "check_window_size", "validate", "vocab_size_with_padding"]

_MOE = "moe_config"
"""Field metadata key of the GPT's MoE options: the :class:`MoEConfig` field an option is
forwarded to, or ``None`` for the GPT's own MoE options (dispatcher, padding, grouped GEMM,
layer frequency)."""


_DENSE_TOO = "dense_too"
"""Field metadata: an option the MoE layer reads that a dense model has too (SwiGLU)."""


def _forwarded(name: str):
    """A GPT field forwarded to :class:`MoEConfig`'s field ``name``, with that field's
    default (the option's one default)."""
    return dataclasses.field(
        default=MoEConfig.__dataclass_fields__[name].default, metadata={_MOE: name}
    )


def _gpt_moe_option(default):
    """An MoE option of the GPT itself (not read by the MoE layer)."""
    return dataclasses.field(default=default, metadata={_MOE: None})


RUN_OPTIONS = frozenset(
    {
        "compute_dtype",
        "params_dtype",
        "attention_backend",
        "layer_scan_unroll",
        "moe_dropless_buffer_factor",
        "moe_permute_fusion",
        *(f"fp8_{f}" for f in Fp8Recipe.__dataclass_fields__),
        "first_last_layers_bf16",
        "num_layers_at_start_in_bf16",
        "num_layers_at_end_in_bf16",
    }
)
"""Fields that say how a run computes, not which model it is (no preset or converted
checkpoint sets them)."""


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a pre-norm decoder: GPT-2 by default (LayerNorm, learned positions, GELU
    MLP, biases, tied embeddings); the architecture options make it a Llama, Mistral, Qwen2
    or Mixtral (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases, untied)."""

    vocab_size: int = 256
    """Vocabulary size (the tokenizer's, the true one); 256 for the byte-level data of
    :mod:`jax_wgrad.training.data`."""
    make_vocab_size_divisible_by: int = 1
    """Pad the vocabulary to a multiple of this (Megatron's
    ``--make-vocab-size-divisible-by``; the command line's default is Megatron's 128):
    the embedding and output layer get :attr:`padded_vocab_size` rows, the padding rows
    are masked out of the softmax (never predicted, zero gradient). Unlike Megatron the
    multiple is NOT multiplied by the tensor-parallel size, so the padded shapes (and
    checkpoints) do not depend on the layout; the layout must divide the padded size
    (Megatron's size for ``tp``: pass Megatron's value times ``tp``)."""
    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width."""
    num_attention_heads: int = 4
    """Attention (query) heads."""
    seq_length: int = 64
    """Tokens per sequence; also the number of learned positions."""
    ffn_hidden_size: int | None = None
    """MLP width; ``None`` means ``4 * hidden_size``."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weight instead of the word embedding table."""
    layernorm_epsilon: float = 1e-5
    """The norms' epsilon (Megatron's ``--norm-epsilon``)."""
    init_method_std: float = 0.02
    """Standard deviation of the weights' normal init."""

    # -- Architecture (Megatron's names): GPT-2 by default; Llama is RMSNorm + rope +
    # swiglu + group_query_attention + no bias + untied embeddings.
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """The norm layers' kind."""
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    """Learned positions or rotary embeddings (RoPE)."""
    rotary_base: float = 10000.0
    """RoPE's base (theta)."""
    rotary_percent: float = 1.0
    """The share of each head's dims that RoPE rotates (the first ones)."""
    rope_scaling: bool = False
    """Scale RoPE's frequencies as Llama 3.1-3.3 do (Hugging Face's ``rope_type:
    "llama3"``; :class:`~jax_wgrad.functional.RopeScaling`)."""
    rope_scaling_factor: float = 8.0
    """The RoPE scaling's factor (8 for Llama 3.1 and 3.3, 32 for 3.2)."""
    rope_scaling_low_freq_factor: float = 1.0
    """The RoPE scaling's low_freq_factor (Hugging Face configs carry it; Megatron fixes 1)."""
    rope_scaling_high_freq_factor: float = 4.0
    """The RoPE scaling's high_freq_factor (Hugging Face configs carry it; Megatron fixes
    4)."""
    rope_scaling_original_max_position_embeddings: int = 8192
    """The RoPE scaling's original_max_position_embeddings: the context the model was
    trained at before scaling (Hugging Face configs carry it; Megatron fixes 8192)."""
    swiglu: bool = dataclasses.field(
        default=MoEConfig.__dataclass_fields__["swiglu"].default,
        metadata={_MOE: "swiglu", _DENSE_TOO: True},
    )
    """``silu(gate) * up`` MLPs (dense and expert) instead of GELU."""
    group_query_attention: bool = False
    """Grouped-query attention (with ``num_query_groups``)."""
    num_query_groups: int | None = None
    """Key/value heads with ``group_query_attention`` (``None``: as many as query heads)."""
    add_bias_linear: bool = True
    """Biases in the linear layers (Megatron's ``--disable-bias-linear`` turns them off)."""
    add_qkv_bias: bool = False
    """A bias in the qkv projection even without the other linear biases (``add_bias_linear``
    False: Megatron's ``--disable-bias-linear``; Qwen2)."""
    qk_layernorm: bool = False
    """Normalize each query and key head (``normalization``, over ``kv_channels``)."""
    kv_channels: int | None = None
    """Each head's dims; ``None`` means ``hidden_size / num_attention_heads``."""
    window_size: tuple[int, int] | None = None
    """Sliding-window attention, Megatron's ``(left, right)`` window size (Transformer
    Engine's; ``left,right`` on the command line): each token attends to itself and the
    ``left`` tokens before it; ``right`` must be 0 (the model is causal). Hugging Face's
    ``sliding_window`` W (Mistral, Qwen2) is ``(W - 1, 0)``: 4096 is ``4095,0``. A
    ``left`` of ``seq_length - 1`` or more changes nothing. ``None``: no window."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """Activations and GEMM inputs (the layers cast their weights to it)."""
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    """The model parameters' dtype (Megatron's ``params_dtype``, which its ``--bf16``
    sets to bf16). Gradient buckets stay fp32 either way. ``bfloat16`` needs
    ``compute_dtype="bfloat16"``; the optimizer then keeps fp32 main parameters (with the
    distributed optimizer only its shard of them, Megatron's 2 + 4 + 12/DP bytes per
    parameter) and all-gathers the updated parameters in bf16. ``float32``: the optimizer
    updates the parameters themselves, no second fp32 copy (4 + 4 + 8/DP)."""
    attention_backend: Literal["auto", "xla", "cudnn"] = "auto"
    """The attention core (Megatron's ``--attention-backend``): ``xla`` computes
    ``softmax(Q K^T / sqrt(d)) V`` with plain XLA ops (fp32 softmax); ``cudnn`` is
    :func:`jax.nn.dot_product_attention`'s cuDNN flash attention (CUDA GPUs, bfloat16);
    ``auto`` picks ``cudnn`` on a CUDA GPU with bfloat16 compute and a head size cuDNN
    takes (a multiple of 8, at most 128), ``xla`` otherwise."""

    layer_scan_unroll: int = 1
    """Layers per iteration of a stage's loop over its layers (``jax.lax.scan``'s
    ``unroll``, counted in periods of ``moe_layer_freq`` layers for an MoE model). ``1``:
    compile time flat in the depth. The stage's layer count: no loop, straight-line code
    that XLA:GPU can capture in fewer CUDA graphs (fewer kernel launches per tick; compile
    time grows with the depth). Not a shape: checkpoints ignore it."""

    # -- Mixture of Experts (Megatron's names and defaults, except the dispatcher). The
    # options the MoE layer reads are forwarded to :class:`MoEConfig` (field metadata
    # ``"moe_config"``: its field's name), whose field defaults and checks are the only ones.
    num_moe_experts: int | None = dataclasses.field(default=None, metadata={_MOE: "num_experts"})
    """Experts per MoE layer (``--num-experts``); ``None``: a dense model."""
    moe_router_topk: int = _forwarded("topk")
    """Experts each token is routed to."""
    moe_router_pre_softmax: bool = _forwarded("pre_softmax")
    """The gates are the top-k of the softmax over all experts, not renormalised (Hugging
    Face's ``norm_topk_prob: false``); off: the softmax over the top-k logits (= the top-k
    probabilities renormalised: Mixtral's, ``norm_topk_prob: true``)."""
    moe_router_topk_scaling_factor: float | None = _forwarded("topk_scaling_factor")
    """Multiplies the top-k gates (``None``: no scaling)."""
    moe_ffn_hidden_size: int | None = dataclasses.field(
        default=None, metadata={_MOE: "ffn_hidden_size"}
    )
    """Each expert's MLP width; ``None`` means ``ffn_hidden_size``."""
    moe_router_load_balancing_type: Literal["aux_loss", "none"] = _forwarded("load_balancing_type")
    """The router's load-balancing loss."""
    moe_aux_loss_coeff: float = _forwarded("aux_loss_coeff")
    """Weight of the load-balancing loss."""
    moe_token_dispatcher_type: Literal["alltoall"] = _gpt_moe_option("alltoall")
    """Only ``alltoall`` exists here (Megatron's default is ``allgather``)."""
    moe_expert_capacity_factor: float | None = _forwarded("capacity_factor")
    """``None``: no token is dropped; else Megatron's capacity ``ceil(T k f / E)``."""
    moe_dropless_buffer_factor: float | None = _forwarded("dropless_buffer_factor")
    """Not Megatron's (its dropless dispatch has dynamic shapes): each expert rank's
    receive buffer of a dropless MoE layer holds ``ceil(factor T k)`` rows (``T k``: one
    rank's routed choices; exchanged exactly on GPUs) instead of the worst case ``EP T k``;
    a step routing more to one rank stops the run with an error. ``None``: the worst
    case."""
    moe_pad_expert_input_to_capacity: bool = _gpt_moe_option(False)
    """Pad each expert's input to its capacity. Needs a capacity factor; with one it is
    required here, because XLA's static shapes always pad."""
    moe_grouped_gemm: bool = _gpt_moe_option(False)
    """Expert weight gradients by ONE grouped fused wgrad call per expert linear into the
    gradient bucket (with gradient accumulation fusion); off: ordinary gradients (XLA's
    batched einsum), added to the bucket like a bias gradient."""
    moe_shared_expert_intermediate_size: int | None = _gpt_moe_option(None)
    """Width of the shared experts' MLP on every MoE layer (Megatron's
    ``--moe-shared-expert-intermediate-size``: the shared experts' total size, e.g. 2
    shared experts of ``F`` -> ``2F``); ``None``: no shared experts."""
    moe_shared_expert_overlap: bool = _gpt_moe_option(False)
    """Megatron's ``--moe-shared-expert-overlap``: the shared experts may run while the
    dispatcher's all-to-alls are in flight (no dependence on the routed experts). Off: the
    shared experts start after the routed experts' output (an ``optimization_barrier``),
    Megatron's order without the option. Same arithmetic either way."""
    moe_layer_freq: int = _gpt_moe_option(1)
    """``N``: layers 0, N, 2N, ... are MoE layers, the others dense (Megatron's
    ``[1 if i % N == 0 else 0 for i in range(L)]``)."""
    overlap_dispatch_backward_with_experts_wgrad: bool = _forwarded("overlap_wgrad")
    """Megatron PR 3766: the expert wgrad runs after the expert dgrad and independent of the
    dispatch-backward all-to-all (:func:`jax_wgrad.functional.moe_mlp`); bitwise equal."""
    moe_permute_fusion: bool = _forwarded("permute_fusion")
    """Megatron's ``--moe-permute-fusion``: the dropless dispatcher's token permutations
    are gathers whose gradients are gathers too (no scatter), fused into their neighbours
    (:func:`jax_wgrad.functional.moe_dispatch.permute_rows`); the same numbers up to the
    order of a token's sum over its choices."""

    # -- FP8 (Megatron's names; the recipe's default is per-tensor current scaling). Each
    # option is forwarded to :class:`~jax_wgrad.functional.fp8.Fp8Recipe` (field metadata
    # "fp8": its field's name), whose defaults and checks are the only ones.
    fp8_format: Literal["e4m3", "hybrid"] | None = None
    """Megatron's ``--fp8-format``: the transformer layers' linears (qkv, projection, MLP,
    shared experts) run their forward, data-gradient and weight-gradient GEMMs in FP8
    (:mod:`jax_wgrad.functional.fp8`); ``e4m3`` everywhere, or ``hybrid`` with E5M2
    output gradients. The embedding, the output layer, the norms, the router, the
    attention core and the routed experts stay in ``compute_dtype``. ``None``: no FP8."""
    fp8_recipe: Literal["tensorwise", "delayed"] = dataclasses.field(
        default=Fp8Recipe.__dataclass_fields__["recipe"].default, metadata={"fp8": "recipe"}
    )
    """Megatron's ``--fp8-recipe``: ``tensorwise`` (per-tensor current scaling, the
    default here; Megatron's is ``delayed``); ``delayed`` is not built and is refused."""
    fp8_margin: int = dataclasses.field(
        default=Fp8Recipe.__dataclass_fields__["margin"].default, metadata={"fp8": "margin"}
    )
    """Megatron's ``--fp8-margin``: each scale is ``2**-margin`` times the largest that
    fits."""
    fp8_amax_history_len: int = dataclasses.field(
        default=Fp8Recipe.__dataclass_fields__["amax_history_len"].default,
        metadata={"fp8": "amax_history_len"},
    )
    """Megatron's ``--fp8-amax-history-len`` (delayed scaling)."""
    fp8_amax_compute_algo: Literal["max", "most_recent"] = dataclasses.field(
        default=Fp8Recipe.__dataclass_fields__["amax_compute_algo"].default,
        metadata={"fp8": "amax_compute_algo"},
    )
    """Megatron's ``--fp8-amax-compute-algo`` (delayed scaling)."""
    first_last_layers_bf16: bool = False
    """Megatron's ``--first-last-layers-bf16``: the first ``num_layers_at_start_in_bf16``
    and the last ``num_layers_at_end_in_bf16`` transformer layers run their linears in
    ``compute_dtype``, the others in FP8. Built without pipeline parallelism (a stage's
    position is traced in the SPMD program: refused with ``pipeline_model_parallel_size``
    > 1)."""
    num_layers_at_start_in_bf16: int = 1
    """Megatron's ``--num-layers-at-start-in-bf16`` (with ``first_last_layers_bf16``; 0 to
    the layers per pipeline stage)."""
    num_layers_at_end_in_bf16: int = 1
    """Megatron's ``--num-layers-at-end-in-bf16`` (with ``first_last_layers_bf16``; 0 to
    the layers per pipeline stage)."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "make_vocab_size_divisible_by",
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "seq_length",
            "layer_scan_unroll",
        ):
            check_positive(name, getattr(self, name))
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        check_positive("ffn_hidden_size", self.ffn_hidden_size)
        self._validate_architecture()
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"compute_dtype must be 'float32' or 'bfloat16', got {self.compute_dtype!r}"
            )
        if self.params_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"params_dtype must be 'float32' or 'bfloat16', got {self.params_dtype!r}"
            )
        if self.params_dtype == "bfloat16" and self.compute_dtype != "bfloat16":
            raise ValueError(
                "params_dtype 'bfloat16' needs compute_dtype 'bfloat16' (Megatron's "
                "--bf16 sets both), got compute_dtype "
                f"{self.compute_dtype!r}"
            )
        if self.attention_backend not in ("auto", "xla", "cudnn"):
            raise ValueError(
                "attention_backend must be 'auto', 'xla' or 'cudnn', got "
                f"{self.attention_backend!r}"
            )
        if self.attention_backend == "cudnn" and self.compute_dtype != "bfloat16":
            raise ValueError(
                "attention_backend 'cudnn' needs compute_dtype 'bfloat16' "
                f"(cuDNN flash attention takes 16-bit inputs), got "
                f"{self.compute_dtype!r}"
            )
        self._validate_moe()
        self._validate_fp8()

    def _validate_fp8(self) -> None:
        """FP8's options: checked by :class:`~jax_wgrad.functional.fp8.Fp8Recipe` with a
        format; without one, none may differ from its default (it would be ignored)."""
        if self.fp8_format is None:
            given = [
                f.name
                for f in dataclasses.fields(self)
                if ("fp8" in f.metadata or f.name.endswith("_in_bf16"))
                and getattr(self, f.name) != f.default
            ]
            if self.first_last_layers_bf16:
                given.append("first_last_layers_bf16")
            if given:
                raise ValueError(f"FP8 options {given} need fp8_format (FP8 is off without it)")
            return
        self.fp8_config()  # the recipe's checks
        counts = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name.endswith("_in_bf16") and getattr(self, f.name) != f.default
        }
        if counts and not self.first_last_layers_bf16:
            given = ", ".join(f"{k} ({v})" for k, v in counts.items())
            raise ValueError(f"{given} needs first_last_layers_bf16 (it is ignored without it)")

    def without_fp8(self) -> GPTConfig:
        """This model with every FP8 option at its default: its layers in
        ``compute_dtype`` (the layers ``first_last_layers_bf16`` keeps out of FP8)."""
        return dataclasses.replace(
            self,
            **{
                f.name: f.default
                for f in dataclasses.fields(self)
                if f.name.startswith("fp8_")
                or f.name.endswith("_in_bf16")
                or f.name == "first_last_layers_bf16"
            },
        )

    def check_layers_in_bf16(self, parallel: ParallelConfig) -> None:
        """``first_last_layers_bf16`` split as ``parallel`` asks: Megatron's range of the
        counts (transformer_config.py), and no pipeline parallelism (not built); raises
        ``ValueError``."""
        if not self.first_last_layers_bf16:
            return
        per_stage = self.num_layers // parallel.pipeline_model_parallel_size
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= per_stage:
                raise ValueError(
                    f"{name} ({n}) must be between 0 and number of layers per pipeline stage "
                    f"({per_stage})."
                )
        if parallel.pipeline_model_parallel_size > 1:
            raise ValueError(
                "first_last_layers_bf16 with pipeline_model_parallel_size "
                f"({parallel.pipeline_model_parallel_size}) > 1 is not built: which layers a "
                "stage holds is traced in the SPMD program, and a branch per precision would "
                "copy the gradient buckets (XLA conditionals); use it without pipeline "
                "parallelism"
            )

    def layers_in_bf16(self) -> tuple[int, int]:
        """``(first, last)``: how many of the first and of the last transformer layers run
        without FP8 (Megatron's ``is_first_last_bf16_layer``; ``(0, 0)`` unless
        ``first_last_layers_bf16``; they may overlap)."""
        if self.fp8_format is None or not self.first_last_layers_bf16:
            return (0, 0)
        return (self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16)

    def fp8_config(self) -> Fp8Recipe | None:
        """The transformer layers' :class:`~jax_wgrad.functional.fp8.Fp8Recipe`, ``None``
        without ``fp8_format``: every field with ``"fp8"`` metadata, under its recipe
        name."""
        if self.fp8_format is None:
            return None
        return Fp8Recipe(
            format=self.fp8_format,
            **{
                f.metadata["fp8"]: getattr(self, f.name)
                for f in dataclasses.fields(self)
                if "fp8" in f.metadata
            },
        )

    def _validate_architecture(self) -> None:
        """Megatron's checks of the architecture options (``arguments.py``)."""
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by "
                    f"num_attention_heads ({self.num_attention_heads})"
                )
        else:
            check_positive("kv_channels", self.kv_channels)
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}"
            )
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ValueError(
                "position_embedding_type must be 'learned_absolute' or 'rope', "
                f"got {self.position_embedding_type!r}"
            )
        for name in ("layernorm_epsilon", "init_method_std"):  # NaN or wrong otherwise
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.rotary_base > 0 or not 0 < self.rotary_percent <= 1:
            raise ValueError(
                f"rotary_base ({self.rotary_base}) must be > 0 and rotary_percent "
                f"({self.rotary_percent}) in (0, 1]"
            )
        if self.rope_scaling and self.position_embedding_type != "rope":
            raise ValueError(
                "rope_scaling (--use-rope-scaling) needs position_embedding_type 'rope', "
                f"got {self.position_embedding_type!r}"
            )
        self.rope_scaling_config()  # its own checks
        if self.position_embedding_type == "rope" and int(self.head_dim * self.rotary_percent) % 2:
            raise ValueError(
                f"rotary_percent ({self.rotary_percent}) x kv_channels "
                f"({self.head_dim}) must be an even number of rotary dims"
            )
        object.__setattr__(self, "window_size", check_window_size(self.window_size))
        if self.num_query_groups is not None:
            check_positive("num_query_groups", self.num_query_groups)
        if self.num_query_groups is not None and not self.group_query_attention:
            raise ValueError(
                f"num_query_groups ({self.num_query_groups}) needs "
                "group_query_attention (--group-query-attention)"
            )
        if self.num_attention_heads % self.query_groups != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_query_groups ({self.query_groups})"
            )

    @property
    def attention_window(self) -> int | None:
        """The tokens each query attends to (itself included) under ``window_size``:
        ``left + 1``, :func:`~jax_wgrad.functional.causal_attention`'s ``window`` (Hugging
        Face's ``sliding_window``); ``None`` without a window."""
        return None if self.window_size is None else self.window_size[0] + 1

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``num_query_groups`` with GQA, else one per query head."""
        return (
            self.num_query_groups
            if self.group_query_attention and self.num_query_groups is not None
            else self.num_attention_heads
        )

    def _validate_moe(self) -> None:
        """The GPT's own MoE options; the layer's options are checked once, by
        :class:`MoEConfig` (built here by :meth:`moe_config`)."""
        if self.num_moe_experts is None:
            given = [
                f.name
                for f in dataclasses.fields(self)
                if _MOE in f.metadata
                and not f.metadata.get(_DENSE_TOO)
                and getattr(self, f.name) != f.default
            ]
            if given:
                raise ValueError(
                    f"MoE options {given} need num_moe_experts (a dense model has no experts)"
                )
            return
        if self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
        self.moe_config()  # checks num_experts, F, top-k, capacity factor, loss type, coeff
        check_positive("moe_layer_freq", self.moe_layer_freq)
        if self.moe_shared_expert_intermediate_size is not None:
            check_positive(
                "moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size
            )
        elif self.moe_shared_expert_overlap:
            raise ValueError(
                "moe_shared_expert_overlap needs shared experts "
                "(moe_shared_expert_intermediate_size)"
            )
        if self.moe_token_dispatcher_type != "alltoall":
            raise ValueError(
                f"moe_token_dispatcher_type {self.moe_token_dispatcher_type!r} is "
                "not supported; only 'alltoall' is implemented"
            )
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            # Megatron's check (transformer_config.py).
            raise ValueError(
                "moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity"
            )
        if (
            self.moe_expert_capacity_factor is not None
            and not self.moe_pad_expert_input_to_capacity
        ):
            raise ValueError(
                "moe_expert_capacity_factor needs "
                "moe_pad_expert_input_to_capacity here: XLA's static shapes "
                "always pad each expert's input to its capacity"
            )
        if self.overlap_dispatch_backward_with_experts_wgrad and not self.moe_grouped_gemm:
            raise ValueError(
                "overlap_dispatch_backward_with_experts_wgrad requires moe_grouped_gemm"
            )

    def moe_config(self) -> MoEConfig | None:
        """The MoE layers' :class:`~jax_wgrad.functional.MoEConfig` (``None``: dense): every
        field with ``"moe_config"`` metadata, passed under its MoEConfig name."""
        if self.num_moe_experts is None:
            return None
        return MoEConfig(
            **{
                f.metadata[_MOE]: getattr(self, f.name)
                for f in dataclasses.fields(self)
                if f.metadata.get(_MOE)
            }
        )

    @property
    def moe_layer_pattern(self) -> tuple[bool, ...]:
        """Per layer: an MoE layer (Megatron's ``moe_layer_freq`` pattern); all False for
        a dense model."""
        if self.num_moe_experts is None:
            return (False,) * self.num_layers
        return tuple(i % self.moe_layer_freq == 0 for i in range(self.num_layers))

    def rope_scaling_config(self) -> RopeScaling | None:
        """The RoPE frequency scaling of the ``rope_scaling*`` fields, ``None`` when off.
        Raises ``ValueError`` for factors that do not make one."""
        if not self.rope_scaling:
            return None
        return RopeScaling(
            factor=self.rope_scaling_factor,
            low_freq_factor=self.rope_scaling_low_freq_factor,
            high_freq_factor=self.rope_scaling_high_freq_factor,
            original_max_position_embeddings=self.rope_scaling_original_max_position_embeddings,
        )

    @property
    def padded_vocab_size(self) -> int:
        """The embedding's and output layer's rows: ``vocab_size`` rounded up to a multiple
        of ``make_vocab_size_divisible_by`` (:func:`vocab_size_with_padding`)."""
        return vocab_size_with_padding(self.vocab_size, self.make_vocab_size_divisible_by)

    @property
    def head_dim(self) -> int:
        """``kv_channels``, or ``hidden_size / num_attention_heads``."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    # -- what a plan and a checkpoint ask of a model config (training.plan.ModelConfig)

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = (
        "vocab_size",
        "make_vocab_size_divisible_by",
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "ffn_hidden_size",
        "untie_embeddings_and_output_weights",
        "num_moe_experts",
        "moe_ffn_hidden_size",
        "moe_layer_freq",
        "moe_shared_expert_intermediate_size",
        "normalization",
        "position_embedding_type",
        "swiglu",
        "group_query_attention",
        "num_query_groups",
        "add_bias_linear",
        "add_qkv_bias",
        "qk_layernorm",
        "kv_channels",
    )
    """The fields that fix the parameters' shapes: a checkpoint must agree on them."""

    def validate(self, parallel: ParallelConfig) -> None:
        """:func:`validate` (this model split as ``parallel`` asks); raises ``ValueError``."""
        validate(parallel, self)

    def program(self, parallel: ParallelConfig, platform: str | None = None):
        """The GPT's stage programs (:class:`~jax_wgrad.models.gpt.GPTProgram`)."""
        from jax_wgrad.models.gpt.program import GPTProgram  # the program imports this module

        return GPTProgram(self, parallel, platform=platform)

    def shape_differences(self, saved: dict) -> list[tuple[str, Any, Any]]:
        """``(field, saved, this)`` for every :attr:`SHAPE_FIELDS` field on which ``saved``
        (a checkpoint's ``dataclasses.asdict`` of its model config) and this config
        disagree; a field missing from an older checkpoint counts as its default. The
        ``moe_*`` shape fields count only when both models have experts (else
        ``num_moe_experts`` names it), ``seq_length`` only with learned positions,
        ``make_vocab_size_divisible_by`` only when the padded vocabularies differ."""
        now = dataclasses.asdict(self)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        then = {k: saved.get(k, defaults[k]) for k in self.SHAPE_FIELDS}
        dense = then["num_moe_experts"] is None or now["num_moe_experts"] is None
        rope = then["position_embedding_type"] == now["position_embedding_type"] == "rope"
        return [
            (k, then[k], now[k])
            for k in self.SHAPE_FIELDS
            if then[k] != now[k]
            and not (dense and k.startswith("moe_"))  # a dense model has no MoE shapes
            and not (rope and k == "seq_length")
            and not (
                k == "make_vocab_size_divisible_by"
                and vocab_size_with_padding(then["vocab_size"], then[k]) == self.padded_vocab_size
            )
        ]  # no learned positions: any length

    def flops_per_step(self, global_batch_size: int) -> float:
        """Model FLOPs of one training step of ``global_batch_size`` sequences: Megatron-LM's
        ``num_floating_point_operations`` (``megatron/training/training.py``), the figure
        its MFU and TFLOP/s logs use. Per layer and token, ``3 x 2 x 2 x H^2`` (forward,
        weight and input gradients; two GEMMs of a kind; 2 FLOPs per multiply-add) times:
        attention ``(1 + G/A + s/H) x (A d / H)`` (query and output projections, keys and
        values, the ``s x s`` core counted in full, no causal halving), MLP ``F/H x 3/2``
        with SwiGLU (per routed expert, ``top-k`` of them, plus the shared experts, on MoE
        layers -- Megatron's formula takes every layer as MoE; here the dense layers of
        ``moe_layer_freq`` count their own MLP), and the output layer ``V / (2 L H)``."""
        h, s, n = self.hidden_size, self.seq_length, self.num_layers
        gated = 1.5 if self.swiglu else 1.0
        attention = (
            (1 + self.query_groups / self.num_attention_heads + s / h)
            * self.head_dim
            * self.num_attention_heads
            / h
        )
        moe = self.moe_config()
        mlp = 0.0
        for is_moe in self.moe_layer_pattern:
            if is_moe and moe is not None:
                ffn = self.moe_ffn_hidden_size or self.ffn_hidden_size
                shared = self.moe_shared_expert_intermediate_size or 0
                mlp += (ffn * self.moe_router_topk + shared) / h * gated
            else:
                mlp += self.ffn_hidden_size / h * gated
        logit = self.padded_vocab_size / (2 * n * h)  # Megatron's: the padded vocabulary
        return 12.0 * global_batch_size * s * n * h * h * (attention + mlp / n + logit)

    def cudnn_context_parallel(self, parallel: ParallelConfig) -> bool:
        """Whether ``parallel``'s context-parallel attention can run cuDNN's flash
        attention: without CP, or where the split runs it
        (:func:`~jax_wgrad.functional.context_parallel.runs_cudnn`)."""
        return parallel.context_parallel_size == 1 or runs_cudnn(
            parallel.cp_comm_type, self.attention_window
        )

    def attention_implementation(
        self, platform: str, parallel: ParallelConfig | None = None
    ) -> Literal["xla", "cudnn"]:
        """``attention_backend`` resolved for a jax platform (``"cpu"``, ``"gpu"``, ...)
        and layout: ``"auto"`` is XLA's where the layout's context-parallel attention
        can only compute its blocks in XLA (:meth:`cudnn_context_parallel`); an explicit
        ``"cudnn"`` there is refused by the program."""
        if self.attention_backend != "auto":
            return self.attention_backend  # type: ignore[return-value]
        if parallel is not None and not self.cudnn_context_parallel(parallel):
            return "xla"
        cudnn_ok = (
            platform in ("gpu", "cuda")
            and self.compute_dtype == "bfloat16"
            and self.head_dim % 8 == 0
            and self.head_dim <= 128
        )
        return "cudnn" if cudnn_ok else "xla"


def vocab_size_with_padding(vocab_size: int, divisible_by: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by``: THE padding rule
    (Megatron's ``_vocab_size_with_padding`` without its factor
    ``tensor_model_parallel_size``, so the padded size is the same on every layout).
    Raises ``ValueError`` naming the flag for a ``divisible_by`` below 1."""
    if isinstance(divisible_by, bool) or not isinstance(divisible_by, int) or divisible_by < 1:
        raise ValueError(f"--make-vocab-size-divisible-by must be >= 1, got {divisible_by!r}")
    return -(-vocab_size // divisible_by) * divisible_by


def check_window_size(value: Any) -> tuple[int, int] | None:
    """``value`` as a ``window_size`` (:attr:`GPTConfig.window_size`): ``None``, or a pair
    ``(left, right)`` of ints (a list is made a tuple) with ``left >= 0`` and ``right ==
    0``. Raises ``ValueError`` naming the value and what is allowed."""
    if value is None:
        return None
    pair = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if len(pair) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in pair):
        raise ValueError(
            f"window_size must be a (left, right) pair of integers, got {value!r} "
            "(Megatron's tuple: a Hugging Face sliding_window of W is (W - 1, 0))"
        )
    left, right = pair
    if right != 0:
        raise ValueError(
            f"window_size {pair}: the right window must be 0, got {right} (the GPT is "
            f"causal: a token never attends to later ones); use ({left}, 0)"
        )
    if left < 0:
        raise ValueError(
            f"window_size {pair}: the left window must be >= 0, got {left} (Megatron's "
            "-1, an unlimited window, is no window here: leave window_size out)"
        )
    return pair


def validate(parallel: ParallelConfig, model: GPTConfig) -> None:
    """Checks that ``model`` can be split as ``parallel`` asks; raises ``ValueError``."""
    tp = parallel.tensor_model_parallel_size
    pp = parallel.pipeline_model_parallel_size
    for name in ("num_attention_heads", "hidden_size", "ffn_hidden_size"):
        value = getattr(model, name)
        if value % tp != 0:
            raise ValueError(
                f"{name} ({value}) must be divisible by tensor_model_parallel_size ({tp})"
            )
    _validate_vocab(parallel, model)
    if model.query_groups % tp != 0:  # Megatron's rule: whole query groups per rank
        raise ValueError(
            f"num_query_groups ({model.query_groups}) must be a multiple of "
            f"tensor_model_parallel_size ({tp})"
        )
    if model.num_layers % pp != 0:
        raise ValueError(
            f"num_layers ({model.num_layers}) must be divisible by "
            f"pipeline_model_parallel_size ({pp})"
        )
    v = parallel.num_model_chunks
    if (model.num_layers // pp) % v != 0:  # Megatron's wording (arguments.py)
        raise ValueError(
            f"number of layers per pipeline stage ({model.num_layers // pp}) "
            "must be divisible by virtual_pipeline_model_parallel_size "
            f"({v})"
        )
    parallel.check_seq_length(model.seq_length)
    cp = parallel.context_parallel_size
    if parallel.sequence_parallel and parallel.context_seq_length(model.seq_length) % tp != 0:
        per_rank = "" if cp == 1 else f" / context_parallel_size ({cp})"
        raise ValueError(
            f"seq_length ({model.seq_length}){per_rank} must be divisible by "
            f"tensor_model_parallel_size ({tp}) with sequence parallelism"
        )
    if cp > 1 and parallel.cp_comm_type == "a2a" and (model.query_groups // tp) % cp != 0:
        raise ValueError(
            f"cp_comm_type 'a2a' splits each tensor rank's attention heads over "
            f"context_parallel_size ({cp}): num_query_groups ({model.query_groups}) / "
            f"tensor_model_parallel_size ({tp}) must be a multiple of it; use "
            "cp_comm_type 'p2p' or 'allgather'"
        )
    _validate_moe_layout(parallel, model)
    model.check_layers_in_bf16(parallel)


def _validate_vocab(parallel: ParallelConfig, model: GPTConfig) -> None:
    """The padded vocabulary splits into whole shards over ``tensor`` (and ``pipeline``
    with the vocabulary over the pipeline); the error names the padding that would."""
    tp = parallel.tensor_model_parallel_size
    pp = parallel.pipeline_model_parallel_size if parallel.vocab_parallel_over_pipeline else 1
    v, d, padded = model.vocab_size, model.make_vocab_size_divisible_by, model.padded_vocab_size
    if padded % (tp * pp) == 0:
        return
    by = (
        f"tensor_model_parallel_size x pipeline_model_parallel_size ({tp} x {pp}) with "
        "vocab_parallel_over_pipeline"
        if pp > 1
        else f"tensor_model_parallel_size ({tp})"
    )
    size = (
        f"vocab_size ({v})"
        if padded == v
        else f"vocab_size ({v}) padded to a multiple of make_vocab_size_divisible_by ({d}), "
        f"{padded},"
    )
    raise ValueError(
        f"{size} must be divisible by {by}; pad it: make_vocab_size_divisible_by "
        f"{math.lcm(d if d > 1 else 128, tp * pp)} (a multiple of {tp * pp}; Megatron pads to "
        "a multiple of make_vocab_size_divisible_by x tensor_model_parallel_size)"
    )


def _validate_moe_layout(parallel: ParallelConfig, model: GPTConfig) -> None:
    ep = parallel.expert_model_parallel_size
    if model.num_moe_experts is None:
        if ep > 1:  # Megatron's wording (arguments.py)
            raise ValueError(
                f"expert_model_parallel_size ({ep}) needs num_experts (experts "
                "to split); a dense model takes expert_model_parallel_size 1"
            )
        return
    if model.num_moe_experts % ep != 0:
        raise ValueError(
            f"Number of experts ({model.num_moe_experts}) should be a multiple of "
            f"expert model parallel_size ({ep})."
        )
    tp, etp = parallel.tensor_model_parallel_size, parallel.expert_tensor_parallel_size
    if tp > 1 and not parallel.sequence_parallel:
        raise ValueError(
            "When using MoE and tensor parallelism, sequence parallelism must be used."
        )
    if model.moe_ffn_hidden_size % etp != 0:
        raise ValueError(
            f"moe_ffn_hidden_size ({model.moe_ffn_hidden_size}) must be "
            f"divisible by expert_tensor_parallel_size ({etp})"
        )
    shared = model.moe_shared_expert_intermediate_size
    if shared is not None and shared % tp != 0:
        raise ValueError(
            f"moe_shared_expert_intermediate_size ({shared}) must be divisible "
            f"by tensor_model_parallel_size ({tp})"
        )
    per_stage = model.num_layers // (
        parallel.pipeline_model_parallel_size * parallel.num_model_chunks
    )
    if per_stage % model.moe_layer_freq != 0:
        where = "virtual pipeline stage" if parallel.num_model_chunks > 1 else "pipeline stage"
        raise ValueError(
            f"layers per {where} ({per_stage}) must be divisible by "
            f"moe_layer_freq ({model.moe_layer_freq}) so that every stage has "
            "the same pattern of MoE and dense layers"
        )
    if model.moe_grouped_gemm and not parallel.gradient_accumulation_fusion:
        raise ValueError(
            "moe_grouped_gemm needs gradient_accumulation_fusion: it selects the "
            "grouped fused wgrad into the gradient bucket (without fusion the "
            "expert weight gradients are XLA's batched einsum either way)"
        )
