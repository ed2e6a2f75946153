"""The GPT's canonical parameters and its modules as the layout places them.

Parameters live outside the modules as one plain nested dict, the *canonical layout*
(independent of the parallel layout)::

    {'embedding': {'word': {'embedding': [V, H]}, 'position': [S, H]},
     'layers':    {'ln1': {...}, 'qkv': {'weight': [L, 3H, H], 'bias': [L, 3H]},
                   'proj': {...}, 'ln2': {...}, 'fc1': {...}, 'fc2': {...}},  # stacked [L]
     'head':      {'final_norm': {...}, 'output': {'weight': [V, H]}}}  # output if untied

An MoE model (``GPTConfig.num_moe_experts``) stacks its dense layers in ``'layers'``
(``[L_dense]``, absent if every layer is an MoE layer) and its MoE layers in
``'moe_layers'`` (``[L_moe]``: ``ln1``, ``qkv``, ``proj``, ``ln2``, ``'router': [L_moe, E, H]``,
``'experts': {'fc1': [L_moe, E, F, H], 'fc2': [L_moe, E, H, F]}``). Every stage has the same
local pattern of MoE and dense layers (``config.validate`` checks it): a period of
``moe_layer_freq`` layers (:func:`period_pattern`).

The qkv output dim is ordered ``(heads, 3, head_dim)`` (Megatron's interleaved layout) so
a contiguous split over ``tensor`` gives each rank whole heads. :func:`init_params` builds
the full parameters from a seed only; :func:`model_parts` names the modules, their kinds
and the period for the library's layout (:class:`~jax_wgrad.layout.StageLayout`), which
derives their sharding, the per-device device tree and the gradient layout from the
modules' parameter metadata.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_wgrad.models.gpt.config import GPTConfig
from jax_wgrad.models.gpt.modules import GPTEmbedding, GPTHead, TransformerLayer
from jax_wgrad.models.parts import LayerKind, ModelParts

__all__ = [
    "abstract_modules",
    "init_params",
    "layer_loop_length",
    "model_parts",
    "period_pattern",
]


def period_pattern(cfg: GPTConfig) -> tuple[bool, ...]:
    """Per layer of the repeating period of the layer pattern: an MoE layer. A dense
    model's period is one dense layer; an MoE model's is ``moe_layer_freq`` layers, the
    first one MoE (Megatron's pattern). Every stage holds whole periods
    (``GPTConfig``'s checks)."""
    return cfg.moe_layer_pattern[: cfg.moe_layer_freq if cfg.num_moe_experts else 1]


def layer_loop_length(cfg: GPTConfig, parallel) -> int:
    """Iterations of a model chunk's loop over its layers (its periods of layers,
    :func:`period_pattern`): ``L / (P V)`` layers over the period's length, for a
    :class:`~jax_wgrad.parallel.ParallelConfig` ``parallel`` of ``P`` stages and ``V``
    model chunks per stage."""
    chunks = parallel.pipeline_model_parallel_size * parallel.num_model_chunks
    return cfg.num_layers // chunks // len(period_pattern(cfg))


def _pure(module: nnx.Module) -> dict:
    return nnx.to_pure_dict(nnx.split(module)[1])


def init_params(cfg: GPTConfig, seed: int) -> dict:
    """Full (unsharded) canonical parameters in ``cfg.params_dtype``; depend only on
    ``cfg`` and ``seed``.

    Every part draws from its own ``fold_in`` of the seed, so the values do not depend
    on the parallel layout. The modules draw in fp32; bf16 parameters
    (``params_dtype="bfloat16"``) are those values rounded to bf16 (the optimizer's fp32
    main parameters start from the bf16 values, as Megatron's copy of its bf16 model). Call
    under ``jax.jit(..., out_shardings=...)`` to create them sharded directly.
    """
    key = jax.random.key(seed)
    embedding = GPTEmbedding(cfg, rngs=nnx.Rngs(jax.random.fold_in(key, 0)))
    per_key: dict[str, list] = {"layers": [], "moe_layers": []}
    for i, moe in enumerate(cfg.moe_layer_pattern):
        layer = TransformerLayer(cfg, moe=moe, rngs=nnx.Rngs(jax.random.fold_in(key, 1 + i)))
        per_key["moe_layers" if moe else "layers"].append(_pure(layer))
    head = GPTHead(cfg, rngs=nnx.Rngs(jax.random.fold_in(key, 1 + cfg.num_layers)))
    out = {"embedding": _pure(embedding)}
    for k, ps in per_key.items():
        if ps:
            out[k] = jax.tree.map(lambda *xs: jnp.stack(xs), *ps)
    out["head"] = _pure(head)
    dtype = jnp.dtype(cfg.params_dtype)
    return jax.tree.map(lambda a: a.astype(dtype), out)


def abstract_modules(
    cfg: GPTConfig,
    tp: int = 1,
    sp: bool = False,
    attention: str = "xla",
    ep: int = 1,
    vocab_pp: int = 1,
    etp: int = 1,
    fold: bool = False,
    cp: int = 1,
    cp_comm_type: str = "p2p",
    cp_ring_shift: str = "ppermute",
):
    """``(embedding, dense layer, MoE layer or None, head)`` modules of the layout, shapes
    only (no arrays); ``vocab_pp``: the pipeline stages the vocabulary is split over;
    ``etp``: the expert-tensor-parallel size; ``fold``: MoE parallel folding
    (:attr:`~jax_wgrad.parallel.ParallelConfig.folds_experts`); ``cp``, ``cp_comm_type``:
    context parallelism (:attr:`~jax_wgrad.parallel.ParallelConfig.context_parallel_size`)
    and how its ring passes blocks
    (:attr:`~jax_wgrad.functional.context_parallel.ContextParallel.ring_shift`)."""
    kw = dict(tp_size=tp, sequence_parallel=sp)
    layer = lambda moe: nnx.eval_shape(
        lambda: TransformerLayer(
            cfg,
            **kw,
            attention=attention,
            moe=moe,
            ep_size=ep,
            etp_size=etp,
            fold_experts=fold,
            cp_size=cp,
            cp_comm_type=cp_comm_type,
            cp_ring_shift=cp_ring_shift,
            rngs=nnx.Rngs(0),
        )
    )
    ends = dict(kw, vocab_pipeline_size=vocab_pp)
    return (
        nnx.eval_shape(lambda: GPTEmbedding(cfg, **ends, rngs=nnx.Rngs(0))),
        layer(False),
        layer(True) if cfg.num_moe_experts is not None else None,
        nnx.eval_shape(lambda: GPTHead(cfg, **ends, rngs=nnx.Rngs(0))),
    )


def model_parts(cfg: GPTConfig, etp: int = 1, fold: bool = False) -> ModelParts:
    """The GPT's modules for the layout (:class:`~jax_wgrad.models.parts.ModelParts`):
    ``embedding`` and ``head``, the dense ``layers`` and MoE ``moe_layers`` kinds (the
    latter's ``experts`` in the expert chunk) in the order of ``cfg.moe_layer_pattern``,
    one :func:`period_pattern` per period; built for one tensor rank (``etp``: the expert
    tensor-parallel size, and ``fold``: MoE parallel folding, which say how the expert
    weights are split)."""
    layer = lambda moe: (
        lambda: TransformerLayer(cfg, moe=moe, etp_size=etp, fold_experts=fold, rngs=nnx.Rngs(0))
    )
    kinds = [LayerKind("layers", layer(False))]
    if cfg.num_moe_experts is not None:
        kinds.append(LayerKind("moe_layers", layer(True), experts="experts"))
    return ModelParts(
        embed=("embedding", lambda: GPTEmbedding(cfg, rngs=nnx.Rngs(0))),
        kinds=tuple(kinds),
        pattern=tuple(int(m) for m in cfg.moe_layer_pattern),
        period=tuple(int(m) for m in period_pattern(cfg)),
        head=("head", lambda: GPTHead(cfg, rngs=nnx.Rngs(0))),
        seq_length=cfg.seq_length,
        hidden_size=cfg.hidden_size,
        compute_dtype=cfg.compute_dtype,
    )
