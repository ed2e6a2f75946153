"""The pipeline executor runs a model that is not the GPT.

A stack of residual MLP blocks with a regression loss, defined here as a
:class:`~jax_wgrad.parallel.pipeline.program.StageProgram` (its own config, canonical
parameters, device tree and gradient specs): its input projection is fused in the
``INPUT`` role, its block weights in ``LAYERS`` (their biases are ordinary gradients), its
output projection in ``OUTPUT`` (so deferral applies to it). Through 1F1B and ZB-H1 with
fused buckets, deferral and the cooldown sync, the gradients equal ``jax.grad`` of its
single-device form; a :class:`~jax_wgrad.TrainPlan` trains it.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad import DDPConfig, ParallelConfig, TrainPlan, fusion_available
from jax_wgrad.functional import linear
from jax_wgrad.grads import GradSpec
from jax_wgrad.grads.chunks import Chunks
from jax_wgrad.grads.spec import INPUT, LAYERS, OUTPUT, SHARED, STAGE
from jax_wgrad.layout.setup import StageSetup
from jax_wgrad.ops import DENSE_FAMILIES
from jax_wgrad.parallel.mesh import PIPELINE, make_mesh
from jax_wgrad.parallel.pipeline.gradients import pipeline_gradients
from jax_wgrad.parallel.pipeline.program import StageProgram
from jax_wgrad.training import build_train_step, init_train_state, shard_batch
from jax_wgrad.training.plan import ModelConfig

needs_fusion = pytest.mark.skipif(not fusion_available("cpu"), reason="needs the CPU handler")


@dataclasses.dataclass(frozen=True)
class MLPStackConfig:
    """``x [S, D_in] -> in-proj -> L x (x + w2 gelu(w1 x) + b) -> out-proj -> [S, D_out]``;
    loss per token ``0.5 * |pred - target|^2``."""

    num_layers: int = 4
    d_in: int = 3
    hidden: int = 8
    ffn: int = 16
    d_out: int = 2
    seq_length: int = 4

    def validate(self, parallel: ParallelConfig) -> None:
        if parallel.tensor_model_parallel_size != 1 or parallel.expert_model_parallel_size != 1:
            raise ValueError("MLPStackConfig: no tensor or expert parallelism")
        if self.num_layers % parallel.pipeline_model_parallel_size:
            raise ValueError(
                f"num_layers ({self.num_layers}) must be divisible by "
                f"pipeline_model_parallel_size "
                f"({parallel.pipeline_model_parallel_size})"
            )

    def program(self, parallel: ParallelConfig, platform: str | None = None) -> MLPStack:
        return MLPStack(self, parallel)

    def shape_differences(self, saved: dict) -> list:
        return [
            (k, saved[k], v) for k, v in dataclasses.asdict(self).items() if saved.get(k, v) != v
        ]


def init_params(cfg: MLPStackConfig, seed: int) -> dict:
    keys = iter(jax.random.split(jax.random.key(seed), 5))
    normal = lambda shape, std: std * jax.random.normal(next(keys), shape, jnp.float32)
    n = cfg.num_layers
    return {
        "inp": {"weight": normal((cfg.hidden, cfg.d_in), 0.5)},
        "blocks": {
            "w1": normal((n, cfg.ffn, cfg.hidden), 0.3),
            "w2": normal((n, cfg.hidden, cfg.ffn), 0.3),
            "b": normal((n, cfg.hidden), 0.1),
        },
        "out": {"weight": normal((cfg.d_out, cfg.hidden), 0.5)},
    }


def block(p, x):
    h = jax.nn.gelu(linear(x, p["w1"]))
    return x + linear(h, p["w2"], p["b"])


def reference_loss(params, batch, cfg: MLPStackConfig):
    """Single device: the mean token loss."""
    x, target = batch[..., : cfg.d_in], batch[..., cfg.d_in :]
    h = x @ params["inp"]["weight"].T
    for i in range(cfg.num_layers):
        h = block(jax.tree.map(lambda a, i=i: a[i], params["blocks"]), h)
    pred = h @ params["out"]["weight"].T
    return jnp.mean(0.5 * jnp.sum((pred - target) ** 2, axis=-1))


@dataclasses.dataclass(frozen=True, eq=False)
class MLPStack:
    """The stack's stage programs: ``pre`` projects the inputs, ``body`` runs the stage's
    blocks, ``post`` projects and sums the token losses."""

    model: MLPStackConfig
    parallel: ParallelConfig
    ends_over_pipeline = False  # pre and post run on the first / last stage only

    @property
    def output_grad_recompute(self) -> MLPStack:
        return self  # it rebuilds its output projection's gradient itself

    stacks_layers = False  # a Python loop over per-layer parameters
    fused_op_families = DENSE_FAMILIES  # fused linears only

    @property
    def setup(self) -> StageSetup:
        cfg = self.model
        return StageSetup.create(
            self.parallel,
            seq_length=cfg.seq_length,
            hidden_size=cfg.hidden,
            dtype="float32",
            sample_shape=(cfg.seq_length, cfg.d_in + cfg.d_out),
            sample_dtype="float32",
        )

    def pre(self, params, batch):
        return linear(batch[..., : self.model.d_in], params.shared["inp"]["weight"]), ()

    def body(self, params, x, layers=None):
        assert layers is None, "the stack's layers are not stacked: no interleaving"
        for p in params.stage:
            x = block(p, x)
        return x, ()

    def post(self, params, y, batch, *, output_grad_extras=False):
        pred = linear(y, params.shared["out"]["weight"])
        target = batch[..., self.model.d_in :]
        return jnp.sum(0.5 * (pred - target) ** 2), ()  # the extras come from the batch

    def defer_extras(self, post_aux, batch):
        return (batch[..., self.model.d_in :],)  # the targets [mb, S, d_out]

    def recompute_output_grad(self, x, extras, weight):
        (target,) = extras  # d(0.5 |x W^T - target|^2) / d(x W^T)
        return jnp.einsum("bsh,oh->bso", x, weight) - target

    def metrics(self, aux_sum):
        return {}

    def init_params(self, seed: int = 0):
        return init_params(self.model, seed)

    def param_specs(self):
        specs = jax.tree.map(lambda _: P(), init_params(self.model, 0))
        specs["blocks"] = {k: P(PIPELINE) for k in ("w1", "w2", "b")}
        return specs

    canonical_specs = param_specs  # no interleaved layout: the canonical form is the layout

    def to_canonical(self, params):
        return params

    from_canonical = to_canonical

    def device_tree(self, params) -> Chunks:
        blocks = params["blocks"]
        n = jax.tree.leaves(blocks)[0].shape[0]
        stage = [
            collections.OrderedDict((k, _index(blocks[k], i)) for k in ("w1", "w2", "b"))
            for i in range(n)
        ]
        shared = collections.OrderedDict(inp=params["inp"], out=params["out"])
        return Chunks(stage=stage, experts=[], shared=shared)

    def canonical_tree(self, tree):
        blocks = {k: jnp.stack([layer[k] for layer in tree.stage]) for k in ("w1", "w2", "b")}
        return {"inp": dict(tree.shared["inp"]), "blocks": blocks, "out": dict(tree.shared["out"])}

    def grad_specs(self) -> Chunks:
        n = self.model.num_layers // self.parallel.pipeline_model_parallel_size
        fused = GradSpec(chunk=STAGE, roles={LAYERS}, fused_in=LAYERS, weight_decay=True)
        bias = GradSpec(chunk=STAGE, roles={LAYERS})
        layer = collections.OrderedDict(w1=fused, w2=fused, b=bias)
        shared = collections.OrderedDict(
            inp={"weight": GradSpec(chunk=SHARED, roles={INPUT}, fused_in=INPUT)},
            out={"weight": GradSpec(chunk=SHARED, roles={OUTPUT}, fused_in=OUTPUT)},
        )
        return Chunks(stage=[layer] * n, experts=[], shared=shared)


def _index(a, i):
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
    return a[i]


CFG = MLPStackConfig()


def _batch(par: ParallelConfig, seed: int = 1) -> jax.Array:
    return jax.random.normal(
        jax.random.key(seed), (par.global_batch_size, CFG.seq_length, CFG.d_in + CFG.d_out)
    )


def test_the_program_is_a_stage_program():
    assert isinstance(MLPStack(CFG, ParallelConfig()), StageProgram)
    assert isinstance(CFG, ModelConfig)


@needs_fusion
@pytest.mark.parametrize(
    "schedule, defer, mode",
    [
        ("1f1b", 0, "stash"),
        ("zb-h1", 0, "stash"),
        ("1f1b", 2, "stash"),
        ("zb-h1", 3, "stash"),
        ("zb-h1", 3, "recompute"),
    ],
    ids=["1f1b", "zb-h1", "1f1b-defer2", "zb-h1-defer3", "zb-h1-defer3-recompute"],
)
def test_executor_runs_a_model_that_is_not_the_gpt(schedule, defer, mode):
    """Fused buckets in all three roles, deferral (partial: L < M; in recompute mode the
    drain rebuilds ``dy`` through the program's ``defer_extras`` and
    ``recompute_output_grad``) and the cooldown sync on (dp, pp) = (2, 4), M = 4
    microbatches per data rank: gradients equal ``jax.grad``."""
    par = ParallelConfig(
        pipeline_model_parallel_size=4,
        micro_batch_size=1,
        global_batch_size=8,
        gradient_accumulation_fusion=True,
        pipeline_schedule=schedule,
        defer_embedding_wgrad_compute=defer > 0,
        wgrad_deferral_limit=defer,
        defer_mode=mode,
    )
    program = MLPStack(CFG, par)
    CFG.validate(par)
    mesh = make_mesh(par)
    params = init_params(CFG, 0)
    batch = _batch(par)
    ref_loss, ref = jax.value_and_grad(reference_loss)(params, batch, CFG)
    shard = lambda t: jax.tree.map(
        lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), t, program.param_specs()
    )
    ddp = DDPConfig(overlap_grad_reduce=True, bucket_size=40)  # several buckets per chunk
    grads, loss = jax.jit(lambda p, b: pipeline_gradients(program, mesh, p, b, ddp))(
        shard(params), jax.device_put(batch, NamedSharding(mesh, P("data")))
    )
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref)):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path)
        )


@needs_fusion
def test_carry_is_named_and_sized_by_tracing():
    """The zero-bubble carry's W stash and deferral stash are keyed by the weights' names;
    their shapes come from tracing the programs (stacked or not, no formula)."""
    from jax_wgrad.parallel.pipeline.gradients import (
        carry_shapes,
        grad_layout,
        grad_sink,
        schedule_of,
    )

    par = ParallelConfig(
        pipeline_model_parallel_size=4,
        micro_batch_size=1,
        global_batch_size=8,
        gradient_accumulation_fusion=True,
        pipeline_schedule="zb-h1",
        defer_embedding_wgrad_compute=True,
    )
    program = MLPStack(CFG, par)
    ddp = DDPConfig()
    layout, table = grad_layout(program, ddp), schedule_of(program)
    carry = carry_shapes(program, grad_sink(program, layout, table), ddp, table, make_mesh(par))
    assert sorted(carry.weight_pairs) == [
        ".shared['out']['weight']",
        ".stage[0]['w1']",
        ".stage[0]['w2']",
    ]
    pair = carry.weight_pairs[".stage[0]['w1']"]
    assert pair.x.shape == (table.weight_slots, 1, CFG.seq_length, CFG.hidden)
    assert pair.dy.shape == (table.weight_slots, 1, CFG.seq_length, CFG.ffn)
    x, dy = carry.deferred[".shared['out']['weight']"]
    assert x.shape == (4, 1, CFG.seq_length, CFG.hidden)  # M = 4 deferred microbatches
    assert dy.shape == (4, 1, CFG.seq_length, CFG.d_out)


@needs_fusion
def test_train_plan_trains_a_model_that_is_not_the_gpt():
    """``TrainPlan`` + the train step (distributed optimizer, zero bubble, deferral; no
    clipping): one SGD step equals ``params - lr * jax.grad``."""
    par = ParallelConfig(
        pipeline_model_parallel_size=2,
        micro_batch_size=1,
        global_batch_size=8,
        gradient_accumulation_fusion=True,
        pipeline_schedule="zb-h1",
        defer_embedding_wgrad_compute=True,
    )
    mesh = make_mesh(par)
    plan = TrainPlan.create(
        CFG,
        par,
        mesh,
        optax.sgd(0.5),
        ddp=DDPConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, clip_grad=0.0),
    )
    state = init_train_state(plan, seed=0)
    batch = np.asarray(_batch(par))
    step = build_train_step(plan, state)
    state, metrics = step(state, shard_batch(mesh, batch))
    params = init_params(CFG, 0)
    loss, ref = jax.value_and_grad(reference_loss)(params, batch, CFG)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-6)
    want = jax.tree.map(lambda p, g: p - 0.5 * g, params, ref)
    for (path, got), w in zip(
        jax.tree_util.tree_flatten_with_path(state.params)[0], jax.tree.leaves(want)
    ):
        np.testing.assert_allclose(
            np.asarray(got), np.asarray(w), rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path)
        )


class _Counted(MLPStack):
    """:class:`MLPStack` counting how often its ``body`` is traced."""

    def body(self, params, x, layers=None):
        self.traces.append(1)
        return super().body(params, x, layers)


@pytest.mark.parametrize("schedule, traces", [("1f1b", 2), ("zb-h1", 3)])
def test_the_stage_body_is_traced_once_for_its_shapes(schedule, traces):
    """Building the step traces the layers once for their shapes (the residual layout,
    records and aux together) besides the real trace; a split backward once more, for its
    probes' shapes (the probes are inputs of the traced function)."""
    par = ParallelConfig(
        pipeline_model_parallel_size=2,
        micro_batch_size=1,
        global_batch_size=4,
        gradient_accumulation_fusion=True,
        pipeline_schedule=schedule,
    )
    program = _Counted(CFG, par)
    object.__setattr__(program, "traces", [])
    mesh = make_mesh(par)
    params = jax.eval_shape(lambda: init_params(CFG, 0))
    batch = jax.ShapeDtypeStruct(_batch(par).shape, jnp.float32)
    jax.jit(lambda p, b: pipeline_gradients(program, mesh, p, b)).trace(params, batch)
    assert len(program.traces) == traces
