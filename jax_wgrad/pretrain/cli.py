"""The pretraining job's command line (Megatron's flag names), derived from the configs.

:data:`SECTIONS` declares every flag once, as a :class:`Flag`. A flag that sets a config
field names the field, and the rest follows from it::

    Flag("--tensor-model-parallel-size", ParallelConfig, "tensor_model_parallel_size",
         type=positive_int)

Its help is the field's docstring (field names spelled as flags, ``None`` as "absent"),
its default the field's default, and its type and choices come from the field's annotation
(``bool``: a switch; ``Literal``: the choices; ``float``: a finite float), unless the row
gives them. Flags that set no field (paths, the launch, the learning-rate schedule, the
compile for a GPU) give their own help.

The same table builds the parser (:func:`make_parser`), turns the parsed flags into
configs (:func:`build_configs`, :func:`loop_options`) and a model config back into flags
(:func:`model_flags`), turns a preset into flag defaults (:func:`apply_preset`), and spells
the field names of an error message as the flags the user typed (:func:`flag_names`). The
job itself is :func:`jax_wgrad.pretrain.main`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import math
import os
import re
import textwrap
import types
import typing
from typing import Any, Literal, NoReturn

from jax_wgrad.grads.config import DDPConfig
from jax_wgrad.interop.hf import checked_hf_config
from jax_wgrad.models.gpt.config import RUN_OPTIONS, GPTConfig, check_window_size
from jax_wgrad.models.gpt.params import layer_loop_length
from jax_wgrad.models.gpt.presets import PRESETS
from jax_wgrad.parallel.config import ParallelConfig
from jax_wgrad.training.gpu import (
    COMMAND_BUFFER_FLAG,
    CUDA_GRAPH_SCOPES,
    check_cuda_graph_scope,
    cuda_gpu_usable,
)
from jax_wgrad.training.loop import LoopOptions

__all__ = [
    "DESCRIPTION",
    "EPILOG",
    "Flag",
    "SECTIONS",
    "FLAGS",
    "HelpFormatter",
    "NEGATIVE_VALUE",
    "MEGATRON_MOMENT_DTYPES",
    "MOMENT_DTYPE_BY_NAME",
    "NOT_BUILT",
    "NOT_BUILT_DTYPES",
    "NOT_FLAGS",
    "apply_preset",
    "build_configs",
    "check_flags",
    "check_output_paths",
    "check_report_json",
    "config_kwargs",
    "field_docs",
    "finite_float",
    "flag_names",
    "given_flags",
    "int_at_least",
    "loop_options",
    "make_parser",
    "model_flags",
    "preset_line",
    "usage_error",
    "virtual_stages",
    "window_size_type",
]

# ------------------------------------------------------------------------ value types


def finite_float(text: str) -> float:
    """argparse type: a finite float (``nan``/``inf`` are refused, naming the flag)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def int_at_least(minimum: int, below: int | None = None):
    """argparse type: an integer >= ``minimum`` (and < ``below`` when given); the error
    names the flag."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if below is not None and value >= below:
            raise argparse.ArgumentTypeError(f"must be < {below}, got {value}")
        return value

    return parse


def float_above(minimum: float, inclusive: bool):
    """argparse type: a finite float >= ``minimum`` (``inclusive``) or > ``minimum``; the
    error names the flag and repeats the value as typed."""

    def parse(text: str) -> float:
        value = finite_float(text)
        if value < minimum or (value == minimum and not inclusive):
            raise argparse.ArgumentTypeError(
                f"must be {'>=' if inclusive else '>'} {minimum:g}, got {text}"
            )
        return value

    return parse


def window_size_type(text: str) -> tuple[int, int] | None:
    """argparse type of ``--window-size``: Megatron's ``tuple_type``, ``LEFT,RIGHT`` (or
    ``(LEFT,RIGHT)``) integers, negative ones too (the parser reads ``-1,0`` as a value,
    :data:`NEGATIVE_VALUE`). ``-1,0`` is Megatron's (Transformer Engine's) causal
    attention with an unlimited window, i.e. no sliding window: ``None``, the same as
    leaving the flag out (it overrides a preset's window). Other pairs are checked by
    :func:`~jax_wgrad.models.gpt.config.check_window_size` (the ranges a GPT allows)."""
    try:
        pair = tuple(int(part) for part in text.strip().strip("()").split(","))
    except ValueError:
        pair = ()
    if len(pair) != 2:
        raise argparse.ArgumentTypeError(
            f"expected LEFT,RIGHT (Megatron's tuple, e.g. 4095,0: a Hugging Face "
            f"sliding_window of 4096; -1,0: no sliding window), got {text!r}"
        )
    if pair == (-1, 0):  # Megatron's unlimited left window: no sliding window
        return None
    if pair[0] < -1:
        raise argparse.ArgumentTypeError(
            f"{text}: the left window must be >= 0, or -1 (Megatron's unlimited window: no "
            f"sliding window), got {pair[0]}"
        )
    try:
        check_window_size(pair)
    except ValueError as exc:
        why = str(exc).split(": ", 1)[-1].replace("window_size", "--window-size")
        raise argparse.ArgumentTypeError(f"{text}: {why}") from None
    return pair


NEGATIVE_VALUE = re.compile(r"^-\.?\d")
"""What the parser reads as a value although it starts with ``-`` (Python 3.13's rule):
a negative number (``-1``, ``-.5``, ``-1e-3``) or Megatron's tuple (``--window-size
-1,0``); argparse before 3.13 takes ``-1,0`` and ``-1e-3`` for flags and says "expected
one argument". No flag of the parser starts with ``-`` and a digit."""


MEGATRON_MOMENT_DTYPES = ("fp32", "fp16", "bf16", "fp8")
"""Megatron's choices of ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``."""

positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)
nonnegative_float = float_above(0.0, inclusive=True)

# ------------------------------------------------------------------------- the table


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()
"""A :class:`Flag` attribute not given (``None`` is a value there)."""


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag of the command line.

    Args:
      name: the flag (``"--hidden-size"``); its argparse ``dest`` is the name without the
        dashes, dashes as underscores, unless ``dest`` is given.
      config: the config class the flag sets a field of (``None``: a flag of the job).
      field: the field (or fields) of ``config`` it sets.
      help: the flag's help; a field flag's is the field's docstring unless given (a
        switch that sets the field to another value than ``True`` says it here).
      default: the flag's default; a field flag's is the field's unless given.
      type: argparse's ``type``; a field flag's follows from its annotation (``int``,
        :func:`finite_float` for ``float``) unless given.
      choices: argparse's ``choices``; a field flag's are its ``Literal`` values unless
        ``type`` or ``choices`` is given.
      value: makes the flag a switch that sets the field(s) to ``value`` when given (a
        ``bool`` field's flag is a switch setting ``True``).
      switch: a job flag that is a switch (``store_true``).
      aliases: other spellings of the flag (argparse option strings after ``name``).
      exclusive: flags of a section sharing this name exclude each other.
    """

    name: str
    config: type | None = None
    field: str | tuple[str, ...] = ()
    help: str | None = None
    default: Any = _UNSET
    type: Any = None
    choices: tuple | None = None
    value: Any = _UNSET
    switch: bool = False
    metavar: str | None = None
    nargs: str | None = None
    aliases: tuple[str, ...] = ()
    dest: str | None = None
    exclusive: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.field, str):
            object.__setattr__(self, "field", (self.field,))
        if self.dest is None:
            object.__setattr__(self, "dest", self.name[2:].replace("-", "_"))
        if self.config is not None:
            hints = _type_hints(self.config)
            for name in self.field:
                if name not in hints:
                    raise TypeError(f"{self.name}: {self.config.__name__} has no field {name!r}")

    @property
    def option_strings(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def is_switch(self) -> bool:
        """A ``store_true`` flag (it sets :attr:`set_value` when given)."""
        if self.switch or self.value is not _UNSET:
            return True
        return self.config is not None and _base_type(self.config, self.field[0]) is bool

    @property
    def set_value(self) -> Any:
        """What a switch sets its field(s) to when given."""
        return True if self.value is _UNSET else self.value

    @property
    def names_field(self) -> bool:
        """Whether an error message's field name may be spelled as this flag: one field,
        and the flag does not set it to the opposite (``--disable-bias-linear``)."""
        return (
            self.config is not None
            and len(self.field) == 1
            and (not self.is_switch or self.set_value is True)
        )

    def argparse_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"dest": self.dest, "help": self.help_text()}
        if self.is_switch:
            return kw | {"action": "store_true"}
        kw["default"] = self.flag_default()
        kind = self.type
        choices = self.choices
        if self.config is not None and kind is None and choices is None:
            base = _base_type(self.config, self.field[0])
            if typing.get_origin(base) is Literal:
                choices = typing.get_args(base)
            elif base is float:
                kind = finite_float
            elif base is int:
                kind = int
        if kind is not None and kind is not str:
            kw["type"] = kind
        for key, value in (("choices", choices), ("metavar", self.metavar), ("nargs", self.nargs)):
            if value is not None:
                kw[key] = value
        return kw

    def flag_default(self) -> Any:
        if self.default is not _UNSET or self.config is None:
            return None if self.default is _UNSET else self.default
        field = _fields(self.config)[self.field[0]]
        if field.default is dataclasses.MISSING:
            raise TypeError(f"{self.name}: {self.config.__name__}.{field.name} has no default")
        return field.default

    def help_text(self) -> str:
        if self.help is not None:
            return self.help
        doc = field_docs(self.config).get(self.field[0])
        if not doc:
            raise TypeError(f"{self.name}: {self.config.__name__}.{self.field[0]} has no docstring")
        return _help_from_doc(doc, self.flag_default())


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _base_type(cls: type, name: str) -> Any:
    """The field's annotation without ``| None``."""
    hint = _type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return args[0] if len(args) == 1 else hint
    return hint


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings of ``cls``'s fields: the string right after each annotated field in
    the class body (how Sphinx reads attribute docs)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    out = {}
    for stmt, after in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            out[stmt.target.id] = inspect.cleandoc(after.value.value)
    return out


def _help_from_doc(doc: str, default: Any) -> str:
    """A field docstring as flag help: one line, reST markup dropped, field names spelled
    as flags, ``None`` as "absent" (the sentence on ``None`` dropped when the flag has
    another default), ``%`` escaped for argparse."""
    text = " ".join(doc.split())
    if default is not None:
        text = re.sub(r"(^|(?<=\. ))``None``[^.]*\.( |$)", "", text).strip()
    text = re.sub(r"(^|(?<=\. ))``None``", "Absent", text)
    text = text.replace("``None``", "absent")
    text = re.sub(
        r":\w+:`(~?)([^`]+)`",
        lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2),
        text,
    )

    def code(m: re.Match) -> str:  # ``save`` is the field: its flag; quotes off literals
        inner = m.group(1)
        return _FIELD_FLAGS.get(inner) or re.sub(r"""(["'])([\w-]+)\1""", r"\2", inner)

    text = re.sub(r"``(.+?)``", code, text)
    return _spell_as_flags(text, _FIELD_FLAGS).replace("%", "%%")


SECTIONS: tuple[tuple[str, tuple[Flag, ...]], ...] = (
    (
        "launch",
        (
            Flag(
                "--num-cpu-devices",
                type=positive_int,
                default=8,
                help="virtual CPU devices of this process when running on CPU",
            ),
            Flag(
                "--distributed",
                switch=True,
                help="call jax.distributed.initialize() (multi-process launch)",
            ),
            Flag(
                "--coordinator-address",
                help="host:port of process 0 (with --distributed; or JAX_COORDINATOR_ADDRESS)",
            ),
            Flag(
                "--num-processes",
                type=positive_int,
                help="processes of a --distributed launch (absent: from the cluster's environment)",
            ),
            Flag(
                "--process-id",
                type=nonnegative_int,
                help="this process's rank in a --distributed launch (absent: from the "
                "cluster's environment)",
            ),
            Flag(
                "--cuda-graph-scope",
                choices=CUDA_GRAPH_SCOPES,
                default="kernels",
                help="what XLA:GPU runs as CUDA graphs (Megatron's flag; on a GPU, and "
                "with --compile-only): 'kernels', XLA's default command buffers (runs of "
                "kernels, cuBLAS and cuDNN calls, the fused FFI handlers; control flow "
                "and collectives from the host, each conditional reading its predicate "
                "back); 'full_iteration', every command-buffer type (conditionals, loops "
                "and collectives too): with the layers unrolled (--layer-scan-unroll, "
                "required) the step has no host synchronisation",
            ),
            Flag(
                "--verbose-collectives",
                switch=True,
                help="keep the CPU collectives' (gloo) connection messages on stdout "
                "(absent: filtered out)",
            ),
        ),
    ),
    (
        "parallelism",
        (
            Flag(
                "--tensor-model-parallel-size",
                ParallelConfig,
                "tensor_model_parallel_size",
                type=positive_int,
            ),
            Flag(
                "--pipeline-model-parallel-size",
                ParallelConfig,
                "pipeline_model_parallel_size",
                type=positive_int,
            ),
            Flag(
                "--context-parallel-size",
                ParallelConfig,
                "context_parallel_size",
                type=positive_int,
            ),
            Flag("--cp-comm-type", ParallelConfig, "cp_comm_type"),
            Flag(
                "--expert-model-parallel-size",
                ParallelConfig,
                "expert_model_parallel_size",
                type=positive_int,
            ),
            Flag(
                "--expert-tensor-parallel-size",
                ParallelConfig,
                "expert_tensor_parallel_size",
                type=positive_int,
            ),
            Flag("--sequence-parallel", ParallelConfig, "sequence_parallel"),
            Flag("--gradient-accumulation-fusion", ParallelConfig, "gradient_accumulation_fusion"),
            Flag(
                "--defer-embedding-wgrad-compute", ParallelConfig, "defer_embedding_wgrad_compute"
            ),
            Flag("--wgrad-deferral-limit", ParallelConfig, "wgrad_deferral_limit"),
            Flag("--pipeline-schedule", ParallelConfig, "pipeline_schedule"),
            Flag(
                "--virtual-pipeline-model-parallel-size",
                ParallelConfig,
                "virtual_pipeline_model_parallel_size",
                metavar="V",
            ),
            Flag(
                "--num-layers-per-virtual-pipeline-stage",
                type=int,
                metavar="N",
                help="the same as V = num_layers / pp / N",
            ),
            Flag(
                "--microbatch-group-size-per-virtual-pipeline-stage",
                ParallelConfig,
                "microbatch_group_size_per_vp_stage",
                metavar="G",
            ),
            Flag("--vocab-parallel-over-pipeline", ParallelConfig, "vocab_parallel_over_pipeline"),
            Flag("--recompute-granularity", ParallelConfig, "recompute_granularity"),
            Flag("--recompute-method", ParallelConfig, "recompute_method"),
            Flag("--recompute-num-layers", ParallelConfig, "recompute_num_layers"),
            Flag("--defer-mode", ParallelConfig, "defer_mode"),
        ),
    ),
    (
        "gradient buffers and data-parallel sync",
        (
            Flag("--use-distributed-optimizer", DDPConfig, "use_distributed_optimizer"),
            Flag("--use-precision-aware-optimizer", DDPConfig, "use_precision_aware_optimizer"),
            Flag(
                "--main-grads-dtype",
                choices=("fp32", "bf16"),
                default="fp32",
                help="dtype of the main gradients with --use-precision-aware-optimizer "
                "(Megatron's; fp32 only: the gradient buckets accumulate in fp32)",
            ),
            Flag(
                "--main-params-dtype",
                choices=("fp32", "fp16"),
                default="fp32",
                help="dtype of the main parameters with --use-precision-aware-optimizer "
                "(Megatron's; fp32 only: bf16 parameters keep exact int16 remainders of "
                "them, 2 bytes, DDPConfig.store_param_remainders)",
            ),
            Flag(
                "--exp-avg-dtype",
                choices=MEGATRON_MOMENT_DTYPES,
                default="fp32",
                help="dtype Adam's first moment is stored in with "
                "--use-precision-aware-optimizer (computed in fp32 either way); fp32 or bf16",
            ),
            Flag(
                "--exp-avg-sq-dtype",
                choices=MEGATRON_MOMENT_DTYPES,
                default="fp32",
                help="dtype Adam's second moment is stored in with "
                "--use-precision-aware-optimizer (computed in fp32 either way); fp32 or bf16",
            ),
            Flag("--overlap-grad-reduce", DDPConfig, "overlap_grad_reduce"),
            Flag(
                "--overlap-grad-reduce-in-backward",
                DDPConfig,
                "overlap_grad_reduce_in_backward",
            ),
            Flag("--ddp-bucket-size", DDPConfig, "bucket_size"),
            Flag("--ddp-average-in-collective", DDPConfig, "average_in_collective"),
            Flag(
                "--pad-buckets-for-high-nccl-busbw",
                DDPConfig,
                "pad_buckets_for_high_nccl_busbw",
                aliases=("--ddp-pad-buckets-for-high-nccl-busbw",),  # Megatron's spelling
            ),
        ),
    ),
    (
        "model",
        (
            Flag(
                "--model",
                choices=tuple(sorted(PRESETS)),
                help="a preset shape (its architecture and sizes); the flags below override it",
            ),
            Flag("--num-layers", GPTConfig, "num_layers"),
            Flag("--hidden-size", GPTConfig, "hidden_size", default=128),
            Flag("--num-attention-heads", GPTConfig, "num_attention_heads"),
            Flag("--ffn-hidden-size", GPTConfig, "ffn_hidden_size"),
            Flag("--seq-length", GPTConfig, "seq_length", default=128),
            Flag(
                "--untie-embeddings-and-output-weights",
                GPTConfig,
                "untie_embeddings_and_output_weights",
            ),
            Flag("--normalization", GPTConfig, "normalization"),
            Flag("--norm-epsilon", GPTConfig, "layernorm_epsilon"),
            Flag("--position-embedding-type", GPTConfig, "position_embedding_type"),
            Flag("--rotary-base", GPTConfig, "rotary_base"),
            Flag("--rotary-percent", GPTConfig, "rotary_percent"),
            Flag("--use-rope-scaling", GPTConfig, "rope_scaling"),
            Flag("--rope-scaling-factor", GPTConfig, "rope_scaling_factor"),
            Flag("--rope-scaling-low-freq-factor", GPTConfig, "rope_scaling_low_freq_factor"),
            Flag("--rope-scaling-high-freq-factor", GPTConfig, "rope_scaling_high_freq_factor"),
            Flag(
                "--rope-scaling-original-max-position-embeddings",
                GPTConfig,
                "rope_scaling_original_max_position_embeddings",
            ),
            Flag("--swiglu", GPTConfig, "swiglu"),
            Flag("--group-query-attention", GPTConfig, "group_query_attention"),
            Flag("--num-query-groups", GPTConfig, "num_query_groups"),
            Flag(
                "--disable-bias-linear",
                GPTConfig,
                "add_bias_linear",
                value=False,
                help="no biases in the linear layers",
            ),
            Flag("--add-qkv-bias", GPTConfig, "add_qkv_bias"),
            Flag("--qk-layernorm", GPTConfig, "qk_layernorm"),
            Flag("--kv-channels", GPTConfig, "kv_channels"),
            Flag(
                "--window-size",
                GPTConfig,
                "window_size",
                type=window_size_type,
                metavar="LEFT,RIGHT",
                help="Sliding-window attention, Megatron's (left, right) window size "
                "(Transformer Engine's): each token attends to itself and the left tokens "
                "before it; right must be 0 (the model is causal). Hugging Face's "
                "sliding_window W (Mistral, Qwen2) is W-1,0: 4096 is 4095,0. A left of "
                "--seq-length - 1 or more changes nothing. -1,0 (Megatron's unlimited "
                "window) is no sliding window, as is leaving the flag out (default: none)",
            ),
            Flag("--init-method-std", GPTConfig, "init_method_std"),
            Flag("--layer-scan-unroll", GPTConfig, "layer_scan_unroll"),
        ),
    ),
    (
        "precision",
        (
            Flag(
                "--fp32",
                GPTConfig,
                ("compute_dtype", "params_dtype"),
                value="float32",
                exclusive="precision",
                help="fp32 compute (the default)",
            ),
            Flag(
                "--bf16",
                GPTConfig,
                ("compute_dtype", "params_dtype"),
                value="bfloat16",
                exclusive="precision",
                help="Megatron's --bf16: bf16 parameters, activations and GEMMs; fp32 "
                "gradient buckets and fp32 main parameters in the optimizer (only "
                "this rank's shard of them with --use-distributed-optimizer)",
            ),
        ),
    ),
    (
        "FP8 (Megatron's flags; needs --bf16)",
        (
            Flag("--fp8-format", GPTConfig, "fp8_format"),
            Flag("--fp8-recipe", GPTConfig, "fp8_recipe"),
            Flag("--fp8-margin", GPTConfig, "fp8_margin"),
            Flag("--fp8-amax-history-len", GPTConfig, "fp8_amax_history_len"),
            Flag("--fp8-amax-compute-algo", GPTConfig, "fp8_amax_compute_algo"),
            Flag("--first-last-layers-bf16", GPTConfig, "first_last_layers_bf16"),
            Flag("--num-layers-at-start-in-bf16", GPTConfig, "num_layers_at_start_in_bf16"),
            Flag("--num-layers-at-end-in-bf16", GPTConfig, "num_layers_at_end_in_bf16"),
        ),
    ),
    (
        "mixture of experts (Megatron's flags)",
        (
            Flag("--num-experts", GPTConfig, "num_moe_experts"),
            Flag("--moe-router-topk", GPTConfig, "moe_router_topk"),
            Flag("--moe-router-pre-softmax", GPTConfig, "moe_router_pre_softmax"),
            Flag("--moe-router-topk-scaling-factor", GPTConfig, "moe_router_topk_scaling_factor"),
            Flag("--moe-ffn-hidden-size", GPTConfig, "moe_ffn_hidden_size"),
            Flag("--moe-router-load-balancing-type", GPTConfig, "moe_router_load_balancing_type"),
            Flag("--moe-aux-loss-coeff", GPTConfig, "moe_aux_loss_coeff"),
            # a string, not a choice: the config names the one dispatcher there is
            Flag("--moe-token-dispatcher-type", GPTConfig, "moe_token_dispatcher_type", type=str),
            Flag("--moe-expert-capacity-factor", GPTConfig, "moe_expert_capacity_factor"),
            Flag("--moe-dropless-buffer-factor", GPTConfig, "moe_dropless_buffer_factor"),
            Flag(
                "--moe-pad-expert-input-to-capacity", GPTConfig, "moe_pad_expert_input_to_capacity"
            ),
            Flag("--moe-grouped-gemm", GPTConfig, "moe_grouped_gemm"),
            Flag("--moe-permute-fusion", GPTConfig, "moe_permute_fusion"),
            Flag(
                "--moe-shared-expert-intermediate-size",
                GPTConfig,
                "moe_shared_expert_intermediate_size",
                type=positive_int,
            ),
            Flag("--moe-shared-expert-overlap", GPTConfig, "moe_shared_expert_overlap"),
            Flag("--moe-layer-freq", GPTConfig, "moe_layer_freq"),
            Flag(
                "--overlap-dispatch-backward-with-experts-wgrad",
                GPTConfig,
                "overlap_dispatch_backward_with_experts_wgrad",
            ),
        ),
    ),
    (
        "training",
        (
            Flag("--micro-batch-size", ParallelConfig, "micro_batch_size", default=4),
            Flag("--global-batch-size", ParallelConfig, "global_batch_size", default=32),
            Flag("--train-iters", LoopOptions, "train_iters", default=40),
            Flag("--lr", type=nonnegative_float, default=2e-3, help="peak learning rate"),
            Flag(
                "--min-lr",
                type=nonnegative_float,
                help="cosine-decay floor (absent: constant lr after warm-up)",
            ),
            Flag(
                "--lr-warmup-iters",
                type=nonnegative_int,
                default=0,
                help="steps of linear warm-up from 0 to --lr",
            ),
            Flag("--weight-decay", type=nonnegative_float, default=0.01, help="AdamW weight decay"),
            Flag("--clip-grad", DDPConfig, "clip_grad"),
            Flag("--seed", LoopOptions, "seed", type=int_at_least(0, below=2**32)),
        ),
    ),
    (
        "training data",
        (
            Flag(
                "--data-path",
                nargs="+",
                help="a text file or directory, a Megatron PREFIX (PREFIX.bin/.idx), or "
                "weighted prefixes 'w1 PREFIX1 w2 PREFIX2 ...' (absent: the Python "
                "standard library's sources)",
            ),
            Flag(
                "--split",
                default="98,2,0",
                help="train,validation,test proportions of every dataset (Megatron's)",
            ),
            # the data decides the vocabulary when absent (build_configs is given it)
            Flag(
                "--vocab-size",
                GPTConfig,
                "vocab_size",
                default=None,
                help="absent: bytes 256; Megatron data: largest id + 1, padded",
            ),
            Flag(
                "--make-vocab-size-divisible-by",
                GPTConfig,
                "make_vocab_size_divisible_by",
                type=positive_int,
                default=128,
                help="pad the vocabulary to a multiple of this (Megatron's; not multiplied "
                "by the tensor-parallel size here: the layout must divide the padded "
                "size); the padding rows are masked out of the loss",
            ),
        ),
    ),
    (
        "checkpointing (see below)",
        (
            Flag("--save", LoopOptions, "save"),
            Flag("--save-interval", LoopOptions, "save_interval"),
            Flag("--load", LoopOptions, "load"),
            Flag(
                "--load-hf",
                metavar="DIR",
                help="start from a Hugging Face model directory (Llama, Mistral, Qwen2, "
                "Qwen3, Mixtral, Qwen3-MoE): its config gives the model flags' defaults, its "
                "weights the initial parameters (step 0, fresh optimizer)",
            ),
            Flag("--load-fallback-to-intact", LoopOptions, "load_fallback"),
            Flag(
                "--no-load-optim",
                LoopOptions,
                "load_optim",
                value=False,
                help="load only the parameters; the optimizer starts afresh",
            ),
        ),
    ),
    (
        "evaluation",
        (
            Flag("--eval-interval", LoopOptions, "eval_interval"),
            Flag("--eval-iters", LoopOptions, "eval_iters"),
        ),
    ),
    (
        "logging",
        (
            Flag("--log-interval", LoopOptions, "log_interval"),
            Flag(
                "--metrics-file",
                help="JSON lines: step, loss, grad_norm, skipped, step_time_s, tokens_per_s "
                "(and valid_loss, valid_ppl); a resumed run keeps the steps up to "
                "its checkpoint",
            ),
            Flag("--tensorboard-dir", help="write TensorBoard scalars here"),
            Flag("--profile-dir", LoopOptions, "profile_dir"),
            Flag("--profile-steps", LoopOptions, "profile_steps"),
            Flag(
                "--no-progress",
                LoopOptions,
                "progress",
                value=False,
                help="no progress bar (there is none when stdout is not a terminal)",
            ),
        ),
    ),
    (
        "compile for a GPU (no GPU needed)",
        (
            Flag(
                "--compile-only",
                switch=True,
                help="compile the train step of this layout for --target GPUs and run "
                "nothing: print per-device memory against the GPU's with a fits / "
                "DOES NOT FIT verdict (exit status 1 when it does not fit), the "
                "compile time and the step's structure (needs jax's CUDA plugin, "
                "no GPU: jax starts on the CPU, JAX_PLATFORMS=cpu unless set)",
            ),
            Flag(
                "--target",
                choices=("h100", "h200"),
                default="h100",
                help="GPU to compile for with --compile-only",
            ),
            Flag(
                "--target-gpus-per-host",
                aliases=("--target-gpus",),
                type=positive_int,
                default=1,
                help="GPUs per host",
            ),
            Flag("--target-hosts", type=positive_int, default=1, help="hosts"),
            Flag(
                "--estimate-routing-skew",
                type=float_above(1.0, inclusive=True),
                default=1.0,
                help="with --compile-only and dropless experts: the busiest expert rank's "
                "routed rows over the balanced T k (1: balanced routing); the estimate "
                "charges the ragged expert GEMMs for those rows and also reports the step "
                "charged for every row of the receive buffers",
            ),
            Flag(
                "--report-json",
                metavar="FILE",
                help="with --compile-only: also write the report's figures (bytes per "
                "device, fits, bytes per parameter, launches and non-GEMM traffic "
                "per microbatch, fused calls, compile time) to FILE as JSON",
            ),
        ),
    ),
)
"""Every flag, once, in ``--help``'s sections and order."""

FLAGS: tuple[Flag, ...] = tuple(flag for _, flags in SECTIONS for flag in flags)

NOT_BUILT: dict[str, str] = {
    "--overlap-param-gather": (
        "the distributed optimizer all-gathers each bucket's parameters right after that "
        "bucket's update, in the same step (beside the next bucket's update); the next "
        "step's forward reads them inside the schedule loop, so overlapping the gather "
        "with it would need that forward run before the loop "
        "(docs/design/aot.md, Findings)"
    ),
    "--fp16": (
        "fp16 training needs loss scaling (Megatron's dynamic loss scaler, --loss-scale), "
        "which is not built; --bf16 gives 16-bit parameters, activations and GEMMs without "
        "it (bfloat16 has float32's exponent range), with fp32 gradient buckets and fp32 "
        "main parameters as Megatron's --bf16"
    ),
    "--tp-comm-overlap": (
        "the tensor-parallel collectives are XLA's, not split into chunks between GEMMs; "
        "with --sequence-parallel and --gradient-accumulation-fusion the column-parallel "
        "backward overlaps its all-gather and reduce-scatter with the GEMMs beside them, "
        "as Megatron's default asynchronous backward does (docs/design/aot.md, Findings)"
    ),
}
"""Megatron flags whose features jax_wgrad does not build, each with what it does instead:
given, they end the run with that explanation (never silently ignored)."""

MOMENT_DTYPE_BY_NAME: dict[str, str | None] = {"fp32": None, "bf16": "bfloat16"}
"""The moment dtypes built (:func:`jax_wgrad.optim.scale_by_adam`; ``None``: fp32, optax's
own Adam), by Megatron's name."""

NOT_BUILT_DTYPES: dict[tuple[str, str], str] = {
    **{
        (flag, kind): (
            f"{kind} moments are stored with per-tensor scales in TransformerEngine's FusedAdam, "
            "which is not built; fp32 or bf16 (bf16 has fp32's exponent range: no scale)"
        )
        for flag in ("exp_avg_dtype", "exp_avg_sq_dtype")
        for kind in ("fp16", "fp8")
    },
    ("main_grads_dtype", "bf16"): (
        "the gradient buckets accumulate and reduce in fp32 (Megatron's "
        "--accumulate-allreduce-grads-in-fp32 for --bf16); bf16 buckets are not built"
    ),
    ("main_params_dtype", "fp16"): (
        "fp16 main parameters are not built; bf16 parameters keep exact int16 remainders "
        "of fp32 main parameters (2 bytes a parameter) with --use-precision-aware-optimizer"
    ),
}
"""Megatron's precision-aware optimizer dtypes that are not built, with what is."""

NOT_FLAGS: dict[str, str] = {
    "--params-dtype": (
        "the parameters' dtype follows the precision flag, as in Megatron (which has no "
        "such flag either): --bf16 for bfloat16 parameters (fp32 main parameters in the "
        "optimizer), --fp32 (the default) for float32"
    ),
}
"""Flags people try that neither Megatron nor jax_wgrad has, each with the flag to use:
given (with or without a value), they end the run saying so."""

_BY_FIELD: dict[tuple[type, str], Flag] = {
    (flag.config, flag.field[0]): flag
    for flag in FLAGS
    if flag.config is not None and len(flag.field) == 1
}
"""The flag of each config field that has one (a field set by one flag only)."""

_FIELD_FLAGS: dict[str, str] = {
    **{flag.dest: flag.option_strings[-1] for flag in FLAGS},
    **{flag.field[0]: flag.option_strings[-1] for flag in FLAGS if flag.names_field},
}
"""Names as flags: every flag's ``dest`` and the field it names."""

DESCRIPTION = (
    "Pretrain a small byte-level GPT with tensor, sequence, pipeline (1F1B) and data parallelism."
)

EPILOG = """\
--load DIR resumes from the newest checkpoint in DIR; a DIR that does not exist or holds no
checkpoint is an error, unless DIR is also the --save directory (Megatron's "resume if
there": the run then starts from scratch and says so). A damaged newest checkpoint is an
error naming the step and the damage; --load-fallback-to-intact loads the newest intact one
instead."""


class _NotBuilt(argparse.Action):
    """A :data:`NOT_BUILT` or :data:`NOT_FLAGS` flag: an argparse error saying what is
    done instead (the values after it, if any, are taken with it)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(
            option_strings, dest, nargs="*", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in NOT_FLAGS:
            parser.error(f"{option_string} is not a flag: {NOT_FLAGS[option_string]}")
        parser.error(
            f"{option_string} (Megatron) is not built in jax_wgrad: "
            f"{NOT_BUILT[option_string]}; leave the flag out"
        )


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with every flag's default appended (flags absent by default say
    in their help what absence means)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            action.option_strings
            and "%(default)" not in text
            and action.default is not None
            and action.default is not False
            and action.default is not argparse.SUPPRESS
        ):
            text += " (default: %(default)s)"
        return text


def make_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The job's parser: :data:`SECTIONS` as argument groups (``prog``: argparse's, the
    script's file name by default)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description=DESCRIPTION,
        epilog=EPILOG,
        allow_abbrev=False,  # as Megatron: --hidden is no flag
        usage="%(prog)s [flags] (all flags: --help)",
        formatter_class=HelpFormatter,
    )
    p._negative_number_matcher = NEGATIVE_VALUE  # -1,0 is a value (argparse < 3.13 only knew -1)
    for title, flags in SECTIONS:
        group = p.add_argument_group(title)
        exclusive: dict[str, Any] = {}
        for flag in flags:
            target = group
            if flag.exclusive is not None:
                if flag.exclusive not in exclusive:
                    exclusive[flag.exclusive] = group.add_mutually_exclusive_group()
                target = exclusive[flag.exclusive]
            target.add_argument(*flag.option_strings, **flag.argparse_kwargs())
    for name in (*NOT_BUILT, *NOT_FLAGS):
        p.add_argument(name, action=_NotBuilt, dest=f"not_built_{name[2:].replace('-', '_')}")
    return p


# --------------------------------------------------------- flags <-> config objects


def config_kwargs(args: argparse.Namespace) -> dict[type, dict[str, Any]]:
    """``{config class: keyword arguments}`` from the parsed flags: every field flag's
    value (a switch's only when it is given: absent, its field keeps its default)."""
    out: dict[type, dict[str, Any]] = {}
    for flag in FLAGS:
        if flag.config is None:
            continue
        value = getattr(args, flag.dest)
        if flag.is_switch:
            if not value:
                continue
            value = flag.set_value
        for name in flag.field:
            out.setdefault(flag.config, {})[name] = value
    return out


def build_configs(
    args: argparse.Namespace, vocab_size: int, parser: argparse.ArgumentParser
) -> tuple[GPTConfig, ParallelConfig, DDPConfig]:
    """``(GPTConfig, ParallelConfig, DDPConfig)`` from the flags (``vocab_size``: the
    data's, see :func:`jax_wgrad.pretrain.job.load_data`); a bad combination ends the
    program with an argparse-style error naming it."""
    kwargs = config_kwargs(args)
    try:
        model = GPTConfig(**(kwargs[GPTConfig] | {"vocab_size": vocab_size}))
        vpp = {"virtual_pipeline_model_parallel_size": virtual_stages(args)}
        parallel = ParallelConfig(**(kwargs[ParallelConfig] | vpp))
        ddp = DDPConfig(**kwargs[DDPConfig])
        check_cuda_graph_scope(
            args.cuda_graph_scope, model.layer_scan_unroll, layer_loop_length(model, parallel)
        )
    except ValueError as exc:
        usage_error(parser, exc)
    return model, parallel, ddp


def loop_options(args: argparse.Namespace) -> LoopOptions:
    """The loop's :class:`LoopOptions` from the flags (raises ValueError)."""
    return LoopOptions(**config_kwargs(args)[LoopOptions])


def model_flags(cfg: GPTConfig) -> list[str]:
    """The model flags of ``cfg``: a run passing them builds ``cfg`` (the run that loads a
    converted checkpoint with ``--load``). Flags at their default (the field's; the
    vocabulary padding's: the flag's) are left out, except the sizes; run options
    (:data:`RUN_OPTIONS`: dtypes, ...) too."""
    defaults = {name: f.default for name, f in _fields(GPTConfig).items()}
    # what a run without the flag gets (the padding's default is Megatron's 128, not 1)
    defaults["make_vocab_size_divisible_by"] = _BY_FIELD[
        GPTConfig, "make_vocab_size_divisible_by"
    ].flag_default()
    always = {
        "vocab_size",
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "ffn_hidden_size",
        "layernorm_epsilon",
        "init_method_std",
    }
    out = []
    for name, value in dataclasses.asdict(cfg).items():
        if (
            name in RUN_OPTIONS
            or value is None
            or (value == defaults.get(name) and name not in always)
        ):
            continue
        flag = _BY_FIELD[GPTConfig, name]
        if flag.is_switch:
            if value == flag.set_value:
                out.append(flag.name)
        else:
            out += [
                flag.name,
                ",".join(map(str, value)) if isinstance(value, tuple) else str(value),
            ]
    return out


def virtual_stages(args: argparse.Namespace) -> int | None:
    """``V`` from ``--virtual-pipeline-model-parallel-size`` or Megatron's
    ``--num-layers-per-virtual-pipeline-stage`` (its checks and wording)."""
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    v = args.virtual_pipeline_model_parallel_size
    if per_chunk is None:
        return v
    if v is not None:
        raise ValueError(
            "--num-layers-per-virtual-pipeline-stage and "
            "--virtual-pipeline-model-parallel-size cannot be set at the same time"
        )
    per_stage = args.num_layers // args.pipeline_model_parallel_size
    if per_chunk < 1 or per_stage % per_chunk:
        raise ValueError(
            f"number of layers per pipeline stage ({per_stage}) must be divisible "
            f"by number of layers per virtual pipeline stage ({per_chunk})"
        )
    return per_stage // per_chunk


# ------------------------------------------------------------------- error messages


def _spell_as_flags(message: str, flags: dict[str, str]) -> str:
    names = sorted((n for n in flags if "_" in n), key=len, reverse=True)  # not "lr", "load"
    if not names:
        return message
    pattern = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, names)) + r")(?![\w])")
    return pattern.sub(lambda m: flags[m.group(1)], message)


def flag_names(parser: argparse.ArgumentParser, message: str) -> str:
    """``message`` with the config fields it names (``hidden_size``) spelled as the flags
    the user typed (``--hidden-size``); the table comes from the parser's own actions and
    the fields of :data:`FLAGS`."""
    flags = {
        a.dest: a.option_strings[-1]
        for a in parser._actions
        if a.option_strings and a.option_strings[-1].startswith("--")
    }
    flags |= {
        flag.field[0]: flags[flag.dest] for flag in FLAGS if flag.names_field and flag.dest in flags
    }
    return _spell_as_flags(message, flags)


def usage_error(parser: argparse.ArgumentParser, exc: Exception) -> NoReturn:
    """Ends the program like argparse does (exit 2), naming flags rather than fields."""
    parser.error(flag_names(parser, str(exc)))


# -------------------------------------------------------------------------- presets


def apply_preset(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """``--model NAME`` or ``--load-hf DIR``: the preset's (the directory's config's)
    values become the flags' defaults, so flags given on the command line still win.
    Returns the ``dest`` of every flag the preset sets (empty without one)."""
    known, _ = parser.parse_known_args(argv)
    if known.model is not None and known.load_hf is not None:
        parser.error("--model and --load-hf both give the model; choose one")
    if known.load_hf is not None:
        fields = hf_model_fields(parser, known.load_hf, known.seq_length)
    elif known.model is not None:
        fields = PRESETS[known.model]
    else:
        return set()
    defaults = {}
    for name, value in fields.items():
        flag = _BY_FIELD.get((GPTConfig, name))
        if flag is None:
            defaults[name] = value
        else:
            defaults[flag.dest] = value == flag.set_value if flag.is_switch else value
    parser.set_defaults(**defaults)
    return set(defaults)


def preset_line(
    parser: argparse.ArgumentParser, args: argparse.Namespace, preset: set[str]
) -> str | None:
    """The log line naming the model preset in use and the flags that override it: the
    flags it sets and every other model flag given (``None`` without
    ``--model``/``--load-hf``)."""
    if args.model is None and args.load_hf is None:
        return None
    source = (
        f"--model {args.model}"
        if args.model is not None
        else f"the config.json of --load-hf {args.load_hf}"
    )
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    # a model flag given changes the preset's model whether or not the preset sets its
    # field (--num-experts on a dense preset): as Megatron's flags would
    model = {
        flag.dest
        for flag in FLAGS
        if flag.config is GPTConfig and not set(flag.field) & RUN_OPTIONS
    }
    overrides = sorted(flags[d] for d in (preset | model) & args.given_flags)
    return f"model preset: {source}" + (
        f"; overridden by {', '.join(overrides)}" if overrides else "; no flag overrides it"
    )


def hf_model_fields(parser: argparse.ArgumentParser, directory: str, seq_length: int) -> dict:
    """The ``GPTConfig`` fields of a Hugging Face directory's ``config.json`` that flags
    exist for; an unreadable or unsupported config is a usage error naming it, a
    checkpoint (this library's or Megatron-LM's) one naming the flag that reads it."""
    kind = directory_kind(directory)
    if kind == "jax_wgrad":
        parser.error(
            f"--load-hf {directory}: a jax_wgrad checkpoint, not a Hugging Face model "
            f"directory: resume it with --load {directory} (and the model flags it was "
            "trained with)"
        )
    if kind == "megatron":
        parser.error(f"--load-hf {directory}: {_MEGATRON_CHECKPOINT}")
    try:  # the run's --seq-length (not max_position_embeddings) meets the sliding window
        # missing, truncated, of other shapes: refused before anything is built
        cfg = checked_hf_config(directory, seq_length=seq_length)
    except ValueError as exc:
        parser.error(f"--load-hf {directory}: {exc}")
    # seq_length: the training sequence length is this run's choice (RoPE takes any);
    # so is the vocabulary's padding (the directory has none: its rows are the vocabulary).
    return {
        k: v
        for k, v in dataclasses.asdict(cfg).items()
        if k not in RUN_OPTIONS | {"seq_length", "make_vocab_size_divisible_by"}
        and (GPTConfig, k) in _BY_FIELD
    }


def given_flags(argv: list[str]) -> set[str]:
    """The ``dest`` of every flag ``argv`` gives explicitly (a preset's or the parser's
    default is not "given"): a parser whose defaults are all suppressed parses it."""
    bare = make_parser()
    for action in bare._actions:
        action.default = argparse.SUPPRESS
    known, _ = bare.parse_known_args(argv)
    return set(vars(known))


# --------------------------------------------------------------- rules between flags

CLUSTER_ENV = ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
"""Environment variables by which ``jax.distributed.initialize`` finds its coordinator
(``jax_wgrad.initialize_distributed`` counts the same ones as a multi-process launch)."""


def partner_rules(args: argparse.Namespace) -> list[tuple[str, bool, str]]:
    """``(dest, partner present, what the flag needs)`` for every flag that does nothing
    without another: given alone it would be silently ignored."""
    rope = args.position_embedding_type == "rope"
    return [
        (
            "save_interval",
            args.save is not None,
            "--save (the directory checkpoints are written to)",
        ),
        ("eval_iters", args.eval_interval is not None, "--eval-interval (absent: no evaluation)"),
        ("target", args.compile_only, "--compile-only (without it the run trains here)"),
        ("target_gpus_per_host", args.compile_only, "--compile-only"),
        ("target_hosts", args.compile_only, "--compile-only"),
        ("estimate_routing_skew", args.compile_only, "--compile-only"),
        (
            "use_precision_aware_optimizer",
            args.use_distributed_optimizer,
            "--use-distributed-optimizer (Megatron: --use-precision-aware-optimizer only "
            "supported with distributed optimizer)",
        ),
        *(
            (
                dest,
                args.use_precision_aware_optimizer or getattr(args, dest) == "fp32",
                f"--use-precision-aware-optimizer (Megatron: {dest} can only be fp32 when "
                "not using precision-aware optimizer)",
            )
            for dest in (
                "main_grads_dtype",
                "main_params_dtype",
                "exp_avg_dtype",
                "exp_avg_sq_dtype",
            )
        ),
        (
            "ddp_bucket_size",
            args.overlap_grad_reduce,
            "--overlap-grad-reduce (without it each gradient buffer is one bucket; "
            "Megatron ignores the size then)",
        ),
        (
            "pad_buckets_for_high_nccl_busbw",
            args.use_distributed_optimizer,
            "--use-distributed-optimizer (it pads the buckets that optimizer shards; "
            "Megatron ignores it without)",
        ),
        (
            "cp_comm_type",
            args.context_parallel_size > 1,
            "--context-parallel-size > 1 (one context rank exchanges nothing; Megatron "
            "ignores the type then)",
        ),
        (
            "expert_tensor_parallel_size",
            args.num_experts is not None,
            "--num-experts (a dense model has no experts to split; Megatron ignores it there)",
        ),
        (
            "moe_aux_loss_coeff",
            args.moe_router_load_balancing_type != "none" or args.moe_aux_loss_coeff == 0,
            "--moe-router-load-balancing-type aux_loss (with none there is no load-balancing "
            "loss to weigh; Megatron ignores the coefficient then)",
        ),
        ("load_fallback_to_intact", args.load is not None, "--load"),
        ("no_load_optim", args.load is not None, "--load"),
        ("defer_mode", args.defer_embedding_wgrad_compute, "--defer-embedding-wgrad-compute"),
        ("rotary_base", rope, "--position-embedding-type rope"),
        ("rotary_percent", rope, "--position-embedding-type rope"),
        ("use_rope_scaling", rope, "--position-embedding-type rope"),
        ("rope_scaling_factor", args.use_rope_scaling, "--use-rope-scaling"),
        ("rope_scaling_low_freq_factor", args.use_rope_scaling, "--use-rope-scaling"),
        ("rope_scaling_high_freq_factor", args.use_rope_scaling, "--use-rope-scaling"),
        (
            "rope_scaling_original_max_position_embeddings",
            args.use_rope_scaling,
            "--use-rope-scaling",
        ),
        ("profile_steps", args.profile_dir is not None, "--profile-dir"),
        (
            "cuda_graph_scope",
            args.compile_only or cuda_gpu_usable(),
            "a CUDA GPU or --compile-only (XLA:CPU has no CUDA graphs)",
        ),
        (
            "fp8_format",
            args.bf16,
            "--bf16 (Megatron's FP8 runs on bf16 parameters and activations; the GEMMs "
            "of the transformer layers' linears in FP8)",
        ),
        *(
            (dest, args.fp8_format is not None, "--fp8-format (FP8 is off without it)")
            for dest in (
                "fp8_recipe",
                "fp8_margin",
                "fp8_amax_history_len",
                "fp8_amax_compute_algo",
                "first_last_layers_bf16",
                "num_layers_at_start_in_bf16",
                "num_layers_at_end_in_bf16",
            )
        ),
        ("coordinator_address", args.distributed, "--distributed"),
        ("num_processes", args.distributed, "--distributed"),
        ("process_id", args.distributed, "--distributed"),
        ("verbose_collectives", args.distributed, "--distributed"),
    ]


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set[str]) -> None:
    """The rules between flags (ranges of single flags are their argparse types; rules of
    a config are its dataclass's): a flag without the partner it needs, ``--min-lr`` above
    ``--lr``, a warm-up as long as the decay, a rank outside the launch, a ``--distributed``
    launch with no coordinator. One argparse-style line each, before anything is built."""
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    for dest, present, needs in partner_rules(args):
        if dest in given and not present:
            value = getattr(args, dest)
            shown = "" if isinstance(value, bool) else f" {value}"
            parser.error(f"{flags[dest]}{shown} needs {needs}")
    for (dest, value), why in NOT_BUILT_DTYPES.items():
        if getattr(args, dest) == value:
            parser.error(f"{flags[dest]} {value} is not built in jax_wgrad: {why}")
    if args.min_lr is not None and args.min_lr > args.lr:  # Megatron: min_lr <= max_lr
        parser.error(f"--min-lr ({args.min_lr:g}) must be <= --lr ({args.lr:g})")
    if args.min_lr is not None and 0 < args.train_iters <= args.lr_warmup_iters:
        parser.error(
            f"--lr-warmup-iters ({args.lr_warmup_iters}) must be < --train-iters "
            f"({args.train_iters}), the steps of the --min-lr decay"
        )
    if args.cuda_graph_scope != "kernels" and COMMAND_BUFFER_FLAG in os.environ.get(
        "XLA_FLAGS", ""
    ):
        parser.error(
            f"--cuda-graph-scope {args.cuda_graph_scope} sets {COMMAND_BUFFER_FLAG}, which "
            "XLA_FLAGS sets already (use one or the other)"
        )
    check_compile_platforms(parser, args)
    check_checkpoint_dirs(parser, args)
    if args.distributed:
        if args.coordinator_address is None and not any(v in os.environ for v in CLUSTER_ENV):
            parser.error(
                "--distributed needs --coordinator-address (or "
                "JAX_COORDINATOR_ADDRESS, or a SLURM / Open MPI launch)"
            )
        if (
            args.process_id is not None
            and args.num_processes is not None
            and args.process_id >= args.num_processes
        ):
            parser.error(
                f"--process-id ({args.process_id}) must be < --num-processes ({args.num_processes})"
            )


def check_compile_platforms(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``JAX_PLATFORMS`` naming CUDA on a machine without a usable GPU (no jax CUDA
    plugin, or no NVIDIA device): jax fails to start its CUDA backend there (with
    ``--compile-only`` a plugin traceback ending in ``AssertionError``); refused in one
    line before jax starts a backend, saying what to set instead."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    names = {p.strip().lower() for p in platforms.split(",") if p.strip()}
    if not names & {"cuda", "gpu"} or cuda_gpu_usable():
        return
    if args.compile_only:
        parser.error(
            f"--compile-only with JAX_PLATFORMS={platforms}: this machine has no usable "
            "GPU and jax's CUDA backend does not start without one; unset JAX_PLATFORMS "
            "or set JAX_PLATFORMS=cpu: the CUDA plugin compiles for the --target GPUs "
            "without starting"
        )
    parser.error(
        f"JAX_PLATFORMS={platforms}: this machine has no usable GPU (a jax CUDA plugin "
        "and an NVIDIA device) and jax's CUDA backend does not start without one; unset "
        "JAX_PLATFORMS to train on the CPU, or pass --compile-only to compile for GPUs"
    )


def directory_kind(path: str) -> str | None:
    """What the directory ``path`` holds, by its files (nothing is read): ``"jax_wgrad"``
    (this library's checkpoint: numbered step directories), ``"megatron"`` (a Megatron-LM
    checkpoint: ``latest_checkpointed_iteration.txt`` or ``iter_NNNNNNN`` directories),
    ``"hf"`` (a Hugging Face model: ``config.json`` beside ``*.safetensors`` or
    ``*.bin``), else ``None``."""
    try:
        names = os.listdir(path)
    except OSError:
        return None
    if any(n.isdigit() and os.path.isdir(os.path.join(path, n)) for n in names):
        return "jax_wgrad"
    if "latest_checkpointed_iteration.txt" in names or any(
        re.fullmatch(r"iter_\d+", n) for n in names
    ):
        return "megatron"
    if "config.json" in names and any(n.endswith((".safetensors", ".bin")) for n in names):
        return "hf"
    return None


_MEGATRON_CHECKPOINT = (
    "a Megatron-LM checkpoint (torch_dist or torch format), which jax_wgrad does not "
    "read: convert it to a Hugging Face model directory with Megatron's converter and "
    "start from that with --load-hf"
)


def check_checkpoint_dirs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--load`` of a Hugging Face model directory or a Megatron-LM checkpoint: refused
    naming the flag that reads it (or saying that none does), before anything is built
    (``--load-hf`` of a checkpoint: :func:`hf_model_fields`)."""
    if args.load is None:
        return
    kind = directory_kind(args.load)
    if kind == "hf":
        parser.error(
            f"--load {args.load}: a Hugging Face model directory, not a jax_wgrad "
            f"checkpoint: start from it with --load-hf {args.load}"
        )
    if kind == "megatron":
        parser.error(f"--load {args.load}: {_MEGATRON_CHECKPOINT}")


def unwritable(path: str, directory: bool) -> str | None:
    """Why ``path`` cannot be written (a file, or a ``directory`` to write files in), its
    missing parent directories created; ``None`` when it can."""
    folder = path if directory else os.path.dirname(os.path.abspath(path))
    if not directory and os.path.isdir(path):
        return "is a directory"
    if directory and os.path.exists(path) and not os.path.isdir(path):
        return "is a file, not a directory"
    if not directory and os.path.exists(folder) and not os.path.isdir(folder):
        return f"{folder} is not a directory"
    probe = os.path.join(folder, f".write-probe-{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(probe, "wb"):
            pass
        os.remove(probe)
        if not directory and os.path.exists(path) and not os.access(path, os.W_OK):
            raise PermissionError(13, "the file is not writable")
    except OSError as exc:
        return f"cannot write there ({exc.strerror or exc})"
    return None


def check_output_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--metrics-file``, ``--tensorboard-dir`` and ``--profile-dir`` can be written,
    checked before anything is compiled or trained (as ``--save`` is); the metrics file is
    appended to, so what is there must be a file of metrics records
    (:func:`~jax_wgrad.training.metrics.check_metrics_file`)."""
    from jax_wgrad.training.metrics import check_metrics_file

    try:
        check_metrics_file(args.metrics_file)
    except ValueError as exc:
        parser.error(str(exc))
    for flag, path, directory in (
        ("--metrics-file", args.metrics_file, False),
        ("--tensorboard-dir", args.tensorboard_dir, True),
        ("--profile-dir", args.profile_dir, True),
    ):
        problem = None if path is None else unwritable(path, directory)
        if problem:
            parser.error(f"{flag} {path}: {problem}")


def check_report_json(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--report-json FILE`` needs ``--compile-only`` and a FILE that can be written, its
    directory created if missing: a regular file (not ``/dev/null``, a FIFO, a directory)
    that is missing, empty or an earlier report (a JSON object with the report's keys),
    which is overwritten in place. Checked before anything is compiled, as ``--save`` is; a
    one-line usage error naming the flag and the path otherwise."""
    import json

    from jax_wgrad.training.metrics import not_a_regular_file

    path = args.report_json
    if path is None:
        return
    if not args.compile_only:
        parser.error(
            f"--report-json {path}: needs --compile-only (the report is of a "
            "compile for --target GPUs)"
        )
    if os.path.isdir(path):
        parser.error(f"--report-json {path}: is a directory")
    problem = not_a_regular_file(path) or unwritable(path, directory=False)
    if problem is not None:
        parser.error(f"--report-json {path}: {problem}")
    report_keys = {"target", "mesh_shape", "peak_bytes", "budget_bytes"}  # AotReport.figures
    try:
        with open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        return
    try:
        old = json.loads(text) if text.strip() else None  # None: an empty file
    except ValueError:
        old = []
    if old is not None and not (isinstance(old, dict) and report_keys <= old.keys()):
        parser.error(
            f"--report-json {path}: holds something other than a --report-json report "
            "(it would be overwritten; name a new file or an earlier report)"
        )
