"""Deviceless XLA:GPU compile (one H100) of the backward of a scan over stacked layers whose
weight gradients go into one flat fp32 bucket at TRACED offsets (issue 19, item 5).

Run with jax[cuda13] and nothing started on a GPU (../shared/gpu/DEVICELESS.md)::

    JAX_PLATFORMS=cpu /work/venv-gpu/bin/python notes/issue19_traced_offset_h100.py [DUMP_DIR]

Prints, per case, what notes/issue19_traced_offset.md reports: the custom calls and where
they are (loop body or not), their aliasing, bucket-sized instructions in the loop, the
buffer-assignment allocation of the bucket, the thunks of one loop iteration (kernels with
their grids) and the memory analysis. Nothing is run.
"""

from __future__ import annotations

import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_wgrad import ops
from jax_wgrad.aot import hlo, thunks
from jax_wgrad.aot.compile import read_largest_dump
from jax_wgrad.aot.targets import target_devices
from jax_wgrad.functional import grouped_linear, linear_into_bucket
from jax_wgrad.ops import registry

L = 4                 # stacked layers
T = 4096              # tokens of a microbatch (micro-batch 4 x sequence 1024)
D = 2048              # square weights [D, D] (they chain)
E, C, DE = 8, 1024, 1024  # grouped: experts, capacity, expert weights [DE, DE]
N = 200_000_003       # bucket elements (800 MB fp32; odd: no other array has this size)
BASE = 50_000_000     # the stack's region starts here


def _plain_backward(ws, bucket, x, dy):
    """vjp of ``scan(linear_into_bucket)`` over ``L`` stacked bf16 layers; the bucket is
    the scan carry and its cotangent the carried bucket (functional/linear.py)."""
    def stacked(ws, bucket, x):
        offsets = BASE + jnp.arange(L, dtype=jnp.int32) * (D * D)

        def layer(carry, xs):
            h, bk = carry
            h, bk = linear_into_bucket(h, xs[0], None, bk, offset=xs[1])
            return (jax.nn.gelu(h), bk), None
        return jax.lax.scan(layer, (x, bucket), (ws, offsets))[0]

    _, vjp_fn = jax.vjp(stacked, ws, bucket, x)
    _, new_bucket, dx = vjp_fn((dy, bucket))
    return new_bucket, dx


def _grouped_backward(ws, bucket, x, dy):
    """The same for stacked expert weights ``[L, E, DE, DE]`` (one grouped call a layer)."""
    def stacked(ws, bucket, x):
        offsets = BASE + jnp.arange(L, dtype=jnp.int32) * (E * DE * DE)

        def layer(carry, xs):
            h, bk = carry
            h, bk = grouped_linear(h, xs[0], bucket=bk, offset=xs[1])
            return (jax.nn.gelu(h), bk), None
        return jax.lax.scan(layer, (x, bucket), (ws, offsets))[0]

    _, vjp_fn = jax.vjp(stacked, ws, bucket, x)
    _, new_bucket, dx = vjp_fn((dy, bucket))
    return new_bucket, dx


CASES = {
    "plain": (_plain_backward, [(L, D, D), (N,), (T, D), (T, D)]),
    "grouped": (_grouped_backward, [(L, E, DE, DE), (N,), (E, C, DE), (E, C, DE)]),
}


_largest = read_largest_dump  # the AOT report's reader of an XLA dump


def _bucket_allocations(assignment: str) -> list[str]:
    """Buffer-assignment allocations holding an f32[N] value (the bucket)."""
    out = []
    for block in re.split(r"\n(?=allocation \d+:)", assignment):
        if block.startswith("allocation") and f"f32[{N}]" in block:
            head = block.splitlines()[0]
            values = [l.strip() for l in block.splitlines()[1:] if f"f32[{N}]" in l]
            out.append(head + "\n      " + "\n      ".join(values))
    return out


def report(name: str, dump_root: str, *, xla_reference: bool = False, **flags) -> None:
    """Compiles case ``name`` and prints its facts; ``xla_reference``: with the plain-XLA
    reference (dynamic_slice + dot + dynamic_update_slice at the traced offset) in place of
    the fused call, for comparison."""
    if xla_reference:
        fused, ops.wgrad_accumulate = ops.wgrad_accumulate, ops.wgrad_accumulate_ref
        jax.clear_caches()  # the fused trace of the same function must not be reused
        try:
            return report(name + "_xla_reference", dump_root, **flags)
        finally:
            ops.wgrad_accumulate = fused
            jax.clear_caches()
    fn, shapes = CASES[name.removesuffix("_xla_reference")]
    (device,) = target_devices("h100")
    mesh = jax.sharding.Mesh(np.array([device]), ("d",))
    rep = NamedSharding(mesh, P())
    dtypes = [jnp.bfloat16, jnp.float32, jnp.bfloat16, jnp.bfloat16]
    args = [jax.ShapeDtypeStruct(s, d, sharding=rep) for s, d in zip(shapes, dtypes)]
    dump = os.path.join(dump_root, name + "".join(f"_{k}" for k in flags))
    lowered = jax.jit(fn, donate_argnums=1).trace(*args).lower()
    # The flags a GPU run gets (jax_wgrad.training.gpu.GPU_XLA_FLAGS), and a dump.
    compiled = lowered.compile({"xla_gpu_enable_latency_hiding_scheduler": True,
                                "xla_dump_to": dump, "xla_dump_hlo_as_text": True, **flags})
    text = compiled.as_text()
    comps = hlo.computations(text)
    entry = hlo.entry_name(text)
    print(f"=== {name}: shapes {shapes}, bucket f32[{N}] ({N * 4 / 1e6:.0f} MB) donated; "
          f"extra flags {flags or 'none'}")
    for target in (registry.TARGET_AT, registry.TARGET):
        for c, lines in comps.items():
            for line in lines:
                if f'custom_call_target="{target}"' in line:
                    where = [b for _, b in hlo.while_bodies(comps, entry)
                             if c in hlo.reachable(comps, b)]
                    alias = re.search(r"output_to_operand_aliasing=\{[^}]*\}[^,]*", line)
                    shape = line.split(" = ", 1)[1].split(" custom-call(")[0]
                    print(f"  {target} in {c} (loop body: {bool(where)}); result {shape}; "
                          f"{alias.group(0) if alias else 'NOT ALIASED'}")
    loops = [b for _, b in hlo.while_bodies(comps, entry)]
    for body in loops:
        sized = hlo.sized_ops(comps, hlo.reachable(comps, body), [N])
        print(f"  while body {body}: bucket-sized instructions: "
              f"{[i.line[:120] for i in sized] or 'none'}")
    whole = hlo.sized_ops(comps, hlo.reachable(comps, entry), [N])
    print(f"  whole program: bucket-sized instructions: "
          f"{[i.line[:120] for i in whole] or 'none'}")
    assignment = _largest(dump, "*buffer-assignment.txt", "*buffer_assignment.txt")
    if assignment:
        for alloc in _bucket_allocations(assignment):
            print("  " + alloc)
    seq = _largest(dump, "*thunk_sequence_after_thunk_passes.txt", "*thunk_sequence.txt")
    names = thunks.thunk_names(_largest(dump, "*thunk_metadata.txt") or "")
    if seq:
        top = thunks.parse_thunks(seq)
        for t in top:
            for w in t.walk():
                if w.kind == "kWhile":
                    body = w.nested.get("body", [])
                    print(f"  while thunk {w.id}: one iteration = "
                          f"{thunks.launches(body)} launches:")
                    for b in body:
                        for leaf in b.walk():
                            if not leaf.nested or leaf.kind == "kCommandBuffer":
                                print(f"    {leaf.kind} {names.get(leaf.id, '')}: "
                                      f"{leaf.text[:110]}")
    mem = compiled.memory_analysis()
    print(f"  memory: arguments {mem.argument_size_in_bytes / 1e6:.1f} MB, outputs "
          f"{mem.output_size_in_bytes / 1e6:.1f} MB, aliased {mem.alias_size_in_bytes / 1e6:.1f}"
          f" MB, temp {mem.temp_size_in_bytes / 1e6:.1f} MB")


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/issue19_traced_offset_dump"
    for case in CASES:
        report(case, root)
    # Command buffers (CUDA graphs) form only from 5 capturable thunks in a row by default;
    # with 1, whatever XLA may capture is captured: is the traced-offset call among it?
    report("plain", root, xla_gpu_graph_min_graph_size=1)
    report("plain", root, xla_reference=True)
