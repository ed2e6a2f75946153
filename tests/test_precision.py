"""Matmul precision: jnp.dot's meaning and default, in the op, the linears and the CUDA
lowering (checked by lowering for CUDA on this machine, no GPU needed)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_wgrad import linear, ops
from jax_wgrad.functional import WgradRoutes

SETTINGS = [
    None,
    "bfloat16",
    "tensorfloat32",
    "float32",
    "default",
    "high",
    "highest",
    jax.lax.Precision.HIGH,
    ("float32", "bfloat16"),
]
XLA_NAMES = {"DEFAULT": 0, "HIGH": 1, "HIGHEST": 2}


def _cuda_text(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _dot_precisions(text):
    """Per dot_general of a lowered module: the max operand precision (XLA's number)."""
    out = []
    for line in text.splitlines():
        if "stablehlo.dot_general" in line:
            m = re.search(r"precision = \[(\w+), (\w+)\]", line)
            names = m.groups() if m else re.findall(r"#stablehlo<precision (\w+)>", line)
            out.append(max((XLA_NAMES[n] for n in names), default=0))
    return out


def _custom_call_precisions(text):
    return [int(v) for v in re.findall(r"precision = (\d) : i32", text)]


def test_matmul_precision_mapping():
    assert ops.matmul_precision(None) == 0
    assert ops.matmul_precision("bfloat16") == ops.matmul_precision("default") == 0
    assert ops.matmul_precision("tensorfloat32") == ops.matmul_precision("high") == 1
    assert ops.matmul_precision("float32") == ops.matmul_precision(jax.lax.Precision.HIGHEST) == 2
    assert ops.matmul_precision(("float32", "bfloat16")) == 2  # XLA: max over operands
    with jax.default_matmul_precision("float32"):
        assert ops.matmul_precision(None) == 2
    with jax.default_matmul_precision("tensorfloat32"):
        assert ops.matmul_precision(None) == 1


@pytest.mark.parametrize("bad", ["fp8", 3.5, jax.lax.DotAlgorithmPreset.BF16_BF16_F32])
def test_bad_precision(bad):
    x, dy, acc = jnp.ones((4, 3)), jnp.ones((4, 2)), jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="precision must be None, a jax.lax.Precision"):
        ops.wgrad_accumulate(x, dy, acc, precision=bad)


@pytest.mark.cuda_handler
@pytest.mark.parametrize("precision", SETTINGS)
def test_cuda_lowering_precision_equals_jnp_dot(precision):
    # The fused op must compute at the precision XLA gives jnp.dot with the same argument:
    # on a GPU, TF32 for DEFAULT/HIGH and full fp32 for HIGHEST.
    x, dy, acc = jnp.ones((8, 4)), jnp.ones((8, 3)), jnp.zeros((3, 4))
    ours = _cuda_text(
        lambda x, dy, a: ops.wgrad_accumulate(x, dy, a, precision=precision), x, dy, acc
    )
    xla = _cuda_text(lambda x, dy, a: a + jnp.dot(dy.T, x, precision=precision), x, dy, acc)
    assert _custom_call_precisions(ours) == _dot_precisions(xla)


@pytest.mark.cuda_handler
@pytest.mark.parametrize("context", [None, "float32", "tensorfloat32"])
def test_default_follows_jax_default_matmul_precision(context):
    x, dy, acc = jnp.ones((8, 4)), jnp.ones((8, 3)), jnp.zeros((3, 4))
    fused = lambda x, dy, a: ops.wgrad_accumulate(x, dy, a)
    plain = lambda x, dy, a: a + jnp.dot(dy.T, x)
    if context is None:
        got, want = _cuda_text(fused, x, dy, acc), _cuda_text(plain, x, dy, acc)
    else:
        with jax.default_matmul_precision(context):
            got, want = _cuda_text(fused, x, dy, acc), _cuda_text(plain, x, dy, acc)
    assert _custom_call_precisions(got) == _dot_precisions(want)


@pytest.mark.cuda_handler
def test_cuda_lowering_has_workspace_result():
    x, dy, acc = jnp.ones((8, 4)), jnp.ones((8, 3)), jnp.zeros((3, 4))
    text = _cuda_text(lambda x, dy, a: ops.wgrad_accumulate(x, dy, a), x, dy, acc)
    call = [l for l in text.splitlines() if "@jax_wgrad_wgrad_accumulate" in l]
    assert len(call) == 1
    assert f"-> (tensor<3x4xf32>, tensor<{ops.WORKSPACE_BYTES + 256}xui8>)" in call[0]
    assert "output_tuple_indices = [0], operand_index = 2" in call[0]
    # The CPU lowering has no workspace.
    cpu = jax.jit(lambda x, dy, a: ops.wgrad_accumulate(x, dy, a)).lower(x, dy, acc).as_text()
    assert "xui8" not in cpu


@pytest.mark.parametrize("precision", [None, "float32", "tensorfloat32"])
@pytest.mark.parametrize(
    "fused",
    [
        "plain",
        pytest.param("accumulator", marks=pytest.mark.cuda_handler),
        pytest.param("bucket", marks=pytest.mark.cuda_handler),
    ],
)
def test_linear_gemms_all_use_the_precision(precision, fused):
    # Forward, data gradient and (fused) weight gradient: one precision for all three.
    x, w, b = jnp.ones((8, 4)), jnp.ones((3, 4)), jnp.ones(3)

    def loss(x, w, acc):
        if fused == "plain":
            return jnp.sum(linear(x, w, b, precision=precision))
        if fused == "accumulator":
            return jnp.sum(linear(x, w, b, main_grad=acc, precision=precision))
        routes = WgradRoutes((acc.reshape(-1),))
        return jnp.sum(linear(x, routes.to_bucket(w, 0, 0), b, precision=precision))

    text = _cuda_text(jax.grad(loss, argnums=(0, 1, 2)), x, w, jnp.zeros((3, 4)))
    level = ops.matmul_precision(precision)
    dots = _dot_precisions(text)
    assert dots and set(dots) == {level}
    assert _custom_call_precisions(text) == ([] if fused == "plain" else [level])


@pytest.mark.parametrize("precision", [None, "highest"])
def test_cpu_result_does_not_depend_on_precision(precision):
    # XLA:CPU computes float32 dots in float32 at every precision; so does the handler.
    rng = np.random.default_rng(0)
    x, dy = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(33, 7), (33, 5)])
    acc = jnp.zeros((5, 7))
    got = ops.wgrad_accumulate(x, dy, acc, precision=precision)
    ref = ops.wgrad_accumulate_ref(x, dy, acc, precision=precision)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
