"""Output files and checkpoint directories of ``examples/pretrain_gpt.py`` fail loudly and
lose nothing: ``--metrics-file`` and ``--report-json`` refuse what is not a regular file of
theirs (left as it was) and append to / overwrite in place what is; a ``--save`` directory
is locked by the run saving there (a second run is refused in one line, the lock goes with
a killed process); a save that does not fit or that the file system refuses is one line,
the step before it intact; a damaged checkpoint is one line with nothing after it;
``XLA_PYTHON_CLIENT_MEM_FRACTION`` outside (0, 1] is refused."""

import argparse
import errno
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from script_util import ROOT
from test_fail_loudly import usage_error

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

TINY = [
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


def one_line_exit_1(pretrain, capsys, argv: list[str]) -> str:
    """``argv`` ends the example with exit code 1 and one error line (returned without the
    program's name)."""
    with pytest.raises(SystemExit) as exc:
        pretrain.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 1, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip().split(": error: ", 1)[1]


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """``{relative path: (size, mtime_ns)}`` of every file under ``directory``."""
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def saved(pretrain, tmp_path_factory) -> Path:
    """A --save directory holding the checkpoint of step 1 of the TINY run."""
    d = tmp_path_factory.mktemp("saved") / "ckpt"
    pretrain.main(TINY + ["--train-iters", "1", "--save", str(d)])
    assert sorted(p.name for p in d.iterdir()) == ["1"]
    return d


# ------------------------------------------------------------------------ --metrics-file


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev-null"])
def test_metrics_file_that_is_not_a_regular_file_is_refused(pretrain, capsys, tmp_path, kind):
    if kind == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
        message = f"--metrics-file {path}: is a FIFO, not a regular file"
    elif kind == "directory":
        path = tmp_path / "dir"
        path.mkdir()
        message = f"--metrics-file {path}: is a directory, not a regular file"
    else:
        path = Path(os.devnull)
        message = f"--metrics-file {path}: is a character device, not a regular file"
    before = os.stat(path)
    usage_error(pretrain, capsys, TINY + ["--metrics-file", str(path)], message)
    after = os.stat(path)
    assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode)
    assert after.st_ino == before.st_ino
    if kind != "dev-null":
        assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # nothing beside it


def test_metrics_file_holding_other_text_is_refused_and_left_as_it_was(pretrain, capsys, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"my notes\nsecond line\n")
    before = path.stat()
    usage_error(
        pretrain,
        capsys,
        TINY + ["--metrics-file", str(path)],
        f"--metrics-file {path}: line 1 ('my notes') is not a metrics record",
    )
    assert path.read_bytes() == b"my notes\nsecond line\n"
    assert path.stat().st_mtime_ns == before.st_mtime_ns


def test_an_existing_metrics_file_is_appended_to(pretrain, tmp_path):
    path = tmp_path / "m.jsonl"
    earlier = '{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n'
    path.write_text(earlier + '{"step": 3, "lo')  # a last line cut short by a killed run
    inode = path.stat().st_ino
    pretrain.main(TINY + ["--train-iters", "2", "--metrics-file", str(path)])
    text = path.read_text()
    assert text.startswith(earlier), text
    steps = [json.loads(line)["step"] for line in text.splitlines()]
    assert steps == [1, 2, 1, 2]  # the earlier run's, then this run's; the torn line gone
    assert path.stat().st_ino == inode


def test_a_resumed_run_cuts_the_redone_records_in_place(tmp_path):
    from jax_wgrad.training.metrics import MetricsWriter

    path = tmp_path / "m.jsonl"
    earlier = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4, 5))
    killed = "".join(json.dumps({"step": s, "loss": 2.0}) + "\n" for s in (1, 2, 3, 4))
    path.write_text(earlier + killed + '{"step": 5')
    inode = path.stat().st_ino
    writer = MetricsWriter(str(path))
    writer.start(2)  # the killed run's checkpoint of step 2: steps 3, 4 are redone
    writer.write({"step": 3, "loss": 3.0})
    writer.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [
        *((s, 1.0) for s in (1, 2, 3, 4, 5)),  # an earlier run's records, whatever their steps
        (1, 2.0),
        (2, 2.0),
        (3, 3.0),
    ]
    assert path.stat().st_ino == inode


# ------------------------------------------------------------------------- --report-json


def _check_report_json(path) -> str | None:
    """The usage error :func:`cli.check_report_json` gives ``--compile-only --report-json
    path`` (``None``: accepted)."""
    from jax_wgrad.pretrain import cli

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise ValueError(message)

    try:
        cli.check_report_json(
            Parser(prog="t"), argparse.Namespace(report_json=str(path), compile_only=True)
        )
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    "content",
    [b"my notes\n", b"[1, 2]\n", b'{"loss": 1.0}\n', b"\x00\x01binary"],
    ids=["text", "json-list", "json-object-of-another-kind", "binary"],
)
def test_report_json_refuses_a_file_that_is_not_a_report(tmp_path, content):
    path = tmp_path / "r.json"
    path.write_bytes(content)
    assert _check_report_json(path) == (
        f"--report-json {path}: holds something other than a --report-json report (it would "
        "be overwritten; name a new file or an earlier report)"
    )
    assert path.read_bytes() == content


def test_report_json_refuses_what_is_not_a_regular_file(pretrain, capsys, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert _check_report_json(fifo) == f"--report-json {fifo}: is a FIFO, not a regular file"
    assert _check_report_json(os.devnull) == (
        f"--report-json {os.devnull}: is a character device, not a regular file"
    )
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
    usage_error(  # through the example, before anything is built
        pretrain,
        capsys,
        ["--compile-only", *TINY, "--report-json", str(fifo)],
        f"--report-json {fifo}: is a FIFO, not a regular file",
    )
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_report_json_accepts_a_new_an_empty_or_an_earlier_report(tmp_path):
    assert _check_report_json(tmp_path / "new" / "r.json") is None
    (tmp_path / "empty.json").write_bytes(b"")
    assert _check_report_json(tmp_path / "empty.json") is None
    report = {"target": "h100", "mesh_shape": [8, 1, 1, 1], "peak_bytes": 1, "budget_bytes": 2}
    (tmp_path / "old.json").write_text(json.dumps(report))
    assert _check_report_json(tmp_path / "old.json") is None


# ------------------------------------------------------ XLA_PYTHON_CLIENT_MEM_FRACTION


@pytest.mark.parametrize("value", ["2", "abc", "0", "-0.5", "nan"])
def test_mem_fraction_outside_0_1_is_refused(pretrain, capsys, monkeypatch, value):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", value)
    usage_error(
        pretrain,
        capsys,
        ["--compile-only", *TINY],
        f"XLA_PYTHON_CLIENT_MEM_FRACTION={value}: must be a number in (0, 1], the share of "
        "the GPU's memory jax may use (unset: 0.75)",
    )


def test_mem_fraction_in_0_1_is_read(monkeypatch):
    from jax_wgrad.aot.compile import mem_fraction

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert mem_fraction() == 0.75
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1")
    assert mem_fraction() == 1.0
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".5")
    assert mem_fraction() == 0.5


# -------------------------------------------------------------------- the --save lock


def test_a_locked_directory_refuses_a_second_checkpointer(saved):
    from jax_wgrad.training.checkpoint import Checkpointer, CheckpointWriteError

    before = snapshot(saved)
    first = Checkpointer(saved)
    first.lock()
    second = Checkpointer(saved)
    with pytest.raises(CheckpointWriteError) as exc:
        second.lock()
    assert str(exc.value) == (
        f"checkpoint directory {saved}: another run is saving checkpoints there (it holds "
        "the directory's lock until it ends); wait for it to end, or save to another directory"
    )
    second.close()
    assert first.latest_step() == 1
    first.close()  # lets go of the directory
    third = Checkpointer(saved)
    third.lock()
    third.close()
    assert snapshot(saved) == before  # nothing of the first's touched


_HOLD_THE_LOCK = """
import sys, time
from jax_wgrad.training.checkpoint import Checkpointer
ckpt = Checkpointer(sys.argv[1])
ckpt.lock()
print("locked", flush=True)
time.sleep(600)
"""


def test_the_lock_of_a_killed_run_is_released(tmp_path):
    from jax_wgrad.training.checkpoint import Checkpointer, CheckpointWriteError

    d = tmp_path / "ckpt"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_THE_LOCK, str(d)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        assert holder.stdout.readline() == "locked\n", holder.stderr.read()
        ckpt = Checkpointer(d)
        with pytest.raises(CheckpointWriteError, match="another run is saving checkpoints"):
            ckpt.lock()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=60)
    assert holder.returncode == -signal.SIGKILL
    ckpt.lock()  # released with the process
    ckpt.close()


@pytest.mark.slow  # two example runs at once (~1 min on 2 cores)
def test_a_second_run_saving_to_the_same_directory_is_refused(tmp_path):
    d = tmp_path / "ckpt"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, str(ROOT / "examples" / "pretrain_gpt.py"), *TINY, "--save", str(d)]
    first = subprocess.Popen(
        [*argv, "--train-iters", "60", "--save-interval", "5", "--log-interval", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    out = ""
    for line in first.stdout:  # saving: the lock is held since before the first step
        out += line
        if "iteration     6/60" in line:
            break
    first.send_signal(signal.SIGSTOP)  # still running when the second one starts
    try:
        second = subprocess.run(
            [*argv, "--train-iters", "60"], capture_output=True, text=True, env=env, timeout=300
        )
    finally:
        first.send_signal(signal.SIGCONT)
    rest, first_err = first.communicate(timeout=600)
    assert second.returncode == 1, second.stderr
    assert second.stderr.strip() == (
        f"pretrain_gpt.py: error: --save {d}: another run is saving checkpoints there (it "
        "holds the directory's lock until it ends); wait for it to end, or save to another "
        "directory"
    )
    assert first.returncode == 0 and "Traceback" not in first_err, first_err
    assert f"checkpoint of step 60 in {d}" in out + rest
    assert {p.name for p in d.iterdir()} == {str(s) for s in range(5, 61, 5)}


# ----------------------------------------------------------------- a full file system


def test_a_save_that_does_not_fit_is_one_line_and_the_step_before_is_intact(
    pretrain, capsys, tmp_path, monkeypatch
):
    import shutil

    d = tmp_path / "ckpt"
    usage = shutil.disk_usage

    def disk_usage(path):  # the disk is full once step 1 is written
        real = usage(path)
        free = 1000 if (d / "1").exists() else real.free
        return type(real)(real.total, real.total - free, free)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    line = one_line_exit_1(
        pretrain, capsys, TINY + ["--train-iters", "3", "--save", str(d), "--save-interval", "1"]
    )
    assert line.startswith(f"--save {d}: 1.0 KiB free, the checkpoint of step 2 needs up to "), line
    assert " bytes); the newest complete checkpoint, step 1, is intact" in line, line
    assert sorted(p.name for p in d.iterdir()) == ["1"]


@pytest.mark.parametrize(
    "when",
    [pytest.param("save", marks=pytest.mark.slow), "wait"],  # suite time: one is enough
)
def test_a_write_the_file_system_refuses_is_one_line_and_nothing_half_written_is_left(
    pretrain, capsys, tmp_path, monkeypatch, when
):
    """The write of step 2 fails with ENOSPC as orbax reports it: at once (an ``OSError``)
    or when the save is waited for (tensorstore's error text), after writing part of it."""
    import orbax.checkpoint as ocp

    d = tmp_path / "ckpt"
    save, wait = ocp.CheckpointManager.save, ocp.CheckpointManager.wait_until_finished
    failed = []

    def half_written(step):
        part = d / f"{step}.orbax-checkpoint-tmp-1234" / "params"
        part.mkdir(parents=True)
        (part / "chunk").write_bytes(b"x" * 100)

    def failing_save(self, step, *args, **kwargs):
        if step != 2:
            return save(self, step, *args, **kwargs)
        half_written(step)
        if when == "save":
            raise OSError(errno.ENOSPC, "No space left on device")
        failed.append(step)
        return True

    def failing_wait(self):
        if failed:
            failed.clear()
            raise ValueError(
                'RESOURCE_EXHAUSTED: Error writing "x" in OCDBT database: Failed to write 190 '
                "bytes to file 15 [os_error_code='28'] [tensorstore_spec='{}']"
            )
        return wait(self)

    monkeypatch.setattr(ocp.CheckpointManager, "save", failing_save)
    monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", failing_wait)
    line = one_line_exit_1(
        pretrain, capsys, TINY + ["--train-iters", "3", "--save", str(d), "--save-interval", "1"]
    )
    assert line.startswith(f"--save {d}: no space left for the checkpoint of step 2 ("), line
    assert " free now, it needs up to " in line, line
    assert line.endswith(" bytes)); the newest complete checkpoint, step 1, is intact"), line
    assert sorted(p.name for p in d.iterdir()) == ["1"]  # the half-written step removed


# ---------------------------------------------------------------- a damaged checkpoint


def test_a_damaged_checkpoint_is_one_line_with_nothing_after_it(saved, tmp_path):
    import shutil

    d = shutil.copytree(saved, tmp_path / "ckpt")
    for chunk in (d / "1").rglob("*"):
        if chunk.is_file() and chunk.parent.name == "d":  # tensorstore's data chunks
            chunk.write_bytes(chunk.read_bytes()[:20])
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "pretrain_gpt.py"),
            *TINY,
            "--train-iters",
            "2",
            "--load",
            str(d),
            "--save",
            str(d),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith(f"pretrain_gpt.py: error: checkpoint {d} step 1 is damaged: ")
    assert len(lines) == 2, run.stderr  # the usage line and the error
    assert "Traceback" not in run.stderr and "Event loop is closed" not in run.stderr
