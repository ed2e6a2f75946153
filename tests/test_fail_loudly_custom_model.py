"""Careless inputs to ``examples/custom_model.py`` and to a layer stack, and the commands the
docs print: each mistake is refused in one line naming the flag (or layer, parameter) and
what is allowed -- the example's flags with ``examples/pretrain_gpt.py``'s messages for the
same mistakes -- and every command printed in the example's docstring, the README and the
user guide starts with the README's interpreter and runs."""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_model.py"

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("custom_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["custom_model"] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


def error_line(example, capsys, argv: list[str]) -> str:
    """``argv`` ends the example with an argparse error (exit 2, no traceback): the message
    of its one error line, the last line of stderr."""
    with pytest.raises(SystemExit) as exc:
        example.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert ": error: " in last and err.count(": error: ") == 1, err
    return last.split(": error: ", 1)[1]


KV_HEADS = (
    "num_kv_heads (2) must be a multiple of --tp (4): each tensor rank holds whole KV groups "
    "(Megatron's num_query_groups rule)"
)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-layers", "0"], "--num-layers must be a positive integer, got 0"),
        (["--num-layers", "-2"], "--num-layers must be a positive integer, got -2"),
        (["--lr", "-1"], "argument --lr: must be >= 0, got -1"),
        (["--lr", "nan"], "argument --lr: must be a finite number, got 'nan'"),
        (["--lr", "inf"], "argument --lr: must be a finite number, got 'inf'"),
        (["--steps", "-1"], "--steps must be an integer >= 0, got -1"),
        (["--dp", "0"], "argument --dp: must be >= 1, got 0"),
        (["--tp", "0"], "argument --tp: must be >= 1, got 0"),
        (["--pp", "-1"], "argument --pp: must be >= 1, got -1"),
        (["--tp", "4"], KV_HEADS),
        (["--tp", "3"], KV_HEADS.replace("(4)", "(3)")),
        (["--pp", "3"], "--num-layers (4) must be divisible by --pp (3)"),
        (
            ["--tp", "2", "--pp", "4", "--dp", "1", "--schedule", "interleaved"],
            "number of layers per pipeline stage (1) must be divisible by "
            "virtual_pipeline_model_parallel_size (2) (--schedule interleaved: 2 model chunks "
            "per stage)",
        ),
        (
            ["--pp", "1", "--schedule", "interleaved"],
            "virtual_pipeline_model_parallel_size (2) asks for the interleaved schedule, which "
            "needs --pp > 1, got 1 (--schedule interleaved: 2 model chunks per stage)",
        ),
        (
            ["--dp", "4"],
            "--dp x --tp x --pp (4 x 2 x 2 = 16) is more than the 8 cpu devices jax has",
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_a_bad_flag_is_one_usage_error(example, capsys, argv, message):
    assert error_line(example, capsys, argv) == message


@pytest.mark.parametrize(
    "argv, pretrain_argv, flags",
    [
        (["--num-layers", "0"], ["--num-layers", "0"], {}),
        (["--lr", "-1"], ["--lr", "-1"], {}),
        (["--lr", "nan"], ["--lr", "nan"], {}),
        (["--steps", "-1"], ["--train-iters", "-1"], {"--train-iters": "--steps"}),
        (
            ["--tp", "0"],
            ["--tensor-model-parallel-size", "0"],
            {"--tensor-model-parallel-size": "--tp"},
        ),
        (
            ["--tp", "1", "--dp", "1", "--pp", "8"],
            ["--pipeline-model-parallel-size", "8", "--num-layers", "4"],
            {"--pipeline-model-parallel-size": "--pp"},
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_the_same_mistake_gets_pretrain_gpts_message(
    example, pretrain, capsys, argv, pretrain_argv, flags
):
    """The example's flags are spelled differently (``--tp``); its messages are
    ``examples/pretrain_gpt.py``'s, word for word, for the same mistake."""
    with pytest.raises(SystemExit):
        pretrain.main(pretrain_argv)
    want = capsys.readouterr().err.strip().splitlines()[-1].split(": error: ", 1)[1]
    for flag, ours in flags.items():
        want = want.replace(flag, ours)
    assert error_line(example, capsys, argv) == want


def test_the_model_refuses_a_tensor_size_that_splits_a_kv_group(example):
    cfg = example.LlamaConfig()
    with pytest.raises(ValueError, match=r"num_kv_heads \(2\).*tensor_model_parallel_size \(4\)"):
        cfg.build(tp_size=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads"):
        example.LlamaConfig(num_kv_heads=3)
    with pytest.raises(ValueError, match="num_layers must be a positive integer, got 0"):
        example.LlamaConfig(num_layers=0)


def test_a_usage_error_from_the_command_line_exits_2_with_one_line():
    """As a program: exit status 2, the usage then one error line, no traceback, nothing on
    stdout (the model's refusal of ``--tp 4``, the case that was a reshape traceback)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--tp", "4"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and run.stdout == "", run.stderr
    assert run.stderr.strip().splitlines()[-1] == f"custom_model.py: error: {KV_HEADS}"


# ------------------------------------------------------------- jax's CUDA plugin, no GPU

_IMPORT_EXAMPLE = """
import importlib.util, os, sys
from jax_wgrad.pretrain import launch

called = []
helper = launch.start_jax_on_cpu_without_gpu
def recording():
    called.append("jax" in sys.modules)
    helper()
launch.start_jax_on_cpu_without_gpu = recording

spec = importlib.util.spec_from_file_location("custom_model", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules["custom_model"] = module
spec.loader.exec_module(module)
print(called, os.environ.get("JAX_PLATFORMS"))
"""


@pytest.mark.skipif(
    bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg")),
    reason="this machine has an NVIDIA device",
)
def test_the_example_starts_jax_on_the_cpu_when_the_cuda_plugin_has_no_gpu(tmp_path):
    """jax's CUDA plugin installed, no NVIDIA device: the example calls the launcher's
    :func:`~jax_wgrad.pretrain.launch.start_jax_on_cpu_without_gpu` once, before jax is
    imported, so jax starts on the CPU (as ``examples/pretrain_gpt.py`` does) instead of
    opening with the plugin's failed initialisation."""
    plugin = tmp_path / "jax_plugins" / "xla_cuda13"  # a stand-in for jax[cuda13]'s module
    plugin.mkdir(parents=True)
    (plugin / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = str(tmp_path)
    run = subprocess.run(
        [sys.executable, "-c", _IMPORT_EXAMPLE, str(EXAMPLE)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[False] cpu", run.stdout


# ------------------------------------------------------------- the docstring's commands


def docstring_commands(example) -> list[list[str]]:
    """The example's flags in each command its docstring prints (``.venv/bin/python
    examples/custom_model.py ...``, continued over lines by a backslash)."""
    text = re.sub(r"\\\n\s*", " ", example.__doc__)
    out = []
    for line in text.splitlines():
        if line.strip().startswith(".venv/bin/python examples/custom_model.py"):
            out.append(shlex.split(line.split("#")[0])[2:])
    return out


def test_the_docstring_prints_commands(example):
    commands = docstring_commands(example)
    assert len(commands) >= 3 and [] in commands, commands
    assert any("interleaved" in argv for argv in commands), commands


def test_every_docstring_command_is_a_valid_layout(example):
    """Each command's flags pass every check and make a plan (fast: nothing compiled)."""
    for argv in docstring_commands(example):
        parser = example.make_parser()
        args = parser.parse_args(argv)
        plan, _ = example.plan_of(parser, args)
        assert plan.parallel.world_size == 8, argv


@pytest.mark.slow
def test_every_docstring_command_runs_a_step(example):
    """Each command as printed (the README's interpreter being this one), for one step:
    exit status 0, a finite loss, no traceback."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    for argv in docstring_commands(example):
        run = subprocess.run(
            [sys.executable, "examples/custom_model.py", *argv, "--steps", "1"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert run.returncode == 0, (argv, run.stderr[-3000:])
        assert "Traceback" not in run.stderr, (argv, run.stderr[-3000:])
        assert re.search(r"step +1  loss \d+\.\d+$", run.stdout.strip()), (argv, run.stdout)


# -------------------------------------------------------------- layers built differently


def test_layers_of_different_shapes_are_refused_naming_the_layer_and_parameter(example):
    """A layer stack whose layer 2 has a narrower MLP: refused naming the layer, the
    parameter and both shapes (it used to fail in ``jnp.stack``, naming no layer)."""

    class Odd(example.Llama):
        def __init__(self, cfg, *, tp_size=1, sequence_parallel=False, rngs):
            super().__init__(cfg, tp_size=tp_size, sequence_parallel=sequence_parallel, rngs=rngs)
            tp = dict(tp_size=tp_size, sequence_parallel=sequence_parallel)
            self.layers[2] = example.Block(dataclasses.replace(cfg, ffn_hidden_size=64), tp, rngs)

    @dataclasses.dataclass(frozen=True)
    class OddConfig(example.LlamaConfig):
        def build(self, *, tp_size=1, sequence_parallel=False, rngs):
            return Odd(self, tp_size=tp_size, sequence_parallel=sequence_parallel, rngs=rngs)

    with pytest.raises(ValueError) as exc:
        OddConfig().init_params(0)
    assert str(exc.value).startswith(
        "OddConfig: layer 2's parameter ['mlp']['fc1']['weight'] has shape (2, 64, 64), "
        "layer 0's shape (2, 128, 64): every layer must be built alike"
    ), exc.value


def test_a_layer_with_a_parameter_the_first_lacks_is_refused(example):
    cfg = example.LlamaConfig(num_layers=2)
    state = nnx.to_pure_dict(nnx.state(cfg.build(rngs=nnx.Rngs(0))))
    state["layers"][1]["extra"] = jax.numpy.zeros(3)
    with pytest.raises(ValueError, match=r"layer 1's parameter \['extra'\] has shape \(3,\), "):
        cfg.canonical_params(state)
    del state["layers"][1]["extra"]
    del state["layers"][1]["ln1"]
    with pytest.raises(ValueError, match=r"layer 1's parameter \['ln1'\]\['scale'\] has no such"):
        cfg.canonical_params(state)


# ------------------------------------------------------- commands in the README and docs

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BARE_PYTHON = re.compile(r"python3? ")
SETUP = "python3 -m venv "
"""The README's setup: creating the virtual environment needs the system's interpreter."""


def printed_commands(text: str) -> list[str]:
    """The commands of a Markdown page: every line of its fenced blocks (not ``python``
    code) and every code span, split at ``&&``, ``||``, ``;``, ``|`` and ``$(``, without a
    leading prompt (``$ ``) or environment assignments (``XLA_FLAGS=... ``)."""
    pieces = []
    fences = re.compile(r"^ *```(\w*)\n(.*?)^ *```", re.S | re.M)
    for lang, body in fences.findall(text):
        if lang != "python":
            pieces += body.splitlines()
    prose = fences.sub("", text)
    pieces += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]
    out = []
    for piece in pieces:
        for command in re.split(r"&&|\|\||;|\||\$\(", piece):
            command = re.sub(r"^\s*(\$ )?((\w+=\S*) +)*", "", command)
            out.append(command)
    return out


def test_printed_commands_split_as_a_shell_would():
    page = "`A=1 python x.py` and\n```bash\n$ .venv/bin/python a && python3 b\n```\n"
    assert printed_commands(page) == [".venv/bin/python a ", "python3 b", "python x.py"]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_printed_command_uses_the_readmes_interpreter(page):
    """The README installs into ``.venv``: a command printed with a bare ``python`` runs
    another interpreter (without the package) when typed as shown."""
    bare = [
        c
        for c in printed_commands(page.read_text())
        if BARE_PYTHON.match(c) and not c.startswith(SETUP)
    ]
    assert not bare, f"{page.relative_to(ROOT)}: use .venv/bin/python in {bare}"
