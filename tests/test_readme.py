"""Every code sample and every command of the README and of the user guide (``docs/*.md``)
runs as printed.

Python samples run in-process, each in a fresh namespace. Each ``bash`` block runs in a
fresh directory (with ``examples/``, ``tools/``, ``benchmarks/``, ``docs/`` and ``tests/``
linked in, so relative paths and the ``runs/`` outputs behave as in a checkout), its lines
in order, through ``bash``, with ``.venv/bin/python`` / ``python`` meaning this
interpreter: the virtual environment the README's setup creates is the one running the
tests. A block printed on several pages runs once. Blocks that train are ``slow``; every
block must be classified in :data:`BLOCKS`, so a new command cannot go untested
unnoticed. (The design notes, ``docs/design/``, record how measurements were made; their
commands are not run.)
"""

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import CPU_FIRST_MARK

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
"""The README and the user guide's pages (not ``docs/design/``)."""
TEXTS = [page.read_text() for page in PAGES]
TEXT = TEXTS[0]
SAMPLES = list(
    dict.fromkeys(s for text in TEXTS for s in re.findall(r"```python\n(.*?)```", text, re.S))
)
COMMANDS = list(
    dict.fromkeys(
        textwrap.dedent(block)
        for text in TEXTS
        for block in re.findall(r"^ *```bash\n(.*?)^ *```", text, re.S | re.M)
    )
)

SETUP = re.compile(r"^python3 -m venv \.venv && \.venv/bin/pip install (-q )?-e '\.\[test\]' && ")
"""The README's setup prefix: already done for the interpreter running this test."""

BLOCKS = {
    # a distinctive part of the block: how it is run
    "examples/pretrain_gpt.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
    "--sequence-parallel": "slow",
    "pip install -q -e '.[test]' && .venv/bin/python -m pytest": "skip: it is this test suite",
    "-m jax_wgrad.schedules": "fast",
    "--save runs/ckpt --save-interval 10": "slow",
    "examples/plot_metrics.py": "slow",
    "--output-prefix runs/asyncio --append-eod": "slow",
    "--num-processes 2": "slow",
    'pip install "jax[cuda13]"': "skip: installs jax's CUDA plugin from the network",
    "fusion_status()": "fast",
    "pytest -m gpu": "skip: it is this test suite",
    "benchmarks/pipeline_scaling.py": "slow",
    "tools/convert_hf.py --export": "slow",
    "benchmarks/step_vs_plain_jax.py": "gpu",
    "--compile-only": "skip: needs jax's CUDA plugin (tests/test_aot.py runs it where it is)",
    "--num-layers-per-virtual-pipeline-stage": "slow",
    "--moe-shared-expert-intermediate-size 128": "slow",
    "scale_table.py --list": "skip: needs jax's CUDA plugin (compiles for H100s)",
    "examples/custom_model.py": "slow",
    "--context-parallel-size 2 --sequence-parallel": "slow",
}


def test_readme_has_samples():
    assert len(re.findall(r"```python\n(.*?)```", TEXT, re.S)) >= 3


@pytest.mark.parametrize("index", range(len(SAMPLES)))
def test_readme_sample_runs(index, capsys):
    exec(compile(SAMPLES[index], f"sample {index}", "exec"), {"__name__": "__readme__"})


def _kind(block: str) -> str:
    kinds = [kind for key, kind in BLOCKS.items() if key in block]
    assert len(kinds) == 1, f"classify this command of README.md or docs/ in BLOCKS:\n{block}"
    return kinds[0]


def test_every_readme_command_is_classified():
    assert len(COMMANDS) >= 10
    for block in COMMANDS:
        _kind(block)


def _params():
    out = []
    for i, block in enumerate(COMMANDS):
        kind = _kind(block)
        marks = {"slow": [pytest.mark.slow], "gpu": [pytest.mark.gpu], "fast": []}.get(
            kind, [pytest.mark.skip(reason=kind[len("skip: ") :])]
        )
        first = block.strip().splitlines()[0]
        out.append(pytest.param(block, marks=marks, id=f"{i}-{first[:60]}"))
    return out


def as_run_here(line: str) -> str:
    """A README command line as this test runs it: the setup prefix dropped, the README's
    interpreter replaced by this one."""
    line = SETUP.sub("", line)
    python = shlex.quote(sys.executable)
    line = re.sub(r"(?<![\w/.-])\.venv/bin/python(?=\s)", python, line)
    return re.sub(r"(?<![\w/.-])python(?=\s)", python, line)


def command_env(kind: str, environ: dict[str, str]) -> dict[str, str]:
    """The environment a README command runs in: the test session's, less what the session
    set for itself -- ``XLA_FLAGS`` (the commands set their own device count) and, for a
    GPU command, the ``JAX_PLATFORMS=cpu,cuda`` that ``conftest.py`` put there (inherited,
    it made the CPU jax's default backend, and the GPU benchmark ran there for hours)."""
    env = dict(environ, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    if env.pop(CPU_FIRST_MARK, None) and kind == "gpu":
        env.pop("JAX_PLATFORMS", None)
    return env


@pytest.mark.parametrize("block", _params())
def test_readme_command_runs_as_printed(block, tmp_path):
    for name in ("examples", "tools", "benchmarks", "docs", "tests"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = command_env(_kind(block), dict(os.environ))
    # a command continued over several lines (a trailing backslash) is one line to bash
    for line in re.sub(r"\\\n\s*", " ", block.strip()).splitlines():
        cmd = as_run_here(line)
        run = subprocess.run(
            ["bash", "-c", cmd], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=1800
        )
        assert run.returncode == 0, (line, run.stdout[-2000:], run.stderr[-3000:])
        assert "Traceback" not in run.stderr, (line, run.stderr[-3000:])


def test_a_gpu_command_gets_the_users_platforms():
    session = {"JAX_PLATFORMS": "cpu,cuda", CPU_FIRST_MARK: "1", "XLA_FLAGS": "x", "A": "b"}
    assert command_env("gpu", session) == {"A": "b", "PYTHONUNBUFFERED": "1"}
    assert command_env("slow", session) == {
        "JAX_PLATFORMS": "cpu,cuda",
        "A": "b",
        "PYTHONUNBUFFERED": "1",
    }
    # the user's own JAX_PLATFORMS stays, also for a GPU command
    assert command_env("gpu", {"JAX_PLATFORMS": "cuda"})["JAX_PLATFORMS"] == "cuda"


def test_readme_command_rewrite():
    line = ".venv/bin/python examples/pretrain_gpt.py --x 1 && python -c 'print(1)'"
    got = as_run_here("python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && " + line)
    py = shlex.quote(sys.executable)
    assert got == f"{py} examples/pretrain_gpt.py --x 1 && {py} -c 'print(1)'"
    assert "$(" + py in as_run_here("--input $(.venv/bin/python -c 'x')/*.py")
