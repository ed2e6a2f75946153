"""The benchmarks run and print what they promise (tiny sizes; numbers are not checked)."""

import json

import jax
import pytest
from script_util import load_script

from jax_wgrad import fusion_available


def _load(name):
    return load_script(f"benchmarks/{name}.py")


@pytest.mark.slow  # a full fused and plain train step compile (suite time)
@pytest.mark.skipif(not fusion_available("cpu"), reason="the fused step needs the CPU handler")
@pytest.mark.parametrize("unroll, variants", [("1", None), ("2", None), ("1", ["fused", "plain"])])
def test_step_vs_plain_jax_prints_one_json_line(capsys, unroll, variants):
    bench = _load("step_vs_plain_jax")
    bench.main(
        (["--variants", *variants] if variants else [])
        + [
            "--layer-scan-unroll",
            unroll,
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--seq-length",
            "16",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "4",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--peak-tflops",
            "1.0",
        ]
    )
    (line,) = capsys.readouterr().out.strip().splitlines()
    row = json.loads(line)
    for key in ("plain_ms", "fused_ms", "fused_over_plain", "mfu", "peak_tflops", "peak_source"):
        assert key in row, key
    assert row["peak_source"] == "--peak-tflops" and row["fused_ms"] > 0
    # Same parameters and batch: the steps' first losses agree.
    assert abs(row["fused_first_loss"] - row["plain_first_loss"]) < 1e-5
    if variants:  # only the steps asked for are built and timed
        assert not any(k.startswith("unfused") or k.endswith("_unfused") for k in row), row
    else:
        assert abs(row["unfused_first_loss"] - row["plain_first_loss"]) < 1e-5
        assert {"unfused_ms", "unfused_over_plain", "fused_over_unfused"} <= set(row)


def test_step_vs_plain_jax_variants_are_for_measured_runs(capsys):
    bench = _load("step_vs_plain_jax")
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--compile-only", "--variants", "fused", "plain"])
    assert exc.value.code == 2
    assert "--variants fused plain: --compile-only compiles all three" in capsys.readouterr().err


def test_step_vs_plain_jax_cuda_graphs_need_the_layers_unrolled(capsys):
    bench = _load("step_vs_plain_jax")
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--num-layers", "4", "--cuda-graph-scope", "full_iteration"])
    assert exc.value.code == 2
    assert "(--layer-scan-unroll 4), got --layer-scan-unroll 1" in capsys.readouterr().err
    args = bench.parse_args(
        ["--num-layers", "4", "--cuda-graph-scope", "full_iteration", "--layer-scan-unroll", "4"]
    )
    assert bench._config(args).layer_scan_unroll == 4


def test_step_vs_plain_jax_out_of_memory_says_to_time_fewer_steps():
    bench = _load("step_vs_plain_jax")

    class OutOfMemory:
        def run(self, n, record):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9.37GiB")

    with pytest.raises(SystemExit, match=r"3 steps \(fused, unfused, plain\).*--variants"):
        bench._time_interleaved(
            dict.fromkeys(("fused", "unfused", "plain"), OutOfMemory()), 1, 1, 1
        )
    with pytest.raises(jax.errors.JaxRuntimeError):  # one step alone: nothing to drop
        bench._time_interleaved({"fused": OutOfMemory()}, 1, 1, 1)


def test_model_flops_formula():
    bench = _load("step_vs_plain_jax")
    from jax_wgrad import GPTConfig

    cfg = GPTConfig(num_layers=2, hidden_size=64, seq_length=32, vocab_size=256)
    per_token = 2 * (2 * (4 * 64 * 64 + 2 * 64 * 256) + 2 * 32 * 64) + 2 * 64 * 256
    assert bench.model_flops_per_step(cfg, 10) == 3 * per_token * 10


@pytest.mark.skipif(not fusion_available("cpu"), reason="needs the CPU handler")
def test_device_peaks_prints_one_json_line(capsys):
    result = _load("device_peaks").main(
        ["--gemm-sizes", "64", "--dtype", "float32", "--copy-mib", "1", "--iters", "2"]
    )
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line) == result
    assert result["gemm_float32_64_tflops"] > 0 and result["copy_tbps"] > 0
    assert "gemm_efficiency" not in result  # no datasheet for a CPU


def test_wgrad_kernel_prints_rows(capsys):
    _load("wgrad_kernel").main(
        [
            "--cases",
            "64x16x8",
            "4x32x16x8",
            "--dtypes",
            "float32",
            "bfloat16",
            "--warmup",
            "0",
            "--iters",
            "1",
        ]
    )
    rows = [json.loads(l) for l in capsys.readouterr().out.strip().splitlines()]
    assert [r["dtype"] for r in rows] == ["float32"] * 2 + ["bfloat16"] * 2
    assert [r.get("E") for r in rows] == [None, 4] * 2  # the grouped (expert) case
    assert all(r["rel_diff"] <= 1e-4 and r["precision"] == "default" for r in rows)
    for r in rows:  # the traced-position (_at) call beside XLA's own, dense cases only
        at = {"fused_at_ms", "xla_at_ms", "fused_at_over_xla_at", "fused_at_over_fused"}
        assert at <= set(r) if r.get("E") is None else not at & set(r), r


@pytest.mark.skipif(not fusion_available("cpu"), reason="needs the CPU handler")
def test_wgrad_kernel_times_the_fp8_form(capsys):
    """``--dtypes float8``: the FP8 fused op beside XLA's FP8 GEMM plus the add, dense
    cases only (a grouped case is skipped), the same numbers."""
    _load("wgrad_kernel").main(
        ["--cases", "64x16x16", "4x32x16x8", "--dtypes", "float8", "--warmup", "0", "--iters", "1"]
    )
    (row,) = [json.loads(l) for l in capsys.readouterr().out.strip().splitlines()]
    assert row["dtype"].startswith("float8") and row["rel_diff"] <= 1e-4
    assert {"fused_at_ms", "xla_at_ms", "fused_over_xla"} <= set(row), row


def test_wgrad_kernel_bad_case():
    with pytest.raises(SystemExit):
        _load("wgrad_kernel").main(["--cases", "4x16"])


@pytest.mark.skipif(not fusion_available("cpu"), reason="needs the CPU handler")
def test_ragged_gemm_prints_rows(capsys):
    _load("ragged_gemm").main(
        [
            "--rows",
            "64",
            "--hidden",
            "16",
            "--ffn",
            "8",
            "--groups",
            "4",
            "--fractions",
            "1",
            "0.25",
            "--dtypes",
            "bfloat16",
            "--warmup",
            "0",
            "--iters",
            "1",
            "--json",
        ]
    )
    rows = [json.loads(l) for l in capsys.readouterr().out.strip().splitlines()]
    assert [r["routed"] for r in rows] == [1.0, 0.25]
    assert all(r["fwd_fused_ms"] > 0 and r["wgrad_ratio"] > 0 for r in rows)


@pytest.mark.cuda_handler  # set_cuda_kernel needs the CUDA handlers importable (no GPU)
@pytest.mark.skipif(not fusion_available("cpu"), reason="needs the CPU handler")
def test_moe_layer_gpu_row_on_a_cpu_device():
    """The GPU MoE-layer benchmark's case, run on a CPU device at a tiny size (its ``main``
    needs a GPU): every variant timed, the capacity variant the only one dropping."""
    import jax

    row = _load("moe_layer_gpu").run_case((64, 32, 16, 4, 2), 0, 1, jax.devices("cpu")[0])
    for name in ("dropless[auto]", "dropless[wmma]", "capacity=1"):
        assert row[f"{name}_ms"] > 0 and row[f"{name}_kernels"] == "none", row
    assert row["dropless[auto]_dropped"] == row["dropless[wmma]_dropped"] == 0.0
    assert row["capacity=1_vs_capacity1"] == 1.0
