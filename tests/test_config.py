"""ParallelConfig / GPTConfig validation and the mesh helper."""

import re

import jax
import pytest

from jax_wgrad import GPTConfig, ParallelConfig
from jax_wgrad.models.gpt import validate
from jax_wgrad.parallel.mesh import AXES, make_mesh


def test_derived_sizes():
    par = ParallelConfig(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, micro_batch_size=2,
        global_batch_size=16, world_size=8,
    )
    assert par.data_parallel_size == 2
    assert par.num_microbatches == 4
    assert par.mesh_shape == (2, 1, 2, 2)  # (data = dp / EP, expert, tensor, pipeline)


def test_global_batch_defaults_to_one_microbatch_per_rank():
    par = ParallelConfig(micro_batch_size=3, world_size=4)
    assert par.global_batch_size == 12 and par.num_microbatches == 1


def test_world_size_defaults_to_device_count():
    assert ParallelConfig().world_size == jax.device_count()


def test_device_count_not_divisible_by_tp_pp():
    with pytest.raises(ValueError, match=re.escape(
        "world size (8) is not divisible by tensor_model_parallel_size (3) x "
        "pipeline_model_parallel_size (1)")):
        ParallelConfig(tensor_model_parallel_size=3, world_size=8)


def test_global_batch_not_divisible():
    with pytest.raises(ValueError, match=re.escape(
        "global batch size (10) is not divisible by micro batch size (2) times data "
        "parallel size (4)")):
        ParallelConfig(tensor_model_parallel_size=2, micro_batch_size=2,
                       global_batch_size=10, world_size=8)


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
        (GPTConfig(num_attention_heads=12, hidden_size=60), 5,
         "num_attention_heads (12) must be divisible by tensor_model_parallel_size (5)"),
        (GPTConfig(num_attention_heads=2, hidden_size=6), 4,
         "num_attention_heads (2) must be divisible by tensor_model_parallel_size (4)"),
        (GPTConfig(num_attention_heads=4, hidden_size=64, ffn_hidden_size=130), 4,
         "ffn_hidden_size (130) must be divisible by tensor_model_parallel_size (4)"),
        (GPTConfig(num_attention_heads=4, hidden_size=64, vocab_size=250), 4,
         "vocab_size (250) must be divisible by tensor_model_parallel_size (4)"),
    ],
)
def test_tp_must_divide_model(model, tp, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(ParallelConfig(tensor_model_parallel_size=tp, world_size=tp * 2), model)


def test_pp_must_divide_layers():
    with pytest.raises(ValueError, match=re.escape(
        "num_layers (3) must be divisible by pipeline_model_parallel_size (2)")):
        validate(ParallelConfig(pipeline_model_parallel_size=2, world_size=8),
                 GPTConfig(num_layers=3))


def test_sequence_parallel_needs_divisible_seq():
    with pytest.raises(ValueError, match=re.escape(
        "seq_length (30) must be divisible by tensor_model_parallel_size (4)")):
        validate(ParallelConfig(tensor_model_parallel_size=4, sequence_parallel=True,
                                world_size=8), GPTConfig(seq_length=30))


def test_gpt_config_heads_divide_hidden():
    with pytest.raises(ValueError, match=re.escape(
        "hidden_size (10) must be divisible by num_attention_heads (4)")):
        GPTConfig(hidden_size=10, num_attention_heads=4)


def test_ffn_default():
    assert GPTConfig(hidden_size=32, num_attention_heads=4).ffn_hidden_size == 128


def test_make_mesh():
    par = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    mesh = make_mesh(par)
    assert mesh.axis_names == AXES
    assert dict(mesh.shape) == {"data": 2, "expert": 1, "tensor": 2, "pipeline": 2}


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
