"""Hugging Face ``config.json`` <-> :class:`~jax_wgrad.GPTConfig` for the Llama, Mistral,
Qwen2, Qwen3, Mixtral and Qwen3-MoE families.

Everything the GPT cannot compute exactly as ``transformers`` does is refused with the HF
field and its value named (RoPE scaling other than Llama 3's, a sliding window on some
layers only, other activations, bias combinations Megatron's flags cannot express, router
jitter, dropout, a Qwen3-MoE layer pattern Megatron's ``moe_layer_freq`` cannot give), so
an imported model is never silently a different function. A sliding window on every layer
is Megatron's ``window_size`` (``(sliding_window - 1, 0)``). Qwen3's per-head q/k RMSNorm
is Megatron's ``qk_layernorm``; Qwen3-MoE's ``norm_topk_prob`` is the negation of
``moe_router_pre_softmax``.
"""

from __future__ import annotations

from typing import Any

from jax_wgrad.models.gpt.config import GPTConfig

__all__ = [
    "FAMILIES",
    "UnsupportedHFConfig",
    "expert_family",
    "config_from_hf",
    "hf_config_from",
    "head_dim",
    "hf_to_megatron_aux_loss_coeff",
    "megatron_to_hf_aux_loss_coeff",
]

FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
"""The ``architectures`` entries read and written, and their ``model_type``."""

_ROPE_DEFAULTS = {
    "llama": 10000.0,
    "mistral": 10000.0,
    "qwen2": 10000.0,
    "mixtral": 1e6,
    "qwen3": 10000.0,
    "qwen3_moe": 10000.0,
}
_QWEN3 = ("qwen3", "qwen3_moe")
"""The families with Megatron's ``qk_layernorm`` (q_norm/k_norm: RMSNorm over each head)."""


class UnsupportedHFConfig(ValueError):
    """A Hugging Face config the GPT cannot represent exactly (the field is named)."""


def _refuse(field: str, value: Any, why: str) -> None:
    raise UnsupportedHFConfig(f"Hugging Face config {field}={value!r}: {why}")


def head_dim(cfg: GPTConfig) -> int:
    """Attention head size: ``kv_channels``, or ``hidden_size / num_attention_heads``."""
    return getattr(cfg, "kv_channels", None) or cfg.hidden_size // cfg.num_attention_heads


def expert_family(cfg: Any) -> str:
    """The Hugging Face family of an MoE config: ``qwen3_moe`` with ``qk_layernorm``,
    else ``mixtral`` (it decides the expert tensors' names too)."""
    return "qwen3_moe" if getattr(cfg, "qk_layernorm", False) else "mixtral"


def _family(hf: dict) -> str:
    arch = hf.get("architectures") or []
    if len(arch) != 1 or arch[0] not in FAMILIES:
        _refuse("architectures", arch, f"only one of {sorted(FAMILIES)} is supported")
    return FAMILIES[arch[0]]


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_fields(hf: dict, family: str) -> dict[str, Any]:
    """``rotary_base`` and the ``rope_scaling*`` fields from transformers 4's flat fields
    (``rope_theta``, ``rope_scaling``) or 5's ``rope_parameters``: plain RoPE, or Llama
    3.x's ``rope_type: "llama3"``; other scalings and partial rotary embeddings are
    refused."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or (params if "rope_type" in params else None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    where = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    fields: dict[str, Any] = {}
    if kind == "llama3":
        missing = [k for k in _LLAMA3_KEYS if k not in scaling]
        if missing:
            _refuse(where, scaling, f"rope_type 'llama3' needs {missing}")
        fields = dict(
            rope_scaling=True,
            rope_scaling_factor=float(scaling["factor"]),
            rope_scaling_low_freq_factor=float(scaling["low_freq_factor"]),
            rope_scaling_high_freq_factor=float(scaling["high_freq_factor"]),
            rope_scaling_original_max_position_embeddings=int(
                scaling["original_max_position_embeddings"]
            ),
        )
    elif kind != "default":
        _refuse(
            f"{where}.rope_type",
            kind,
            "only plain RoPE ('default') and Llama 3.x's 'llama3' scaling are implemented "
            "(linear, yarn, longrope, dynamic, ... are not)",
        )
    for source in (hf, params):
        factor = source.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            _refuse("partial_rotary_factor", factor, "this family rotates the whole head")
    theta = params.get("rope_theta", hf.get("rope_theta", _ROPE_DEFAULTS[family]))
    return {"rotary_base": float(theta), **fields}


def _window_size(hf: dict, family: str, seq_length: int) -> tuple[int, int] | None:
    """Megatron's ``window_size`` ``(W - 1, 0)`` of a sliding window of ``W`` tokens
    (transformers' mask: ``kv_idx > q_idx - sliding_window``, causal) that every layer
    uses: Mistral's and Mixtral's ``sliding_window``; Qwen2's when ``use_sliding_window``,
    on the layers ``layer_types`` names ``"sliding_attention"`` (without ``layer_types``,
    transformers' default: the layers from ``max_window_layers`` on). ``None``: no window.
    A window on some layers only is refused, naming the field and the layer split, unless
    no sequence of ``seq_length`` tokens reaches past it."""
    window = hf.get("sliding_window")
    if family == "qwen3_moe" and not hf.get("use_sliding_window"):
        window = None  # transformers' Qwen3MoeConfig drops it; else every layer slides
    if family in ("qwen2", "qwen3"):
        layers = hf["num_hidden_layers"]
        if not hf.get("use_sliding_window"):
            window = None  # transformers' Qwen2Config drops it
        _check_sliding_window(window)
        types, field = hf.get("layer_types"), "layer_types"
        if types is not None and len(types) != layers:
            _refuse("layer_types", types, f"needs one entry per layer ({layers})")
        if types is None:
            first, field = hf.get("max_window_layers", layers), "max_window_layers"
            types = [
                "sliding_attention" if window is not None and i >= first else "full_attention"
                for i in range(layers)
            ]
        sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
        if not sliding:
            return None
        if window is None:
            _refuse(
                "layer_types",
                types,
                f"sliding_attention on {_spans(sliding)} without a window "
                "(use_sliding_window false or sliding_window null): transformers refuses it",
            )
        if len(sliding) < layers:
            if window < seq_length:
                full = [i for i in range(layers) if i not in sliding]
                _refuse(
                    field,
                    types if field == "layer_types" else first,
                    f"a sliding window of {window} tokens on {_spans(sliding)} and full "
                    f"attention on {_spans(full)}: the window here is the same "
                    f"on every layer (--window-size); it is inactive only for sequences of "
                    f"at most {window} tokens (pass seq_length <= {window}; now "
                    f"{seq_length})",
                )
            return None  # no sequence of this run reaches past it
    elif family not in ("mistral", "mixtral", "qwen3_moe"):
        return None
    _check_sliding_window(window)
    return None if window is None else (window - 1, 0)


def _check_sliding_window(window: Any) -> None:
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        _refuse("sliding_window", window, "a window is a number of tokens >= 1 (or null)")


def _spans(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"layers 0-2, 5"``, ``[3]`` -> ``"layer 3"``."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    spans = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
    return f"layer{'s' if len(layers) > 1 else ''} {spans}"


def _check(hf: dict, family: str) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        _refuse("hidden_act", act, "SwiGLU here is SiLU-gated (Megatron's --swiglu)")
    if family == "llama" and hf.get("attention_bias", False) != hf.get("mlp_bias", False):
        _refuse(
            "attention_bias/mlp_bias",
            (hf.get("attention_bias"), hf.get("mlp_bias")),
            "Megatron's --disable-bias-linear switches every linear's bias together "
            "(--add-qkv-bias adds q/k/v biases only, not o_proj's)",
        )
    if family in _QWEN3 and hf.get("attention_bias", False):
        _refuse(
            "attention_bias",
            hf["attention_bias"],
            "Qwen3's attention_bias adds q/k/v and o_proj biases without MLP biases: "
            "Megatron's --add-qkv-bias adds q/k/v biases only, --disable-bias-linear off "
            "adds the MLPs' too",
        )
    for name in ("attention_dropout", "router_jitter_noise"):
        if hf.get(name, 0.0):
            _refuse(name, hf[name], "not implemented (must be 0)")


def hf_to_megatron_aux_loss_coeff(router_aux_loss_coef: float, topk: int, moe_layers: int) -> float:
    """Megatron's ``moe_aux_loss_coeff`` giving the load-balancing loss of Mixtral's
    ``router_aux_loss_coef`` (exactly when every MoE layer routes alike; the two losses
    are normalised differently, so the coefficients differ):

    - transformers (``load_balancing_loss_func``): the router logits of all ``L`` MoE
      layers are concatenated into ``L T`` rows; ``f_e`` = the one-hot top-k mask's mean
      over the rows, summed over the ``k`` choices (so ``sum_e f_e = k``), ``P_e`` = the
      mean full-softmax probability of expert ``e``;
      ``loss = router_aux_loss_coef * E * sum_e f_e P_e``: one term for the whole model.
    - Megatron (``switch_load_balancing_loss_func``, :func:`jax_wgrad.functional.
      load_balancing_loss`): per MoE layer ``coeff * E / (k T^2) * sum_e (sum_t p[t, e])
      * count_e`` = ``coeff * (E / k) * sum_e f_e P_e`` with that layer's ``f``, ``P``;
      added over the ``L`` layers.

    With the same statistics in every layer Megatron's is ``L / k`` times transformers'
    for equal coefficients, hence ``coeff = router_aux_loss_coef * k / L``."""
    return float(router_aux_loss_coef) * topk / moe_layers


def megatron_to_hf_aux_loss_coeff(moe_aux_loss_coeff: float, topk: int, moe_layers: int) -> float:
    """The inverse of :func:`hf_to_megatron_aux_loss_coeff`."""
    return float(moe_aux_loss_coeff) * moe_layers / topk


def config_from_hf(hf_config: dict, **overrides) -> GPTConfig:
    """The :class:`GPTConfig` of a Hugging Face ``config.json`` (a dict); a required key
    that is absent is a ``ValueError`` naming it (see :func:`_config_from_hf`)."""
    try:
        return _config_from_hf(hf_config, **overrides)
    except KeyError as exc:
        raise ValueError(
            f"config.json has no {exc.args[0]!r} (a required field of this model family)"
        ) from None


def _config_from_hf(hf_config: dict, **overrides) -> GPTConfig:
    """The :class:`GPTConfig` of a Hugging Face ``config.json`` (a dict).

    ``overrides`` are GPTConfig fields set on top (e.g. ``seq_length=4096`` -- the default
    is ``max_position_embeddings`` -- or ``compute_dtype="bfloat16"``); the checks see
    the final values.

    Raises:
      UnsupportedHFConfig (a ValueError): a family or option the GPT cannot represent,
        naming the HF field and its value.
    """
    hf = hf_config
    family = _family(hf)
    nh, hidden = hf["num_attention_heads"], hf["hidden_size"]
    nkv = hf.get("num_key_value_heads") or nh
    # transformers' Qwen3Config defaults head_dim to 128; the others to hidden / heads
    d = hf.get("head_dim", 128 if family == "qwen3" else None) or hidden // nh
    fields: dict[str, Any] = dict(
        vocab_size=hf["vocab_size"],
        num_layers=hf["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=nh,
        seq_length=hf.get("max_position_embeddings", 2048),
        ffn_hidden_size=hf["intermediate_size"],
        normalization="RMSNorm",
        position_embedding_type="rope",
        **_rope_fields(hf, family),
        swiglu=True,
        group_query_attention=nkv != nh,
        num_query_groups=nkv if nkv != nh else None,
        kv_channels=d if d * nh != hidden else None,
        add_bias_linear=bool(hf.get("attention_bias", False)) if family == "llama" else False,
        add_qkv_bias=family == "qwen2",
        qk_layernorm=family in _QWEN3,
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
    )
    if family == "mixtral":
        fields.update(
            num_moe_experts=hf["num_local_experts"],
            moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=hf["intermediate_size"],
            moe_layer_freq=1,
            moe_aux_loss_coeff=hf_to_megatron_aux_loss_coeff(
                hf.get("router_aux_loss_coef", 0.0),
                hf["num_experts_per_tok"],
                hf["num_hidden_layers"],
            )
            if hf.get("output_router_logits")
            else 0.0,
        )
    if family == "qwen3_moe":
        fields.update(_qwen3_moe_fields(hf))
    _check(hf, family)
    seq_length = overrides.get("seq_length", fields["seq_length"])
    fields["window_size"] = _window_size(hf, family, seq_length)
    fields.update(overrides)
    return GPTConfig(**fields)


def _moe_layer_freq(hf: dict) -> int:
    """Megatron's ``moe_layer_freq`` N of Qwen3-MoE's layer pattern (transformers: layer
    ``i`` is MoE when ``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in
    ``mlp_only_layers``; Megatron: when ``i % N == 0``); another pattern is refused."""
    layers = hf["num_hidden_layers"]
    step = hf.get("decoder_sparse_step", 1)
    only = hf.get("mlp_only_layers") or []
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        _refuse("decoder_sparse_step", step, "a number of layers >= 1")
    moe = [i for i in range(layers) if i not in only and (i + 1) % step == 0]
    freq = moe[1] - moe[0] if len(moe) > 1 else layers
    if not moe or moe != list(range(0, layers, freq)):
        _refuse(
            "decoder_sparse_step/mlp_only_layers",
            (step, only),
            f"MoE on {_spans(moe) if moe else 'no layer'} of {layers}: Megatron's "
            "--moe-layer-freq N puts experts on layers 0, N, 2N, ... (here only that "
            "pattern is implemented, not Megatron's list form)",
        )
    return freq


def _qwen3_moe_fields(hf: dict) -> dict[str, Any]:
    """GPTConfig's MoE fields of a Qwen3-MoE config (no shared experts)."""
    experts = hf.get("num_local_experts", hf.get("num_experts"))  # transformers 5 / 4 name
    if not experts:
        _refuse("num_experts", experts, "a Qwen3-MoE model needs experts (else it is Qwen3)")
    freq = _moe_layer_freq(hf)
    topk = hf["num_experts_per_tok"]
    return dict(
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_layer_freq=freq,
        # transformers' Qwen3MoeTopKRouter: softmax over all experts, top-k, renormalised
        # only with norm_topk_prob (its default: False)
        moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
        moe_aux_loss_coeff=hf_to_megatron_aux_loss_coeff(
            hf.get("router_aux_loss_coef", 0.001),
            topk,
            len(range(0, hf["num_hidden_layers"], freq)),
        )
        if hf.get("output_router_logits")
        else 0.0,
    )


def _export_refusals(cfg: GPTConfig) -> list[tuple[str, Any, str]]:
    checks = [
        ("normalization", "RMSNorm"),
        ("position_embedding_type", "rope"),
        ("swiglu", True),
        ("rotary_percent", 1.0),
    ]
    out = [
        (f, getattr(cfg, f, None), f"the Llama family needs {want!r}")
        for f, want in checks
        if getattr(cfg, f, None) != want
    ]
    qwen3 = cfg.qk_layernorm
    if qwen3 and (cfg.add_bias_linear or cfg.add_qkv_bias):
        out.append(
            (
                "add_bias_linear/add_qkv_bias",
                (cfg.add_bias_linear, cfg.add_qkv_bias),
                "qk_layernorm makes it Qwen3, whose attention_bias adds q/k/v and o_proj "
                "biases and no MLP biases",
            )
        )
    if cfg.num_moe_experts is not None:
        if not qwen3 and cfg.moe_layer_freq != 1:
            out.append(("moe_layer_freq", cfg.moe_layer_freq, "Mixtral has experts in every layer"))
        if not qwen3 and cfg.moe_router_pre_softmax:
            out.append(
                (
                    "moe_router_pre_softmax",
                    True,
                    "Mixtral renormalises its top-k gates (Qwen3-MoE's norm_topk_prob false "
                    "needs qk_layernorm)",
                )
            )
        if not qwen3 and (cfg.add_bias_linear or cfg.add_qkv_bias):
            out.append(
                (
                    "add_bias_linear/add_qkv_bias",
                    (cfg.add_bias_linear, cfg.add_qkv_bias),
                    "Mixtral has no linear biases",
                )
            )
        for field in ("moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size"):
            if getattr(cfg, field) is not None:
                out.append(
                    (field, getattr(cfg, field), "Mixtral and Qwen3-MoE have no such option")
                )
    return out


def hf_config_from(cfg: GPTConfig, *, family: str | None = None, dtype: str = "float32") -> dict:
    """A ``config.json`` (dict) ``transformers`` loads as the same model: with
    ``qk_layernorm`` Qwen3-MoE (experts) or Qwen3; else Mixtral with experts, Qwen2 with
    q/k/v biases only, else Llama, or Mistral with a sliding window (``family="mistral"``
    also for a dense model without biases). ``window_size (left, 0)`` is written as
    ``sliding_window = left + 1`` (Qwen2's and Qwen3's on every layer:
    ``use_sliding_window``, ``max_window_layers`` 0). Qwen3-MoE's dense layers of
    ``moe_layer_freq`` are its ``mlp_only_layers``.

    Raises:
      ValueError: ``cfg`` has an option no such family has (the field named).
    """
    bad = _export_refusals(cfg)
    if bad:
        raise ValueError(
            "cannot export to Hugging Face: " + "; ".join(f"{f}={v!r} ({why})" for f, v, why in bad)
        )
    auto = (
        expert_family(cfg)
        if cfg.num_moe_experts is not None
        else "qwen3"
        if cfg.qk_layernorm
        else "qwen2"
        if cfg.add_qkv_bias and not cfg.add_bias_linear
        else "llama"
    )
    window = cfg.attention_window
    if auto == "llama" and window is not None:  # Llama has no sliding window, Mistral has
        if cfg.add_bias_linear or family == "llama":
            raise ValueError(
                f"cannot export {'as llama' if family == 'llama' else 'to Hugging Face'}: "
                f"window_size={cfg.window_size!r} (Llama has no sliding window; Mistral "
                "has, without linear biases)"
            )
        auto = "mistral"
    family = family or auto
    if family != auto and not (family == "mistral" and auto == "llama" and not cfg.add_bias_linear):
        raise ValueError(f"cannot export as {family!r}: this model's options make it {auto!r}")
    nkv = cfg.num_query_groups or cfg.num_attention_heads
    out = {
        "architectures": [next(a for a, f in FAMILIES.items() if f == family)],
        "model_type": family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.moe_ffn_hidden_size
        if family == "mixtral"
        else cfg.ffn_hidden_size,  # Qwen3-MoE: its dense layers' (mlp_only_layers)
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": nkv,
        "head_dim": head_dim(cfg),
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_length,
        "initializer_range": cfg.init_method_std,
        "rms_norm_eps": cfg.layernorm_epsilon,
        "rope_theta": cfg.rotary_base,
        "rope_scaling": None
        if not cfg.rope_scaling
        else {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_scaling_low_freq_factor,
            "high_freq_factor": cfg.rope_scaling_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_scaling_original_max_position_embeddings,
        },
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if family == "llama":
        out.update(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear)
    if family in ("mistral", "mixtral"):
        out["sliding_window"] = window
    if family in _QWEN3:
        out["attention_bias"] = False
    if family == "qwen3_moe":  # every layer slides with use_sliding_window
        out.update(use_sliding_window=window is not None, sliding_window=window)
    if family in ("qwen2", "qwen3"):  # every layer from max_window_layers on slides
        out.update(
            use_sliding_window=window is not None,
            sliding_window=window,
            max_window_layers=cfg.num_layers if window is None else 0,
        )
    if family == "mixtral":
        out.update(
            num_local_experts=cfg.num_moe_experts,
            num_experts_per_tok=cfg.moe_router_topk,
            router_jitter_noise=0.0,
            router_aux_loss_coef=megatron_to_hf_aux_loss_coeff(
                cfg.moe_aux_loss_coeff, cfg.moe_router_topk, sum(cfg.moe_layer_pattern)
            ),
            output_router_logits=cfg.moe_aux_loss_coeff > 0,
        )
    if family == "qwen3_moe":
        pattern = cfg.moe_layer_pattern
        out.update(
            num_experts=cfg.num_moe_experts,
            num_experts_per_tok=cfg.moe_router_topk,
            moe_intermediate_size=cfg.moe_ffn_hidden_size,
            norm_topk_prob=not cfg.moe_router_pre_softmax,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
            router_aux_loss_coef=megatron_to_hf_aux_loss_coeff(
                cfg.moe_aux_loss_coeff, cfg.moe_router_topk, sum(pattern)
            ),
            output_router_logits=cfg.moe_aux_loss_coeff > 0,
        )
    return out
