"""Hugging Face ``config.json`` <-> :class:`~jax_wgrad.GPTConfig` for the Llama, Mistral,
Qwen2, Qwen3, Mixtral and Qwen3-MoE families.

A key that ``config.json`` leaves out means what it means to ``transformers``: the default of
that family's config class (:data:`HF_DEFAULTS`, one table per family, transformers 5.23/5.24,
the version ``tools/make_hf_fixtures.py`` made the fixtures with), and the keys defaulted are
logged (one warning line naming each key and the value used). A value of the wrong type is
refused naming the key and what it must be.

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

import logging
from typing import Any

from jax_wgrad.models.gpt.config import GPTConfig

__all__ = [
    "FAMILIES",
    "HF_CONFIG_CLASSES",
    "HF_DEFAULTS",
    "UnsupportedHFConfig",
    "expert_family",
    "config_from_hf",
    "hf_config_from",
    "hf_defaults_note",
    "hf_defaults_used",
    "head_dim",
    "hf_to_megatron_aux_loss_coeff",
    "megatron_to_hf_aux_loss_coeff",
]

logger = logging.getLogger(__name__)

FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
"""The ``architectures`` entries read and written, and their ``model_type``."""

HF_CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "mixtral": "MixtralConfig",
    "qwen3": "Qwen3Config",
    "qwen3_moe": "Qwen3MoeConfig",
}
"""Per family: the ``transformers`` config class whose defaults :data:`HF_DEFAULTS` holds."""

HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {  # LlamaConfig (models/llama/configuration_llama.py)
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,  # __post_init__: num_attention_heads
        "head_dim": None,  # __post_init__: hidden_size // num_attention_heads
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,  # rope_parameters None: default_theta
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
    },
    "mistral": {  # MistralConfig (models/mistral/configuration_mistral.py)
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": None,
        "hidden_act": "silu",
        "max_position_embeddings": 4096 * 32,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "attention_dropout": 0.0,
    },
    "qwen2": {  # Qwen2Config (models/qwen2/configuration_qwen2.py); no head_dim field
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "use_sliding_window": False,
        "sliding_window": 4096,  # __post_init__: None unless use_sliding_window
        "max_window_layers": 28,
        "layer_types": None,  # __post_init__: sliding from max_window_layers on
        "attention_dropout": 0.0,
    },
    "mixtral": {  # MixtralConfig (models/mixtral/configuration_mixtral.py)
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": None,
        "hidden_act": "silu",
        "max_position_embeddings": 4096 * 32,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_theta": 1e6,  # MixtralConfig.default_theta
        "sliding_window": None,
        "attention_dropout": 0.0,
        "num_experts_per_tok": 2,
        "num_local_experts": 8,  # also read as num_experts (attribute_map)
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
    },
    "qwen3": {  # Qwen3Config (models/qwen3/configuration_qwen3.py)
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "layer_types": None,
        "attention_dropout": 0.0,
    },
    "qwen3_moe": {  # Qwen3MoeConfig (models/qwen3_moe/configuration_qwen3_moe.py)
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,  # __post_init__: None unless use_sliding_window
        "attention_dropout": 0.0,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "num_local_experts": 128,  # the class's num_experts (attribute_map), saved so
        "norm_topk_prob": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "mlp_only_layers": None,  # __post_init__: []
    },
}
"""Per family, every ``config.json`` key the import reads and the default of the family's
``transformers`` config class (:data:`HF_CONFIG_CLASSES`; transformers 5.23 and 5.24 agree)
used when the key is absent. ``rope_theta`` is the class's ``default_theta``, used when
neither ``rope_parameters`` nor the flat ``rope_theta`` gives one. Qwen2 and Qwen3-MoE have
no ``head_dim`` field: their attention reads ``getattr(config, "head_dim", hidden_size //
num_attention_heads)``, and so does the import (not a default, not logged)."""

_KINDS = {
    "int": ((int,), "an integer"),
    "int?": ((int, type(None)), "an integer or null"),
    "number": ((int, float), "a number"),
    "bool": ((bool,), "true or false"),
    "str": ((str,), "a string"),
    "list?": ((list, type(None)), "a list or null"),
}
_KIND_OF = {
    **dict.fromkeys(
        (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
            "max_window_layers",
            "decoder_sparse_step",
            "moe_intermediate_size",
            "num_experts_per_tok",
            "num_local_experts",
        ),
        "int",
    ),
    **dict.fromkeys(("num_key_value_heads", "head_dim", "sliding_window"), "int?"),
    **dict.fromkeys(
        (
            "initializer_range",
            "rms_norm_eps",
            "rope_theta",
            "attention_dropout",
            "router_aux_loss_coef",
            "router_jitter_noise",
        ),
        "number",
    ),
    **dict.fromkeys(
        (
            "tie_word_embeddings",
            "attention_bias",
            "mlp_bias",
            "use_sliding_window",
            "output_router_logits",
            "norm_topk_prob",
        ),
        "bool",
    ),
    "hidden_act": "str",
    **dict.fromkeys(("layer_types", "mlp_only_layers"), "list?"),
}
"""What each key's value must be (the type annotation of the transformers field)."""

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
    """The family of ``architectures`` (one entry), or of ``model_type`` without it (what
    ``AutoModelForCausalLM`` goes by)."""
    arch = hf.get("architectures")
    if not arch and hf.get("model_type") in HF_DEFAULTS:
        return hf["model_type"]
    if not isinstance(arch, list) or len(arch) != 1 or arch[0] not in FAMILIES:
        _refuse(
            "architectures",
            arch,
            f"one of {sorted(FAMILIES)} (or, without architectures, model_type one of "
            f"{sorted(HF_DEFAULTS)})",
        )
    return FAMILIES[arch[0]]


def _rope_dict(hf: dict) -> tuple[str, dict]:
    """The RoPE dict transformers uses and its key: ``rope_scaling`` (transformers 4's,
    which wins) or ``rope_parameters`` (5's); ``{}`` without either."""
    where = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(where) or {}
    if not isinstance(rope, dict):
        _refuse(where, rope, "must be an object (or null)")
    return where, rope


def _given_rope_theta(hf: dict) -> Any:
    """``rope_theta`` as transformers finds it: in the RoPE dict, else the flat
    ``rope_theta``; ``None``: not given."""
    theta = _rope_dict(hf)[1].get("rope_theta")
    return hf.get("rope_theta") if theta is None else theta


def hf_defaults_used(hf_config: dict) -> dict[str, Any]:
    """The keys of :data:`HF_DEFAULTS` that ``hf_config`` leaves out (absent; a ``null`` is
    a value), with the default each gets, in the table's order; and Llama 3's
    ``original_max_position_embeddings``, which transformers takes from
    ``max_position_embeddings`` when the RoPE dict leaves it out."""
    family = _family(hf_config)
    table = HF_DEFAULTS[family]
    given = set(hf_config) - {"rope_theta"}
    if "num_experts" in given:  # attribute_map: the same value as num_local_experts
        given.add("num_local_experts")
    if _given_rope_theta(hf_config) is not None:
        given.add("rope_theta")
    used = {k: v for k, v in table.items() if k not in given}
    where, rope = _rope_dict(hf_config)
    if _rope_kind(rope) == "llama3" and "original_max_position_embeddings" not in rope:
        used[f"{where}.original_max_position_embeddings"] = hf_config.get(
            "max_position_embeddings", table["max_position_embeddings"]
        )
    return used


def _with_defaults(hf: dict, family: str) -> dict[str, Any]:
    """Every key of the family's :data:`HF_DEFAULTS`: ``hf``'s value, else the default;
    each value checked against the transformers field's type (refused naming the key)."""
    table = HF_DEFAULTS[family]
    out = {k: hf.get(k, default) for k, default in table.items()}
    if "num_local_experts" in table and "num_local_experts" not in hf and "num_experts" in hf:
        out["num_local_experts"] = hf["num_experts"]
    theta = _given_rope_theta(hf)
    out["rope_theta"] = table["rope_theta"] if theta is None else theta
    if "head_dim" not in table:  # not a field: the attention's getattr(config, "head_dim")
        out["head_dim"] = hf.get("head_dim")
    for key, value in out.items():
        types, what = _KINDS[_KIND_OF[key]]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            _refuse(key, value, f"must be {what}")
    return out


def _rope_kind(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_fields(c: dict, hf: dict) -> dict[str, Any]:
    """``rotary_base`` and the ``rope_scaling*`` fields from transformers 4's flat fields
    (``rope_theta``, ``rope_scaling``) or 5's ``rope_parameters``: plain RoPE, or Llama
    3.x's ``rope_type: "llama3"`` (``original_max_position_embeddings`` defaults to
    ``max_position_embeddings``, as in transformers); other scalings and partial rotary
    embeddings are refused. ``c``: :func:`_with_defaults` of ``hf``."""
    where, rope = _rope_dict(hf)
    kind = _rope_kind(rope)
    fields: dict[str, Any] = {}
    if kind == "llama3":
        rope = {"original_max_position_embeddings": c["max_position_embeddings"], **rope}
        missing = [k for k in _LLAMA3_KEYS if k not in rope]
        if missing:
            _refuse(where, rope, f"rope_type 'llama3' needs {missing}")
        fields = dict(
            rope_scaling=True,
            rope_scaling_factor=float(rope["factor"]),
            rope_scaling_low_freq_factor=float(rope["low_freq_factor"]),
            rope_scaling_high_freq_factor=float(rope["high_freq_factor"]),
            rope_scaling_original_max_position_embeddings=int(
                rope["original_max_position_embeddings"]
            ),
        )
    elif kind != "default":
        _refuse(
            f"{where}.rope_type",
            kind,
            "only plain RoPE ('default') and Llama 3.x's 'llama3' scaling are implemented "
            "(linear, yarn, longrope, dynamic, ... are not)",
        )
    for source in (hf, rope):
        factor = source.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            _refuse("partial_rotary_factor", factor, "this family rotates the whole head")
    return {"rotary_base": float(c["rope_theta"]), **fields}


def _window_size(c: dict, family: str, seq_length: int) -> tuple[int, int] | None:
    """Megatron's ``window_size`` ``(W - 1, 0)`` of a sliding window of ``W`` tokens
    (transformers' mask: ``kv_idx > q_idx - sliding_window``, causal) that every layer
    uses: Mistral's and Mixtral's ``sliding_window``; Qwen3-MoE's when
    ``use_sliding_window``; Qwen2's and Qwen3's when ``use_sliding_window``, on the layers
    ``layer_types`` names ``"sliding_attention"`` (without ``layer_types``, transformers'
    default: the layers from ``max_window_layers`` on). ``None``: no window. A window on
    some layers only is refused, naming the field and the layer split, unless no sequence
    of ``seq_length`` tokens reaches past it. ``c``: :func:`_with_defaults`'s."""
    if family == "llama":
        return None
    window = c["sliding_window"]
    if family in ("qwen2", "qwen3", "qwen3_moe") and not c["use_sliding_window"]:
        window = None  # transformers' __post_init__ drops it
    _check_sliding_window(window)
    if family in ("qwen2", "qwen3"):
        layers = c["num_hidden_layers"]
        types, field = c["layer_types"], "layer_types"
        if types is not None and len(types) != layers:
            _refuse("layer_types", types, f"needs one entry per layer ({layers})")
        if types is None:
            first, field = c["max_window_layers"], "max_window_layers"
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
    return None if window is None else (window - 1, 0)


def _check_sliding_window(window: Any) -> None:
    if window is not None and window < 1:
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


def _check(c: dict, family: str) -> None:
    if c["hidden_act"] != "silu":
        _refuse("hidden_act", c["hidden_act"], "SwiGLU here is SiLU-gated (Megatron's --swiglu)")
    if family == "llama" and c["attention_bias"] != c["mlp_bias"]:
        _refuse(
            "attention_bias/mlp_bias",
            (c["attention_bias"], c["mlp_bias"]),
            "Megatron's --disable-bias-linear switches every linear's bias together "
            "(--add-qkv-bias adds q/k/v biases only, not o_proj's)",
        )
    if family in _QWEN3 and c["attention_bias"]:
        _refuse(
            "attention_bias",
            c["attention_bias"],
            "Qwen3's attention_bias adds q/k/v and o_proj biases without MLP biases: "
            "Megatron's --add-qkv-bias adds q/k/v biases only, --disable-bias-linear off "
            "adds the MLPs' too",
        )
    for name in ("attention_dropout", "router_jitter_noise"):
        if c.get(name, 0.0):
            _refuse(name, c[name], "not implemented (must be 0)")


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
    """The :class:`GPTConfig` of a Hugging Face ``config.json`` (a dict).

    A key of :data:`HF_DEFAULTS` that ``hf_config`` leaves out gets transformers' default
    for the family (as ``transformers`` loads the file), and one warning names every key
    defaulted and its value (:func:`hf_defaults_used`). ``overrides`` are GPTConfig fields
    set on top (e.g. ``seq_length=4096`` -- the default is ``max_position_embeddings`` -- or
    ``compute_dtype="bfloat16"``); the checks see the final values.

    Raises:
      UnsupportedHFConfig (a ValueError): a family, option or value the GPT cannot
        represent, naming the HF field, its value and what is allowed.
      ValueError: GPTConfig's own checks (with the keys defaulted named, if any).
    """
    hf = hf_config
    family = _family(hf)
    used = hf_defaults_used(hf)
    if used:
        logger.warning(
            "Hugging Face config.json leaves out %d key(s); transformers' %s defaults used: %s",
            len(used),
            HF_CONFIG_CLASSES[family],
            ", ".join(f"{k}={v!r}" for k, v in used.items()),
        )
    c = _with_defaults(hf, family)
    nh, hidden = c["num_attention_heads"], c["hidden_size"]
    nkv = c["num_key_value_heads"] or nh  # null: __post_init__'s num_attention_heads
    d = c["head_dim"] or hidden // nh  # null: __post_init__'s hidden / heads
    fields: dict[str, Any] = dict(
        vocab_size=c["vocab_size"],
        num_layers=c["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=nh,
        seq_length=c["max_position_embeddings"],
        ffn_hidden_size=c["intermediate_size"],
        normalization="RMSNorm",
        position_embedding_type="rope",
        **_rope_fields(c, hf),
        swiglu=True,
        group_query_attention=nkv != nh,
        num_query_groups=nkv if nkv != nh else None,
        kv_channels=d if d * nh != hidden else None,
        add_bias_linear=c["attention_bias"] if family == "llama" else False,
        add_qkv_bias=family == "qwen2",
        qk_layernorm=family in _QWEN3,
        layernorm_epsilon=float(c["rms_norm_eps"]),
        init_method_std=float(c["initializer_range"]),
        untie_embeddings_and_output_weights=not c["tie_word_embeddings"],
    )
    if family == "mixtral":
        fields.update(
            num_moe_experts=c["num_local_experts"],
            moe_router_topk=c["num_experts_per_tok"],
            moe_ffn_hidden_size=c["intermediate_size"],
            moe_layer_freq=1,
            moe_aux_loss_coeff=hf_to_megatron_aux_loss_coeff(
                c["router_aux_loss_coef"], c["num_experts_per_tok"], c["num_hidden_layers"]
            )
            if c["output_router_logits"]
            else 0.0,
        )
    if family == "qwen3_moe":
        fields.update(_qwen3_moe_fields(c))
    _check(c, family)
    seq_length = overrides.get("seq_length", fields["seq_length"])
    fields["window_size"] = _window_size(c, family, seq_length)
    fields.update(overrides)
    try:
        return GPTConfig(**fields)
    except ValueError as exc:
        if not used:
            raise
        raise ValueError(f"{exc}{hf_defaults_note(hf)}") from None


def hf_defaults_note(hf_config: dict) -> str:
    """``""`` when ``hf_config`` leaves out no key of :data:`HF_DEFAULTS`; else
    ``" (config.json leaves out K: transformers' <Class> default V used; ...)"``, to end an
    error the defaults may have caused (a tensor of another shape, GPTConfig's checks)."""
    used = hf_defaults_used(hf_config)
    if not used:
        return ""
    cls = HF_CONFIG_CLASSES[_family(hf_config)]
    what = ", ".join(f"{k} (default {v!r})" for k, v in used.items())
    return f" (config.json leaves out {what}: transformers' {cls} defaults used)"


def _moe_layer_freq(c: dict) -> int:
    """Megatron's ``moe_layer_freq`` N of Qwen3-MoE's layer pattern (transformers: layer
    ``i`` is MoE when ``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in
    ``mlp_only_layers``; Megatron: when ``i % N == 0``), with ``num_hidden_layers`` a
    multiple of N (the layer stack is whole periods of N layers); another pattern is
    refused, naming both fields and what is allowed."""
    layers, step = c["num_hidden_layers"], c["decoder_sparse_step"]
    only = c["mlp_only_layers"] or []
    if step < 1:
        _refuse("decoder_sparse_step", step, "a number of layers >= 1")
    if any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        _refuse("mlp_only_layers", only, "a list of layer numbers")
    moe = [i for i in range(layers) if i not in only and (i + 1) % step == 0]
    freq = moe[1] - moe[0] if len(moe) > 1 else layers
    if moe and moe == list(range(0, layers, freq)) and layers % freq == 0:
        return freq
    where = f"MoE on {_spans(moe) if moe else 'no layer'} of {layers}"
    if moe and moe == list(range(0, layers, freq)):
        where += f": {layers} layers are not whole periods of {freq}"
    _refuse(
        "decoder_sparse_step/mlp_only_layers",
        (step, only),
        f"{where}; allowed: experts on layers 0, N, 2N, ... with num_hidden_layers a "
        "multiple of N (Megatron's --moe-layer-freq N; e.g. decoder_sparse_step 1 and "
        "mlp_only_layers the other layers). Megatron's list form of --moe-layer-freq is not "
        "implemented here",
    )


def _qwen3_moe_fields(c: dict) -> dict[str, Any]:
    """GPTConfig's MoE fields of a Qwen3-MoE config (no shared experts)."""
    experts = c["num_local_experts"]
    if not experts:
        _refuse("num_experts", experts, "a Qwen3-MoE model needs experts (else it is Qwen3)")
    freq = _moe_layer_freq(c)
    topk = c["num_experts_per_tok"]
    return dict(
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=c["moe_intermediate_size"],
        moe_layer_freq=freq,
        # transformers' Qwen3MoeTopKRouter: softmax over all experts, top-k, renormalised
        # only with norm_topk_prob (its default: False)
        moe_router_pre_softmax=not c["norm_topk_prob"],
        moe_aux_loss_coeff=hf_to_megatron_aux_loss_coeff(
            c["router_aux_loss_coef"], topk, c["num_hidden_layers"] // freq
        )
        if c["output_router_logits"]
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
