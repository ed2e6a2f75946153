"""Mixture-of-Experts MLP with expert parallelism, as pure functions over arrays.

Megatron's ``MoELayer`` with the ``alltoall`` token dispatcher, in static shapes (so it
runs on every backend, the CPU included), called inside ``shard_map`` where the expert
axis (``expert_axis``, e.g. :data:`jax_wgrad.parallel.mesh.EXPERT`) holds ``EP`` ranks,
each with its own tokens (EP is carved out of data parallelism) and ``E / EP`` experts:

1. **Router**: fp32 logits ``x @ w_router^T`` ``[T, E]``, top-k, gates = softmax over the
   k selected logits (Megatron's default, ``moe_router_pre_softmax=False``).
2. **Dispatch**: every (token, choice) gets a position in its expert's queue, choices
   ranked first by ``k`` then by token order (Megatron's ``moe_token_drop_policy=
   "position"``); positions ``>= capacity`` are dropped. Tokens are scattered into an
   ``[E, C, H]`` buffer (zero-padded to the capacity ``C``) and exchanged by one
   ``all_to_all`` over the expert axis: each rank receives ``[E/EP, EP * C, H]``.
3. **Experts**: two grouped linears ``[E/EP, F, H]`` and ``[E/EP, H, F]`` (no biases) with a
   GeLU between. Their weight gradients can go through :func:`grouped_linear`'s fused
   path: ONE :func:`jax_wgrad.ops.grouped_wgrad_accumulate` call per expert linear, in
   place into an accumulator or a flat bucket.
4. **Combine**: the inverse ``all_to_all``, then each token's output is the gate-weighted
   sum of its kept choices (a dropped choice contributes nothing).
5. **Aux loss**: Megatron's ``switch_load_balancing_loss_func``:
   ``E * coeff / (k * T^2) * sum_e(sum_t probs[t, e] * tokens_per_expert[e])`` with the
   full softmax ``probs`` and the routed (pre-drop) counts. Under sequence parallelism
   (``sequence_axis``) each tensor rank routes its own slice of the sequence; as in
   Megatron the counts are summed over the tensor ranks and ``T`` is the whole sequence's,
   so the tensor ranks' losses add up to the loss of the whole sequence.
   :func:`attach_aux_loss` adds its gradient in the backward (Megatron's
   ``MoEAuxLossAutoScaler``).

**Delayed expert wgrad** (``overlap_wgrad=True``, Megatron's
``--overlap-dispatch-backward-with-experts-wgrad``): the expert weight-gradient GEMM is
made to start only after the expert data-gradient GEMM (an ``optimization_barrier`` on
``(x, dy, dx)``) and nothing downstream depends on it except the gradient itself, so
XLA may run it while the dispatch-backward all-to-all is in flight. Without it the
data gradient is released only after the weight gradient (the baseline order: the
all-to-all waits for the wgrad). Both compute the same operations: bitwise equal.
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
from jax_wgrad.functional.linear import BucketSlot, WgradBuckets, check_bucket_block

__all__ = ["MoEConfig", "MoEStats", "route", "dispatch_slots", "grouped_linear",
           "moe_mlp", "load_balancing_loss", "attach_aux_loss"]


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
      capacity_factor: ``moe_expert_capacity_factor``; ``None`` (Megatron's default): no
        token is ever dropped (capacity = all routed choices of a rank, ``T * k``).
      load_balancing_type: ``"aux_loss"`` or ``"none"`` (``moe_router_load_balancing_type``).
      aux_loss_coeff: ``moe_aux_loss_coeff`` (Megatron's default 0: the loss is computed
        and reported, its gradient is zero).
      overlap_wgrad: ``overlap_dispatch_backward_with_experts_wgrad`` (module docstring).
      swiglu: SwiGLU experts (Mixtral): ``fc1 [E, 2F, H]`` = gate rows, then up rows.
    """

    num_experts: int
    ffn_hidden_size: int
    topk: int = 2
    capacity_factor: float | None = None
    load_balancing_type: Literal["aux_loss", "none"] = "aux_loss"
    aux_loss_coeff: float = 0.0
    overlap_wgrad: bool = False
    swiglu: bool = False

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
            raise ValueError(f"moe_router_topk ({self.topk}) must be in [1, num_moe_experts "
                             f"= {self.num_experts}]")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"moe_expert_capacity_factor ({self.capacity_factor}) must be "
                             "> 0, or None for no token dropping")
        if self.load_balancing_type not in ("aux_loss", "none"):
            raise ValueError(f"moe_router_load_balancing_type {self.load_balancing_type!r} "
                             "is not supported; choose 'aux_loss' or 'none'")
        coeff = self.aux_loss_coeff
        if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not coeff >= 0:
            raise ValueError(f"moe_aux_loss_coeff must be >= 0, got {coeff!r}")
        object.__setattr__(self, "aux_loss_coeff", float(coeff))

    def capacity(self, tokens: int) -> int:
        """Slots per expert per source rank: ``ceil(T * k * factor / E)`` (Megatron's
        ``get_capacity``), or ``T * k`` without dropping."""
        if self.capacity_factor is None:
            return tokens * self.topk
        return max(1, math.ceil(tokens * self.topk * self.capacity_factor / self.num_experts))


class MoEStats(NamedTuple):
    """Per-call statistics of one rank's tokens."""

    aux_loss: jax.Array
    """Scalar load-balancing loss (already scaled by ``aux_loss_coeff``; 0 with ``"none"``)."""
    tokens_per_expert: jax.Array
    """``[E]`` routed choices per expert, before dropping."""
    dropped_fraction: jax.Array
    """Scalar: dropped choices / routed choices."""


def route(x: jax.Array, w_router: jax.Array, topk: int):
    """Router: ``(probs [T, E] fp32 softmax, experts [T, k] int32, gates [T, k] fp32)``."""
    logits = jnp.matmul(x.astype(jnp.float32), w_router.astype(jnp.float32).T,
                        precision=jax.lax.Precision.HIGHEST)
    top_logits, experts = jax.lax.top_k(logits, topk)
    return jax.nn.softmax(logits, axis=-1), experts.astype(jnp.int32), \
        jax.nn.softmax(top_logits, axis=-1)


def dispatch_slots(experts: jax.Array, num_experts: int, capacity: int):
    """Queue positions of every (token, choice): ``(slot [T, k], kept [T, k] bool)``.

    Choices are queued k-major (all first choices in token order, then all second
    choices, ...); a choice whose position reaches ``capacity`` is dropped.
    """
    t, k = experts.shape
    onehot = jax.nn.one_hot(experts.T.reshape(-1), num_experts, dtype=jnp.int32)  # [k*T, E]
    position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)
    slot = position.reshape(k, t).T
    return slot, slot < capacity


def load_balancing_loss(probs: jax.Array, tokens_per_expert: jax.Array, topk: int,
                        coeff: float, num_tokens: int | None = None) -> jax.Array:
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


# ---------------------------------------------------------------- grouped expert linear
def _gforward(x, w, precision):
    return jnp.einsum("eci,eoi->eco", x, w.astype(x.dtype),
                      precision=jax.lax.Precision(precision))


def _gdgrad(dy, w, precision, dtype):
    return jnp.einsum("eco,eoi->eci", dy, w.astype(dy.dtype),
                      precision=jax.lax.Precision(precision)).astype(dtype)


def _ordered(x, dy, dx, wgrad, overlap):
    """Runs ``wgrad(x, dy)`` after the data gradient ``dx`` (overlap) or holds ``dx`` back
    until the weight gradient is done (the serial baseline); returns ``(dx, wgrad)``."""
    if overlap:
        x, dy, dx = jax.lax.optimization_barrier((x, dy, dx))
        return dx, wgrad(x, dy)
    new = wgrad(x, dy)
    return jax.lax.optimization_barrier((dx, new))


# Threaded into a bucket: a static (int) offset is a nondiff argument, a traced one a
# regular integer argument saved as a residual (cotangent None); one backward body.
def _grouped_threaded_bwd_body(x, w, dy, ct_bucket, offset, precision, overlap):
    """``(dx, zeros like w, bucket + every expert's block)``."""
    dx = _gdgrad(dy, w, precision, x.dtype)
    wgrad = lambda x, dy: ops.grouped_wgrad_accumulate(x, dy, ct_bucket, offset=offset,
                                                       precision=precision)
    dx, new_bucket = _ordered(x, dy, dx, wgrad, overlap)
    return dx, jnp.zeros_like(w), new_bucket


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped_threaded(x, w, bucket, offset, precision, overlap):
    return _gforward(x, w, precision), bucket


def _grouped_threaded_fwd(x, w, bucket, offset, precision, overlap):
    return (_gforward(x, w, precision), bucket), (x, w)


def _grouped_threaded_bwd(offset, precision, overlap, res, cts):
    x, w = res
    return _grouped_threaded_bwd_body(x, w, *cts, offset, precision, overlap)


_grouped_threaded.defvjp(_grouped_threaded_fwd, _grouped_threaded_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _grouped_threaded_at(x, w, bucket, offset, precision, overlap):
    return _gforward(x, w, precision), bucket


def _grouped_threaded_at_fwd(x, w, bucket, offset, precision, overlap):
    return (_gforward(x, w, precision), bucket), (x, w, offset)


def _grouped_threaded_at_bwd(precision, overlap, res, cts):
    x, w, offset = res
    return (*_grouped_threaded_bwd_body(x, w, *cts, offset, precision, overlap), None)


_grouped_threaded_at.defvjp(_grouped_threaded_at_fwd, _grouped_threaded_at_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _grouped_plain(x, w, precision, overlap):
    return _gforward(x, w, precision)


def _grouped_plain_fwd(x, w, precision, overlap):
    return _gforward(x, w, precision), (x, w)


def _grouped_plain_bwd(precision, overlap, res, dy):
    x, w = res
    dx = _gdgrad(dy, w, precision, x.dtype)
    wgrad = lambda x, dy: jnp.einsum(
        "eco,eci->eoi", dy, x, preferred_element_type=jnp.float32,
        precision=jax.lax.Precision(precision)).astype(w.dtype)
    return _ordered(x, dy, dx, wgrad, overlap)


_grouped_plain.defvjp(_grouped_plain_fwd, _grouped_plain_bwd)


def grouped_linear(x: jax.Array, w: jax.Array, *, bucket: jax.Array | None = None,
                   offset: int | jax.Array = 0, main_grad: BucketSlot | None = None,
                   precision: ops.PrecisionLike = None, overlap_wgrad: bool = False):
    """Per-expert ``y[e] = x[e] @ w[e]^T``.

    Args:
      x: ``[E, C, in]``; w: ``[E, out, in]``.
      bucket: optional flat fp32 gradient bucket threaded like
        :func:`jax_wgrad.functional.linear_into_bucket`: the backward adds every expert's
        ``dy[e]^T x[e]`` to its blocks ``[offset, offset + E * out * in)`` with ONE
        grouped fused call (``w`` then gets a zero gradient).
      offset: a Python int (static, checked to fit) or an int32 scalar array (may be
        traced, e.g. per layer of a ``scan``; clamped into ``[0, N - E * out * in]`` like
        ``lax.dynamic_update_slice``).
      main_grad: instead of ``bucket``/``offset``, the weight's
        :class:`~jax_wgrad.functional.BucketSlot` in buckets threaded by a
        :class:`~jax_wgrad.functional.WgradBuckets` (returns ``y`` only).
      overlap_wgrad: the delayed-wgrad order (module docstring).
    Returns:
      ``y [E, C, out]``, and the bucket token when ``bucket`` is given.
    """
    if x.ndim != 3 or w.ndim != 3 or x.shape[0] != w.shape[0] or x.shape[2] != w.shape[2]:
        raise ValueError(f"grouped_linear: x must be [E, C, in] and w [E, out, in]; got x "
                         f"{list(x.shape)}, w {list(w.shape)}")
    if main_grad is not None:
        if bucket is not None:
            raise ValueError("grouped_linear: give bucket or main_grad, not both")
        return main_grad.owner.thread(main_grad.bucket, lambda bk: grouped_linear(
            x, w, bucket=bk, offset=main_grad.offset, precision=precision,
            overlap_wgrad=overlap_wgrad))
    level = ops.matmul_precision(precision)
    if bucket is None:
        return _grouped_plain(x, w, level, overlap_wgrad)
    if check_bucket_block("grouped_linear", bucket, offset, w.size,
                          f"{list(w.shape)} blocks"):
        return _grouped_threaded_at(x, w, bucket, offset, level, overlap_wgrad)
    return _grouped_threaded(x, w, bucket, offset, level, overlap_wgrad)


# ------------------------------------------------------------------------------ layer
def _exchange(buf: jax.Array, axis: str | None, ep: int) -> jax.Array:
    """``[E, C, H]`` per source rank -> ``[E/EP, EP*C, H]`` on each expert's rank."""
    if axis is not None:
        buf = jax.lax.all_to_all(buf, axis, 0, 0, tiled=True)  # [EP(src)*E_local, C, H]
    e, c, h = buf.shape
    return buf.reshape(ep, e // ep, c, h).transpose(1, 0, 2, 3).reshape(e // ep, ep * c, h)


def _exchange_back(buf: jax.Array, axis: str | None, ep: int) -> jax.Array:
    """Inverse of :func:`_exchange`."""
    el, ec, h = buf.shape
    buf = buf.reshape(el, ep, ec // ep, h).transpose(1, 0, 2, 3).reshape(el * ep, ec // ep, h)
    return buf if axis is None else jax.lax.all_to_all(buf, axis, 0, 0, tiled=True)


def moe_mlp(params: dict[str, jax.Array], x: jax.Array, cfg: MoEConfig, *,
            expert_axis: str | None = None, sequence_axis: str | None = None,
            buckets: tuple[jax.Array, int, int] | None = None,
            main_grads: tuple[BucketSlot, BucketSlot] | None = None,
            precision: ops.PrecisionLike = None) -> tuple[Any, MoEStats]:
    """The MoE MLP of this rank's tokens.

    Args:
      params: ``router [E, H]`` (replicated), ``fc1 [E/EP, F, H]``, ``fc2 [E/EP, H, F]``
        (this rank's experts: rank ``r`` holds experts ``[r * E/EP, (r + 1) * E/EP)``).
      x: ``[T, H]`` this rank's tokens.
      cfg: the MoE options.
      expert_axis: the ``shard_map`` axis of the ``EP`` expert ranks; ``None``: one rank.
      sequence_axis: under sequence parallelism, the tensor axis the sequence is split
        over (the aux loss counts the whole sequence, see the module docstring).
      buckets: optional ``(bucket, fc1 offset, fc2 offset)``: expert weight gradients go
        into that flat fp32 bucket (threaded, see :func:`grouped_linear`).
      main_grads: instead of ``buckets``, the ``(fc1, fc2)`` weights'
        BucketSlot objects (returns ``y`` only).
    Returns:
      ``(y [T, H], stats)``, or ``((y, bucket), stats)`` with ``buckets``; ``stats``: a
      :class:`MoEStats`.
    """
    e, k = cfg.num_experts, cfg.topk
    ep = 1 if expert_axis is None else jax.lax.axis_size(expert_axis)
    e_local = params["fc1"].shape[0]
    if e_local * ep != e or params["router"].shape != (e, x.shape[-1]):
        raise ValueError(
            f"moe_mlp: num_moe_experts ({e}) must equal expert_model_parallel_size ({ep}) x "
            f"local experts ({e_local}), router [E, H] = {list(params['router'].shape)} for "
            f"x {list(x.shape)}")
    t, h = x.shape
    f = cfg.ffn_hidden_size
    f1 = 2 * f if cfg.swiglu else f
    if params["fc1"].shape != (e_local, f1, h) or params["fc2"].shape != (e_local, h, f):
        raise ValueError(
            f"moe_mlp: expert weights must be fc1 [E/EP, {'2 x ' if cfg.swiglu else ''}"
            f"moe_ffn_hidden_size, H] = {[e_local, f1, h]} and fc2 [E/EP, H, "
            f"moe_ffn_hidden_size] = {[e_local, h, f]}; got fc1 "
            f"{list(params['fc1'].shape)}, fc2 {list(params['fc2'].shape)}")
    cap = cfg.capacity(t)
    probs, experts, gates = route(x, params["router"], k)
    slot, kept = dispatch_slots(experts, e, cap)
    # Dropped choices are scattered to slot C (out of bounds: mode="drop").
    target = jnp.where(kept, slot, cap)
    buf = jnp.zeros((e, cap, h), x.dtype).at[experts, target].set(
        jnp.broadcast_to(x[:, None, :], (t, k, h)), mode="drop")
    local = _exchange(buf, expert_axis, ep)
    opts = dict(precision=precision, overlap_wgrad=cfg.overlap_wgrad)
    owner = None
    if buckets is not None:
        if main_grads is not None:
            raise ValueError("moe_mlp: give buckets or main_grads, not both")
        owner = WgradBuckets((buckets[0],))
        main_grads = (owner.slot(0, buckets[1]), owner.slot(0, buckets[2]))
    mg1, mg2 = main_grads or (None, None)
    hid = grouped_linear(local, params["fc1"], main_grad=mg1, **opts)
    out = grouped_linear(cfg.activation(hid), params["fc2"], main_grad=mg2, **opts)
    back = _exchange_back(out, expert_axis, ep)
    picked = back.at[experts, target].get(mode="fill", fill_value=0)  # [T, k, H]
    weights = jnp.where(kept, gates, 0.0).astype(x.dtype)
    y = jnp.einsum("tkh,tk->th", picked, weights)
    tokens_per_expert = jnp.sum(jax.nn.one_hot(experts, e, dtype=jnp.float32), axis=(0, 1))
    counts, total = tokens_per_expert, t
    if sequence_axis is not None:
        counts = jax.lax.psum(tokens_per_expert, sequence_axis)
        total = t * jax.lax.axis_size(sequence_axis)
    aux = (load_balancing_loss(probs, jax.lax.stop_gradient(counts), k, cfg.aux_loss_coeff,
                               total)
           if cfg.load_balancing_type == "aux_loss" else jnp.zeros((), jnp.float32))
    stats = MoEStats(aux, tokens_per_expert, jnp.sum(~kept) / jnp.float32(kept.size))
    return ((y, owner.buckets[0]) if owner is not None else y), stats
