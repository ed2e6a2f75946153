"""The dropless MoE layer (tokens sorted by expert, ragged grouped GEMMs) and
expert tensor parallelism, against the dense single-device reference (every token
through its top-k experts, nothing dropped), skewed routing included; the delayed expert
wgrad's order on the ragged path (HLO); the example's MoE flags fail loudly. The expert
GEMM FLOPs: tests/test_moe_flops.py. The exact-size exchange (``ragged_all_to_all``, emulated
on CPU) against a numpy model of its semantics, and its receive-buffer bound."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from script_util import SMALL_GPT

from jax_wgrad.functional import MoEConfig, moe_mlp
from jax_wgrad.functional.moe import ROUTER_SCOPE
from jax_wgrad.functional.moe_dispatch import (
    EMULATED_EXCHANGE_SCOPE,
    group_by_expert,
    ragged_all_to_all,
    receive_rows,
)
from jax_wgrad.ops import fusion_available
from jax_wgrad.parallel.mesh import EXPERT, TENSOR
from jax_wgrad.testing import reference_moe_mlp

pytestmark = [
    pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices"),
    pytest.mark.skipif(
        not fusion_available("cpu", families=("dense", "ragged")),
        reason="the ragged GEMMs need the CPU FFI handlers",
    ),
]

E, H, F, T = 8, 16, 32, 12  # experts, hidden, expert ffn, tokens per (expert, tensor) rank


def _params(skewed: bool, swiglu: bool = False, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 4)
    router = jax.random.normal(k[0], (E, H))
    if skewed:  # expert 0 takes most first choices, expert E-1 none at all
        u = jnp.ones((H,)) / np.sqrt(H)
        router = 0.3 * router + 4.0 * jnp.outer(jnp.eye(E)[0] - 3 * jnp.eye(E)[E - 1], u)
    fc1 = (E, 2, F, H) if swiglu else (E, F, H)
    return {
        "router": router,
        "fc1": jax.random.normal(k[1], fc1) / np.sqrt(H),
        "fc2": jax.random.normal(k[2], (E, H, F)) / np.sqrt(F),
    }


def _data(n: int, skewed: bool, seed: int = 1):
    kx, kr = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (n, H))
    if skewed:
        x = x + 2.0 / np.sqrt(H) * H**0.5
    return x, jax.random.normal(kr, (n, H))


def _sharded(cfg: MoEConfig, ep: int, tp: int, etp: int, fused: bool, folded: bool = False):
    """jitted ``(params, x, r) -> (loss, grads, dx, counts, overflow)`` on an (expert,
    tensor) mesh:
    every rank its own ``T`` tokens (a tensor rank: its slice of the sequence), ``E/EP``
    experts, their ``F / etp`` features with expert tensor parallelism; ``folded``
    (Megatron's parallel folding, etp 1): the experts split over ``(expert, tensor)``,
    ``E / (ep tp)`` on each rank."""
    n = ep * tp * T
    f_axis = TENSOR if etp > 1 else None
    e_axis = (EXPERT, TENSOR) if folded else EXPERT
    specs = {
        "router": P(),
        "fc1": P(e_axis, *([None] if cfg.swiglu else []), f_axis, None),
        "fc2": P(e_axis, None, f_axis),
    }

    def local(p, x, r):
        sizes = (p["fc1"].size, p["fc2"].size)

        def loss(p, bucket, x):
            kw = dict(
                expert_axis=e_axis,
                sequence_axis=TENSOR,
                expert_tensor_axis=TENSOR if etp > 1 else None,
            )
            if fused:
                (y, bucket), stats = moe_mlp(p, x, cfg, buckets=(bucket, 0, sizes[0]), **kw)
            else:
                y, stats = moe_mlp(p, x, cfg, **kw)
            return jnp.sum(y * r) / n + stats.aux_loss, (bucket, stats)

        bucket = jnp.zeros(sum(sizes), jnp.float32)
        (value, (_, stats)), (dp, dbucket, dx) = jax.value_and_grad(
            loss, argnums=(0, 1, 2), has_aux=True
        )(p, bucket, x)
        if fused:
            dp = dict(
                dp,
                fc1=dbucket[: sizes[0]].reshape(p["fc1"].shape),
                fc2=dbucket[sizes[0] :].reshape(p["fc2"].shape),
            )
        dp["router"] = jax.lax.psum(dp["router"], (EXPERT, TENSOR))
        if etp == 1 and not folded:  # experts replicated over the tensor ranks: each saw
            # its own tokens
            dp["fc1"], dp["fc2"] = (jax.lax.psum(dp[k], TENSOR) for k in ("fc1", "fc2"))
        counts = jax.lax.psum(stats.tokens_per_expert, (EXPERT, TENSOR))
        overflow = jax.lax.psum(stats.overflow_rows, (EXPERT, TENSOR))
        return jax.lax.psum(value, (EXPERT, TENSOR)), dp, dx, counts, overflow

    mesh = Mesh(np.array(jax.devices()[: ep * tp]).reshape(ep, tp), (EXPERT, TENSOR))
    tokens = P((EXPERT, TENSOR))
    return jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(specs, tokens, tokens),
            out_specs=(P(), specs, tokens, P(), P()),
            check_vma=False,
        )
    )


def _reference(params, x, r, cfg, ep, tp):
    """Per expert rank the whole sequence of its tensor ranks (the aux loss's ``T``)."""
    total, seq = 0.0, tp * T
    for i in range(ep):
        y, aux = reference_moe_mlp(params, x[i * seq : (i + 1) * seq], cfg)
        total = total + jnp.sum(y * r[i * seq : (i + 1) * seq]) / (ep * seq) + aux
    return total


def _check(
    ep,
    tp,
    etp,
    topk,
    fused,
    skewed,
    capacity=None,
    swiglu=False,
    buffer_factor=None,
    permute_fusion=False,
    folded=False,
):
    cfg = MoEConfig(
        num_experts=E,
        ffn_hidden_size=F,
        topk=topk,
        capacity_factor=capacity,
        aux_loss_coeff=1e-2,
        swiglu=swiglu,
        dropless_buffer_factor=buffer_factor,
        permute_fusion=permute_fusion,
    )
    params, (x, r) = _params(skewed, swiglu), _data(ep * tp * T, skewed)
    loss, grads, dx, counts, overflow = _sharded(cfg, ep, tp, etp, fused, folded)(params, x, r)
    assert float(overflow) == 0.0
    want, (wgrads, wdx) = jax.value_and_grad(_reference, argnums=(0, 1))(params, x, r, cfg, ep, tp)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    for name in params:
        g, w = np.asarray(grads[name]), np.asarray(wgrads[name])
        assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max(), name
    assert np.abs(np.asarray(dx) - wdx).max() <= 1e-5 * np.abs(wdx).max()
    counts = np.asarray(counts)
    assert counts.sum() == ep * tp * T * topk
    if skewed:  # one expert gets most first choices, one gets no token at all
        assert counts[0] >= 0.8 * ep * tp * T and counts[E - 1] == 0, counts


def _grid(cases, default):
    """``cases`` as params; those not in ``default`` marked slow (test_moe.py's
    test_no_drop_equals_dense_reference covers EP 1, 2, 4 x top-1, top-2 without skew, its
    default EP 4, top-2)."""
    return [pytest.param(*c, marks=[] if c in default else [pytest.mark.slow]) for c in cases]


@pytest.mark.parametrize(
    "ep, topk, skewed",
    _grid(
        [(ep, k, s) for ep in (1, 2, 4) for k in (1, 2) for s in (False, True)],
        # none by default (suite time): EP 4 through the exchange in test_moe.py's
        # test_no_drop_equals_dense_reference[fused-4-2], skewed routing in
        # test_dropless_tensor_parallel_equals_dense_reference[2-2-True]
        default=[],
    ),
)
def test_dropless_equals_dense_reference(ep, topk, skewed):
    _check(ep, 1, 1, topk, fused=True, skewed=skewed)


@pytest.mark.parametrize(
    "ep, etp, fused",
    _grid(
        [(ep, etp, f) for ep, etp in ((1, 2), (2, 2), (2, 1), (4, 2)) for f in (False, True)],
        default=[(2, 2, True), (2, 1, False)],
    ),
)
def test_dropless_tensor_parallel_equals_dense_reference(ep, etp, fused):
    """tp = 2 with sequence parallelism; the experts split over tensor (ETP) or not."""
    _check(ep, 2, etp, 2, fused=fused, skewed=True)


@pytest.mark.parametrize(
    "ep, fused, capacity",
    [
        (1, True, None),
        pytest.param(2, True, None, marks=pytest.mark.slow),
        pytest.param(2, False, float(E), marks=pytest.mark.slow),
    ],
)
def test_parallel_folding_equals_dense_reference(ep, fused, capacity):
    """Megatron's MoE parallel folding: ETP 1 beside TP 2 attention, the experts split over
    ``(expert, tensor)`` (EP ``2 ep``), every tensor rank routing its own sequence shard;
    dropless (skewed routing, fused into a bucket) and capacity buffers that drop
    nothing."""
    _check(ep, 2, 1, 2, fused, capacity is None, capacity=capacity, folded=True)


@pytest.mark.slow
def test_swiglu_experts_with_expert_tensor_parallelism():
    _check(2, 2, 2, 2, fused=True, skewed=False, swiglu=True)


def test_capacity_path_with_expert_tensor_parallelism():
    """The capacity dispatcher with ETP; a capacity that drops nothing equals the
    reference."""
    _check(2, 2, 2, 2, fused=True, skewed=False, capacity=float(E))


@pytest.mark.parametrize(
    "ep, tp, etp, factor",
    [
        # -m slow (suite time): the bound's default cover is the ETP case; EP 4 through the
        # exchange, test_moe.py::test_no_drop_equals_dense_reference[fused-4-2]
        pytest.param(4, 1, 1, 1.5, id="ep4_factor1.5", marks=pytest.mark.slow),
        pytest.param(2, 2, 2, 1.25, id="ep2_etp2_factor1.25"),
    ],
)
def test_bounded_receive_buffer_equals_dense_reference(ep, tp, etp, factor):
    """A receive buffer smaller than the worst case, routing that fits it: the same
    numbers as the reference, nothing counted as overflow."""
    assert receive_rows(T * 2, ep, factor) < ep * T * 2
    _check(ep, tp, etp, 2, fused=True, skewed=False, buffer_factor=factor)


@pytest.mark.parametrize(
    "ep, tp, etp, topk, skewed, factor",
    [
        pytest.param(1, 1, 1, 2, False, None, id="one_rank", marks=pytest.mark.slow),
        pytest.param(2, 2, 2, 2, True, None, id="ep2_etp2_skewed"),
        pytest.param(4, 1, 1, 2, False, 1.5, id="ep4_factor1.5", marks=pytest.mark.slow),
        pytest.param(2, 2, 1, 1, True, None, id="ep2_etp1_top1", marks=pytest.mark.slow),
    ],
)
def test_fused_permutations_equal_dense_reference(ep, tp, etp, topk, skewed, factor):
    """``moe_permute_fusion``: the permutations gather both ways; the same numbers as the
    reference (every parameter's and the input's gradient)."""
    _check(ep, tp, etp, topk, fused=True, skewed=skewed, buffer_factor=factor, permute_fusion=True)


@pytest.mark.parametrize("permute_fusion", [False, True])
def test_fused_permutations_leave_no_float_scatter(permute_fusion):
    """The compiled layer's forward and backward (EP 2 through the exchange): with
    ``moe_permute_fusion`` no scatter writes floating-point rows (the ones left are the
    integer counts and the inverse permutation, the router's top-k gradient ``[T, E]``
    and XLA:CPU's emulation of the ragged exchange, which GPUs do not run); without it the
    permutations' gradients and the unpermute are scatters."""
    cfg = MoEConfig(num_experts=E, ffn_hidden_size=F, topk=2, permute_fusion=permute_fusion)
    params, (x, r) = _params(False, False), _data(2 * T, False)
    text = _sharded(cfg, 2, 1, 1, False).lower(params, x, r).compile().as_text()
    float_scatters = [
        line
        for line in text.splitlines()
        if re.search(r"= (f32|bf16|f16)\[[^\]]*\][^ ]* scatter\(", line)
        and EMULATED_EXCHANGE_SCOPE not in line
        and f"({ROUTER_SCOPE})" not in line  # the top-k's [T, E] gradient: no tokens' rows
    ]
    assert bool(float_scatters) != permute_fusion, float_scatters[:3]


def test_receive_buffer_overflow_is_counted():
    """Skewed routing into buffers of T k rows: every routed choice past a rank's buffer is
    counted (the training loop refuses such a step)."""
    ep, k = 4, 2
    cfg = MoEConfig(num_experts=E, ffn_hidden_size=F, topk=k, dropless_buffer_factor=1.0)
    params, (x, r) = _params(True), _data(ep * T, True)
    *_, counts, overflow = _sharded(cfg, ep, 1, 1, fused=False)(params, x, r)
    received = np.asarray(counts).reshape(ep, E // ep).sum(axis=1)
    cap = receive_rows(T * k, ep, 1.0)
    want = np.maximum(received - cap, 0).sum()
    assert want > 0 and float(overflow) == want, (received, cap, overflow)


def test_receive_rows_bounds():
    assert receive_rows(24, 4, None) == 96  # the worst case
    assert receive_rows(24, 4, 1.5) == 40  # ceil(36) to a multiple of 8
    assert receive_rows(24, 4, 8.0) == 96  # never past the worst case
    with pytest.raises(
        ValueError, match=r"moe_dropless_buffer_factor must be a finite number >= 1"
    ):
        MoEConfig(num_experts=E, ffn_hidden_size=F, dropless_buffer_factor=0.5)
    with pytest.raises(ValueError, match="cannot be combined with moe_expert_capacity_factor"):
        MoEConfig(num_experts=E, ffn_hidden_size=F, capacity_factor=1.0, dropless_buffer_factor=2)


def _exchange_case(ep: int, rows: int, out_rows: int, seed: int):
    """Consistent random arguments of a ragged all-to-all over ``ep`` ranks: sender ``s``
    sends ``send[s, d]`` rows to ``d`` from a random offset; receiver ``d`` places its
    sources back to back from a random start."""
    rng = np.random.default_rng(seed)
    send = rng.integers(0, rows // ep + 1, size=(ep, ep)).astype(np.int32)
    in_off = np.stack([rng.integers(0, rows - send[s].max() + 1, ep) for s in range(ep)])
    out_off = np.zeros((ep, ep), np.int32)  # [s, d]: where s's rows land on d
    for d in range(ep):
        base = rng.integers(0, out_rows - send[:, d].sum() + 1)
        out_off[:, d] = base + np.concatenate([[0], np.cumsum(send[:-1, d])])
    operand = rng.normal(size=(ep, rows, 3)).astype(np.float32)
    want = np.zeros((ep, out_rows, 3), np.float32)
    for s in range(ep):
        for d in range(ep):
            n = send[s, d]
            want[d, out_off[s, d] : out_off[s, d] + n] = operand[s, in_off[s, d] : in_off[s, d] + n]
    return operand, in_off.astype(np.int32), send, out_off, send.T.copy(), want


def test_ragged_all_to_all_matches_its_semantics_on_cpu():
    """The CPU emulation of :func:`jax.lax.ragged_all_to_all` against a numpy model of the
    collective's documented semantics (senders' offsets, receivers' placement)."""
    ep, rows, out_rows = 4, 10, 24
    mesh = Mesh(np.array(jax.devices()[:ep]), (EXPERT,))
    f = jax.jit(
        jax.shard_map(
            lambda o, i, s, oo, rs: ragged_all_to_all(
                o[0], jnp.zeros((out_rows, 3)), i[0], s[0], oo[0], rs[0], axis_name=EXPERT
            )[None],
            mesh=mesh,
            in_specs=P(EXPERT),
            out_specs=P(EXPERT),
        )
    )
    for seed in range(3):
        operand, in_off, send, out_off, recv, want = _exchange_case(ep, rows, out_rows, seed)
        got = f(operand, in_off, send, out_off, recv)
        np.testing.assert_array_equal(np.asarray(got), want)


def test_ragged_all_to_all_is_exact_sized_on_gpus():
    """Lowered for CUDA the exchange is XLA's ragged all-to-all (no worst-case buffer);
    for CPU, where XLA has none, an all-to-all."""
    mesh = Mesh(np.array(jax.devices()[:4]), (EXPERT,))

    def text(platform):
        f = jax.jit(
            jax.shard_map(
                lambda o, i, s, oo, rs: ragged_all_to_all(
                    o, jnp.zeros((16, 8)), i, s, oo, rs, axis_name=EXPERT
                ),
                mesh=mesh,
                in_specs=P(EXPERT),
                out_specs=P(EXPERT),
            )
        )
        sizes = jax.ShapeDtypeStruct((16,), jnp.int32)
        args = (jax.ShapeDtypeStruct((32, 8), jnp.float32), sizes, sizes, sizes, sizes)
        return f.trace(*args).lower(lowering_platforms=(platform,)).as_text()

    cuda, cpu = text("cuda"), text("cpu")
    assert "ragged_all_to_all" in cuda and "all_to_all" not in cuda.replace("ragged_all_to_all", "")
    assert "ragged_all_to_all" not in cpu and "all_to_all" in cpu


def test_group_by_expert_orders_the_sources_by_local_expert():
    # Two sources, three local experts: source 0 sent [2, 0, 1] rows, source 1 [1, 2, 0],
    # each in a block of 4 buffer rows.
    counts = jnp.array([[2, 0, 1], [1, 2, 0]], jnp.int32)
    dest, sizes = group_by_expert(counts, jnp.array([0, 4], jnp.int32), 8)
    assert sizes.tolist() == [3, 2, 1]
    # expert 0: s0 rows 0, 1 then s1 row 0; expert 1: s1 rows 1, 2; expert 2: s0 row 2.
    assert dest.tolist() == [0, 1, 5, 8, 2, 3, 4, 8]
    # Back to back (the exact exchange), an empty source between, 2 rows left over.
    counts = jnp.array([[2, 0, 1], [0, 0, 0], [1, 2, 0]], jnp.int32)
    dest, sizes = group_by_expert(counts, jnp.array([0, 3, 3], jnp.int32), 8)
    assert sizes.tolist() == [3, 2, 1]
    assert dest.tolist() == [0, 1, 5, 2, 3, 4, 8, 8]


# A tiny MoE model for the example (one step).
_EXAMPLE_MOE = SMALL_GPT + ["--no-progress", "--num-experts", "8", "--train-iters", "1"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            [
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--expert-tensor-parallel-size",
                "3",
            ],
            r"expert.tensor.parallel.size \(3\) must be 1 or (--)?tensor.model.parallel.size \(2\)",
        ),
        (
            ["--moe-shared-expert-overlap"],
            r"moe.shared.expert.overlap needs shared experts "
            r"\((--)?moe.shared.expert.intermediate.size\)",
        ),
        (
            ["--moe-shared-expert-intermediate-size", "0"],
            "argument --moe-shared-expert-intermediate-size: must be >= 1",
        ),
        (
            [
                "--tensor-model-parallel-size",
                "4",
                "--sequence-parallel",
                "--moe-ffn-hidden-size",
                "50",
            ],
            r"moe.ffn.hidden.size \(50\) must be divisible by (--)?expert.tensor.parallel.size "
            r"\(4\)",
        ),
        (
            ["--moe-dropless-buffer-factor", "0.5"],
            r"moe.dropless.buffer.factor must be a finite number >= 1 .*got 0.5",
        ),
    ],
    ids=["etp", "overlap-without-shared", "shared-size", "ffn-etp", "buffer-factor"],
)
def test_example_moe_flags_fail_loudly(pretrain, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        pretrain.main(_EXAMPLE_MOE + argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    assert re.search(message, err), err


def test_the_loop_stops_at_a_step_that_overflowed_the_receive_buffers():
    """A step whose metrics count overflow rows raises before it is logged (the metrics
    writer is not called); through the example: the slow test below."""
    from types import SimpleNamespace

    from jax_wgrad.training.loop import DispatchOverflowError, _one_step

    written = []
    metrics = {"loss": 1.0, "grad_norm": 1.0, "skipped": False, "moe_dispatch_overflow": 3.0}
    summary = {"losses": [], "times": [], "skipped_steps": 0, "start_step": 0}
    with pytest.raises(DispatchOverflowError, match=r"iteration 5: .* routed 3 token choices"):
        _one_step(
            lambda state, tokens: (state, metrics),
            "state",
            lambda i: np.zeros((2, 9), np.int32),
            4,
            (0, 0),
            SimpleNamespace(profile_dir=None),
            summary,
            SimpleNamespace(write=written.append),
            SimpleNamespace(set_postfix=lambda **kw: None),
            print,
        )
    assert written == []


# -m slow (suite time, a 25 s example run): the default run's cover is the layer's overflow
# count (test_receive_buffer_overflow_is_counted) and the loop's refusal (just above).
@pytest.mark.slow
def test_example_stops_at_a_step_overflowing_the_receive_buffers(pretrain, capsys, tmp_path):
    """EP 4, buffers of T k rows (the mean): a random router overflows them in the first
    step; the run stops with one line naming the flag, before the step is saved."""
    argv = ["--expert-model-parallel-size", "4", "--moe-dropless-buffer-factor", "1"]
    argv += ["--num-layers", "2"]  # suite time
    with pytest.raises(SystemExit) as exc:
        pretrain.main(_EXAMPLE_MOE + argv + ["--save", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "Traceback" not in err, err
    assert re.search(
        r"error: iteration 1: the dropless MoE dispatch routed \d+ token choices past the "
        r"expert ranks' receive buffers \(--moe-dropless-buffer-factor",
        err,
    ), err
    assert not any((tmp_path / "ckpt").glob("*/"))


@pytest.mark.parametrize("overlap", [False, True])
def test_hlo_delayed_ragged_wgrad_frees_the_dispatch_backward(overlap):
    """``--overlap-dispatch-backward-with-experts-wgrad`` on the dropless path (EP = 4): in
    the program given to XLA the dispatch-backward all-to-all waits for the ragged expert
    wgrads exactly when the option is off; compiled, with the option, no all-to-all
    depends on them and each updates the bucket in place."""
    from hlo_util import INSTRUCTION, ancestors, dataflow

    from jax_wgrad.ops import handlers

    cfg = MoEConfig(
        num_experts=E, ffn_hidden_size=F, topk=2, aux_loss_coeff=1e-2, overlap_wgrad=overlap
    )
    params, (x, r) = _params(False), _data(4 * T, False)
    lowered = _sharded(cfg, 4, 1, 1, fused=True).lower(params, x, r)
    for text, compiled in (
        (lowered.as_text(dialect="hlo"), False),
        (lowered.compile().as_text(), True),
    ):
        if compiled and not overlap:
            continue
        lines = [l.strip() for l in text.splitlines()]
        graph = dataflow(lines)
        name = lambda l: INSTRUCTION.match(l).group(1)
        a2a = [
            name(l)
            for l in lines
            if INSTRUCTION.match(l) and re.search(r" all-to-all(-start)?\(", l)
        ]
        wgrads = [l for l in lines if f'custom_call_target="{handlers.RAGGED_WGRAD_TARGET}"' in l]
        assert len(wgrads) == 2 and len(a2a) >= 5  # rows, counts, combine; 2 transposes
        waits = [any(name(w) in ancestors(graph, a) for a in a2a) for w in wgrads]
        assert waits == [not overlap] * 2
        if compiled:
            assert all("output_to_operand_aliasing" in w for w in wgrads)
