"""ParallelConfig / GPTConfig validation and the mesh helper."""

import re
from pathlib import Path

import jax
import numpy as np
import pytest

from jax_wgrad import GPTConfig, ParallelConfig
from jax_wgrad.models.gpt import validate
from jax_wgrad.parallel.mesh import AXES, make_mesh


def test_derived_sizes():
    par = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        micro_batch_size=2,
        global_batch_size=16,
        world_size=8,
    )
    assert par.data_parallel_size == 2
    assert par.num_microbatches == 4
    assert par.mesh_shape == (2, 1, 1, 2, 2)  # (data = dp / EP, expert, context, tensor, pipeline)


def test_global_batch_defaults_to_one_microbatch_per_rank():
    par = ParallelConfig(micro_batch_size=3, world_size=4)
    assert par.global_batch_size == 12 and par.num_microbatches == 1


def test_world_size_defaults_to_device_count():
    assert ParallelConfig().world_size == jax.device_count()


def test_device_count_not_divisible_by_tp_pp():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "world size (8) is not divisible by tensor_model_parallel_size (3) x "
            "pipeline_model_parallel_size (1)"
        ),
    ):
        ParallelConfig(tensor_model_parallel_size=3, world_size=8)


def test_global_batch_not_divisible():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "global batch size (10) is not divisible by micro batch size (2) times data "
            "parallel size (4)"
        ),
    ):
        ParallelConfig(
            tensor_model_parallel_size=2, micro_batch_size=2, global_batch_size=10, world_size=8
        )


@pytest.mark.parametrize("field", ["tensor_model_parallel_size", "micro_batch_size"])
def test_positive(field):
    with pytest.raises(ValueError, match=f"{field} must be a positive integer, got 0"):
        ParallelConfig(**{field: 0}, world_size=8)


def test_sequence_parallel_without_tp_is_disabled():
    with pytest.warns(UserWarning, match="Disabling sequence parallelism"):
        par = ParallelConfig(sequence_parallel=True, world_size=8)
    assert not par.sequence_parallel


def test_frozen():
    par = ParallelConfig(world_size=8)
    with pytest.raises(AttributeError):
        par.micro_batch_size = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    "model, tp, message",
    [
        (
            GPTConfig(num_attention_heads=12, hidden_size=60),
            5,
            "num_attention_heads (12) must be divisible by tensor_model_parallel_size (5)",
        ),
        (
            GPTConfig(num_attention_heads=2, hidden_size=6),
            4,
            "num_attention_heads (2) must be divisible by tensor_model_parallel_size (4)",
        ),
        (
            GPTConfig(num_attention_heads=4, hidden_size=64, ffn_hidden_size=130),
            4,
            "ffn_hidden_size (130) must be divisible by tensor_model_parallel_size (4)",
        ),
        (
            GPTConfig(num_attention_heads=4, hidden_size=64, vocab_size=250),
            4,
            "vocab_size (250) must be divisible by tensor_model_parallel_size (4)",
        ),
    ],
)
def test_tp_must_divide_model(model, tp, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(ParallelConfig(tensor_model_parallel_size=tp, world_size=tp * 2), model)


def test_pp_must_divide_layers():
    with pytest.raises(
        ValueError,
        match=re.escape("num_layers (3) must be divisible by pipeline_model_parallel_size (2)"),
    ):
        validate(
            ParallelConfig(pipeline_model_parallel_size=2, world_size=8), GPTConfig(num_layers=3)
        )


def test_sequence_parallel_needs_divisible_seq():
    with pytest.raises(
        ValueError,
        match=re.escape("seq_length (30) must be divisible by tensor_model_parallel_size (4)"),
    ):
        validate(
            ParallelConfig(tensor_model_parallel_size=4, sequence_parallel=True, world_size=8),
            GPTConfig(seq_length=30),
        )


def test_gpt_config_heads_divide_hidden():
    with pytest.raises(
        ValueError, match=re.escape("hidden_size (10) must be divisible by num_attention_heads (4)")
    ):
        GPTConfig(hidden_size=10, num_attention_heads=4)


def test_ffn_default():
    assert GPTConfig(hidden_size=32, num_attention_heads=4).ffn_hidden_size == 128


def test_make_mesh():
    par = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    mesh = make_mesh(par)
    assert mesh.axis_names == AXES
    assert dict(mesh.shape) == {"data": 2, "expert": 1, "context": 1, "tensor": 2, "pipeline": 2}


def test_make_mesh_orders_devices_as_megatron_ranks():
    """Megatron's default rank order (tp-cp-ep-dp-pp): tensor ranks consecutive, pipeline
    slowest -- so a tensor group stays on one host (here: hosts of 2 devices)."""
    devices = jax.devices()
    par = ParallelConfig(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2
    )
    mesh = make_mesh(par, devices)
    d_, e_, c_, t_, p_ = par.mesh_shape  # (1, 2, 1, 2, 2)
    for d, e, c, t, p in np.ndindex(*par.mesh_shape):
        rank = t + t_ * (c + c_ * (e + e_ * (d + d_ * p)))
        assert mesh.devices[d, e, c, t, p] == devices[rank]
    hosts = {i: i // 2 for i in range(8)}
    for d, e, p in np.ndindex(d_, e_, p_):
        assert len({hosts[x.id] for x in mesh.devices[d, e, 0, :, p]}) == 1


def test_make_mesh_device_mismatch():
    par = ParallelConfig(world_size=4)
    with pytest.raises(ValueError, match=r"world_size \(4\) does not match the 8 devices"):
        make_mesh(par)


def test_ddp_config_validation_and_megatron_bucket_size_rule():
    from jax_wgrad import DDPConfig

    assert DDPConfig().effective_bucket_size(8) is None  # no overlap: one bucket
    assert DDPConfig(bucket_size=1000).effective_bucket_size(8) is None
    assert DDPConfig(overlap_grad_reduce=True).effective_bucket_size(8) == 40_000_000
    assert DDPConfig(overlap_grad_reduce=True).effective_bucket_size(64) == 64_000_000
    assert DDPConfig(overlap_grad_reduce=True, bucket_size=1000).effective_bucket_size(8) == 1000
    with pytest.raises(ValueError, match="bucket_size must be a positive integer"):
        DDPConfig(bucket_size=0)
    with pytest.raises(ValueError, match="clip_grad must be a finite number >= 0"):
        DDPConfig(clip_grad=-1.0)
    with pytest.raises(ValueError, match="use_distributed_optimizer must be a bool"):
        DDPConfig(use_distributed_optimizer=1)


# ------------------------------------------------------------ one definition per fact


def _forwarded_fields():
    """GPTConfig's MoE options forwarded to MoEConfig: ``{gpt field: MoEConfig field}``."""
    import dataclasses

    return {
        f.name: f.metadata["moe_config"]
        for f in dataclasses.fields(GPTConfig)
        if f.metadata.get("moe_config")
    }


def test_moe_options_have_one_default_megatrons():
    """Every MoE option the layer reads has ONE default: MoEConfig's field default, which
    GPTConfig's flat Megatron-named field reads (no second copy), and it is Megatron's."""
    import dataclasses

    from jax_wgrad.functional import MoEConfig

    moe = {f.name: f for f in dataclasses.fields(MoEConfig)}
    gpt = {f.name: f for f in dataclasses.fields(GPTConfig)}
    forwarded = _forwarded_fields()
    assert sorted(forwarded.values()) == sorted(moe)  # every MoEConfig option, once
    for outer, inner in forwarded.items():
        if moe[inner].default is not dataclasses.MISSING:
            assert gpt[outer].default == moe[inner].default, (outer, inner)
    # Megatron's defaults (transformer_config.py).
    assert moe["capacity_factor"].default is None
    assert moe["aux_loss_coeff"].default == 0.0
    assert moe["topk"].default == 2
    assert moe["load_balancing_type"].default == "aux_loss"


def test_gpt_moe_config_is_what_the_moe_layer_gets():
    from jax_wgrad.functional import MoEConfig

    cfg = GPTConfig(num_moe_experts=4)
    assert cfg.moe_config() == MoEConfig(num_experts=4, ffn_hidden_size=cfg.ffn_hidden_size)
    assert cfg.moe_config().capacity_factor is None and cfg.moe_config().aux_loss_coeff == 0.0
    cfg = GPTConfig(
        num_moe_experts=8,
        moe_router_topk=1,
        moe_ffn_hidden_size=32,
        moe_expert_capacity_factor=1.5,
        moe_pad_expert_input_to_capacity=True,
        moe_aux_loss_coeff=1e-2,
        moe_router_load_balancing_type="none",
        moe_grouped_gemm=True,
        overlap_dispatch_backward_with_experts_wgrad=True,
    )
    assert cfg.moe_config() == MoEConfig(
        num_experts=8,
        ffn_hidden_size=32,
        topk=1,
        capacity_factor=1.5,
        load_balancing_type="none",
        aux_loss_coeff=1e-2,
        overlap_wgrad=True,
    )
    assert GPTConfig().moe_config() is None


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(topk=9), r"moe_router_topk \(9\) must be in \[1, num_moe_experts = 8\]"),
        (dict(capacity_factor=0.0), r"moe_expert_capacity_factor \(0.0\) must be > 0"),
        (dict(load_balancing_type="sinkhorn"), "'sinkhorn' is not supported"),
        (dict(aux_loss_coeff=-1.0), "moe_aux_loss_coeff must be >= 0, got -1.0"),
        (dict(aux_loss_coeff=float("nan")), "moe_aux_loss_coeff must be >= 0, got nan"),
        (dict(num_experts=0), "num_moe_experts must be a positive integer, got 0"),
        (dict(ffn_hidden_size=0), "moe_ffn_hidden_size must be a positive integer, got 0"),
    ],
)
def test_moe_options_are_checked_once_by_moe_config(kw, match):
    """MoEConfig is the one validator of the layer's options: the same message whether it
    is built directly or from GPTConfig's flat fields."""
    from jax_wgrad.functional import MoEConfig

    with pytest.raises(ValueError, match=match):
        MoEConfig(**{"num_experts": 8, "ffn_hidden_size": 16, **kw})
    outer = {v: k for k, v in _forwarded_fields().items()}
    gpt_kw = {outer[k]: v for k, v in kw.items()}
    extra = {"moe_pad_expert_input_to_capacity": True} if "capacity_factor" in kw else {}
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{"num_moe_experts": 8, "moe_ffn_hidden_size": 16, **gpt_kw, **extra})


def test_mesh_shape_has_one_derivation():
    import jax_wgrad.training
    from jax_wgrad.parallel.mesh import axis_sizes, mesh_shape

    par = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    mesh = make_mesh(par)
    assert mesh_shape(mesh) == par.mesh_shape
    assert axis_sizes(par) == dict(mesh.shape)
    assert jax_wgrad.training.mesh_shape is mesh_shape  # the public name still works


def test_stage_setup():
    from jax_wgrad.layout.setup import StageSetup

    par = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        sequence_parallel=True,
        micro_batch_size=2,
        global_batch_size=8,
    )
    setup = StageSetup.create(par, seq_length=16, hidden_size=8, dtype="bfloat16")
    assert (setup.num_stages, setup.num_microbatches, setup.local_seq_length) == (2, 2, 8)
    assert setup.batch_shape == (4, 17) and setup.num_tokens == 2 * 2 * 16
    assert setup.zero_activation().shape == (2, 8, 8)
    assert setup.zero_activation().dtype == jax.numpy.bfloat16
    assert setup.microbatches(jax.numpy.zeros((4, 17), "int32"), "me").shape == (2, 2, 17)
    with pytest.raises(
        ValueError, match=re.escape("me: expected a local batch of shape [4, 17], got [4, 16]")
    ):
        setup.microbatches(jax.numpy.zeros((4, 16), "int32"), "me")
    floats = StageSetup.create(
        par, seq_length=16, hidden_size=8, dtype="float32", sample_shape=(16, 3)
    )
    assert floats.microbatches(jax.numpy.zeros((4, 16, 3)), "me").shape == (2, 2, 16, 3)
    no_sp = ParallelConfig(tensor_model_parallel_size=2, micro_batch_size=2)
    assert (
        StageSetup.create(no_sp, seq_length=16, hidden_size=8, dtype="float32").local_seq_length
        == 16
    )


def test_train_plan_validates_once(monkeypatch):
    """``validate(parallel, model)`` runs once per plan, in :meth:`TrainPlan.create` (the
    example leaves it to the plan)."""
    import optax

    import jax_wgrad.models.gpt.config as gpt_config
    from jax_wgrad import TrainPlan

    calls = []
    real = gpt_config.validate

    def counting(parallel, model):
        calls.append(1)
        return real(parallel, model)

    monkeypatch.setattr(gpt_config, "validate", counting)
    par = ParallelConfig(pipeline_model_parallel_size=2)
    TrainPlan.create(GPTConfig(), par, make_mesh(par), optax.sgd(0.1))
    assert len(calls) == 1
    with pytest.raises(
        ValueError,
        match=re.escape("num_layers (2) must be divisible by pipeline_model_parallel_size (8)"),
    ):
        bad = ParallelConfig(pipeline_model_parallel_size=8)
        TrainPlan.create(GPTConfig(), bad, make_mesh(bad), optax.sgd(0.1))
    import inspect

    from jax_wgrad.pretrain import cli, job, launch

    root = Path(__file__).resolve().parents[1]
    for source in [(root / "examples" / "pretrain_gpt.py").read_text()] + [
        inspect.getsource(m) for m in (job, launch, cli)
    ]:
        assert "validate(" not in source


def test_resume_log_reads_the_saved_layouts_mesh_shape():
    """The resume line's mesh comes from the checkpoint's saved ParallelConfig, derived by
    ParallelConfig.mesh_shape (checkpoints from before EP count as EP = 1)."""
    import dataclasses

    from jax_wgrad.training.loop import _mesh

    par = ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    assert _mesh({"parallel": dataclasses.asdict(par)}) == par.mesh_shape == (2, 2, 1, 2, 1)
    old = {k: v for k, v in dataclasses.asdict(par).items() if k != "expert_model_parallel_size"}
    assert _mesh({"parallel": old}) == (4, 1, 1, 2, 1)
