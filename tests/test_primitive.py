"""The one primitive abstraction of the FFI ops (jax_wgrad.ops.primitive): every op is one
FfiPrimitive spec; its rules (impl, abstract eval, lowering with the handler-unavailable
rule or fallback, batching, status) are the shared ones."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_wgrad import ops
from jax_wgrad.ops import primitive, registry
from jax_wgrad.ops.primitive import FfiPrimitive

pytestmark = pytest.mark.skipif(not ops.fusion_available("cpu"), reason="needs the CPU handler")


def _lowered(fn, *args, platform="cpu"):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _without_target(monkeypatch, platform, target):
    metadata = registry.handler_metadata(platform)
    del metadata[target]
    monkeypatch.setitem(registry._METADATA, platform, metadata)
    monkeypatch.setattr(registry, "_VERIFIED", {})


def test_every_op_is_one_spec():
    specs = {op.name: op for op in primitive.defined()}
    assert {name: op.primitive for name, op in specs.items()} == {
        "wgrad_accumulate": ops.wgrad_accumulate_p,
        "wgrad_accumulate_at": ops.wgrad_accumulate_at_p,
        "bucket_add": ops.bucket_add_p,
        "ragged_matmul": ops.ragged_matmul_p,
        "ragged_wgrad_accumulate": ops.ragged_wgrad_accumulate_p,
    }
    assert {op.target for op in specs.values()} == {
        registry.TARGET,
        registry.TARGET_AT,
        registry.BUCKET_ADD_TARGET,
        registry.RAGGED_MATMUL_TARGET,
        registry.RAGGED_WGRAD_TARGET,
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
    names = [c[0] for c in registry._probe_cases()]
    rng = np.random.default_rng(0)
    assert names == [c[0] for op in primitive.defined() for c in op.self_check(rng)]


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
    assert "t" not in {op.name for op in primitive.defined()}


def test_a_bind_must_give_exactly_the_declared_attributes():
    x, dy, acc = jnp.ones((4, 3)), jnp.ones((4, 2)), jnp.zeros((2, 3))
    with pytest.raises(TypeError, match=r"parameters \['offset'\], expected \['offset', 'p"):
        _lowered(functools.partial(ops.wgrad_accumulate_p.bind, offset=0), x, dy, acc)


def test_a_new_op_is_one_spec(monkeypatch):
    # Another primitive on the bucket_add handler, batched sequentially: every rule comes
    # from the spec -- eager impl, abstract eval (the aliased operand), the aliased FFI
    # call with an int64 array attribute, vmap with a per-example accumulator.
    monkeypatch.setattr(primitive, "_DEFINED", dict(primitive._DEFINED))
    spec = FfiPrimitive(
        name="block_add_test",
        target=registry.BUCKET_ADD_TARGET,
        attributes={"offsets": np.int64},
        aliases={0: 0},
        vmap_method="sequential",
        family="bucket_add",
        per_example=(0,),
    )
    assert primitive.defined()[-1] is spec
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
    _without_target(monkeypatch, "cpu", registry.RAGGED_WGRAD_TARGET)
    unbuilt = (
        "its cpu handler module was built without jax_wgrad_ragged_wgrad_accumulate; "
        "rebuild jax_wgrad (pip install .)"
    )
    # The status of its family; a dense model's fusion does not need it.
    assert ops.op_status("cpu") == {**dict.fromkeys(registry.OP_FAMILIES), "ragged": unbuilt}
    assert ops.fusion_status(families="ragged")["cpu"] == f"op family 'ragged': {unbuilt}"
    assert not ops.fusion_available("cpu", families="ragged")
    assert ops.fusion_status()["cpu"] is None and ops.fusion_available("cpu")
    x, dy, sizes, acc = jnp.ones((5, 4)), jnp.ones((5, 3)), jnp.asarray([5]), jnp.zeros((1, 3, 4))
    with pytest.raises(RuntimeError, match="ragged_wgrad_accumulate: the jax_wgrad handler for"):
        _lowered(lambda *a: ops.ragged_wgrad_accumulate(*a), x, dy, sizes, acc)


def test_unavailable_wgrad_handler_is_megatrons_error(monkeypatch):
    # The wgrad ops say it in Megatron's words (naming the platform and the load error).
    monkeypatch.setitem(registry._LOADED, "cpu", "jax_wgrad._wgrad_ffi_cpu was not built")
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
    _without_target(monkeypatch, "cpu", registry.BUCKET_ADD_TARGET)
    fn = lambda b, g: ops.bucket_add(b, [g], [5])
    text = _lowered(fn, bucket, g)
    assert "custom_call" not in text and "dynamic_update_slice" in text
    np.testing.assert_array_equal(jax.jit(fn)(bucket, g), want)
    # Any other platform lowers the fallback too.
    assert "dynamic_update_slice" in _lowered(fn, bucket, g, platform="tpu")
