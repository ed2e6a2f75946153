"""The wgrad GEMMs of step_vs_plain_jax.py's default step, fused vs unfused, in one process.

    python step_shapes_ab.py DTYPE REPS '{"fused": {}}'

Per jit call: 8 x (the 5 weight shapes of the default GPT, T = 512 tokens) into one flat
fp32 bucket, as a scan (donated): `fused` = wgrad_accumulate per weight, `unfused` = XLA
dot + one bucket_add (what the unfused step does). Variants are timed in rotating rounds;
wall and process CPU time, medians, and per-round ratios to unfused. The JSON dict names
variants with environment variables to set around each call (used with a debug build of
the handler that read AB_* knobs per call; {"fused": {}} for a normal build).
MB_T, MB_R, MB_SHAPES override tokens, calls per jit and [[in, out], ...].
"""
import sys, time, statistics, json, os
import jax, jax.numpy as jnp, numpy as np
from jax_wgrad import ops
dt = jnp.dtype(sys.argv[1]); reps = int(sys.argv[2])
configs = json.loads(sys.argv[3])  # {"name": {"AB_W": "1", ...}}
T = int(os.environ.get("MB_T", 512)); R = int(os.environ.get("MB_R", 8))
shapes = json.loads(os.environ.get("MB_SHAPES", "[[128,384],[128,128],[128,512],[512,128],[128,256]]"))
sizes = [i * o for i, o in shapes]; offs = [int(v) for v in np.cumsum([0] + sizes[:-1])]; N = sum(sizes)
k = jax.random.split(jax.random.key(0), 2 * len(shapes))
xs = [jax.random.normal(k[2*i], (R, T, s[0]), dt) for i, s in enumerate(shapes)]
dys = [jax.random.normal(k[2*i+1], (R, T, s[1]), dt) for i, s in enumerate(shapes)]
def fused(buf, xs, dys):
    def body(buf, xd):
        for x, dy, o in zip(*xd, offs):
            buf = ops.wgrad_accumulate(x, dy, buf, offset=o)
        return buf, None
    return jax.lax.scan(body, buf, (xs, dys))[0]
def unfused(buf, xs, dys):
    def body(buf, xd):
        gs = [jnp.dot(dy.T, x, preferred_element_type=jnp.float32) for x, dy in zip(*xd)]
        return ops.bucket_add(buf, gs, offs), None
    return jax.lax.scan(body, buf, (xs, dys))[0]
ff, uf = jax.jit(fused, donate_argnums=0), jax.jit(unfused, donate_argnums=0)
variants = {"unfused": (uf, {})} | {n: (ff, e) for n, e in configs.items()}
bufs = {n: jnp.zeros(N, jnp.float32) for n in variants}
keys = set(k for e in configs.values() for k in e)
def setenv(e):
    for kk in keys: os.environ.pop(kk, None)
    os.environ.update(e)
for n, (f, e) in variants.items():
    setenv(e)
    for _ in range(3): bufs[n] = jax.block_until_ready(f(bufs[n], xs, dys))
wall = {n: [] for n in variants}; cpu = {n: [] for n in variants}
names = list(variants)
for r in range(reps):
    for n in names[r % len(names):] + names[:r % len(names)]:
        f, e = variants[n]; setenv(e)
        ws, cs = [], []
        for _ in range(8):
            t0, c0 = time.perf_counter(), time.process_time()
            bufs[n] = jax.block_until_ready(f(bufs[n], xs, dys))
            ws.append(time.perf_counter() - t0); cs.append(time.process_time() - c0)
        wall[n].append(statistics.median(ws) * 1e3); cpu[n].append(statistics.median(cs) * 1e3)
res = {"dtype": dt.name, "T": T}
for n in names:
    res[n] = {"ms": round(statistics.median(wall[n]), 2), "cpu_ms": round(statistics.median(cpu[n]), 2),
              "wall/unf": round(statistics.median(a / b for a, b in zip(wall[n], wall["unfused"])), 3),
              "cpu/unf": round(statistics.median(a / b for a, b in zip(cpu[n], cpu["unfused"])), 3)}
print(json.dumps(res))
