"""The package's shape: tiers and their imports, axis names, public API, doctests (cohesion,
not a line cap, decides a module's size)."""

import ast
import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import jax_wgrad

PKG = Path(jax_wgrad.__file__).parent
MODULES = sorted(p for p in PKG.rglob("*.py"))

# Import tiers, bottom up: a module may import its own tier and the ones below. The first
# is the foundation: argument checks, and the parallel layout (the mesh with the axis
# names, the parallel config, the schedule tables), which every tier may read; the
# pipeline and the deferral drain live in the `parallel` package too, as a tier of their
# own near the top. A module's tier is that of its longest matching name.
TIERS = [
    (
        "jax_wgrad._validation",
        "jax_wgrad._cuda_probe",
        "jax_wgrad.parallel",
    ),
    ("jax_wgrad.ops",),
    ("jax_wgrad.functional",),
    ("jax_wgrad.nn",),
    ("jax_wgrad.grads", "jax_wgrad.models"),
    ("jax_wgrad.layout",),
    ("jax_wgrad.optim",),
    ("jax_wgrad.parallel.pipeline", "jax_wgrad.parallel.deferred"),
    ("jax_wgrad.training",),
    ("jax_wgrad.interop",),
    ("jax_wgrad.testing", "jax_wgrad.schedules", "jax_wgrad.aot", "jax_wgrad.pretrain"),
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from jax_wgrad import ops` imports the submodule jax_wgrad.ops.
            if node.module != "jax_wgrad":
                out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("jax_wgrad")}


def _tier(name: str) -> int | None:
    found = [
        (len(p), rank)
        for rank, prefixes in enumerate(TIERS)
        for p in prefixes
        if name == p or name.startswith(p + ".")
    ]
    return max(found)[1] if found else None


def test_every_module_is_in_a_tier():
    for path in MODULES:
        name = _module_name(path)
        assert name == "jax_wgrad" or _tier(name) is not None, name


def test_imports_follow_the_tiers():
    bad = []
    for path in MODULES:
        name = _module_name(path)
        if name == "jax_wgrad":
            continue
        own = _tier(name)
        for dep in _imports(path):
            if dep == "jax_wgrad":
                bad.append((name, dep))
                continue
            rank = _tier(dep)
            if rank is not None and rank > own and not dep.startswith(name):
                bad.append((name, dep))
    assert bad == [], bad


def test_grads_do_not_import_the_model():
    for path in (PKG / "grads").rglob("*.py"):
        deps = _imports(path)
        assert not [
            d
            for d in deps
            if d.startswith(("jax_wgrad.models", "jax_wgrad.nn", "jax_wgrad.training"))
        ], path


def _docstrings(tree) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
        # Attribute docstrings: a string expression statement right after an assignment.
        body = getattr(node, "body", [])
        for stmt in body if isinstance(body, list) else []:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                ids.add(id(stmt.value))
    return ids


def test_axis_names_are_spelled_only_in_the_mesh_module():
    names = {"data", "tensor", "pipeline"}
    found = []
    for path in MODULES:
        if path == PKG / "parallel" / "mesh.py":
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docs:
                found.append(f"{path.relative_to(PKG)}:{node.lineno} {node.value!r}")
    assert found == []


def test_public_api():
    required = [
        "DDPConfig",
        "GPTConfig",
        "ParallelConfig",
        "make_mesh",
        "init_params",
        "param_specs",
        "GPTProgram",
        "pipeline_gradients",
        "init_train_state",
        "build_train_step",
        "default_optimizer",
        "shard_batch",
        "plan_buckets",
        "wgrad_accumulate",
        "linear",
        "linear_into_bucket",
    ]
    for name in required:
        assert name in jax_wgrad.__all__ and hasattr(jax_wgrad, name), name
    for name in jax_wgrad.__all__:
        assert hasattr(jax_wgrad, name), name
    # No public name shadows a submodule: jax_wgrad.<submodule> IS the module.
    for info in pkgutil.iter_modules(jax_wgrad.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"jax_wgrad.{info.name}")
        assert getattr(jax_wgrad, info.name) is module, info.name


def _has_doctest(path: Path) -> bool:
    """A docstring of ``path`` (module, class or function) holds a ``>>>`` example."""
    tree = ast.parse(path.read_text(), str(path))
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, defs))]
    parser = doctest.DocTestParser()
    return any(parser.get_examples(ast.get_docstring(n) or "") for n in nodes)


DOCTEST_MODULES = [p for p in MODULES if _has_doctest(p)]


def test_some_module_has_doctests():
    assert DOCTEST_MODULES, "no module of the package has a doctest: test_doctests runs nothing"


@pytest.mark.parametrize("path", DOCTEST_MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_doctests(path):
    module = importlib.import_module(_module_name(path))
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    # Every example found in the source runs (doctest.testmod finds no nested function's).
    assert result.attempted > 0, f"{path.name}: testmod found none of its examples"
    assert result.failed == 0
