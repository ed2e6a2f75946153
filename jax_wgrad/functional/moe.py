"""Mixture-of-Experts MLP with expert parallelism, as pure functions over arrays.

Megatron's ``MoELayer`` with the ``alltoall`` token dispatcher, in static shapes (so it
runs on every backend, the CPU included), called inside ``shard_map`` where the expert
axis (``expert_axis``, e.g. :data:`jax_wgrad.parallel.mesh.EXPERT`) holds ``EP`` ranks,
each with its own tokens (EP is carved out of data parallelism) and ``E / EP`` experts:

1. **Router** (:func:`route`, Megatron's ``topk_softmax_with_capacity``): fp32 logits
   ``x @ w_router^T`` ``[T, E]``; gates = softmax over the k largest logits (Megatron's
   default: the top-k probabilities renormalised, Hugging Face's ``norm_topk_prob``) or,
   with ``moe_router_pre_softmax``, the k largest of the softmax over all ``E`` experts
   (not renormalised); times ``moe_router_topk_scaling_factor`` when given.
2. **Dispatch** (:mod:`jax_wgrad.functional.moe_dispatch`): dropless (Megatron's default:
   tokens sorted by expert, ragged groups, expert GEMMs over the routed rows only) or, with
   ``moe_expert_capacity_factor``, capacity buffers ``[E, C, H]`` (choices past ``C``
   dropped, Megatron's ``"position"`` policy); one ``all_to_all`` over the expert axis.
3. **Experts**: two expert linears ``[E/EP, F, H]`` and ``[E/EP, H, F]`` (no biases) with a
   GeLU (or SwiGLU: ``fc1 [E/EP, 2, F, H]``, gate then up) between
   (:mod:`jax_wgrad.functional.expert_linear`); their weight gradients optionally go into a
   flat bucket with ONE fused call per expert linear. With expert tensor parallelism
   (``expert_tensor_axis``) the expert weights are split over ``F`` on the tensor ranks.
4. **Combine**: the inverse exchange, then each token's output is the gate-weighted sum of
   its kept choices (a dropped choice contributes nothing).
5. **Shared experts** (``moe_shared_expert_intermediate_size``) are a dense MLP beside the
   routed experts, built by the model (:class:`jax_wgrad.models.gpt.TransformerLayer`).
6. **Aux loss**: Megatron's ``switch_load_balancing_loss_func``:
   ``E * coeff / (k * T^2) * sum_e(sum_t probs[t, e] * tokens_per_expert[e])`` with the
   full softmax ``probs`` and the routed (pre-drop) counts. Under sequence parallelism
   (``sequence_axis``) each tensor rank routes its own slice of the sequence; as in
   Megatron the counts are summed over the tensor ranks and ``T`` is the whole sequence's,
   so the tensor ranks' losses add up to the loss of the whole sequence.
   :func:`attach_aux_loss` adds its gradient in the backward (Megatron's
   ``MoEAuxLossAutoScaler``).

**Delayed expert wgrad** (``overlap_wgrad=True``, Megatron's
``--overlap-dispatch-backward-with-experts-wgrad``): see
:mod:`jax_wgrad.functional.expert_linear`; bitwise equal to the serial order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from jax_wgrad import ops
from jax_wgrad._validation import check_positive
from jax_wgrad.functional.expert_linear import grouped_linear, ragged_linear
from jax_wgrad.functional.moe_dispatch import CapacityDispatch, DroplessDispatch, dispatch_slots
from jax_wgrad.functional.routes import WgradRoutes, route_of, value_of

__all__ = [
    "MoEConfig",
    "MoEStats",
    "route",
    "dispatch_slots",
    "grouped_linear",
    "moe_mlp",
    "load_balancing_loss",
    "attach_aux_loss",
    "ROUTER_SCOPE",
    "DISPATCH_SCOPE",
    "EXPERTS_SCOPE",
    "COMBINE_SCOPE",
]

# The named scopes (``op_name`` metadata in the compiled HLO) of an MoE layer's parts,
# under the model's ``moe`` scope: what the estimate's breakdown reads
# (:data:`jax_wgrad.aot.estimate.PARTS`).
ROUTER_SCOPE = "router"
DISPATCH_SCOPE = "dispatch"
"""Sort by expert, permute, the exchange to the expert ranks."""
EXPERTS_SCOPE = "experts"
"""The expert linears and their activation."""
COMBINE_SCOPE = "combine"
"""The exchange back, unpermute, the gate-weighted sum."""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Megatron's MoE options (``--num-experts``, ``--moe-router-topk``, ...): the ONE place
    their defaults (Megatron's) and their checks are written.

    :class:`~jax_wgrad.models.gpt.GPTConfig` forwards its flat Megatron-named fields
    (``num_moe_experts``, ``moe_router_topk``, ...) here: their defaults are read from these
    fields and :meth:`GPTConfig.moe_config` builds this class, whose ``__post_init__``
    checks them.

    Attributes:
      num_experts: ``E`` (``num_moe_experts``).
      ffn_hidden_size: ``F`` of each expert (``moe_ffn_hidden_size``).
      topk: experts per token (``moe_router_topk``).
      capacity_factor: ``moe_expert_capacity_factor``; ``None`` (Megatron's default):
        dropless -- no token is ever dropped, and the experts compute on the routed tokens
        only (:class:`~jax_wgrad.functional.moe_dispatch.DroplessDispatch`).
      load_balancing_type: ``"aux_loss"`` or ``"none"`` (``moe_router_load_balancing_type``).
      aux_loss_coeff: ``moe_aux_loss_coeff`` (Megatron's default 0: the loss is computed
        and reported, its gradient is zero).
      overlap_wgrad: ``overlap_dispatch_backward_with_experts_wgrad`` (module docstring).
      swiglu: SwiGLU experts (Mixtral): ``fc1 [E, 2, F, H]`` = gate rows, then up rows
        (each tensor rank holds the gate and up rows of the same features).
      pre_softmax: ``moe_router_pre_softmax``: the gates are the top-k of the softmax
        over all experts (not renormalised; Hugging Face's ``norm_topk_prob: false``);
        off (Megatron's default): the softmax over the top-k logits.
      topk_scaling_factor: ``moe_router_topk_scaling_factor``: multiplies the gates;
        ``None`` (Megatron's default): no scaling.
      dropless_buffer_factor: ``moe_dropless_buffer_factor``: a dropless layer's receive
        buffer per expert rank holds ``ceil(factor T k)`` rows (``T k``: one rank's routed
        choices) instead of the worst case ``EP T k``
        (:func:`~jax_wgrad.functional.moe_dispatch.receive_rows`); a step routing more to
        one rank counts the excess in :attr:`MoEStats.overflow_rows` (the training loop
        refuses it). ``None``: the worst case, which no routing exceeds.
      permute_fusion: ``moe_permute_fusion`` (Megatron's): the dropless dispatcher's
        permutations gather in both directions
        (:func:`~jax_wgrad.functional.moe_dispatch.permute_rows`).
    """

    num_experts: int
    ffn_hidden_size: int
    topk: int = 2
    capacity_factor: float | None = None
    load_balancing_type: Literal["aux_loss", "none"] = "aux_loss"
    aux_loss_coeff: float = 0.0
    overlap_wgrad: bool = False
    swiglu: bool = False
    pre_softmax: bool = False
    topk_scaling_factor: float | None = None
    dropless_buffer_factor: float | None = None
    permute_fusion: bool = False

    def activation(self, hidden: jax.Array) -> jax.Array:
        """The experts' nonlinearity: ``[..., F]`` (GELU), ``[..., 2F]`` (SwiGLU) -> ``F``."""
        if not self.swiglu:
            return jax.nn.gelu(hidden, approximate=False)
        gate, up = jnp.split(hidden, 2, axis=-1)
        return jax.nn.silu(gate) * up

    def __post_init__(self):
        check_positive("num_moe_experts", self.num_experts)
        check_positive("moe_ffn_hidden_size", self.ffn_hidden_size)
        if not isinstance(self.topk, int) or not 1 <= self.topk <= self.num_experts:
            raise ValueError(
                f"moe_router_topk ({self.topk}) must be in [1, num_moe_experts "
                f"= {self.num_experts}]"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"moe_expert_capacity_factor ({self.capacity_factor}) must be "
                "> 0, or None for no token dropping"
            )
        if self.load_balancing_type not in ("aux_loss", "none"):
            raise ValueError(
                f"moe_router_load_balancing_type {self.load_balancing_type!r} "
                "is not supported; choose 'aux_loss' or 'none'"
            )
        coeff = self.aux_loss_coeff
        if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not coeff >= 0:
            raise ValueError(f"moe_aux_loss_coeff must be >= 0, got {coeff!r}")
        object.__setattr__(self, "aux_loss_coeff", float(coeff))
        if not isinstance(self.pre_softmax, bool):
            raise ValueError(
                f"moe_router_pre_softmax must be True or False, got {self.pre_softmax!r}"
            )
        scale = self.topk_scaling_factor
        if scale is not None:
            if (
                isinstance(scale, bool)
                or not isinstance(scale, (int, float))
                or not 0 < scale < math.inf
            ):
                raise ValueError(
                    f"moe_router_topk_scaling_factor must be a finite number > 0 (or None: "
                    f"no scaling), got {scale!r}"
                )
            object.__setattr__(self, "topk_scaling_factor", float(scale))
        factor = self.dropless_buffer_factor
        if factor is not None:
            if (
                isinstance(factor, bool)
                or not isinstance(factor, (int, float))
                or not (math.isfinite(factor) and factor >= 1)
            ):
                raise ValueError(
                    f"moe_dropless_buffer_factor must be a finite number >= 1 (a rank "
                    f"receives T k rows on average; or None: the worst case), got {factor!r}"
                )
            if self.capacity_factor is not None:
                raise ValueError(
                    f"moe_dropless_buffer_factor ({factor}) bounds the dropless dispatch; "
                    f"it cannot be combined with moe_expert_capacity_factor "
                    f"({self.capacity_factor})"
                )
            object.__setattr__(self, "dropless_buffer_factor", float(factor))
        if not isinstance(self.permute_fusion, bool):
            raise ValueError(
                f"moe_permute_fusion must be True or False, got {self.permute_fusion!r}"
            )
        if self.permute_fusion and self.capacity_factor is not None:
            raise ValueError(
                f"moe_permute_fusion fuses the dropless dispatcher's permutations; with "
                f"moe_expert_capacity_factor ({self.capacity_factor}) it is not built "
                "(the capacity buffers are filled by a scatter)"
            )

    def capacity(self, tokens: int) -> int:
        """Slots per expert per source rank: ``ceil(T * k * factor / E)`` (Megatron's
        ``get_capacity``); dropless (no factor): none."""
        if self.capacity_factor is None:
            raise ValueError(
                "a dropless MoE (moe_expert_capacity_factor None) has no expert capacity"
            )
        return max(1, math.ceil(tokens * self.topk * self.capacity_factor / self.num_experts))


class MoEStats(NamedTuple):
    """Per-call statistics of one rank's tokens."""

    aux_loss: jax.Array
    """Scalar load-balancing loss (already scaled by ``aux_loss_coeff``; 0 with ``"none"``)."""
    tokens_per_expert: jax.Array
    """``[E]`` routed choices per expert, before dropping."""
    dropped_fraction: jax.Array
    """Scalar: dropped choices / routed choices."""
    overflow_rows: jax.Array
    """Scalar: routed choices this expert rank's dropless receive buffer could not hold
    (``MoEConfig.dropless_buffer_factor``); nonzero means the layer's output is wrong."""


def route(
    x: jax.Array,
    w_router: jax.Array,
    topk: int,
    *,
    pre_softmax: bool = False,
    scaling_factor: float | None = None,
):
    """Router: ``(probs [T, E] fp32 softmax, experts [T, k] int32, gates [T, k] fp32)``.

    Megatron's ``topk_softmax_with_capacity`` (score function softmax): the ``k`` experts
    of the largest logits; ``gates`` = the softmax over those ``k`` logits, or with
    ``pre_softmax`` the ``k`` largest of ``probs`` (the softmax over all experts, not
    renormalised); then times ``scaling_factor`` when given. ``probs`` (what the
    load-balancing loss reads) is the full softmax either way."""
    logits = jnp.matmul(
        x.astype(jnp.float32), w_router.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST
    )
    probs = jax.nn.softmax(logits, axis=-1)
    if pre_softmax:
        gates, experts = jax.lax.top_k(probs, topk)
    else:
        top_logits, experts = jax.lax.top_k(logits, topk)
        gates = jax.nn.softmax(top_logits, axis=-1)
    if scaling_factor is not None:
        gates = gates * scaling_factor
    return probs, experts.astype(jnp.int32), gates


def load_balancing_loss(
    probs: jax.Array,
    tokens_per_expert: jax.Array,
    topk: int,
    coeff: float,
    num_tokens: int | None = None,
) -> jax.Array:
    """Megatron's ``switch_load_balancing_loss_func`` over ``num_tokens`` tokens (default
    this rank's ``T``; the whole sequence's under sequence parallelism)."""
    t, e = probs.shape
    t = t if num_tokens is None else num_tokens
    return jnp.sum(jnp.sum(probs, axis=0) * tokens_per_expert) * (e * coeff / (topk * t * t))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def attach_aux_loss(y: jax.Array, aux_loss: jax.Array, scale: float) -> jax.Array:
    """Returns ``y``; its backward also gives ``aux_loss`` the gradient ``scale``
    (Megatron's ``MoEAuxLossAutoScaler``): the aux loss joins the loss being
    differentiated, weighted by ``scale``, without being an output of the model.

    The pipeline seeds each microbatch's backward with its token-loss SUM, so a layer
    passes ``scale`` = the microbatch's tokens: after the final ``1 / tokens`` scaling the
    aux loss enters as its mean over microbatches and data-parallel ranks.
    """
    return y


def _attach_fwd(y, aux_loss, scale):
    return y, None


def _attach_bwd(scale, _, dy):
    return dy, jnp.full((), scale, jnp.float32)


attach_aux_loss.defvjp(_attach_fwd, _attach_bwd)


def _expert_shapes(params, cfg: MoEConfig, x: jax.Array, ep: int, etp: int) -> None:
    """Checks the router and this rank's expert weights against ``cfg`` and the layout."""
    e, h = cfg.num_experts, x.shape[-1]
    e_local = params["fc1"].shape[0]
    if e_local * ep != e or params["router"].shape != (e, h):
        raise ValueError(
            f"moe_mlp: num_moe_experts ({e}) must equal expert_model_parallel_size ({ep}) x "
            f"local experts ({e_local}), router [E, H] = {list(params['router'].shape)} for "
            f"x {list(x.shape)}"
        )
    f = cfg.ffn_hidden_size
    if f % etp != 0:
        raise ValueError(
            f"moe_ffn_hidden_size ({f}) must be divisible by expert_tensor_parallel_size ({etp})"
        )
    fl = f // etp
    fc1 = (e_local, 2, fl, h) if cfg.swiglu else (e_local, fl, h)
    if params["fc1"].shape != fc1 or params["fc2"].shape != (e_local, h, fl):
        width = "moe_ffn_hidden_size" + (
            f" / expert_tensor_parallel_size ({etp})" if etp > 1 else ""
        )
        raise ValueError(
            f"moe_mlp: expert weights must be fc1 [E/EP, {'2, ' if cfg.swiglu else ''}{width}, "
            f"H] = {list(fc1)} and fc2 [E/EP, H, {width}] = {[e_local, h, fl]}; got fc1 "
            f"{list(params['fc1'].shape)}, fc2 {list(params['fc2'].shape)}"
        )


def moe_mlp(
    params: dict[str, jax.Array],
    x: jax.Array,
    cfg: MoEConfig,
    *,
    expert_axis: str | tuple[str, ...] | None = None,
    sequence_axis: str | None = None,
    expert_tensor_axis: str | None = None,
    buckets: tuple[jax.Array, int, int] | None = None,
    precision: ops.PrecisionLike = None,
) -> tuple[Any, MoEStats]:
    """The MoE MLP of this rank's tokens.

    Args:
      params: ``router [E, H]`` (replicated), ``fc1 [E/EP, F/etp, H]`` (``[E/EP, 2, F/etp,
        H]`` with SwiGLU), ``fc2 [E/EP, H, F/etp]`` (this rank's experts: rank ``r`` holds
        experts ``[r * E/EP, (r + 1) * E/EP)``; with expert tensor parallelism, its tensor
        rank's slice of their ``F`` features).
      x: ``[T, H]`` this rank's tokens.
      cfg: the MoE options.
      expert_axis: the ``shard_map`` axis of the ``EP`` expert ranks, or a tuple of axes
        (Megatron's MoE parallel folding: ``(expert, tensor)``, the tensor ranks of the
        attention being expert ranks too, each routing its own sequence shard; experts
        ``[E/EP]`` on rank ``expert_index * tp + tensor_index``); ``None``: one rank.
      sequence_axis: under sequence parallelism, the tensor axis the sequence is split
        over (the aux loss counts the whole sequence, see the module docstring).
      expert_tensor_axis: expert tensor parallelism over this axis (``etp`` ranks; needs
        sequence parallelism over it: each tensor rank routes its own tokens).
      buckets: optional ``(bucket, fc1 offset, fc2 offset)``: expert weight gradients go
        into that flat fp32 bucket (threaded, see :func:`grouped_linear`). Without it,
        ``fc1``/``fc2`` (arrays or NNX variables) go where their routes send them
        (:mod:`jax_wgrad.functional.routes`; one fused call per expert linear), else to
        their cotangents.
    Returns:
      ``(y [T, H], stats)``, or ``((y, bucket), stats)`` with ``buckets``; ``stats``: a
      :class:`MoEStats`.
    """
    if buckets is not None:  # explicit bucket: routes of its own
        routes = WgradRoutes((buckets[0],))
        params = {
            **params,
            "fc1": routes.to_bucket(params["fc1"], 0, buckets[1], name="fc1"),
            "fc2": routes.to_bucket(params["fc2"], 0, buckets[2], name="fc2"),
        }
        y, stats = moe_mlp(
            params,
            x,
            cfg,
            expert_axis=expert_axis,
            sequence_axis=sequence_axis,
            expert_tensor_axis=expert_tensor_axis,
            precision=precision,
        )
        return (y, routes.close()[0]), stats
    e, k = cfg.num_experts, cfg.topk
    ep = 1 if expert_axis is None else jax.lax.axis_size(expert_axis)
    etp = 1 if expert_tensor_axis is None else jax.lax.axis_size(expert_tensor_axis)
    _expert_shapes(params, cfg, x, ep, etp)
    t, h = x.shape
    with jax.named_scope(ROUTER_SCOPE):
        probs, experts, gates = route(
            x,
            value_of(params["router"]),
            k,
            pre_softmax=cfg.pre_softmax,
            scaling_factor=cfg.topk_scaling_factor,
        )
    exchange = dict(expert_axis=expert_axis, ep=ep, tensor_axis=expert_tensor_axis, num_experts=e)
    dispatcher = (
        DroplessDispatch(
            **exchange,
            buffer_factor=cfg.dropless_buffer_factor,
            permute_fusion=cfg.permute_fusion,
        )
        if cfg.capacity_factor is None
        else CapacityDispatch(**exchange, capacity=cfg.capacity(t))
    )
    with jax.named_scope(DISPATCH_SCOPE):
        rows, sizes, state = dispatcher.dispatch(x, experts)
    opts = dict(precision=precision, overlap_wgrad=cfg.overlap_wgrad)
    group = {} if sizes is None else {"group_sizes": sizes}
    expert_linear = grouped_linear if sizes is None else ragged_linear

    def linear(a: jax.Array, param: Any) -> jax.Array:
        """``a`` through expert weight ``param`` (``[E, out, in]``; SwiGLU's ``[E, 2, F,
        H]`` as ``[E, 2F, H]``: gate rows, then up rows), its gradient where its route
        sends it."""
        w, route = value_of(param), route_of(param)
        w = w.reshape(w.shape[0], -1, w.shape[-1])
        if route is None:
            return expert_linear(a, w, **group, **opts)
        return route.into_bucket(
            lambda bk, off: expert_linear(a, w, **group, bucket=bk, offset=off, **opts)
        )

    with jax.named_scope(EXPERTS_SCOPE):
        out = linear(cfg.activation(linear(rows, params["fc1"])), params["fc2"])
    with jax.named_scope(COMBINE_SCOPE):
        y = dispatcher.combine(out, gates, state)
    tokens_per_expert = jnp.sum(jax.nn.one_hot(experts, e, dtype=jnp.float32), axis=(0, 1))
    counts, total = tokens_per_expert, t
    if sequence_axis is not None:
        counts = jax.lax.psum(tokens_per_expert, sequence_axis)
        total = t * jax.lax.axis_size(sequence_axis)
    aux = (
        load_balancing_loss(probs, jax.lax.stop_gradient(counts), k, cfg.aux_loss_coeff, total)
        if cfg.load_balancing_type == "aux_loss"
        else jnp.zeros((), jnp.float32)
    )
    kept = dispatcher.kept(state)
    dropped = (
        jnp.zeros((), jnp.float32) if kept is None else jnp.sum(~kept) / jnp.float32(kept.size)
    )
    overflow = (
        dispatcher.overflow(state).astype(jnp.float32)
        if isinstance(dispatcher, DroplessDispatch)
        else jnp.zeros((), jnp.float32)
    )
    stats = MoEStats(aux, tokens_per_expert, dropped, overflow)
    return y, stats
