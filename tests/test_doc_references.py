"""Every reference in the documentation points at something that exists.

* A dotted ``jax_wgrad`` name (a module, or a module followed by attributes) in
  ``README.md``, ``docs/**/*.md`` and in the docstrings and comments of the Python files of
  ``jax_wgrad/``, ``tests/``, ``benchmarks/``, ``tools/`` and ``examples/``: the longest
  prefix that is a module is imported and the rest is looked up attribute by attribute (a
  dataclass field counts as an attribute of its class).
* A repository path (under ``jax_wgrad/``, ``examples/``, ``tools/``, ``benchmarks/``,
  ``tests/``, ``docs/``, ``ffi/``, ``.ci/``, or the former ``notes/``) named in those same
  places exists; a path followed by a glob or a placeholder (``*``, ``{``, ``<``) is a
  pattern, not checked. (Another repository's paths are written so that they do not start
  with these folders, e.g. Megatron-LM's ``megatron/core/...``.)
* A relative link of ``README.md`` or ``docs/**/*.md`` resolves (the ``#anchor`` is not
  checked).

The last tests show that each check fails on a bad reference.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PYTHON = sorted(
    path
    for folder in ("jax_wgrad", "tests", "benchmarks", "tools", "examples")
    for path in (ROOT / folder).rglob("*.py")
)

DOTTED = re.compile(r"(?<![\w.])jax_wgrad(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(
    r"(?<![\w./-])((?:jax_wgrad|examples|tools|benchmarks|tests|docs|ffi|notes|\.ci)/[\w./-]*\w)"
    r"([*{<]?)"
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def python_prose(source: str) -> str:
    """The docstrings (every bare string statement: module, class, function and attribute
    docstrings) and the comments of a Python source, one per line."""
    parts = [
        node.value.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    parts += [tok.string for tok in tokens if tok.type == tokenize.COMMENT]
    return "\n".join(parts)


def _import(name: str):
    """The module ``name``, or ``None`` if there is no such module (an import error raised
    from inside an existing module propagates)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name == name or (err.name and name.startswith(err.name + ".")):
            return None
        raise


def resolve(ref: str) -> str | None:
    """``None`` if the dotted ``ref`` names something that exists, else why not."""
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        obj = _import(".".join(parts[:i]))
        if obj is not None:
            break
    else:
        return "no module"
    for j, attr in enumerate(parts[i:], i):
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
        elif dataclasses.is_dataclass(obj) and attr in {f.name for f in dataclasses.fields(obj)}:
            return None  # a field without a class-level default: nothing further to look up
        else:
            return f"{'.'.join(parts[:j])} has no attribute {attr!r}"
    return None


def dotted_problems(text: str) -> list[str]:
    refs = dict.fromkeys(DOTTED.findall(text))
    return [f"{ref}: {why}" for ref in refs if (why := resolve(ref)) is not None]


def path_problems(text: str) -> list[str]:
    out = []
    for path, pattern in dict.fromkeys(PATH.findall(text)):
        if pattern:
            continue
        if not (ROOT / path).exists():
            out.append(f"{path}: no such file or directory")
    return out


def link_problems(text: str, page: Path) -> list[str]:
    out = []
    for target in dict.fromkeys(LINK.findall(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor on the same page
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists():
            out.append(f"link {target}: {path} does not exist")
    return out


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", MARKDOWN, ids=_rel)
def test_markdown_references_resolve(page):
    text = page.read_text()
    problems = dotted_problems(text) + path_problems(text) + link_problems(text, page)
    assert not problems, f"{_rel(page)}:\n" + "\n".join(problems)


def test_python_docstrings_and_comments_reference_what_exists():
    problems = []
    for path in PYTHON:
        prose = python_prose(path.read_text())
        problems += [f"{_rel(path)}: {p}" for p in dotted_problems(prose) + path_problems(prose)]
    assert not problems, "\n".join(problems)


def test_readme_is_short():
    assert (ROOT / "README.md").stat().st_size <= 16 * 1024


# --------------------------------------------------------------- the checks can fail


def test_a_bad_dotted_reference_is_reported():
    assert resolve("jax_wgrad.ops.wgrad_accumulate") is None
    assert resolve("jax_wgrad.optim.DistributedOptimizer.state_to_tree") is None
    assert resolve("jax_wgrad.grads.chunks.Chunks.stage") is None  # a dataclass field
    bad = dotted_problems("see :func:`jax_wgrad.ops.no_such_op` and jax_wgrad.no_such_module.f")
    assert len(bad) == 2 and "no_such_op" in bad[0] and "no_such_module" in bad[1], bad


def test_a_bad_path_and_a_bad_link_are_reported():
    assert path_problems("`examples/pretrain_gpt.py`, `tests/fixtures/hf/*`, `docs/<p>.md`") == []
    assert path_problems("see `benchmarks/no_such_benchmark.py`.") != []
    page = ROOT / "docs" / "pipeline.md"
    assert link_problems("[a](buckets.md#options) [b](https://example.com/x.md)", page) == []
    assert link_problems("[c](no_such_page.md)", page) != []


def test_prose_is_docstrings_and_comments_only():
    source = 'x = "jax_wgrad.nope"  # see jax_wgrad.ops\n\n\ndef f():\n    """jax_wgrad.grads"""\n'
    assert DOTTED.findall(python_prose(source)) == ["jax_wgrad.grads", "jax_wgrad.ops"]


def test_the_cli_reference_is_the_help_text(monkeypatch):
    """docs/cli.md prints ``examples/pretrain_gpt.py --help`` at 80 columns, as it is."""
    from jax_wgrad.pretrain import cli

    monkeypatch.setenv("COLUMNS", "80")
    page = (ROOT / "docs" / "cli.md").read_text()
    printed = re.search(r"```text\n(.*?)```", page, re.S).group(1)
    assert printed == cli.make_parser("pretrain_gpt.py").format_help(), (
        "docs/cli.md is out of date: paste `COLUMNS=80 .venv/bin/python examples/pretrain_gpt.py "
        "--help` into its text block"
    )
