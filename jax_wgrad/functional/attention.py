"""The causal attention core of the GPT layers (and of the plain-JAX benchmark model)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

__all__ = [
    "CORE_ATTENTION_SCOPE",
    "RopeScaling",
    "causal_attention",
    "rope_frequencies",
    "rotary_embedding",
]

CORE_ATTENTION_SCOPE = "core_attention"
"""The named scope of :func:`causal_attention` (``op_name`` metadata: Megatron's "core
attention", scores, softmax and the weighted values, without the projections)."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x's RoPE frequency scaling (Megatron's ``--use-rope-scaling``, Hugging
    Face's ``rope_type: "llama3"``): wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are stretched by ``factor``,
    those shorter than ``original_max_position_embeddings / high_freq_factor`` kept, and
    those between interpolated smoothly. The defaults are Llama 3.1's (and Megatron's)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if not (self.factor > 0 and 0 < self.low_freq_factor < self.high_freq_factor):
            raise ValueError(
                f"RoPE scaling needs factor ({self.factor}) > 0 and 0 < low_freq_factor "
                f"({self.low_freq_factor}) < high_freq_factor ({self.high_freq_factor})"
            )
        if not self.original_max_position_embeddings > 0:
            raise ValueError(
                "RoPE scaling's original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings}"
            )


def rope_frequencies(rot: int, base: float, scaling: RopeScaling | None = None) -> jax.Array:
    """``[rot / 2]`` float32: the inverse frequencies ``base^(-2i / rot)`` of RoPE over
    ``rot`` dims, scaled by ``scaling`` (Llama 3.x, :class:`RopeScaling`) as Hugging Face's
    ``_compute_llama3_parameters`` and Megatron's ``_apply_scaling`` do, in float32."""
    inv_freq = 1.0 / (base ** (jnp.arange(0, rot, 2, dtype=jnp.float32) / rot))
    if scaling is None:
        return inv_freq
    old = float(scaling.original_max_position_embeddings)
    lo, hi, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old / lo, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return jnp.where(medium, smoothed, scaled)


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    implementation: str = "xla",
    window: int | None = None,
) -> jax.Array:
    """``q``: ``[b, s, heads, head_dim]``, ``k, v``: ``[b, s, groups, head_dim]`` ->
    ``[b, s, heads * head_dim]``.

    Grouped-query attention when ``groups < heads`` (``heads % groups == 0``): query head
    ``h`` attends with key/value head ``h // (heads / groups)`` (Megatron's and Hugging
    Face's ``repeat_kv`` order). ``implementation``: ``"xla"`` (below: fp32 scores and
    softmax, output in ``q.dtype``) or ``"cudnn"`` (:func:`jax.nn.dot_product_attention`'s
    cuDNN flash attention, 16-bit inputs on a CUDA GPU).

    ``window``: sliding-window attention over ``window`` tokens (an int >= 1): query ``i``
    attends to keys ``j`` with ``i - window < j <= i``, itself and the ``window - 1``
    tokens before it (Hugging Face's ``sliding_window``; Megatron's ``--window-size
    window-1,0``). ``None``, or a window of ``s`` tokens or more: every earlier token.
    """
    b, s, h, d = q.shape
    g = k.shape[2]
    if h % g or k.shape != v.shape or k.shape[:2] + k.shape[3:] != (b, s, d):
        raise ValueError(
            f"causal_attention: q {q.shape} needs k, v [b, s, groups, d] with "
            f"heads divisible by groups; got k {k.shape}, v {v.shape}"
        )
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"causal_attention: window must be an int >= 1 or None, got {window!r}")
    band = window if window is not None and window < s else None  # else no key is cut off
    with jax.named_scope(CORE_ATTENTION_SCOPE):
        return _attend(q, k, v, implementation, band).reshape(b, s, h * d)


def _attend(
    q: jax.Array, k: jax.Array, v: jax.Array, implementation: str, band: int | None
) -> jax.Array:
    """:func:`causal_attention`'s core, ``[b, s, heads, d]`` or ``[b, s, groups, heads /
    groups, d]`` (either reshapes to the result)."""
    b, s, h, d = q.shape
    g = k.shape[2]
    if implementation == "cudnn":
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            # (left, right) tokens beside the query: cuDNN's window (pos - band, pos]
            local_window_size=None if band is None else (band - 1, 0),
            implementation="cudnn",
        )
    qg = q.reshape(b, s, g, h // g, d)
    scores = jnp.einsum("bqgmd,bkgd->bgmqk", qg, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(d)
    scores = jnp.where(_causal_mask(s, band), scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bgmqk,bkgd->bqgmd", probs, v)


def _causal_mask(s: int, window: int | None) -> jax.Array:
    """bool ``[s, s]``: query ``i`` (row) may attend to key ``j`` (column): ``j <= i``, and
    ``j > i - window`` with a window."""
    if window is None:
        return jnp.tril(jnp.ones((s, s), bool))
    return jnp.tril(jnp.ones((s, s), bool)) & jnp.triu(jnp.ones((s, s), bool), 1 - window)


def rotary_embedding(
    x: jax.Array,
    *,
    base: float,
    percent: float = 1.0,
    scaling: RopeScaling | None = None,
    positions: jax.Array | None = None,
) -> jax.Array:
    """RoPE of ``x`` ``[b, s, heads, head_dim]`` at ``positions`` (int ``[s]``; default
    ``0 .. s - 1``, the whole sequence: apply it after the sequence-parallel all-gather;
    a context rank's are :func:`~jax_wgrad.functional.context_positions`), on the first
    ``percent * head_dim`` dims in the non-interleaved ``rotate_half`` convention
    (Megatron's default, Hugging Face Llama's), its frequencies scaled by ``scaling``
    (Llama 3.x, :class:`RopeScaling`): angles in fp32, output in ``x.dtype``."""
    s, d = x.shape[1], x.shape[-1]
    rot = int(d * percent)
    if rot % 2 or not 0 < rot <= d:
        raise ValueError(
            f"rotary_embedding: rotary dims {rot} (head_dim {d} x rotary_percent "
            f"{percent}) must be even and positive"
        )
    inv_freq = rope_frequencies(rot, base, scaling)
    pos = jnp.arange(s) if positions is None else positions
    angles = pos.astype(jnp.float32)[:, None] * inv_freq[None]  # [s, rot/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[None, :, None].astype(x.dtype)
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[None, :, None].astype(x.dtype)
    xr, rest = x[..., :rot], x[..., rot:]
    half = jnp.concatenate([-xr[..., rot // 2 :], xr[..., : rot // 2]], -1)
    return jnp.concatenate([xr * cos + half * sin, rest], -1)
