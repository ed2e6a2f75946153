"""A Hugging Face ``config.json`` that leaves keys out means what it means to
``transformers``: each family's config class's defaults (transformers 5.23/5.24, the
version ``tools/make_hf_fixtures.py`` made ``tests/fixtures/hf`` with), logged; values of
the wrong type and layer patterns the layout cannot stack are refused in one line naming
the key and what is allowed (``config_from_hf``, ``import_hf``, ``--load-hf``,
``tools/convert_hf.py``)."""

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from hf_util import FIXTURES, hf_config

from jax_wgrad.interop import UnsupportedHFConfig, config_from_hf, import_hf
from jax_wgrad.interop.hf_config import HF_CONFIG_CLASSES, HF_DEFAULTS, hf_defaults_used

LOGGER = "jax_wgrad.interop.hf_config"
ROOT = Path(__file__).resolve().parents[1]

# Every config.json key the import reads and its default, copied from the dataclass fields
# of transformers 5.24.0's config classes (5.23.0's are the same). ``rope_theta`` is the
# class's ``default_theta`` (RotaryEmbeddingConfigMixin: 10000.0; MixtralConfig sets
# 1000000.0), used when ``rope_parameters`` is None. ``num_local_experts`` is MixtralConfig's
# field and Qwen3MoeConfig's ``num_experts`` (attribute_map: saved as num_local_experts).
# Qwen2Config and Qwen3MoeConfig have no ``head_dim`` field.
TRANSFORMERS_DEFAULTS = {
    # transformers/models/llama/configuration_llama.py, class LlamaConfig
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "head_dim": None,
    },
    # transformers/models/mistral/configuration_mistral.py, class MistralConfig
    "mistral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": None,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,  # 4096 * 32
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "attention_dropout": 0.0,
    },
    # transformers/models/qwen2/configuration_qwen2.py, class Qwen2Config
    "qwen2": {
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
        "sliding_window": 4096,
        "max_window_layers": 28,
        "layer_types": None,
        "attention_dropout": 0.0,
    },
    # transformers/models/mixtral/configuration_mixtral.py, class MixtralConfig
    "mixtral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": None,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,  # 4096 * 32
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "num_experts_per_tok": 2,
        "num_local_experts": 8,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "rope_theta": 1000000.0,  # MixtralConfig.default_theta
    },
    # transformers/models/qwen3/configuration_qwen3.py, class Qwen3Config
    "qwen3": {
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
    # transformers/models/qwen3_moe/configuration_qwen3_moe.py, class Qwen3MoeConfig
    "qwen3_moe": {
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
        "sliding_window": 4096,
        "attention_dropout": 0.0,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "num_local_experts": 128,  # the field num_experts
        "norm_topk_prob": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "mlp_only_layers": None,
    },
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
CASES = [(f, k) for f, table in TRANSFORMERS_DEFAULTS.items() for k in table]


def _without(hf: dict, key: str) -> dict:
    """``hf`` with ``key`` left out (every spelling transformers reads it under)."""
    names = {key, "num_experts"} if key == "num_local_experts" else {key}
    out = {k: v for k, v in hf.items() if k not in names}
    if key == "rope_theta":
        out["rope_parameters"] = {
            k: v for k, v in hf["rope_parameters"].items() if k != "rope_theta"
        }
    return out


def _with(hf: dict, key: str, value) -> dict:
    """``hf`` with ``key`` given explicitly as ``value``."""
    if key == "rope_theta":
        return {**hf, "rope_parameters": {**hf["rope_parameters"], "rope_theta": value}}
    return {**hf, key: value}


def _outcome(hf: dict):
    """``config_from_hf(hf)``, or its refusal's message (without the note on defaults)."""
    try:
        return config_from_hf(hf)
    except ValueError as exc:
        return str(exc).split(" (config.json leaves out")[0]


def test_the_tables_are_transformers_defaults():
    assert HF_DEFAULTS == TRANSFORMERS_DEFAULTS
    assert set(HF_CONFIG_CLASSES) == set(HF_DEFAULTS)


@pytest.mark.parametrize("family, key", CASES, ids=[f"{f}-{k}" for f, k in CASES])
def test_a_key_left_out_imports_to_the_transformers_default(family, key, caplog):
    """Each read key removed from the family's fixture config: the import equals the one
    with transformers' default written explicitly, and the warning names the key and the
    value."""
    full = hf_config(family)
    default = TRANSFORMERS_DEFAULTS[family][key]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        left_out = _outcome(_without(full, key))
    assert left_out == _outcome(_with(_without(full, key), key, default))
    assert hf_defaults_used(_without(full, key)) == {key: default}
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1, lines
    assert f"{key}={default!r}" in lines[0] and HF_CONFIG_CLASSES[family] in lines[0]


def test_the_cases_of_the_issue():
    """Mixtral without ``rms_norm_eps``: 1e-5 (was 1e-6); Mistral without
    ``sliding_window``: a window of 4096 tokens (was none); and more that differed."""
    mixtral = config_from_hf(_without(hf_config("mixtral"), "rms_norm_eps"))
    assert mixtral.layernorm_epsilon == 1e-5
    mistral = config_from_hf(_without(hf_config("mistral_window"), "sliding_window"))
    assert mistral.window_size == (4095, 0)
    # Qwen2/Qwen3: a window from max_window_layers 28 on (was: no layer)
    qwen2 = {
        **_without(hf_config("qwen2"), "max_window_layers"),
        "use_sliding_window": True,
        "sliding_window": 8,
        "num_hidden_layers": 30,
        "layer_types": None,
    }
    with pytest.raises(UnsupportedHFConfig, match=r"max_window_layers=28: .* layers 28-29 "):
        config_from_hf(qwen2, seq_length=16)
    # Mistral/Mixtral: 8 key/value heads, not one per query head
    heads = {**_without(hf_config("mistral"), "num_key_value_heads"), "num_attention_heads": 16}
    assert config_from_hf(heads).num_query_groups == 8
    # Mixtral's router_aux_loss_coef: 0.001 (was 0)
    aux = {**_without(hf_config("mixtral"), "router_aux_loss_coef"), "output_router_logits": True}
    assert config_from_hf(aux).moe_aux_loss_coeff == pytest.approx(0.001 * 2 / 4)
    # Qwen3-MoE without norm_topk_prob: not renormalised (Megatron's pre-softmax)
    moe = config_from_hf(_without(hf_config("qwen3_moe"), "norm_topk_prob"))
    assert moe.moe_router_pre_softmax


@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
def test_architectures_alone_is_the_class_default(family, caplog):
    explicit = {"architectures": [ARCHITECTURES[family]], **TRANSFORMERS_DEFAULTS[family]}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        bare = config_from_hf({"architectures": [ARCHITECTURES[family]]})
        assert bare == config_from_hf({"model_type": family})  # AutoModel's other key
    assert bare == config_from_hf(explicit)
    assert (bare.num_layers, bare.hidden_size) == (
        TRANSFORMERS_DEFAULTS[family]["num_hidden_layers"],
        TRANSFORMERS_DEFAULTS[family]["hidden_size"],
    )
    assert len([r for r in caplog.records if r.name == LOGGER]) == 2


@pytest.mark.parametrize("family", sorted(p.name for p in FIXTURES.iterdir()))
def test_a_transformers_made_config_defaults_nothing(family, caplog):
    """Every key of the tables is a field transformers writes: nothing logged."""
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        config_from_hf(hf_config(family))
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_llama3_original_max_position_embeddings_defaults_to_max_position_embeddings(caplog):
    """transformers' standardize_rope_params: ``max_position_embeddings``."""
    hf = hf_config("llama31")
    rope = {
        k: v for k, v in hf["rope_parameters"].items() if k != "original_max_position_embeddings"
    }
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cfg = config_from_hf({**hf, "rope_parameters": rope, "max_position_embeddings": 96})
    assert cfg.rope_scaling and cfg.rope_scaling_original_max_position_embeddings == 96
    assert "rope_parameters.original_max_position_embeddings=96" in caplog.text


@pytest.mark.parametrize(
    "key, value, what",
    [
        ("rms_norm_eps", None, "a number"),
        ("num_hidden_layers", "4", "an integer"),
        ("num_hidden_layers", 4.0, "an integer"),
        ("hidden_size", True, "an integer"),
        ("tie_word_embeddings", 1, "true or false"),
        ("sliding_window", True, "an integer or null"),
        ("hidden_act", None, "a string"),
        ("rope_parameters", 10000.0, "an object"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(key, value, what):
    with pytest.raises(UnsupportedHFConfig) as exc:
        config_from_hf({**hf_config("mistral"), key: value})
    assert str(exc.value) == str(exc.value).splitlines()[0]
    assert str(exc.value).startswith(f"Hugging Face config {key}={value!r}: must be {what}")


# ------------------------------------------------------------------ Qwen3-MoE layer patterns

THREE_LAYERS = {"num_hidden_layers": 3, "mlp_only_layers": [1]}
REFUSAL = (
    "Hugging Face config decoder_sparse_step/mlp_only_layers=(1, [1]): MoE on layers 0, 2 of "
    "3: 3 layers are not whole periods of 2; allowed: experts on layers 0, N, 2N, ... with "
    "num_hidden_layers a multiple of N"
)


def _three_layer_directory(tmp_path) -> Path:
    d = shutil.copytree(FIXTURES / "qwen3_moe", tmp_path / "qwen3_moe_3")
    (d / "config.json").write_text(json.dumps({**hf_config("qwen3_moe"), **THREE_LAYERS}))
    return d


def test_a_qwen3_moe_pattern_that_is_not_whole_periods_is_refused(tmp_path):
    """3 layers, MoE on 0 and 2: Megatron's --moe-layer-freq 2 pattern, but the layer stack
    is whole periods of 2 layers (the scan stacks each kind); refused, not a failure in
    ``single_device_logits``."""
    with pytest.raises(UnsupportedHFConfig) as exc:
        config_from_hf({**hf_config("qwen3_moe"), **THREE_LAYERS})
    assert str(exc.value).startswith(REFUSAL) and "\n" not in str(exc.value)
    with pytest.raises(UnsupportedHFConfig, match="mlp_only_layers"):
        import_hf(_three_layer_directory(tmp_path))


def test_the_convert_tool_refuses_it_in_one_line(tmp_path):
    d = _three_layer_directory(tmp_path)
    run = subprocess.run(
        [sys.executable, "tools/convert_hf.py", "--hf-dir", str(d), "--out", str(tmp_path / "c")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(f"convert_hf.py: error: {REFUSAL}")


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")
def test_load_hf_refuses_it_in_one_line(pretrain, capsys, tmp_path):
    d = _three_layer_directory(tmp_path)
    with pytest.raises(SystemExit) as exc:
        pretrain.main(["--load-hf", str(d), "--seq-length", "16", "--train-iters", "1"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 2, err  # usage, error
    assert f"error: --load-hf {d}: {REFUSAL}" in err


def test_a_size_left_out_ends_in_one_line_naming_it(tmp_path, caplog):
    """Mistral without ``hidden_size``: transformers' 4096, which the weights do not have:
    refused from the shard headers (nothing allocated), naming the tensor and the key."""
    d = shutil.copytree(FIXTURES / "mistral", tmp_path / "mistral")
    (d / "config.json").write_text(json.dumps(_without(hf_config("mistral"), "hidden_size")))
    with pytest.raises(ValueError) as exc:
        import_hf(d)
    message = str(exc.value)
    assert "\n" not in message and "has shape (128, 64), the config makes it (128, 4096)" in message
    assert message.endswith(
        "(config.json leaves out hidden_size (default 4096): transformers' MistralConfig "
        "defaults used)"
    )
