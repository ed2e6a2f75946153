"""Qwen3 and Qwen3-MoE in and out of jax_wgrad.interop, Llama 3.1's RoPE scaling against a
transformers-made model, and the router options Qwen3-MoE needs under Megatron's names
(``--moe-router-pre-softmax``, ``--moe-router-topk-scaling-factor``).

Fixtures: tests/fixtures/hf/{qwen3, qwen3_moe, qwen3_moe_unnormed, llama31}, made by
``tools/make_hf_fixtures.py --families qwen3 qwen3_moe qwen3_moe_unnormed llama31`` with
torch 2.13 and transformers 5.24 (the logits there are transformers' own)."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_util import (
    FIXTURES,
    assert_export_round_trip_is_bitwise,
    file_tensors,
    hf_config,
    log_softmax,
    pipeline_loss,
    reference,
)

from jax_wgrad import GPTConfig, single_device_logits
from jax_wgrad.interop import (
    UnsupportedHFConfig,
    config_from_hf,
    hf_config_from,
    hf_tensors,
    import_hf,
)
from jax_wgrad.testing import reference_logits

FAMILIES = ["qwen3", "qwen3_moe", "qwen3_moe_unnormed", "llama31"]


def _families_keeping(*default: str) -> list:
    """FAMILIES, all but ``default`` in ``-m slow`` (suite time; each case compiles a
    model). Together the defaults cover every feature: qwen3_moe has the q/k norms,
    head_dim != hidden / heads, MoE and dense layers and renormalised top-k; llama31 the
    RoPE scaling; the unnormalised routing is test_router_options_against_numpy's."""
    return [f if f in default else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]


def _rel(ours, theirs) -> float:
    return float(np.abs(np.asarray(ours) - theirs).max() / np.abs(theirs).max())


_jit_reference_logits = jax.jit(reference_logits, static_argnums=2)


# --------------------------------------------------------------------------- configs


def test_config_mapping():
    qwen3 = config_from_hf(hf_config("qwen3"))
    assert qwen3.qk_layernorm and qwen3.kv_channels == 32 and qwen3.hidden_size == 64
    assert (qwen3.add_bias_linear, qwen3.add_qkv_bias) == (False, False)
    assert not qwen3.untie_embeddings_and_output_weights  # tied, as Qwen3-0.6B
    assert (qwen3.rotary_base, qwen3.layernorm_epsilon) == (1e6, 1e-6)
    moe = config_from_hf(hf_config("qwen3_moe"))
    assert (
        moe.num_moe_experts,
        moe.moe_router_topk,
        moe.moe_ffn_hidden_size,
        moe.ffn_hidden_size,
        moe.moe_layer_freq,
        moe.moe_router_pre_softmax,
        moe.moe_router_topk_scaling_factor,
        moe.moe_aux_loss_coeff,
    ) == (8, 3, 32, 96, 2, False, None, 0.0)
    assert moe.moe_layer_pattern == (True, False, True, False)  # mlp_only_layers [1, 3]
    assert moe.qk_layernorm and moe.untie_embeddings_and_output_weights
    unnormed = config_from_hf(hf_config("qwen3_moe_unnormed"))
    assert unnormed.moe_router_pre_softmax and unnormed.moe_layer_freq == 1
    assert unnormed.kv_channels is None  # Qwen3-MoE's head_dim default: hidden / heads
    llama31 = config_from_hf(hf_config("llama31"))
    assert llama31.rope_scaling and llama31.rope_scaling_original_max_position_embeddings == 64
    # transformers' Qwen3Config defaults head_dim to 128 (not hidden / heads)
    no_head_dim = {k: v for k, v in hf_config("qwen3").items() if k != "head_dim"}
    assert config_from_hf(no_head_dim).kv_channels == 128


@pytest.mark.parametrize(
    "change, freq",
    [
        ({"mlp_only_layers": [], "decoder_sparse_step": 1}, 1),
        ({"mlp_only_layers": [1, 2, 3, 5, 6, 7], "num_hidden_layers": 8}, 4),
        ({"mlp_only_layers": [1, 2, 3]}, 4),  # one MoE layer, the first
    ],
)
def test_qwen3_moe_layer_patterns_map_to_moe_layer_freq(change, freq):
    cfg = config_from_hf({**hf_config("qwen3_moe"), **change})
    assert cfg.moe_layer_freq == freq
    out = hf_config_from(cfg)
    assert out["decoder_sparse_step"] == 1
    assert out["mlp_only_layers"] == [i for i in range(cfg.num_layers) if i % freq]
    assert config_from_hf(out) == cfg


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_config_maps_back_to_the_same_model(family):
    cfg = config_from_hf(hf_config(family))
    out = hf_config_from(cfg)
    assert out["architectures"] == hf_config(family)["architectures"]
    assert config_from_hf(out) == cfg
    if family.startswith("qwen3_moe"):
        assert out["norm_topk_prob"] == hf_config(family)["norm_topk_prob"]
        assert out["mlp_only_layers"] == hf_config(family).get("mlp_only_layers", [])


@pytest.mark.parametrize(
    "family, change, field",
    [
        ("qwen3", {"attention_bias": True}, "attention_bias"),
        ("qwen3", {"hidden_act": "gelu"}, "hidden_act"),
        ("qwen3", {"attention_dropout": 0.1}, "attention_dropout"),
        (  # MoE on layers 1 and 3: Megatron's pattern starts at layer 0
            "qwen3_moe",
            {"decoder_sparse_step": 2, "mlp_only_layers": []},
            "decoder_sparse_step/mlp_only_layers",
        ),
        ("qwen3_moe", {"mlp_only_layers": [0]}, "decoder_sparse_step/mlp_only_layers"),
        ("qwen3_moe", {"mlp_only_layers": [2]}, "decoder_sparse_step/mlp_only_layers"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("qwen3_moe", {"num_local_experts": 0}, "num_experts"),
        (
            "qwen3_moe",
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
            "rope_parameters.rope_type",
        ),
    ],
)
def test_unrepresentable_configs_are_refused_naming_the_field(family, change, field):
    with pytest.raises(UnsupportedHFConfig, match=f"config {field}="):
        config_from_hf({**hf_config(family), **change})


@pytest.mark.parametrize(
    "family, change, message",
    [
        ("qwen3", {"add_qkv_bias": True}, "add_bias_linear/add_qkv_bias=.*attention_bias"),
        ("qwen3_moe", {"moe_router_topk_scaling_factor": 2.0}, "moe_router_topk_scaling_factor"),
        (
            "qwen3_moe",
            {"moe_shared_expert_intermediate_size": 64},
            "moe_shared_expert_intermediate_size",
        ),
        # without qk_layernorm an MoE model is Mixtral: experts on every layer, renormalised
        ("qwen3_moe", {"qk_layernorm": False}, "moe_layer_freq=2"),
        (
            "qwen3_moe_unnormed",
            {"qk_layernorm": False},
            "moe_router_pre_softmax=True.*renormalises",
        ),
    ],
)
def test_unexportable_options_are_refused_naming_the_field(family, change, message):
    cfg = dataclasses.replace(config_from_hf(hf_config(family)), **change)
    with pytest.raises(ValueError, match=f"cannot export to Hugging Face: .*{message}"):
        hf_config_from(cfg)


def test_mixtral_keeps_renormalised_routing():
    """Mixtral's router (softmax, top-k, renormalised) is Megatron's default routing, both
    ways."""
    cfg = config_from_hf(json.loads((FIXTURES / "mixtral" / "config.json").read_text()))
    assert not cfg.moe_router_pre_softmax and cfg.moe_router_topk_scaling_factor is None
    out = hf_config_from(cfg)
    assert out["architectures"] == ["MixtralForCausalLM"] and "norm_topk_prob" not in out


# --------------------------------------------------------------------------- tensors


def test_tensor_table_names_qwen3_tensors():
    names = {t.name: t for t in hf_tensors(config_from_hf(hf_config("qwen3_moe")), aliases=True)}
    p = "model.layers.0."
    assert names[p + "self_attn.q_norm.weight"].shape == (32,)
    assert names[p + "self_attn.k_norm.weight"].leaf == "moe_layers.k_norm.scale"
    assert names[p + "mlp.gate.weight"].leaf == "moe_layers.router"
    assert names[p + "mlp.experts.7.up_proj.weight"].shape == (32, 64)
    assert names[p + "mlp.experts.gate_up_proj"].shape == (8, 64, 64)  # transformers 5 fused
    assert names["model.layers.1.mlp.up_proj.weight"].leaf == "layers.fc1.weight"  # dense
    assert not any("block_sparse_moe" in n for n in names)


def test_transformers5_fused_expert_names_import_alike(tmp_path):
    """transformers 5 holds Qwen3-MoE's experts fused (``mlp.experts.gate_up_proj [E, 2F,
    H]`` = gate rows then up rows, ``down_proj [E, H, F]``); a file with those names
    imports to the same parameters as the per-expert names of the Hub's files."""
    from safetensors.numpy import save_file

    files = file_tensors(FIXTURES / "qwen3_moe")
    fused = {k: v for k, v in files.items() if ".mlp.experts." not in k}
    for i in (0, 2):
        p = f"model.layers.{i}.mlp.experts."
        fused[p + "gate_up_proj"] = np.stack(
            [
                np.concatenate([files[f"{p}{e}.gate_proj.weight"], files[f"{p}{e}.up_proj.weight"]])
                for e in range(8)
            ]
        )
        fused[p + "down_proj"] = np.stack([files[f"{p}{e}.down_proj.weight"] for e in range(8)])
    save_file(fused, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(hf_config("qwen3_moe")))
    cfg, params = import_hf(tmp_path)
    cfg0, params0 = import_hf(FIXTURES / "qwen3_moe")
    assert cfg == cfg0
    jax.tree.map(np.testing.assert_array_equal, params, params0)


@pytest.mark.parametrize("family", FAMILIES)
def test_import_export_import_is_bitwise(family, tmp_path):
    assert_export_round_trip_is_bitwise(family, tmp_path)


# --------------------------------------------------------------------------- parity


@functools.cache
def _imported(family: str, **overrides):
    cfg, params = import_hf(FIXTURES / family, seq_length=16, **overrides)
    return cfg, jax.tree.map(jnp.asarray, params)


# the dense family by default (suite time): Qwen3-MoE's forward against transformers stays
# in the default run in test_pipeline_cross_entropy_equals_transformers
@pytest.mark.parametrize("family", _families_keeping("qwen3"))
def test_logits_equal_transformers_fp32(family):
    """The library's own layers (single_device_logits) and the independent reference model,
    fp32, within 1e-5 of transformers' largest logit (measured: about 6e-7)."""
    ref = reference(family)
    cfg, params = _imported(family)
    ids = jnp.asarray(ref["tokens"][:, :-1])
    theirs = ref["logits_fp32"]
    assert _rel(single_device_logits(cfg, params, ids), theirs) <= 1e-5
    assert _rel(_jit_reference_logits(params, ids, cfg), theirs) <= 1e-5


# a check of the fixtures themselves (each case compiles a model), not of the library: the
# default parity tests above would fail if an option were dropped because of this
@pytest.mark.slow
@pytest.mark.parametrize(
    "family, change",
    [
        ("llama31", {"rope_scaling": False}),
        ("qwen3_moe_unnormed", {"moe_router_pre_softmax": False}),
        ("qwen3", {"layernorm_epsilon": 1e-5}),  # the q/k norms' epsilon is rms_norm_eps
        ("qwen3", {"qk_layernorm": False}),
    ],
)
def test_the_fixtures_tell_the_options_apart(family, change):
    """Each option the fixtures check changes the logits far beyond the tolerance: the
    RoPE scaling at these 16 positions, the unnormalised routing, the norms' epsilon."""
    ref = reference(family)
    cfg, params = _imported(family)
    if change.get("qk_layernorm") is False:
        strip = lambda t: {k: v for k, v in t.items() if k not in ("q_norm", "k_norm")}
        params = {k: strip(v) if k in ("layers", "moe_layers") else v for k, v in params.items()}
    ours = _jit_reference_logits(
        params, jnp.asarray(ref["tokens"][:, :-1]), dataclasses.replace(cfg, **change)
    )
    assert _rel(ours, ref["logits_fp32"]) > 5e-4


@pytest.mark.parametrize("family", _families_keeping("llama31"))
def test_bf16_kl_per_token(family):
    """The library's layers in bf16 against transformers' fp32 logits: KL(HF fp32 || ours
    bf16) <= 1e-3 for every token (as tests/test_hf.py::test_bf16_kl_per_token). By
    default llama31: without its RoPE scaling the logits are 15% off, far outside this."""
    ref = reference(family)
    cfg, params = _imported(family, compute_dtype="bfloat16")
    ours = log_softmax(single_device_logits(cfg, params, jnp.asarray(ref["tokens"][:, :-1])))
    theirs = log_softmax(ref["logits_fp32"])
    kl = (np.exp(theirs) * (theirs - ours)).sum(-1)
    assert kl.max() <= 1e-3, kl.max()


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")
def test_pipeline_cross_entropy_equals_transformers():
    """Qwen3-MoE (q/k norms, MoE and dense layers alternating, top-3 of 8 experts) on
    (dp, tp, pp) = (2, 2, 2) with sequence parallelism: the pipeline's loss is
    transformers'."""

    ref = reference("qwen3_moe")
    cfg, params = import_hf(FIXTURES / "qwen3_moe", seq_length=16)
    tokens = ref["tokens"]
    theirs = -np.mean(np.take_along_axis(log_softmax(ref["logits_fp32"]), tokens[:, 1:, None], -1))
    ours = pipeline_loss(cfg, params, jnp.asarray(tokens), 2, 2, 2, True)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)


# --------------------------------------------------------------------------- router options


def _route_numpy(logits, k, pre_softmax, scale):
    """Megatron's ``topk_softmax_with_capacity`` (softmax score), in numpy float64."""
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    if pre_softmax:  # softmax over all experts, then top-k: not renormalised
        full = np.exp(logits - logits.max(-1, keepdims=True))
        gates = np.take_along_axis(full / full.sum(-1, keepdims=True), order, -1)
    else:  # top-k of the logits, then softmax over the k
        top = np.exp(np.take_along_axis(logits, order, -1))
        gates = top / top.sum(-1, keepdims=True)
    return order, gates * (1.0 if scale is None else scale)


def _hf_qwen3_moe_router(logits, k, norm_topk_prob):
    """transformers' Qwen3MoeTopKRouter: softmax, top-k, renormalised with norm_topk_prob."""
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(probs, order, -1)
    return order, top / top.sum(-1, keepdims=True) if norm_topk_prob else top


@pytest.mark.parametrize("scale", [None, 2.5])
@pytest.mark.parametrize("pre_softmax", [False, True])
def test_router_options_against_numpy(pre_softmax, scale):
    """route() and the reference MoE (its own code) against Megatron's definition, and
    Hugging Face's norm_topk_prob = not pre_softmax."""
    from jax_wgrad.functional import MoEConfig, moe_mlp
    from jax_wgrad.functional.moe import route
    from jax_wgrad.testing import reference_moe_mlp

    e, h, f, t, k = 8, 16, 8, 32, 3
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(t, h)), jnp.float32)
    w = {
        "router": rng.normal(size=(e, h)),
        "fc1": rng.normal(size=(e, 2, f, h)) / 4,
        "fc2": rng.normal(size=(e, h, f)) / 3,
    }
    w = {n: jnp.asarray(a, jnp.float32) for n, a in w.items()}
    logits = np.asarray(x, np.float64) @ np.asarray(w["router"], np.float64).T
    want_experts, want_gates = _route_numpy(logits, k, pre_softmax, scale)
    probs, experts, gates = route(x, w["router"], k, pre_softmax=pre_softmax, scaling_factor=scale)
    np.testing.assert_array_equal(experts, want_experts)
    np.testing.assert_allclose(gates, want_gates, rtol=1e-5)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)
    if scale is None:
        hf_experts, hf_gates = _hf_qwen3_moe_router(logits, k, norm_topk_prob=not pre_softmax)
        np.testing.assert_array_equal(experts, hf_experts)
        np.testing.assert_allclose(gates, hf_gates, rtol=1e-5)
    if (pre_softmax, scale) != (True, 2.5):
        return  # one compile: the MoE layer passes both options on
    cfg = MoEConfig(
        num_experts=e,
        ffn_hidden_size=f,
        topk=k,
        swiglu=True,
        pre_softmax=pre_softmax,
        topk_scaling_factor=scale,
    )
    y, _ = jax.jit(lambda w, x: moe_mlp(w, x, cfg))(w, x)
    y_ref, _ = reference_moe_mlp(w, x, cfg)  # eager: no compile of its own
    np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5)
    plain, _ = reference_moe_mlp(w, x, dataclasses.replace(cfg, pre_softmax=False))
    assert np.abs(np.asarray(plain) * scale - np.asarray(y_ref)).max() > 1e-3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--moe-router-topk-scaling-factor", "-2"], "--moe-router-topk-scaling-factor must be"),
        (["--moe-router-topk-scaling-factor", "0"], "must be a finite number > 0"),
    ],
)
def test_router_flags(argv, message, capsys):
    from jax_wgrad.pretrain.cli import build_configs, make_parser

    parser = make_parser("pretrain_gpt.py")
    base = ["--num-experts", "4", "--swiglu"]
    args = parser.parse_args(
        base + ["--moe-router-pre-softmax", "--moe-router-topk-scaling-factor", "2.5"]
    )
    model = build_configs(args, 256, parser)[0]
    assert model.moe_router_pre_softmax and model.moe_router_topk_scaling_factor == 2.5
    assert model.moe_config().pre_softmax and model.moe_config().topk_scaling_factor == 2.5
    with pytest.raises(SystemExit):
        build_configs(parser.parse_args(base + argv), 256, parser)
    assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"MoE options \['moe_router_pre_softmax'\] need"):
        GPTConfig(moe_router_pre_softmax=True)


# --------------------------------------------------------------------------- presets


def _parameters(cfg: GPTConfig) -> int:
    from jax_wgrad import init_params

    shapes = jax.eval_shape(functools.partial(init_params, cfg, 0))
    return sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))


def test_presets():
    from jax_wgrad.models.gpt.presets import preset

    for name in ("qwen3-8b", "qwen3-30b-a3b", "qwen3-tiny", "qwen3-moe-tiny"):
        cfg = preset(name)
        assert cfg.qk_layernorm and cfg.head_dim == (32 if "tiny" in name else 128)
        out = hf_config_from(cfg)
        assert out["model_type"] == ("qwen3_moe" if cfg.num_moe_experts else "qwen3")
        assert config_from_hf(out) == cfg
    moe = hf_config_from(preset("qwen3-30b-a3b"))
    assert (moe["num_experts"], moe["num_experts_per_tok"], moe["moe_intermediate_size"]) == (
        128,
        8,
        768,
    )
    assert moe["norm_topk_prob"] and moe["mlp_only_layers"] == []


# ~7 s (two big eval_shapes); the presets' configs are test_presets' by default
@pytest.mark.slow
@pytest.mark.parametrize(
    "name, total",
    [
        ("qwen3-8b", 8_190_735_360),  # Qwen3-8B's model.safetensors.index.json total / 2
        ("qwen3-30b-a3b", 30_532_122_624),
    ],
)
def test_presets_have_the_published_sizes(name, total):
    from jax_wgrad.models.gpt.presets import preset

    cfg = preset(name)
    assert _parameters(cfg) == total
    assert config_from_hf(hf_config_from(cfg)) == cfg
    tiny = preset(name.split("-")[0] + ("-moe" if cfg.num_moe_experts else "") + "-tiny")
    assert (tiny.qk_layernorm, tiny.num_moe_experts is None) == (True, cfg.num_moe_experts is None)
    assert tiny.head_dim * tiny.num_attention_heads != tiny.hidden_size  # as the full sizes
