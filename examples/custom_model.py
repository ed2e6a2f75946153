"""Bring your own Flax model: a Llama written in plain NNX, pretrained through the pipeline.

The model below is ordinary Flax NNX built from jax_wgrad's tensor-parallel layers: on one
device ``Llama(cfg, rngs=nnx.Rngs(0))(tokens)`` is its loss, and ``nnx.grad`` its
gradients. Nothing in it knows about gradient buckets: when the pipeline runs it, every
fused weight's gradient destination (a bucket block, a zero-bubble W task, a deferred
output-layer GEMM) rides on the weight's ``nnx.Param`` as metadata, so whatever the model
does to its variables on the way keeps it -- ``--cast-weights bf16`` casts each layer's
weights to bf16 before its GEMMs, as mixed-precision code does, and the weight gradients
still accumulate in fp32 in the fused GEMMs. Its config subclasses ``LayerStackConfig``,
which derives the stage split, the sharding and the gradient layout from the module
(``jax_wgrad.models.stack``).

    .venv/bin/python examples/custom_model.py              # 8 CPU devices: DP2 TP2 PP2 + SP
    .venv/bin/python examples/custom_model.py --tp 2 --pp 4 --dp 1 --num-layers 8 \
        --schedule interleaved
    .venv/bin/python examples/custom_model.py --schedule zb-h1 --steps 20 --cast-weights bf16
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import NoReturn

from jax_wgrad.pretrain.launch import start_jax_on_cpu_without_gpu  # no jax imported

# jax's CUDA plugin installed on a machine without a GPU: jax on the CPU, chosen before jax
# is imported (otherwise every run opens with the plugin's initialisation traceback).
start_jax_on_cpu_without_gpu()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jax_wgrad import DDPConfig, ParallelConfig, TrainPlan, parallel, training  # noqa: E402
from jax_wgrad._validation import check_positive  # noqa: E402
from jax_wgrad.functional import (  # noqa: E402
    causal_attention,
    rotary_embedding,
    vocab_parallel_cross_entropy,
)
from jax_wgrad.models import LayerStackConfig  # noqa: E402
from jax_wgrad.nn import (  # noqa: E402
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from jax_wgrad.pretrain import cli  # noqa: E402
from jax_wgrad.training.loop import LoopOptions  # noqa: E402


@dataclasses.dataclass(frozen=True)
class LlamaConfig(LayerStackConfig):
    vocab_size: int = 256
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_length: int = 32
    rope_base: float = 10000.0
    init_std: float = 0.02
    cast_weights: str | None = None  # "bfloat16": each block's weights cast before use

    def __post_init__(self) -> None:  # Megatron's checks and wording (GPTConfig's)
        for name in (
            *("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers"),
            *("num_heads", "num_kv_heads", "seq_length"),
        ):
            check_positive(name, getattr(self, name))
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    def build(self, *, tp_size: int = 1, sequence_parallel: bool = False, rngs: nnx.Rngs):
        return Llama(self, tp_size=tp_size, sequence_parallel=sequence_parallel, rngs=rngs)

    def validate(self, parallel: ParallelConfig) -> None:
        """The layouts this model splits into (Megatron's rules and wording): whole KV
        groups per tensor rank, whole layers per pipeline stage and per model chunk; then
        the layer stack's own checks."""
        kv_groups_per_rank(self, parallel.tensor_model_parallel_size)
        pp, chunks = parallel.pipeline_model_parallel_size, parallel.num_model_chunks
        if self.num_layers % pp:
            raise ValueError(
                f"num_layers ({self.num_layers}) must be divisible by "
                f"pipeline_model_parallel_size ({pp})"
            )
        if (self.num_layers // pp) % chunks:
            raise ValueError(
                f"number of layers per pipeline stage ({self.num_layers // pp}) must be "
                f"divisible by virtual_pipeline_model_parallel_size ({chunks})"
            )
        super().validate(parallel)


def kv_groups_per_rank(cfg: LlamaConfig, tp_size: int) -> int:
    """The KV groups (a KV head and its query heads) each of ``tp_size`` tensor ranks holds;
    ``ValueError`` unless ``tp_size`` divides ``cfg.num_kv_heads`` (Megatron's rule for
    ``num_query_groups``: a group is never split over ranks)."""
    if cfg.num_kv_heads % tp_size:
        raise ValueError(
            f"num_kv_heads ({cfg.num_kv_heads}) must be a multiple of "
            f"tensor_model_parallel_size ({tp_size}): each tensor rank holds whole KV groups "
            "(Megatron's num_query_groups rule)"
        )
    return cfg.num_kv_heads // tp_size


class Attention(nnx.Module):
    """Grouped-query attention with RoPE; heads split over the tensor ranks by KV group."""

    def __init__(self, cfg: LlamaConfig, tp: dict, rngs: nnx.Rngs):
        d = cfg.hidden_size // cfg.num_heads
        self.groups = kv_groups_per_rank(cfg, tp["tp_size"])
        self.per_group, self.head_dim, self.base = (
            cfg.num_heads // cfg.num_kv_heads,
            d,
            cfg.rope_base,
        )
        # Per KV group: its query heads, then its key and value head (a contiguous split
        # over the tensor ranks gives each whole groups).
        width = cfg.num_kv_heads * (self.per_group + 2) * d
        std = cfg.init_std
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size, width, use_bias=False, init_std=std, rngs=rngs, **tp
        )
        self.proj = RowParallelLinear(
            cfg.num_heads * d, cfg.hidden_size, use_bias=False, init_std=std, rngs=rngs, **tp
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        qkv = self.qkv(x)  # [b, s, groups/tp * (m + 2) * d]: the whole sequence
        b, s, _ = qkv.shape
        m, d = self.per_group, self.head_dim
        qkv = qkv.reshape(b, s, self.groups, m + 2, d)
        q = qkv[:, :, :, :m].reshape(b, s, self.groups * m, d)
        k, v = qkv[:, :, :, m], qkv[:, :, :, m + 1]
        q, k = rotary_embedding(q, base=self.base), rotary_embedding(k, base=self.base)
        return self.proj(causal_attention(q, k, v))


class MLP(nnx.Module):
    """SwiGLU: ``fc2(silu(gate) * up)``, gate and up fused in ``fc1``."""

    def __init__(self, cfg: LlamaConfig, tp: dict, rngs: nnx.Rngs):
        h, f, std = cfg.hidden_size, cfg.ffn_hidden_size, cfg.init_std
        self.fc1 = ColumnParallelLinear(
            h, f, use_bias=False, gated=True, init_std=std, rngs=rngs, **tp
        )
        self.fc2 = RowParallelLinear(f, h, use_bias=False, init_std=std, rngs=rngs, **tp)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = jnp.split(self.fc1(x), 2, axis=-1)
        return self.fc2(jax.nn.silu(gate) * up)


def cast(module: nnx.Module, dtype: str | None) -> nnx.Module:
    """Mixed precision: ``module`` with its weights (parameters of two or more dims) in
    ``dtype``, its norms' scales kept in fp32. The cast is mapped over the variables, which
    keep their metadata -- a fused weight its gradient destination."""
    if dtype is None:
        return module
    graphdef, state = nnx.split(module)
    weights = lambda a: a.astype(dtype) if a.ndim >= 2 else a
    return nnx.merge(graphdef, jax.tree.map(weights, state))


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, tp: dict, rngs: nnx.Rngs):
        self.cast_weights = cfg.cast_weights
        self.ln1, self.attn = RMSNorm(cfg.hidden_size), Attention(cfg, tp, rngs)
        self.ln2, self.mlp = RMSNorm(cfg.hidden_size), MLP(cfg, tp, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        block = cast(self, self.cast_weights)
        x = x + block.attn(block.ln1(x))
        return x + block.mlp(block.ln2(x))


class Embed(nnx.Module):
    def __init__(self, cfg: LlamaConfig, tp: dict, rngs: nnx.Rngs):
        self.word = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, init_std=cfg.init_std, rngs=rngs, **tp
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.word(tokens)


class Head(nnx.Module):
    """Final norm, untied output layer, vocab-parallel cross entropy: the SUM of the
    token losses (the pipeline normalizes by the step's token count)."""

    def __init__(self, cfg: LlamaConfig, tp: dict, rngs: nnx.Rngs):
        self.tp_size = tp["tp_size"]
        self.norm = RMSNorm(cfg.hidden_size)
        self.output = ColumnParallelLinear(
            cfg.hidden_size, cfg.vocab_size, use_bias=False, init_std=cfg.init_std, rngs=rngs, **tp
        )

    def __call__(self, x: jax.Array, labels: jax.Array) -> jax.Array:
        logits = self.output(self.norm(x))
        return jnp.sum(vocab_parallel_cross_entropy(logits, labels, tp_size=self.tp_size))


class Llama(nnx.Module):
    def __init__(
        self, cfg: LlamaConfig, *, tp_size: int = 1, sequence_parallel: bool = False, rngs: nnx.Rngs
    ):
        tp = dict(tp_size=tp_size, sequence_parallel=sequence_parallel)
        self.embed = Embed(cfg, tp, rngs)
        self.layers = nnx.List([Block(cfg, tp, rngs) for _ in range(cfg.num_layers)])
        self.head = Head(cfg, tp, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """``tokens`` int ``[b, S + 1]`` -> the sum of the next-token losses."""
        x = self.embed(tokens[:, :-1])
        for layer in self.layers:
            x = layer(x)
        return self.head(x, tokens[:, 1:])


# ---------------------------------------------------------------------------- training


def make_parser() -> argparse.ArgumentParser:
    """The flags. A flag whose value a config checks has the config field's name as its
    ``dest`` (``--tp``: ``tensor_model_parallel_size``), so the config's error message
    names the flag (:func:`jax_wgrad.pretrain.cli.flag_names`), as pretrain_gpt's do."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    positive = cli.int_at_least(1)
    parser.add_argument("--dp", type=positive, default=2, help="data-parallel size")
    parser.add_argument(
        "--tp",
        dest="tensor_model_parallel_size",
        metavar="TP",
        type=positive,
        default=2,
        help="tensor-parallel size (it must divide the model's 2 KV heads)",
    )
    parser.add_argument(
        "--pp",
        dest="pipeline_model_parallel_size",
        metavar="PP",
        type=positive,
        default=2,
        help="pipeline-parallel size (it must divide --num-layers)",
    )
    parser.add_argument("--no-sequence-parallel", action="store_true")
    parser.add_argument(
        "--schedule",
        choices=("1f1b", "interleaved", "zb-h1"),
        default="1f1b",
        help="interleaved: 2 model chunks per stage (--num-layers a multiple of 2 x --pp)",
    )
    parser.add_argument("--num-layers", type=int, default=4, help="transformer layers")
    parser.add_argument(
        "--steps", dest="train_iters", metavar="STEPS", type=int, default=10, help="train steps"
    )
    parser.add_argument(
        "--lr", type=cli.float_above(0.0, inclusive=True), default=3e-3, help="learning rate"
    )
    parser.add_argument(
        "--cast-weights",
        choices=("none", "bf16"),
        default="none",
        help="cast each layer's weights to bf16 before its GEMMs (mixed precision); "
        "their fused gradients still go into the fp32 buckets",
    )
    return parser


def usage_error(parser: argparse.ArgumentParser, args, exc: Exception) -> NoReturn:
    """Ends the program as argparse does (exit 2) with ``exc``'s one line, the config
    fields it names spelled as this script's flags."""
    message = cli.flag_names(parser, str(exc))
    if args.schedule == "interleaved" and "virtual_pipeline_model_parallel_size" in message:
        message += " (--schedule interleaved: 2 model chunks per stage)"
    parser.error(message)


def configs(parser: argparse.ArgumentParser, args) -> tuple[LlamaConfig, ParallelConfig]:
    """The model and the layout the flags ask for, checked; a usage error (exit 2) naming
    the flag otherwise."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    microbatches = pp * -(-4 // pp)  # 4, or a multiple of pp (the interleaved schedule's rule)
    try:
        LoopOptions(train_iters=args.train_iters)  # the training loop's check of the steps
        cfg = LlamaConfig(
            num_layers=args.num_layers,
            cast_weights=None if args.cast_weights == "none" else "bfloat16",
        )
        par = ParallelConfig(
            world_size=args.dp * tp * pp,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            sequence_parallel=not args.no_sequence_parallel and tp > 1,
            micro_batch_size=2,
            global_batch_size=2 * microbatches * args.dp,
            gradient_accumulation_fusion=True,  # fused wgrad into the Megatron buckets
            # output-layer deferral (it needs a pipeline; zb-h1 runs those wgrads as W tasks)
            defer_embedding_wgrad_compute=args.schedule != "zb-h1" and pp > 1,
            pipeline_schedule="zb-h1" if args.schedule == "zb-h1" else "1f1b",
            virtual_pipeline_model_parallel_size=2 if args.schedule == "interleaved" else None,
        )
        cfg.validate(par)
    except ValueError as exc:
        usage_error(parser, args, exc)
    return cfg, par


def devices(parser: argparse.ArgumentParser, args) -> list[jax.Device]:
    """The first ``--dp x --tp x --pp`` devices: on the CPU this many virtual devices
    (unless jax already started in this process); a usage error when there are fewer."""
    sizes = (args.dp, args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    world_size = sizes[0] * sizes[1] * sizes[2]
    try:
        parallel.use_virtual_cpu_devices(world_size)  # before the first jax computation
    except ValueError:  # jax started already (a caller's process): the devices it has
        pass
    have = jax.devices()
    if len(have) < world_size:
        parser.error(
            f"--dp x --tp x --pp ({' x '.join(map(str, sizes))} = {world_size}) is more "
            f"than the {len(have)} {have[0].platform} devices jax has"
        )
    return have[:world_size]


def plan_of(parser: argparse.ArgumentParser, args) -> tuple[TrainPlan, jax.sharding.Mesh]:
    """The run's plan: :func:`configs` on the mesh of :func:`devices`."""
    cfg, par = configs(parser, args)
    ddp = DDPConfig(use_distributed_optimizer=True, overlap_grad_reduce=True)  # cooldown sync
    mesh = parallel.make_mesh(par, devices(parser, args))
    try:
        plan = TrainPlan.create(cfg, par, mesh, training.default_optimizer(args.lr), ddp=ddp)
    except ValueError as exc:  # a layout the model or the devices do not allow: one line
        usage_error(parser, args, exc)
    return plan, mesh


def main(argv: list[str] | None = None) -> list[float]:
    parser = make_parser()
    args = parser.parse_args(argv)
    plan, mesh = plan_of(parser, args)
    fused = [e.name for e in plan.sink.entries]
    print(
        f"{len(fused)} weight tensors' gradients fused into the buckets (each GEMM adds dy^T x in "
        f"place), layer weights {'cast to bf16' if plan.model.cast_weights else 'in fp32'}",
        flush=True,
    )
    state = training.init_train_state(plan, seed=0)
    step = training.build_train_step(plan, state)
    cfg, batch = plan.model, plan.parallel.global_batch_size
    # A learnable toy language: each token is the previous one plus one (mod vocab).
    rng = jax.random.key(1)
    losses = []
    for i in range(args.train_iters):
        start = jax.random.randint(jax.random.fold_in(rng, i), (batch, 1), 0, cfg.vocab_size)
        tokens = (start + jnp.arange(cfg.seq_length + 1)) % cfg.vocab_size
        state, metrics = step(state, training.shard_batch(mesh, jax.device_get(tokens)))
        losses.append(float(metrics["loss"]))
        print(f"step {i + 1:3d}  loss {losses[-1]:.4f}", flush=True)
    return losses


if __name__ == "__main__":
    main()
