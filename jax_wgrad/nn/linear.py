"""Flax NNX modules built on the fused-accumulation linear.

A module created with ``gradient_accumulation_fusion=True`` owns a :class:`MainGrad`
variable (fp32 ``[out, in]``, Megatron's ``weight.main_grad``) next to its ``weight``.
Like every layer of the library it hands its weight *variable* to
:func:`~jax_wgrad.functional.linear`, so its weight gradient goes where the variable's
route sends it (:mod:`jax_wgrad.functional.routes`). On one device
:func:`jax_wgrad.training.accumulate_gradients` routes each such weight to its
``MainGrad`` over a scan of microbatches (the fused GEMM adds ``dy^T x`` to it in place);
differentiated otherwise the layer is a plain linear. By hand, the same as one microbatch
of ``accumulate_gradients``::

    graphdef, params, main_grads, rest = nnx.split(model, nnx.Param, MainGrad, ...)
    def loss(params, buckets):
        routes = WgradRoutes(buckets)
        flat = dict(nnx.to_flat_state(params))
        flat[("fc1", "weight")] = routes.to_bucket(flat[("fc1", "weight")], 0, offset=0)
        model = nnx.merge(graphdef, nnx.from_flat_state(flat), rest)
        return loss_fn(model, batch), routes.close()
    buckets = (main_grads["fc1"]["main_grad"][...].reshape(-1),)
    (value, _), vjp = jax.vjp(loss, params, buckets)
    g_params, buckets = vjp((1.0, buckets))      # buckets[0]: main_grad + dW, flat
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_wgrad.functional.linear import linear
from jax_wgrad.nn.facts import param_facts
from jax_wgrad.ops import PrecisionLike, require_fusion

__all__ = ["Linear", "MainGrad"]

# flax.nnx.Linear's default (a module-level initializer, not a call in the signature).
default_kernel_init = nnx.initializers.lecun_normal()


class MainGrad(nnx.Variable):
    """fp32 weight-gradient accumulator of a module (Megatron's ``weight.main_grad``)."""


class Linear(nnx.Module):
    """``y = x @ weight.T + bias`` with an optional fused weight-gradient accumulator.

    ``precision`` is that of its GEMMs, with ``jnp.dot``'s meaning and default.

    Attributes:
      weight: ``[out_features, in_features]`` (Megatron/PyTorch layout).
      bias: ``[out_features]`` or None.
      main_grad: ``[out_features, in_features]`` fp32 :class:`MainGrad` when
        ``gradient_accumulation_fusion`` is on (the accumulator
        :func:`~jax_wgrad.training.accumulate_gradients` routes the weight's gradient
        to), else None.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        gradient_accumulation_fusion: bool = False,
        param_dtype: jnp.dtype = jnp.float32,
        kernel_init: nnx.Initializer = default_kernel_init,
        precision: PrecisionLike = None,
        rngs: nnx.Rngs,
    ):
        if in_features < 1 or out_features < 1:
            raise ValueError(
                f"Linear: in_features ({in_features}) and out_features ({out_features}) "
                "must be >= 1"
            )
        if gradient_accumulation_fusion:
            require_fusion(who="Linear")
        self.in_features = in_features
        self.out_features = out_features
        self.precision = precision
        # lecun_normal expects [fan_in, fan_out]; store the transpose as [out, in].
        w = kernel_init(rngs.params(), (in_features, out_features), param_dtype)
        self.weight = nnx.Param(w.T, **param_facts(None, weight_decay=True, fused_wgrad=True))
        self.bias = (
            nnx.Param(jnp.zeros((out_features,), param_dtype), **param_facts(None))
            if use_bias
            else None
        )
        self.main_grad = (
            MainGrad(jnp.zeros((out_features, in_features), jnp.float32))
            if gradient_accumulation_fusion
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x``: ``[..., in_features]`` -> ``[..., out_features]`` in ``x.dtype``."""
        with jax.named_scope("linear"):
            return linear(x, self.weight, self.bias, precision=self.precision)
