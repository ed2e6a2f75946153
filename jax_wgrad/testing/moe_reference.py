"""A dense single-device reference of the MoE MLP, independent of the dispatcher.

Every token goes through each of its top-k experts (no capacity, no all-to-all): the
expert-parallel layer :func:`jax_wgrad.functional.moe_mlp` must give the same output,
auxiliary loss and gradients whenever no token is dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_wgrad.functional.moe import MoEConfig

__all__ = ["reference_moe_mlp"]


def reference_moe_mlp(
    params: dict[str, jax.Array], x: jax.Array, cfg: MoEConfig
) -> tuple[jax.Array, jax.Array]:
    """``(y [T, H], aux_loss)`` of tokens ``x [T, H]`` with ALL experts' weights
    (``router [E, H]``, ``fc1 [E, F, H]`` (``[E, 2, F, H]`` with SwiGLU), ``fc2 [E, H, F]``),
    in fp32 ``jnp``. The router options (``pre_softmax``, ``topk_scaling_factor``) are
    written here from Megatron's definition, not taken from
    :func:`jax_wgrad.functional.moe.route`."""
    hp = jax.lax.Precision.HIGHEST
    logits = jnp.dot(x.astype(jnp.float32), params["router"].T.astype(jnp.float32), precision=hp)
    experts = jnp.argsort(-logits, axis=-1, stable=True)[:, : cfg.topk]  # ties: lower index
    chosen_logits = jnp.take_along_axis(logits, experts, axis=1)
    # jax.nn.softmax for its gradient: a hand-written exp / sum differentiates through the
    # quotient and loses the router gradient of saturated routing to fp32 cancellation.
    if cfg.pre_softmax:  # the full softmax's values at the chosen experts, as they are
        gates = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), experts, axis=1)
    else:  # renormalised over the chosen experts
        gates = jax.nn.softmax(chosen_logits, axis=-1)
    if cfg.topk_scaling_factor is not None:
        gates = gates * cfg.topk_scaling_factor
    fc1 = params["fc1"].reshape(cfg.num_experts, -1, x.shape[-1])  # SwiGLU: gate, up rows
    hidden = cfg.activation(jnp.einsum("th,efh->tef", x, fc1, precision=hp))
    every = jnp.einsum("tef,ehf->teh", hidden, params["fc2"], precision=hp)  # [T, E, H]
    chosen = jnp.take_along_axis(every, experts[:, :, None], axis=1)  # [T, k, H]
    y = jnp.sum(chosen * gates[:, :, None], axis=1)
    if cfg.load_balancing_type == "none":
        return y, jnp.zeros((), jnp.float32)
    t, e = logits.shape
    counts = jnp.zeros(e).at[experts.reshape(-1)].add(1.0)
    probs = jax.nn.softmax(logits, axis=-1)
    aux = cfg.aux_loss_coeff * e / (cfg.topk * t * t) * jnp.sum(probs.sum(0) * counts)
    return y, aux
