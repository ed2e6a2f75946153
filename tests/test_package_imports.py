"""What importing the package costs and where its programs start: ``import jax_wgrad``
imports neither jax nor flax (its names resolve on first use, PEP 562), the launcher of the
pretraining job imports only the standard library, training, interop and the job import one
another without a cycle, and the ``jax-wgrad-pretrain`` console script is the program of
``examples/pretrain_gpt.py``."""

import ast
import os
import runpy
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import jax_wgrad
from jax_wgrad.pretrain import cli, launch

ROOT = Path(__file__).resolve().parents[1]
PKG = Path(jax_wgrad.__file__).parent
SCRIPT = "jax-wgrad-pretrain"


def _fresh(code: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True
    )


def test_import_imports_neither_jax_nor_flax():
    run = _fresh(
        "import sys, jax_wgrad, jax_wgrad.pretrain, jax_wgrad.pretrain.launch\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax')))"
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_every_public_name_resolves_from_a_fresh_import():
    run = _fresh(
        "import jax_wgrad\n"
        "missing = [n for n in jax_wgrad.__all__ if getattr(jax_wgrad, n, None) is None]\n"
        "print(missing, len(jax_wgrad.__all__))"
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["[]", str(len(jax_wgrad.__all__))]


def test_the_lazy_names_are_the_public_names():
    lazy = [*jax_wgrad._WHERE, *jax_wgrad._SUBMODULES]
    assert sorted(lazy) == sorted(jax_wgrad.__all__)
    assert len(set(lazy)) == len(lazy)
    assert set(jax_wgrad.__all__) <= set(dir(jax_wgrad))
    assert jax_wgrad.train_state_from_hf is jax_wgrad.interop.train_state_from_hf
    with pytest.raises(AttributeError, match="no_such_name"):
        jax_wgrad.no_such_name  # noqa: B018


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at module level or inside a function
    (``from package import submodule`` counts as the submodule only)."""
    names = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        names[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
    graph = {}
    for name, path in names.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                subs = {f"{node.module}.{a.name}" for a in node.names}
                found |= (subs & names.keys()) or {node.module}
        deps = set()
        for dep in found:
            while dep and dep not in names:
                dep = dep.rpartition(".")[0]
            if dep.startswith("jax_wgrad") and dep != name:
                deps.add(dep)
        graph[name] = deps
    return graph


def test_training_interop_and_the_job_import_no_cycle():
    """The knot of the first layout (training.cli <-> interop.hf_config, the train step <->
    interop.hf, job <-> launch) stays untied: no module of these tiers reaches itself."""
    graph = _import_graph()
    cycles = []
    for start in graph:
        if not start.startswith(("jax_wgrad.training", "jax_wgrad.interop", "jax_wgrad.pretrain")):
            continue
        seen, todo = set(), [start]
        while todo:
            for dep in graph[todo.pop()] - seen:
                seen.add(dep)
                todo.append(dep)
        if start in seen:
            cycles.append(start)
    assert cycles == []
    training = [m for m in graph if m.startswith("jax_wgrad.training")]
    assert [(m, d) for m in training for d in graph[m] if d.startswith("jax_wgrad.interop")] == []


def test_the_launcher_imports_only_the_standard_library():
    for module in ("launch", "_interrupts"):
        tree = ast.parse((PKG / "pretrain" / f"{module}.py").read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in top if isinstance(n, ast.ImportFrom)]
        outside = [
            n
            for n in names
            if n.split(".")[0] not in sys.stdlib_module_names
            and n not in ("__future__", "jax_wgrad.pretrain._interrupts")
        ]
        assert outside == [], module


def test_the_console_script_is_the_examples_program():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts[SCRIPT].partition(":")
    assert (module, function) == ("jax_wgrad.pretrain.launch", "script")
    example = runpy.run_path(str(ROOT / "examples" / "pretrain_gpt.py"))
    assert example["script"] is launch.script


def _help(capsys, monkeypatch, prog: str, run) -> str:
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr(sys, "argv", [prog, "--help"])
    with pytest.raises(SystemExit) as exc:
        run()
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out == cli.make_parser(os.path.basename(prog)).format_help()
    return out


def test_the_console_script_and_the_example_print_the_same_help(capsys, monkeypatch):
    entry = _help(capsys, monkeypatch, SCRIPT, lambda: launch.script(["--help"]))
    example = str(ROOT / "examples" / "pretrain_gpt.py")
    printed = _help(
        capsys, monkeypatch, example, lambda: runpy.run_path(example, run_name="__main__")
    )
    assert entry.replace(SCRIPT, "pretrain_gpt.py") == printed


def test_the_console_script_refuses_a_bad_flag_as_argparse_does(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [SCRIPT])
    with pytest.raises(SystemExit) as exc:
        launch.script(["--no-such-flag"])
    assert exc.value.code == 2
    assert f"{SCRIPT}: error: unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_the_console_script_runs_in_a_fresh_process():
    """What pip's generated ``jax-wgrad-pretrain`` runs: ``sys.exit(script())``."""
    code = (
        "import sys\nfrom jax_wgrad.pretrain.launch import script\n"
        f"sys.argv[0] = {SCRIPT!r}\nsys.exit(script())"
    )
    run = _fresh(code, "--help")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"usage: {SCRIPT} [flags]")
    assert _fresh(code, "--no-such-flag").returncode == 2


@pytest.mark.skipif(
    not (Path(sys.executable).parent / SCRIPT).exists(),
    reason=f"{SCRIPT} is not installed beside this interpreter (pip install -e . adds it)",
)
def test_the_installed_console_script_prints_the_help():
    run = subprocess.run(
        [str(Path(sys.executable).parent / SCRIPT), "--help"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"usage: {SCRIPT} [flags]")
