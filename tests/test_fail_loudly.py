"""Careless inputs to ``examples/pretrain_gpt.py`` and the tools: each is refused
in one line naming the flag, the value and what is allowed, before anything is compiled;
Ctrl-C at any moment exits 130; the Hugging Face mappings (sliding window, Mixtral's aux-loss
coefficient, the exported context) and the log's preset line."""

import jax
import pytest

from jax_wgrad.pretrain import cli

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

SMALL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "16",
    "--no-progress",
    "--train-iters",
    "2",
]


def usage_error(pretrain, capsys, argv: list[str], message: str) -> str:
    """``argv`` ends the example with an argparse-style error (exit code 2, usage and
    ``pretrain_gpt.py: error: <message>`` on stderr, one error line, no traceback)."""
    with pytest.raises(SystemExit) as exc:
        pretrain.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"error: {message}" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2, err
    return err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "-1"], "argument --lr: must be >= 0, got -1"),
        (["--min-lr", "-0.1"], "argument --min-lr: must be >= 0, got -0.1"),
        (["--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr (0.01) must be <= --lr (0.001)"),
        (["--weight-decay", "-1"], "argument --weight-decay: must be >= 0, got -1"),
        (
            ["--estimate-routing-skew", "0.5"],
            "argument --estimate-routing-skew: must be >= 1, got 0.5",
        ),
        (["--lr-warmup-iters", "-3"], "argument --lr-warmup-iters: must be >= 0, got -3"),
        (
            ["--min-lr", "1e-5", "--lr-warmup-iters", "2"],
            "--lr-warmup-iters (2) must be < --train-iters (2), the steps of the --min-lr decay",
        ),
        (["--norm-epsilon", "-1"], "--norm-epsilon must be > 0, got -1.0"),
        (["--norm-epsilon", "0"], "--norm-epsilon must be > 0, got 0.0"),
        (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
        (["--seed", str(2**32)], f"argument --seed: must be < 4294967296, got {2**32}"),
        (["--init-method-std", "0"], "--init-method-std must be > 0, got 0.0"),
        (
            ["--group-query-attention", "--num-query-groups", "0"],
            "--num-query-groups must be a positive integer, got 0",
        ),
        (
            ["--make-vocab-size-divisible-by", "0"],
            "argument --make-vocab-size-divisible-by: must be >= 1, got 0",
        ),
        (["--wgrad-deferral-limit", "-1"], "Wgrad deferral limit must be >= 0 (got -1)"),
    ],
)
def test_numeric_range(pretrain, capsys, argv, message):
    usage_error(pretrain, capsys, SMALL + argv, message)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--save-interval", "5"],
            "--save-interval 5 needs --save (the directory checkpoints are written to)",
        ),
        (["--eval-iters", "3"], "--eval-iters 3 needs --eval-interval"),
        (["--target", "h200"], "--target h200 needs --compile-only"),
        (["--target-hosts", "2"], "--target-hosts 2 needs --compile-only"),
        (["--estimate-routing-skew", "1.5"], "--estimate-routing-skew 1.5 needs --compile-only"),
        (["--load-fallback-to-intact"], "--load-fallback-to-intact needs --load"),
        (["--no-load-optim"], "--no-load-optim needs --load"),
        (
            ["--defer-mode", "recompute"],
            "--defer-mode recompute needs --defer-embedding-wgrad-compute",
        ),
        (
            ["--rotary-base", "500000"],
            "--rotary-base 500000.0 needs --position-embedding-type rope",
        ),
        (["--rotary-percent", "0.5"], "--rotary-percent 0.5 needs --position-embedding-type rope"),
        (["--use-rope-scaling"], "--use-rope-scaling needs --position-embedding-type rope"),
        (
            ["--position-embedding-type", "rope", "--rope-scaling-factor", "32"],
            "--rope-scaling-factor 32.0 needs --use-rope-scaling",
        ),
        (["--profile-steps", "2"], "--profile-steps 2 needs --profile-dir"),
        (
            ["--cuda-graph-scope", "full_iteration"],
            "--cuda-graph-scope full_iteration needs a CUDA GPU or --compile-only "
            "(XLA:CPU has no CUDA graphs)",
        ),
        (
            ["--cuda-graph-scope", "kernels"],
            "--cuda-graph-scope kernels needs a CUDA GPU or --compile-only "
            "(XLA:CPU has no CUDA graphs)",
        ),
        (["--process-id", "0"], "--process-id 0 needs --distributed"),
        (
            ["--coordinator-address", "localhost:1234"],
            "--coordinator-address localhost:1234 needs --distributed",
        ),
        (
            [
                "--distributed",
                "--coordinator-address",
                "localhost:1",
                "--num-processes",
                "2",
                "--process-id",
                "2",
            ],
            "--process-id (2) must be < --num-processes (2)",
        ),
    ],
)
def test_flag_needs_partner(pretrain, capsys, monkeypatch, argv, message):
    for var in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    usage_error(pretrain, capsys, SMALL + argv, message)


def test_cuda_graphs_of_the_whole_iteration_need_the_layers_unrolled(pretrain, capsys):
    """``--cuda-graph-scope full_iteration`` with a layer loop left: refused, naming the
    unroll it needs (the 4 layers of a stage of 2, then the 2 of a model chunk of 2),
    before anything is compiled (no CUDA plugin needed)."""
    base = SMALL[:1] + ["8"] + SMALL[2:] + ["--compile-only", "--target-gpus", "8"]
    base += ["--pipeline-model-parallel-size", "2", "--cuda-graph-scope", "full_iteration"]
    usage_error(
        pretrain,
        capsys,
        base + ["--layer-scan-unroll", "3"],
        "--cuda-graph-scope full_iteration needs a model chunk's 4 iterations of its layer "
        "loop unrolled (--layer-scan-unroll 4), got --layer-scan-unroll 3",
    )
    usage_error(
        pretrain,
        capsys,
        base + ["--num-layers-per-virtual-pipeline-stage", "2"],
        "--cuda-graph-scope full_iteration needs a model chunk's 2 iterations of its layer "
        "loop unrolled (--layer-scan-unroll 2), got --layer-scan-unroll 1",
    )


def test_cuda_graph_scope_and_xla_flags_setting_the_same_flag(pretrain, capsys, monkeypatch):
    """``XLA_FLAGS`` naming the command-buffer types wins over the library's flags: with
    ``--cuda-graph-scope full_iteration`` that would silently ignore the option."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--compile-only", "--cuda-graph-scope", "full_iteration"],
        "--cuda-graph-scope full_iteration sets --xla_gpu_enable_command_buffer, which "
        "XLA_FLAGS sets already (use one or the other)",
    )


def test_distributed_needs_a_coordinator(pretrain, capsys, monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--distributed"],
        "--distributed needs --coordinator-address (or JAX_COORDINATOR_ADDRESS, or a "
        "SLURM / Open MPI launch)",
    )


@pytest.mark.parametrize("flag", sorted(cli.NOT_BUILT))
def test_megatron_flags_not_built_say_what_is_done_instead(pretrain, capsys, flag):
    err = usage_error(pretrain, capsys, SMALL + [flag], f"{flag} (Megatron) is not built")
    assert cli.NOT_BUILT[flag] in err and "leave the flag out" in err
    assert flag not in pretrain_help(pretrain, capsys)  # not offered as an option


def pretrain_help(pretrain, capsys) -> str:
    with pytest.raises(SystemExit):
        pretrain.main(["--help"])
    return capsys.readouterr().out


def test_no_abbreviations(pretrain, capsys):
    usage_error(pretrain, capsys, SMALL + ["--hidden", "48"], "unrecognized arguments: --hidden")


@pytest.mark.parametrize("flag", ["--metrics-file", "--tensorboard-dir", "--profile-dir"])
def test_unwritable_output_path(pretrain, capsys, tmp_path, flag):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    target = blocker / "sub" / "out"  # below a regular file: can never be created
    usage_error(pretrain, capsys, SMALL + [flag, str(target)], f"{flag} {target}: ")


def test_metrics_file_is_a_directory(pretrain, capsys, tmp_path):
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--metrics-file", str(tmp_path)],
        f"--metrics-file {tmp_path}: is a directory",
    )


# ------------------------------------------------------------------ --load-hf directories

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures" / "hf"


def _copy(family: str, tmp_path):
    import shutil

    return shutil.copytree(FIXTURES / family, tmp_path / family)


def _edit_config(directory, **changes):
    import json

    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def test_hf_config_missing(pretrain, capsys, tmp_path):
    d = _copy("mistral", tmp_path)
    (d / "config.json").unlink()
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--load-hf", str(d)],
        f"--load-hf {d}: {d / 'config.json'}: no such file",
    )


def test_hf_config_not_json(pretrain, capsys, tmp_path):
    d = _copy("mistral", tmp_path)
    (d / "config.json").write_text("{not json")
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--load-hf", str(d)],
        f"--load-hf {d}: {d / 'config.json'}: not valid JSON",
    )


def test_hf_config_missing_a_key(pretrain, capsys, tmp_path):
    # transformers' MistralConfig default (4096) is used, as transformers would; the
    # shards' shapes then disagree, and the refusal names the key left out
    d = _copy("mistral", tmp_path)
    _edit_config(d, hidden_size=None)
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--load-hf", str(d)],
        f"--load-hf {d}: {d / 'model.safetensors'}: tensor 'lm_head.weight' has shape "
        "(128, 64), the config makes it (128, 4096) (config.json leaves out hidden_size "
        "(default 4096): transformers' MistralConfig defaults used)",
    )


def test_hf_only_pytorch_bin(pretrain, capsys, tmp_path):
    d = _copy("mistral", tmp_path)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--load-hf", str(d)],
        f"--load-hf {d}: {d}: neither model.safetensors nor "
        "model.safetensors.index.json (found pytorch_model.bin",
    )


def test_hf_truncated_shard(pretrain, capsys, tmp_path):
    d = _copy("mistral", tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--load-hf", str(d)],
        f"--load-hf {d}: {d / 'model.safetensors'}: not a readable safetensors file",
    )


def test_hf_missing_shard(pretrain, capsys, tmp_path):
    d = _copy("llama", tmp_path)
    (d / "model-00002-of-00002.safetensors").unlink()
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--load-hf", str(d)],
        f"--load-hf {d}: {d / 'model.safetensors.index.json'}: names shard(s) that "
        "are not there: model-00002-of-00002.safetensors",
    )


def test_hf_sliding_window_is_checked_against_seq_length(capsys, tmp_path):
    """Qwen2's window of 32 on layers 2-3 only is inactive for --seq-length 16 (accepted:
    the preset applies) and active for --seq-length 64 (refused, naming the field and the
    run's length; a window on every layer is --window-size)."""
    d = _copy("qwen2", tmp_path)
    _edit_config(d, use_sliding_window=True, sliding_window=32, max_window_layers=2)
    _edit_config(d, layer_types=None)  # transformers' default: from max_window_layers
    parser = cli.make_parser()
    cli.apply_preset(parser, ["--load-hf", str(d), "--seq-length", "16"])
    assert parser.get_default("hidden_size") == 64
    with pytest.raises(SystemExit):
        cli.apply_preset(cli.make_parser(), ["--load-hf", str(d), "--seq-length", "64"])
    assert "max_window_layers=2" in capsys.readouterr().err


def test_hf_vocab_size_names_the_directory(pretrain, capsys, tmp_path):
    d = _copy("mistral", tmp_path)
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(256)) * 200)  # byte 255 > the fixture's vocabulary 128
    usage_error(
        pretrain,
        capsys,
        SMALL
        + [
            "--load-hf",
            str(d),
            "--data-path",
            str(text),
            "--num-layers",
            "4",
            "--hidden-size",
            "64",
        ],
        f"the vocabulary of --load-hf {d} (128) must exceed the data's largest token id 255",
    )


def _hf_mixtral_loss(gate_logits: list, topk: int, coef: float) -> float:
    """transformers' ``load_balancing_loss_func`` (Mixtral) in numpy: all layers' router
    logits concatenated, one loss for the model, times ``router_aux_loss_coef``."""
    import numpy as np

    logits = np.concatenate(gate_logits)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    num_experts = probs.shape[1]
    top = np.argsort(-probs, axis=-1)[:, :topk]
    mask = np.eye(num_experts)[top]  # [L T, k, E]
    tokens_per_expert = mask.mean(0)  # [k, E]
    router_prob_per_expert = probs.mean(0)  # [E]
    return coef * float(np.sum(tokens_per_expert * router_prob_per_expert[None])) * num_experts


def test_mixtral_aux_loss_coefficient_is_mapped_not_copied():
    """Megatron's loss (summed over the MoE layers) with the mapped coefficient equals
    transformers' when every layer routes alike; the export maps it back."""
    import jax.numpy as jnp
    import numpy as np

    from jax_wgrad.functional.moe import load_balancing_loss
    from jax_wgrad.interop import config_from_hf, hf_config_from

    hf = __import__("json").loads((FIXTURES / "mixtral" / "config.json").read_text())
    hf.update(output_router_logits=True, router_aux_loss_coef=0.02)
    cfg = config_from_hf(hf, seq_length=16)
    layers, k = hf["num_hidden_layers"], hf["num_experts_per_tok"]
    assert (layers, k) == (4, 2) and cfg.moe_aux_loss_coeff == pytest.approx(0.02 * k / layers)
    assert hf_config_from(cfg)["router_aux_loss_coef"] == pytest.approx(0.02)

    logits = np.random.default_rng(0).normal(size=(16, hf["num_local_experts"]))
    probs = jax.nn.softmax(jnp.asarray(logits), axis=-1)
    counts = np.eye(logits.shape[1])[np.argsort(-logits, -1)[:, :k]].sum((0, 1))
    megatron = layers * float(
        load_balancing_loss(probs, jnp.asarray(counts), k, cfg.moe_aux_loss_coeff)
    )
    assert megatron == pytest.approx(_hf_mixtral_loss([logits] * layers, k, 0.02), rel=1e-5)


def test_compare_hf_on_an_exported_directory(capsys, tmp_path):
    """An exported directory has no reference logits: one line naming it, no traceback."""
    from script_util import load_script

    d = _copy("mistral", tmp_path)
    (d / "reference.npz").unlink()
    with pytest.raises(SystemExit) as exc:
        load_script("tools/compare_hf.py").main([str(d)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"error: {d}: no reference.npz" in err, err


# ------------------------------------------------------------------------------- Ctrl-C

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _interrupt(after_s: float, extra: list[str] = (), wait_for: str | None = None):
    """Starts the example as a program, sends SIGINT ``after_s`` seconds later (or once
    its stdout shows ``wait_for``); returns ``(exit status, stdout, stderr)``."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    # Ctrl-C as in a terminal: a shell starts a background job (a CI script run with &)
    # with SIGINT ignored and children inherit that, so the example would never see it;
    # the program is exec'd with SIGINT back to its default (no fork-time hook: jax's
    # threads live in this process)
    as_in_a_terminal = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            as_in_a_terminal,
            str(ROOT / "examples" / "pretrain_gpt.py"),
            *SMALL[:-1],
            "200",
            "--log-interval",
            "1",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    out = ""
    if wait_for is not None:
        for line in proc.stdout:
            out += line
            if wait_for in line:
                break
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=300)
    return proc.returncode, out + rest, err


def test_ctrl_c_during_start_up_exits_130_without_a_traceback():
    code, _, err = _interrupt(1.0)  # while the modules are being imported
    assert code == 130 and "Traceback" not in err, (code, err)
    assert "interrupted; no checkpoint was written (no --save)" in err


@pytest.mark.slow  # ~1 min: three runs up to their first steps
@pytest.mark.parametrize("after_s", [5.0, 8.0])
def test_ctrl_c_while_compiling_exits_130_without_a_crash(after_s):
    code, _, err = _interrupt(after_s)
    assert code == 130 and "Traceback" not in err and "Fatal" not in err, (code, err)


@pytest.mark.slow
def test_ctrl_c_while_training_names_the_checkpoint_to_resume_from(tmp_path):
    save = tmp_path / "ckpt"
    code, out, err = _interrupt(
        0.5, ["--save", str(save), "--save-interval", "2"], wait_for="iteration     4/200"
    )
    assert code == 130 and "Traceback" not in err and "Fatal" not in err, (code, err)
    assert f"(resume with --load {save})" in err, err
    assert "interrupted after step" in out, out


# ------------------------------------------------------------------------ vague messages


def test_empty_data_directory_is_named(pretrain, capsys, tmp_path):
    empty = tmp_path / "texts"
    empty.mkdir()
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--data-path", str(empty)],
        f"--data-path '{empty}': a directory with 0 file(s) holding 0 byte(s) of text",
    )


def test_expert_parallelism_without_experts_names_both_flags(pretrain, capsys):
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--expert-model-parallel-size", "2"],
        "--expert-model-parallel-size (2) needs --num-experts",
    )


def test_interleaving_without_pipeline_names_the_flags(pretrain, capsys):
    usage_error(
        pretrain,
        capsys,
        SMALL + ["--virtual-pipeline-model-parallel-size", "2"],
        "--virtual-pipeline-model-parallel-size (2) asks for the interleaved schedule, "
        "which needs --pipeline-model-parallel-size > 1, got 1",
    )


# ------------------------------------------------------------------------- log and tools


def test_the_preset_and_its_overrides_are_named():
    argv = ["--model", "llama3-tiny", "--num-layers", "2", "--seq-length", "32", "--lr", "1e-3"]
    parser = cli.make_parser()
    preset = cli.apply_preset(parser, argv)
    args = parser.parse_args(argv)
    args.given_flags = cli.given_flags(argv)
    assert cli.preset_line(parser, args, preset) == (
        "model preset: --model llama3-tiny; overridden by --num-layers, --seq-length"
    )
    plain = cli.make_parser()
    assert cli.preset_line(plain, plain.parse_args([]), cli.apply_preset(plain, [])) is None


def test_a_resume_past_train_iters_says_why_nothing_runs(pretrain):
    lines = []
    # summarize reads the plan's buffer sizes only; the message comes from out, train_iters
    plan = type(
        "Plan",
        (),
        {
            "layout": type(
                "L",
                (),
                {"buffer": type("B", (), {"num_buckets": 1, "numel": 2, "param_numel": 2})()},
            )()
        },
    )()
    pretrain.summarize(
        plan,
        {
            "losses": [],
            "times": [],
            "start_step": 8,
            "compile_time_s": 0.0,
            "skipped_steps": 0,
            "valid": [],
        },
        lines.append,
        train_iters=6,
    )
    assert lines == [
        "done: no training step to run: the run resumed at step 8 and "
        "--train-iters is 6; pass a --train-iters above 8 to train on"
    ]


def test_plot_metrics_says_what_it_wrote(capsys, tmp_path):
    from script_util import load_script

    metrics = tmp_path / "m.jsonl"
    metrics.write_text(
        '{"step": 1, "loss": 5.0, "grad_norm": 1.0, "tokens_per_s": 10}\n'
        '{"step": 2, "loss": 4.0, "grad_norm": 0.9, "tokens_per_s": 11}\n'
    )
    out = tmp_path / "m.png"
    load_script("examples/plot_metrics.py").main([str(metrics), "-o", str(out)])
    assert out.is_file() and f"wrote {out}" in capsys.readouterr().out


def test_export_keeps_the_templates_max_position_embeddings(tmp_path):
    """A model imported at --seq-length 16 and exported with --hf-template keeps the
    template's context (64), not the training sequence length."""
    import json

    from script_util import load_script

    tool = load_script("tools/convert_hf.py")
    tool.main(
        ["--hf-dir", str(FIXTURES / "llama"), "--out", str(tmp_path / "ckpt"), "--seq-length", "16"]
    )
    tool.main(
        [
            "--export",
            "--load",
            str(tmp_path / "ckpt"),
            "--hf-dir",
            str(tmp_path / "hf"),
            "--hf-template",
            str(FIXTURES / "llama"),
        ]
    )
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["max_position_embeddings"] == 64


_PLATFORMS = """
import os, sys
from jax_wgrad.pretrain.launch import start_jax_on_cpu_without_gpu
assert "jax" not in sys.modules  # the launcher imports no jax
start_jax_on_cpu_without_gpu()
print(os.environ.get("JAX_PLATFORMS"))
"""


@pytest.mark.skipif(
    bool(__import__("glob").glob("/dev/nvidia[0-9]*")), reason="this machine has an NVIDIA device"
)
@pytest.mark.parametrize("plugin, want", [(True, "cpu"), (False, "None")])
def test_an_installed_cuda_plugin_without_a_gpu_stays_quiet(tmp_path, plugin, want):
    """jax's CUDA plugin installed, no NVIDIA device: the run starts jax on the CPU (no
    plugin traceback); without the plugin nothing is set."""
    import os
    import subprocess
    import sys

    from jax_wgrad.pretrain import launch

    if not plugin and launch.cuda_plugin_installed():
        pytest.skip("jax's CUDA plugin is installed here: 'without the plugin' cannot be staged")
    if plugin:  # a stand-in for jax[cuda13]'s plugin module (never imported here)
        (tmp_path / "jax_plugins" / "xla_cuda13").mkdir(parents=True)
        (tmp_path / "jax_plugins" / "xla_cuda13" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", _PLATFORMS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip().splitlines()[-1] == want
