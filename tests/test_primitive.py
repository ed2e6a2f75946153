"""The one primitive abstraction of the FFI ops (jax_wgrad.ops.primitive): every op is one
FfiPrimitive spec; its rules (impl, abstract eval, lowering with the handler-unavailable
rule or fallback, batching, status) are the shared ones."""

import ast
import functools
import importlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad import ops
from jax_wgrad.ops import handlers, primitive, status
from jax_wgrad.ops.primitive import FfiPrimitive

pytestmark = pytest.mark.skipif(not ops.fusion_available("cpu"), reason="needs the CPU handler")


def _lowered(fn, *args, platform="cpu"):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _without_target(monkeypatch, platform, target):
    metadata = handlers.handler_metadata(platform)
    del metadata[target]
    monkeypatch.setitem(handlers._METADATA, platform, metadata)
    monkeypatch.setattr(status, "_VERIFIED", {})


def test_every_op_is_one_spec():
    specs = {op.name: op for op in status.OPS}
    # Every spec the op modules declare is one of the library's ops (and probed).
    declared = {
        v
        for m in ("wgrad", "bucket_add", "ragged")
        for v in vars(importlib.import_module(f"jax_wgrad.ops.{m}")).values()
        if isinstance(v, FfiPrimitive)
    }
    assert declared == set(status.OPS)
    assert {name: op.primitive for name, op in specs.items()} == {
        "wgrad_accumulate": ops.wgrad_accumulate_p,
        "wgrad_accumulate_at": ops.wgrad_accumulate_at_p,
        "bucket_add": ops.bucket_add_p,
        "ragged_matmul": ops.ragged_matmul_p,
        "ragged_wgrad_accumulate": ops.ragged_wgrad_accumulate_p,
    }
    assert {op.target for op in specs.values()} == {
        handlers.TARGET,
        handlers.TARGET_AT,
        handlers.BUCKET_ADD_TARGET,
        handlers.RAGGED_MATMUL_TARGET,
        handlers.RAGGED_WGRAD_TARGET,
    }
    # Positions are int64 attributes; everything else int32.
    int64 = {
        (op.name, k) for op in specs.values() for k, t in op.attributes.items() if t is np.int64
    }
    assert int64 == {
        ("wgrad_accumulate", "offset"),
        ("wgrad_accumulate_at", "base"),
        ("wgrad_accumulate_at", "stride"),
        ("bucket_add", "offsets"),
        ("ragged_wgrad_accumulate", "base"),
        ("ragged_wgrad_accumulate", "stride"),
    }
    # The probe behind fusion_status is the specs' self-checks, in order.
    names = [c[0] for c in status._probe_cases()]
    rng = np.random.default_rng(0)
    assert names == [c[0] for op in status.OPS for c in op.self_check(rng)]


def test_a_spec_must_declare_its_vmap_method_and_result():
    with pytest.raises(ValueError, match="vmap_method must be one of"):
        FfiPrimitive(
            name="t", target="t", attributes={}, aliases={0: 0}, vmap_method="auto", family="dense"
        )
    with pytest.raises(ValueError, match="needs abstract"):
        FfiPrimitive(name="t", target="t", attributes={}, vmap_method=None, family="dense")
    with pytest.raises(ValueError, match="family must be one of"):
        FfiPrimitive(
            name="t", target="t", attributes={}, aliases={0: 0}, vmap_method=None, family="moe"
        )


def test_a_bind_must_give_exactly_the_declared_attributes():
    x, dy, acc = jnp.ones((4, 3)), jnp.ones((4, 2)), jnp.zeros((2, 3))
    with pytest.raises(TypeError, match=r"parameters \['offset'\], expected \['offset', 'p"):
        _lowered(functools.partial(ops.wgrad_accumulate_p.bind, offset=0), x, dy, acc)


def test_a_new_op_is_one_spec():
    # Another primitive on the bucket_add handler, batched sequentially: every rule comes
    # from the spec -- eager impl, abstract eval (the aliased operand), the aliased FFI
    # call with an int64 array attribute, vmap with a per-example accumulator.
    spec = FfiPrimitive(
        name="block_add_test",
        target=handlers.BUCKET_ADD_TARGET,
        attributes={"offsets": np.int64},
        aliases={0: 0},
        vmap_method="sequential",
        family="bucket_add",
        per_example=(0,),
    )
    bind = functools.partial(spec.primitive.bind, offsets=(2,))
    bucket, g = jnp.zeros(8), jnp.arange(1.0, 4.0)
    np.testing.assert_array_equal(bind(bucket, g), [0, 0, 1, 2, 3, 0, 0, 0])
    assert jax.eval_shape(bind, bucket, g) == jax.ShapeDtypeStruct((8,), jnp.float32)
    text = _lowered(bind, bucket, g)
    call = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(call) == 1 and "@jax_wgrad_bucket_add" in call[0], text
    assert "operand_index = 0" in call[0] and "offsets = dense<2> : tensor<1xi64>" in call[0]
    assert "block_add_test" in str(jax.make_jaxpr(bind)(bucket, g))
    got = jax.vmap(bind, in_axes=(None, 0))(bucket, jnp.stack([g, 2 * g]))
    np.testing.assert_array_equal(got, [[0, 0, 1, 2, 3, 0, 0, 0], [0, 0, 2, 4, 6, 0, 0, 0]])


def test_unbuilt_target_is_the_status_and_a_compile_time_error(monkeypatch):
    _without_target(monkeypatch, "cpu", handlers.RAGGED_WGRAD_TARGET)
    unbuilt = (
        "its cpu handler module was built without jax_wgrad_ragged_wgrad_accumulate; "
        "rebuild jax_wgrad (pip install .)"
    )
    # The status of its family; a dense model's fusion does not need it.
    assert ops.op_status("cpu") == {**dict.fromkeys(handlers.OP_FAMILIES), "ragged": unbuilt}
    assert ops.fusion_status(families="ragged")["cpu"] == f"op family 'ragged': {unbuilt}"
    assert not ops.fusion_available("cpu", families="ragged")
    assert ops.fusion_status()["cpu"] is None and ops.fusion_available("cpu")
    x, dy, sizes, acc = jnp.ones((5, 4)), jnp.ones((5, 3)), jnp.asarray([5]), jnp.zeros((1, 3, 4))
    with pytest.raises(RuntimeError, match="ragged_wgrad_accumulate: the jax_wgrad handler for"):
        _lowered(lambda *a: ops.ragged_wgrad_accumulate(*a), x, dy, sizes, acc)


def test_unavailable_wgrad_handler_is_megatrons_error(monkeypatch):
    # The wgrad ops say it in Megatron's words (naming the platform and the load error).
    monkeypatch.setitem(handlers._LOADED, "cpu", "jax_wgrad._wgrad_ffi_cpu was not built")
    x, dy, acc = jnp.ones((4, 3)), jnp.ones((4, 2)), jnp.zeros((2, 3))
    for fn in (
        lambda x, dy, a: ops.wgrad_accumulate(x, dy, a),
        lambda x, dy, a: ops.wgrad_accumulate(x, dy, a.reshape(-1), offset=jnp.int32(0)),
    ):
        with pytest.raises(
            RuntimeError,
            match=r"wgrad_accumulate was called with gradient_accumulation_fusion set to True "
            r"but the jax_wgrad fused weight-gradient handler for platform 'cpu' is not "
            r"available \(jax_wgrad._wgrad_ffi_cpu was not built\).*turn off gradient",
        ):
            _lowered(fn, x, dy, acc)


def test_bucket_add_falls_back_to_xla_without_its_handler(monkeypatch):
    bucket, g = jnp.arange(16.0), jnp.ones((2, 3))
    want = ops.bucket_add_ref(bucket, [g], [5])
    _without_target(monkeypatch, "cpu", handlers.BUCKET_ADD_TARGET)
    fn = lambda b, g: ops.bucket_add(b, [g], [5])
    text = _lowered(fn, bucket, g)
    assert "custom_call" not in text and "dynamic_update_slice" in text
    np.testing.assert_array_equal(jax.jit(fn)(bucket, g), want)
    # Any other platform lowers the fallback too.
    assert "dynamic_update_slice" in _lowered(fn, bucket, g, platform="tpu")


# ---- the ops tier's floors -------------------------------------------------------------


def test_the_ops_tier_has_floors_and_no_cycle():
    # handlers (bottom) <- primitive <- op modules <- status (top) <- the package: every
    # import of the package's own modules sits at module level and points down.
    ops_dir = Path(ops.__file__).parent
    modules = {"jax_wgrad.ops"} | {f"jax_wgrad.ops.{p.stem}" for p in ops_dir.glob("*.py")}
    graph, late = {}, []
    for path in sorted(ops_dir.glob("*.py")):
        name = "jax_wgrad.ops" + ("" if path.stem == "__init__" else f".{path.stem}")
        tree = ast.parse(path.read_text())
        top = set(tree.body)
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names = {a.name for a in node.names}
            else:
                continue
            if any(n.startswith("jax_wgrad") for n in names):
                deps |= names
                if node not in top:
                    late.append(f"{name}:{node.lineno}")
        graph[name] = deps & modules
    assert late == []
    assert graph["jax_wgrad.ops.handlers"] == set()
    assert graph["jax_wgrad.ops.primitive"] == {"jax_wgrad.ops.handlers"}
    assert [m for m, deps in graph.items() if "jax_wgrad.ops.status" in deps] == ["jax_wgrad.ops"]
    assert [m for m, deps in graph.items() if "jax_wgrad.ops" in deps] == []

    def reaches(start, goal, seen=()):
        return any(
            d == goal or (d not in seen and reaches(d, goal, {*seen, d})) for d in graph[start]
        )

    assert [m for m in graph if reaches(m, m)] == []


# ---- the vma and sharding rules ----------------------------------------------------------

AXES = ("a", "b")


def _manual_mesh():
    return jax.make_mesh((4, 2), AXES, axis_types=(AxisType.Auto,) * 2)


def _vma_of(fn, *args, specs, vary=()):
    """The mesh axes ``fn(*args)`` varies over, traced inside ``shard_map(check_vma=True)``:
    each input varies over the axes its spec names, and input ``i`` also over ``vary[i]``."""
    seen = []

    def body(*local):
        extra = [*vary, *[()] * len(local)]
        local = [jax.lax.pcast(x, e, to="varying") if e else x for x, e in zip(local, extra)]
        seen.append(jax.typeof(fn(*local)))
        return ()

    run = jax.shard_map(body, mesh=_manual_mesh(), in_specs=specs, out_specs=(), check_vma=True)
    jax.eval_shape(run, *args)
    return primitive.varying_axes(seen[0])


def _wgrad_args(grouped=False):
    lead = (2,) if grouped else ()
    x, dy = jnp.ones((*lead, 8, 4)), jnp.ones((*lead, 8, 3))
    return x, dy, jnp.zeros((*lead, 3, 4)), jnp.zeros(64)


@pytest.mark.parametrize(
    "call,bind",
    [
        (
            lambda x, dy, acc, flat: ops.wgrad_accumulate(x, dy, acc),
            lambda x, dy, acc, flat: ops.wgrad_accumulate_p.bind(x, dy, acc, offset=0, precision=0),
        ),
        (
            lambda x, dy, acc, flat: ops.wgrad_accumulate(x, dy, flat, offset=jnp.int32(5)),
            lambda x, dy, acc, flat: ops.wgrad_accumulate_at_p.bind(
                x, dy, flat, jnp.int32(5), base=0, stride=1, precision=0
            ),
        ),
        (
            lambda x, dy, acc, flat: ops.bucket_add(flat, [x], [3]),
            lambda x, dy, acc, flat: ops.bucket_add_p.bind(flat, x, offsets=(3,)),
        ),
    ],
    ids=["wgrad_accumulate", "wgrad_accumulate_at", "bucket_add"],
)
def test_an_in_place_result_is_typed_like_its_accumulator(call, bind):
    args = _wgrad_args()
    rows = (P("a"), P("a"), P(), P())  # tokens split over "a"; the accumulators are not
    # The accumulators vary over "a" (and "b"): the result varies exactly as they do.
    for fn in (call, bind):
        assert _vma_of(fn, *args, specs=rows, vary=((), (), ("a",), ("a",))) == {"a"}
        assert _vma_of(fn, *args, specs=rows, vary=((), (), AXES, AXES)) == set(AXES)
    # An accumulator invariant over "a" cannot hold a sum of per-"a" updates: the public
    # function widens it first, as jax widens the operands of its own ops (a pvary, which
    # lowers to nothing) ...
    assert _vma_of(call, *args, specs=rows) == {"a"}
    widened = jax.shard_map(call, mesh=_manual_mesh(), in_specs=rows, out_specs=P("a"))
    assert "pvary[axes=('a',)]" in str(jax.make_jaxpr(widened)(*args))
    # ... and the bare primitive refuses it, naming the cast.
    with pytest.raises(ValueError, match=r"varies over the mesh axes \('a',\) and operand"):
        _vma_of(bind, *args, specs=rows)
    with pytest.raises(ValueError, match=r"jax.lax.pcast\(operand, \('a',\), to='varying'\)"):
        _vma_of(bind, *args, specs=rows)


def test_grouped_and_ragged_in_place_results_are_typed_like_their_accumulators():
    x, dy, acc, _ = _wgrad_args(grouped=True)
    grouped = lambda x, dy, acc: ops.grouped_wgrad_accumulate(x, dy, acc)
    specs = (P(), P(), P())
    assert _vma_of(grouped, x, dy, acc, specs=specs, vary=((), (), ("b",))) == {"b"}
    assert _vma_of(grouped, x, dy, acc, specs=specs, vary=((), ("b",), ())) == {"b"}
    sizes, main_grad = jnp.asarray([3, 5], jnp.int32), jnp.zeros((2, 3, 4))
    ragged = lambda x, dy, s, a: ops.ragged_wgrad_accumulate(x, dy, s, a)
    args, specs = (x[0], dy[0], sizes, main_grad), (P("a"), P("a"), P(), P())
    assert _vma_of(ragged, *args, specs=specs, vary=((), (), (), ("a",))) == {"a"}
    assert _vma_of(ragged, *args, specs=specs, vary=((), (), ("b",), ("a",))) == set(AXES)
    bind = lambda x, dy, s, a: ops.ragged_wgrad_accumulate_p.bind(
        x, dy, s, a, jnp.int32(0), base=0, stride=0, precision=0
    )
    with pytest.raises(ValueError, match=r"ragged_wgrad_accumulate: operand 2 varies .*\('b',\)"):
        _vma_of(bind, *args, specs=specs, vary=((), (), ("b",), ("a",)))


def test_a_new_result_varies_over_the_union_of_its_operands():
    x, w, sizes = jnp.ones((8, 4)), jnp.ones((2, 3, 4)), jnp.asarray([3, 5], jnp.int32)
    matmul = lambda x, w, s: ops.ragged_matmul(x, w, s)
    assert _vma_of(matmul, x, w, sizes, specs=(P(), P(), P())) == set()
    assert _vma_of(matmul, x, w, sizes, specs=(P("a"), P(), P())) == {"a"}
    both = ((), ("b",), ())
    assert _vma_of(matmul, x, w, sizes, specs=(P("a"), P(), P()), vary=both) == set(AXES)
    assert _vma_of(matmul, x, w, sizes, specs=(P(), P(), P()), vary=((), (), ("b",))) == {"b"}


def test_without_check_vma_nothing_varies():
    # The tests above cover every op: ragged_matmul is the only one with a new result.
    assert {op.name for op in status.OPS if op.abstract is not None} == {"ragged_matmul"}
    x, dy, acc, _ = _wgrad_args()
    seen = []

    def body(x, dy, acc):
        seen.append(jax.typeof(ops.wgrad_accumulate(x, dy, acc)))
        return ()

    specs = (P("a"), P("a"), P())
    run = jax.shard_map(body, mesh=_manual_mesh(), in_specs=specs, out_specs=(), check_vma=False)
    jax.eval_shape(run, x, dy, acc)
    assert primitive.varying_axes(seen[0]) == set()


def test_plain_jit_on_sharded_operands():
    # No partitioning rule: XLA runs the custom call on the gathered operands, so the
    # values are the single-device ones; the result of an in-place op keeps its
    # accumulator's sharding where the mesh's axes are Explicit, and an op with a new
    # result refuses operands sharded over Explicit axes, saying how to call it.
    x = jnp.arange(32.0).reshape(8, 4) % 5
    dy = jnp.arange(24.0).reshape(8, 3) % 3
    acc = jnp.ones((3, 4))
    want = ops.wgrad_accumulate_ref(x, dy, acc)
    specs = (P("a"), P("a"), P(None, "b"))
    auto = _manual_mesh()
    args = [jax.device_put(v, NamedSharding(auto, s)) for v, s in zip((x, dy, acc), specs)]
    np.testing.assert_array_equal(jax.jit(ops.wgrad_accumulate)(*args), want)
    explicit = jax.make_mesh((4, 2), AXES, axis_types=(AxisType.Explicit,) * 2)
    w, sizes = jnp.ones((2, 3, 4)), jnp.asarray([3, 5], jnp.int32)
    with jax.set_mesh(explicit):
        args = [jax.device_put(v, NamedSharding(explicit, s)) for v, s in zip((x, dy, acc), specs)]
        got = jax.jit(ops.wgrad_accumulate)(*args)
        np.testing.assert_array_equal(got, want)
        assert got.sharding.spec == P(None, "b")
        with pytest.raises(
            ValueError,
            match=r"ragged_matmul has no partitioning rule: .*operand 0: float32\[8@a,4\]",
        ):
            jax.jit(ops.ragged_matmul)(args[0], w, sizes)
        y = jax.jit(ops.ragged_matmul)(x, w, sizes)
    np.testing.assert_array_equal(y, ops.ragged_matmul_ref(x, w, sizes))
