"""The example as a pretraining user runs it: evaluation, TensorBoard, plots, Megatron-format
data, a true 2-process launch, and the small defects (``--train-iters 0``, a bad
``--data-path``, progress bars in logs)."""

import importlib.util
import io
import json
import os
import re
import socket
import struct
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from script_util import SMALL_GPT

from jax_wgrad.pretrain import cli

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

SMALL = [*SMALL_GPT]
L222 = [
    "--tensor-model-parallel-size",
    "2",
    "--pipeline-model-parallel-size",
    "2",
    "--sequence-parallel",
    "--use-distributed-optimizer",
]
EVAL = ["--eval-interval", "2", "--eval-iters", "2"]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _train_losses(path: Path) -> list[float]:
    return [r["loss"] for r in _rows(path) if "loss" in r]


def _subprocess(args: list[str], **kw) -> subprocess.CompletedProcess:
    """The example as a user starts it: stdout is a pipe, not a terminal."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # the example sets its own device count
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=600, env=env, **kw
    )


@pytest.fixture(scope="module")
def runs(pretrain, tmp_path_factory):
    """The same 4 steps on (2, 2, 2) with and without evaluation (the first also saving
    every 2 steps and writing TensorBoard scalars)."""
    d = tmp_path_factory.mktemp("ux")
    pretrain.main(
        SMALL
        + L222
        + EVAL
        + [
            "--train-iters",
            "4",
            "--no-progress",
            "--metrics-file",
            str(d / "eval.jsonl"),
            "--save",
            str(d / "ckpt"),
            "--save-interval",
            "2",
            "--tensorboard-dir",
            str(d / "tb"),
        ]
    )
    pretrain.main(
        SMALL
        + L222
        + ["--train-iters", "4", "--no-progress", "--metrics-file", str(d / "plain.jsonl")]
    )
    return d


@pytest.mark.slow  # evaluation stays in the default run:
# test_eval_loss_equals_single_device_reference
def test_evaluation_does_not_change_the_training_curve(runs):
    assert _train_losses(runs / "eval.jsonl") == _train_losses(runs / "plain.jsonl")  # bitwise


def test_eval_loss_equals_single_device_reference(runs):
    from jax_wgrad import (
        DDPConfig,
        ParallelConfig,
        TrainPlan,
        default_optimizer,
        init_train_state,
        make_mesh,
    )
    from jax_wgrad.testing import reference_loss
    from jax_wgrad.training import Checkpointer
    from jax_wgrad.training.data import load_data

    valid_rows = [r for r in _rows(runs / "eval.jsonl") if "valid_loss" in r]
    assert [r["step"] for r in valid_rows] == [2, 4]
    _, valid, _ = load_data(None, "98,2,0")
    par = ParallelConfig(micro_batch_size=2, global_batch_size=16)
    ckpt = Checkpointer(runs / "ckpt")
    meta_model = None
    for row in valid_rows:
        if meta_model is None:
            from jax_wgrad import GPTConfig

            meta_model = GPTConfig(
                vocab_size=256, num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32
            )
            plan = TrainPlan.create(
                meta_model, par, make_mesh(par), default_optimizer(1e-3), ddp=DDPConfig()
            )
            fresh = init_train_state(plan, 0)
        state, _ = ckpt.restore(plan, fresh, step=row["step"], load_optim=False)
        params = jax.device_get(state.params)
        ref = np.mean(
            [
                float(reference_loss(params, jnp.asarray(valid.batch(k, 16, 32, 3)), meta_model))
                for k in range(2)
            ]
        )
        assert abs(row["valid_loss"] - ref) <= 1e-5 * ref, (row, ref)
        assert row["valid_ppl"] == pytest.approx(np.exp(row["valid_loss"]), rel=1e-12)


def _tfrecords(path: Path):
    """Records of a TensorBoard event file (TFRecord framing: length, crc, data, crc)."""
    data, pos = path.read_bytes(), 0
    while pos < len(data):
        (n,) = struct.unpack_from("<Q", data, pos)
        yield data[pos + 12 : pos + 12 + n]
        pos += 12 + n + 4


def test_tensorboard_scalars_are_the_metrics(runs):
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, list[tuple[int, float]]] = {}
    for f in (runs / "tb").iterdir():
        for rec in _tfrecords(f):
            ev = Event.FromString(rec)
            for v in ev.summary.value:
                scalars.setdefault(v.tag, []).append((ev.step, v.simple_value))
    rows = _rows(runs / "eval.jsonl")
    for tag, key in [
        ("train/loss", "loss"),
        ("train/grad_norm", "grad_norm"),
        ("train/tokens_per_s", "tokens_per_s"),
        ("valid/loss", "valid_loss"),
        ("valid/ppl", "valid_ppl"),
    ]:
        want = [(r["step"], np.float32(r[key])) for r in rows if key in r]
        assert scalars[tag] == want, tag


def test_plot_metrics_draws_several_runs(runs, tmp_path):
    plot = _load("plot_metrics", ROOT / "examples" / "plot_metrics.py")
    out = tmp_path / "curves.png"
    plot.main([str(runs / "eval.jsonl"), str(runs / "plain.jsonl"), "-o", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(out).shape[:2] == (440, 1650)  # 15 x 4 in at 110 dpi


def test_plot_metrics_bad_input(tmp_path, capsys):
    plot = _load("plot_metrics", ROOT / "examples" / "plot_metrics.py")
    (tmp_path / "bad.jsonl").write_text('{"step": 1, "loss": 1.0}\nnot json\n')
    for files, msg in [
        ([str(tmp_path / "missing.jsonl")], "no such metrics file"),
        ([str(tmp_path / "bad.jsonl")], "bad.jsonl:2: not a JSON line"),
    ]:
        with pytest.raises(SystemExit) as exc:
            plot.main(files + ["-o", str(tmp_path / "x.png")])
        assert exc.value.code == 2 and msg in capsys.readouterr().err


def test_train_iters_zero_runs_no_step(pretrain, tmp_path, capsys):
    summary = pretrain.main(
        SMALL + ["--train-iters", "0", "--no-progress", "--metrics-file", str(tmp_path / "m.jsonl")]
    )
    assert summary["steps"] == 0 and summary["last_loss"] is None
    assert "done: no training step to run" in capsys.readouterr().out
    assert (tmp_path / "m.jsonl").read_text() == ""


def test_bad_data_path_is_an_argparse_error(tmp_path):
    run = _subprocess([str(EXAMPLE), "--data-path", str(tmp_path / "nothing-here")])
    assert run.returncode == 2, run.stderr
    assert "pretrain_gpt.py: error: " in run.stderr and "nothing-here" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.slow  # blends by default: tests/test_data.py (the preprocess tool, split and
# blend) and test_blend_with_an_empty_validation_part_is_named (the example's blend)
def test_megatron_data_blend_trains_without_progress_bar_in_logs(tmp_path):
    """tools/preprocess_data.py writes two datasets; the example trains on their weighted
    blend with a vocabulary sized from the data; stdout is a pipe: no progress bar."""
    for name, package in [("a", json), ("b", importlib)]:
        files = sorted(Path(package.__file__).parent.glob("*.py"))
        run = _subprocess(
            [
                str(ROOT / "tools" / "preprocess_data.py"),
                "--input",
                *map(str, files),
                "--output-prefix",
                str(tmp_path / name),
                "--append-eod",
            ]
        )
        assert run.returncode == 0, run.stderr
    metrics = tmp_path / "m.jsonl"
    run = _subprocess(
        [
            str(EXAMPLE),
            *SMALL,
            "--train-iters",
            "3",
            "--log-interval",
            "1",
            "--data-path",
            "0.3",
            str(tmp_path / "a"),
            "0.7",
            str(tmp_path / "b"),
            "--split",
            "80,20,0",
            "--eval-interval",
            "3",
            "--eval-iters",
            "1",
            "--metrics-file",
            str(metrics),
        ]
    )
    assert run.returncode == 0, run.stderr[-3000:]
    from jax_wgrad.training.data import load_data, padded_vocab_size

    train, _, _ = load_data(["0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b")], "80,20,0")
    assert f"vocab {padded_vocab_size(train.max_token_id, 128)}," in run.stdout
    assert [r["step"] for r in _rows(metrics) if "loss" in r] == [1, 2, 3]
    assert "\r" not in run.stdout + run.stderr and "it/s" not in run.stdout + run.stderr


def test_blend_with_an_empty_validation_part_is_named(tmp_path, capsys, pretrain):
    from jax_wgrad.training.indexed import write_indexed_dataset

    write_indexed_dataset(tmp_path / "many", [np.arange(40) % 7] * 100, np.uint16)
    write_indexed_dataset(tmp_path / "one", [np.arange(400) % 7], np.uint16)
    with pytest.raises(SystemExit):
        pretrain.main(
            SMALL
            + [
                "--data-path",
                "1",
                str(tmp_path / "many"),
                "1",
                str(tmp_path / "one"),
                "--eval-interval",
                "2",
            ]
        )
    err = capsys.readouterr().err
    assert f"leaves 0 tokens ({tmp_path / 'one'}[valid] empty)" in err, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_two_processes(tmp_path: Path, tag: str, extra: list[str]) -> list[Path]:
    port, procs, files = _free_port(), [], []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    for pid in range(2):
        files.append(tmp_path / f"{tag}-p{pid}.jsonl")
        cmd = [
            sys.executable,
            str(EXAMPLE),
            *SMALL,
            *L222,
            "--no-progress",
            "--distributed",
            "--coordinator-address",
            f"127.0.0.1:{port}",
            "--num-processes",
            "2",
            "--process-id",
            str(pid),
            "--num-cpu-devices",
            "4",
            "--metrics-file",
            str(files[-1]),
            *extra,
        ]
        procs.append(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
        )
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
        assert "[Gloo]" not in out, out[:3000]  # gloo's connection chatter is filtered out
    assert "devices: 8 x cpu in 2 process(es)" in outs[0]
    assert not files[1].exists()  # only process 0 writes metrics
    return files


@pytest.mark.slow  # a real 2-process launch (~2 min); tests/test_readme.py's
# --num-processes 2 command runs one too, also in -m slow
def test_two_processes_equal_one_process(pretrain, tmp_path):
    """2 processes x 4 CPU devices (jax.distributed on localhost, gloo collectives) train
    with gradient accumulation fusion, evaluate, save and resume; the curve equals the
    8-device single-process run. (Every process checks the fused handlers on a device of
    its own: process 1 cannot run anything on process 0's devices.)"""
    # No clipping: the global grad norm's cross-process all-reduce runs in gloo, which sums
    # in its own order (below), and a clip factor off by an ulp may move a parameter by an
    # ulp; without clipping the norm never enters the update, so losses are bitwise.
    fused = EVAL + ["--gradient-accumulation-fusion", "--clip-grad", "0"]
    single = tmp_path / "single.jsonl"
    pretrain.main(
        SMALL
        + L222
        + fused
        + ["--train-iters", "6", "--no-progress", "--metrics-file", str(single)]
    )
    ckpt = str(tmp_path / "ckpt")
    first = _launch_two_processes(
        tmp_path, "first", fused + ["--train-iters", "4", "--save", ckpt]
    )[0]
    second = _launch_two_processes(
        tmp_path, "second", fused + ["--train-iters", "6", "--load", ckpt]
    )[0]
    got, want = _rows(first) + _rows(second), _rows(single)
    assert [(r["step"], r.get("loss"), r.get("valid_loss")) for r in got] == [
        (r["step"], r.get("loss"), r.get("valid_loss")) for r in want
    ]  # bitwise
    # The global grad norm's cross-process all-reduce runs in gloo, which sums the squares
    # in its own order: equal up to float32 rounding (2 ulp seen at step 5 of 6).
    for a, b in zip(got, want):
        if "grad_norm" in a:
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6, abs=0)


def _one_error_line(pretrain, capsys, argv: list[str], code: int = 2) -> str:
    """``argv`` ends the example with exit ``code`` and exactly one error line on stderr
    (after argparse's one-line usage), no traceback."""
    with pytest.raises(SystemExit) as exc:
        pretrain.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == code and "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if not ln.startswith("usage: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "nan"], "argument --lr: must be a finite number, got 'nan'"),
        (["--min-lr", "inf"], "argument --min-lr: must be a finite number, got 'inf'"),
        (["--weight-decay=-inf"], "argument --weight-decay: must be a finite number"),
        (["--clip-grad", "NaN"], "argument --clip-grad: must be a finite number"),
        (["--moe-aux-loss-coeff", "nan"], "argument --moe-aux-loss-coeff: must be a finite number"),
        (["--num-cpu-devices", "0"], "argument --num-cpu-devices: must be >= 1, got 0"),
        (
            ["--tensor-model-parallel-size", "0"],
            "argument --tensor-model-parallel-size: must be >= 1",
        ),
    ],
)
def test_bad_numbers_are_refused_naming_the_flag(pretrain, capsys, argv, message):
    assert f"error: {message}" in _one_error_line(pretrain, capsys, argv)


def test_one_flag_per_config_field_with_the_fields_doc_as_help():
    """The CLI's table covers the configs: every field is set by one flag (the dtypes by
    --fp32 / --bf16), except the ones a run does not choose; a field flag's help is its
    field's docstring and its default the field's unless the table gives another."""
    import dataclasses

    from jax_wgrad import DDPConfig, GPTConfig, ParallelConfig
    from jax_wgrad.training.loop import LoopOptions

    unflagged = {
        GPTConfig: {"attention_backend"},
        ParallelConfig: {"world_size"},
        DDPConfig: {"store_param_remainders"},  # Megatron's OptimizerConfig field, no flag
    }
    for config in (GPTConfig, ParallelConfig, DDPConfig, LoopOptions):
        flags = {}
        for flag in cli.FLAGS:
            for name in flag.field if flag.config is config else ():
                flags.setdefault(name, []).append(flag.name)
        fields = {f.name for f in dataclasses.fields(config)}
        assert set(flags) == fields - unflagged.get(config, set()), config
        assert {k: v for k, v in flags.items() if len(v) > 1} == (
            {"compute_dtype": ["--fp32", "--bf16"], "params_dtype": ["--fp32", "--bf16"]}
            if config is GPTConfig
            else {}
        )
    actions = {a.dest: a for a in cli.make_parser()._actions}
    tp = actions["tensor_model_parallel_size"]
    assert tp.help == "Devices a layer's weights are split over (Megatron TP)." and tp.default == 1
    assert actions["hidden_size"].default == 128 != GPTConfig().hidden_size  # the table's
    assert "absent means 4 * --hidden-size" in actions["ffn_hidden_size"].help
    assert actions["normalization"].choices == ("LayerNorm", "RMSNorm")


def test_every_float_flag_is_finite_and_every_flag_has_help():
    parser = cli.make_parser()
    actions = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert [a.option_strings for a in actions if not (a.help or "").strip()] == []
    assert [a.option_strings for a in actions if a.type is float] == []  # finite_float instead
    text = parser.format_help()
    for flag, default in [
        ("--train-iters", "40"),
        ("--lr", "0.002"),
        ("--seed", "1234"),
        ("--moe-aux-loss-coeff", "0.0"),
        ("--split", "98,2,0"),
    ]:
        block = text[text.index(flag + " ") :]
        assert f"(default: {default})" in block[: block.index("\n  --")].replace("\n", " ")
    groups = {
        g.title: [a.option_strings[0] for a in g._group_actions] for g in parser._action_groups
    }
    assert {"--fp32", "--bf16"} <= set(groups["precision"])
    assert {"--num-cpu-devices", "--distributed", "--process-id"} <= set(groups["launch"])
    assert not {"--num-cpu-devices", "--distributed"} & set(groups["parallelism"])


def test_config_errors_name_the_flags(pretrain, capsys):
    line = _one_error_line(
        pretrain, capsys, SMALL + ["--num-layers", "3", "--pipeline-model-parallel-size", "2"]
    )
    assert line.endswith(
        "error: --num-layers (3) must be divisible by --pipeline-model-parallel-size (2)"
    ), line


def test_flag_names_leave_words_alone():
    parser = cli.make_parser()
    assert (
        cli.flag_names(
            parser, "cannot load: hidden_size (4) and ffn_hidden_size, num_moe_experts, world_size"
        )
        == "cannot load: --hidden-size (4) and --ffn-hidden-size, --num-experts, world_size"
    )


class _FakeOOM:
    """Stands in for ``build_train_step``: its compile (or its first call) raises XLA's
    out-of-memory error."""

    def __init__(self, plan, state, at):
        self.at = at

    def lower(self, *args):
        return self

    def compile(self):
        if self.at == "compile":
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123456789 bytes.\n"
                "BufferAssignment OOM Debugging.\n" + "details\n" * 50
            )
        return self

    def __call__(self, state, batch):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory allocating 2147483648 bytes."
        )


@pytest.mark.parametrize(
    "at, where",
    [("compile", "compilation"), pytest.param("step", "first step", marks=pytest.mark.slow)],
)
def test_out_of_memory_is_one_line(pretrain, capsys, monkeypatch, at, where):
    from jax_wgrad.training import loop

    monkeypatch.setattr(loop, "build_train_step", lambda plan, state: _FakeOOM(plan, state, at))
    line = _one_error_line(pretrain, capsys, SMALL + ["--train-iters", "2"], code=1)
    assert (
        f"error: out of memory in the {where}: 4 layers, hidden 32, seq 32, micro batch 2" in line
    ), line
    assert "M parameters, train state " in line and " MiB per device" in line, line
    assert (
        "XLA tried to allocate 117.7 MiB" if at == "compile" else "XLA tried to allocate 2048.0 MiB"
    ) in line, line
    assert line.endswith("(run with --compile-only to see the per-device memory report)")


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_log_lines_are_written_above_the_progress_bar(pretrain, monkeypatch):
    """On a terminal the bar (stderr) and the log (stdout) share a screen: every log line
    starts on a cleared line, never after the bar's text."""
    screen = _Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    pretrain.main(
        [
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--seq-length",
            "16",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "16",
            "--train-iters",
            "3",
            "--log-interval",
            "1",
        ]
    )
    text = screen.getvalue()
    assert "it/s" in text or "s/it" in text  # the bar was drawn
    starts = [m.start() for m in re.finditer(r"iteration +\d+/3", text)]
    assert len(starts) == 3
    assert all(text[s - 1] in "\r\n" for s in starts), text


def test_interrupted_run_resumes_with_each_step_once_in_the_metrics(
    pretrain, tmp_path, capsys, monkeypatch
):
    """Ctrl-C after step 5 (checkpoints at 2 and 4): the run waits for its saves, says where
    to resume, exits 130 without a traceback; the resumed run replaces step 5's record."""
    from jax_wgrad.training.metrics import MetricsWriter

    tiny = [
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "16",
        "--no-progress",
    ]
    ckpt, metrics = str(tmp_path / "ckpt"), tmp_path / "m.jsonl"
    write = MetricsWriter.write

    def write_then_interrupt(self, record):
        write(self, record)
        if record["step"] == 5:
            raise KeyboardInterrupt

    monkeypatch.setattr(MetricsWriter, "write", write_then_interrupt)
    with pytest.raises(SystemExit) as exc:
        pretrain.main(
            tiny
            + [
                "--train-iters",
                "6",
                "--save",
                ckpt,
                "--save-interval",
                "2",
                "--metrics-file",
                str(metrics),
            ]
        )
    out, err = capsys.readouterr()
    assert exc.value.code == 130 and "Traceback" not in err
    assert f"interrupted after step 4; the newest checkpoint is step 4 in {ckpt}" in out
    assert [r["step"] for r in _rows(metrics)] == [1, 2, 3, 4, 5]
    monkeypatch.setattr(MetricsWriter, "write", write)
    pretrain.main(
        tiny
        + ["--train-iters", "6", "--load", ckpt, "--save", ckpt, "--metrics-file", str(metrics)]
    )
    assert [r["step"] for r in _rows(metrics)] == [1, 2, 3, 4, 5, 6]


def test_line_filter_drops_only_gloo_chatter(tmp_path):
    from jax_wgrad.training.console import LineFilter

    with open(tmp_path / "out", "wb") as f:
        with LineFilter(fd=f.fileno()) as quiet:
            os.write(
                f.fileno(),
                b"keep 1\n[Gloo] Rank 0 is connected to 7 peer ranks. Expected "
                b"number of connected peer ranks is : 7\nkeep [Gloo] 2\n",
            )
            os.write(f.fileno(), b"[Gloo] Rank 12 is connected to 1 peer ranks. x\npartial")
            # two threads' messages interleaved, as gloo writes them without a lock
            os.write(
                f.fileno(),
                b"\n[Gloo] Rank [Gloo] Rank 01 is connected to  is connected "
                b"to 11 peer ranks.  peer ranks. Expected number of connected "
                b"peer ranks is : 1\nExpected number of connected peer ranks "
                b"is : 1\nlast",
            )
    assert (tmp_path / "out").read_bytes() == b"keep 1\nkeep [Gloo] 2\npartial\nlast"
    assert quiet.dropped == 4
