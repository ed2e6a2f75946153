"""Helpers to check structural claims in compiled HLO text (and in jaxprs)."""

import re

import numpy as np

# Module parsing shared with the library's compile reports.
from jax_wgrad.aot.hlo import computations, entry_name, reachable, while_bodies  # noqa: F401


def compiled_text(fn, *args, donate_argnums=()) -> str:
    import jax

    return jax.jit(fn, donate_argnums=donate_argnums).lower(*args).compile().as_text()


def copies_of(hlo: str, dtype: str, shape: tuple[int, ...]) -> list[str]:
    """HLO lines that copy an array of exactly ``dtype[shape]``."""
    pat = re.compile(rf"= {dtype}\[{','.join(map(str, shape))}\]\{{[^}}]*\}} copy\(")
    return [line.strip() for line in hlo.splitlines() if pat.search(line)]


def custom_calls(hlo: str, target: str) -> list[str]:
    return [l.strip() for l in hlo.splitlines() if f'custom_call_target="{target}"' in l]


def entry_aliases_param(hlo: str, param: int) -> bool:
    header = hlo.splitlines()[0]
    return re.search(rf"input_output_alias=\{{.*\({param}, \{{\}}, may-alias\)", header) is not None


def collective_arrays(lines, op: str, dtype: str = "f32", replica_groups=None) -> list[int]:
    """Element counts of the 1-D ``dtype`` arrays produced by ``op`` instructions (XLA may
    combine several collectives into one tuple-shaped instruction: count arrays).

    ``replica_groups``: only instructions over exactly these device groups (a collection
    of collections of logical device ids, e.g. the data-parallel groups of a mesh)."""
    want = None
    if replica_groups is not None:
        want = sorted(tuple(sorted(g)) for g in replica_groups)
    out = []
    for line in lines:
        m = re.search(rf"= (\([^)]*\)|\S+) {op}(?:-start)?\(", line)
        if m and want is not None:
            g = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
            named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
            got = (
                []
                if g is None
                else [
                    tuple(sorted(int(x) for x in grp.split(",") if x))
                    for grp in re.findall(r"\{([\d,]*)\}", g.group(1))
                ]
            )
            if named is not None:
                got = _mesh_groups(named.group(1), named.group(2))
            if sorted(got) != want:
                continue
        if m:
            out += [int(n) for n in re.findall(rf"{dtype}\[(\d+)\]", m.group(1))]
    return out


def _mesh_groups(mesh: str, axes: str) -> list[tuple[int, ...]]:
    """Device groups of newer XLA's ``replica_groups=mesh['data'=4,'expert'=2,...]
    {'data'}`` form: the devices varying along the named axes, the others fixed."""
    names = re.findall(r"'(\w+)'=\d+", mesh)
    sizes = [int(n) for n in re.findall(r"'\w+'=(\d+)", mesh)]
    over = [names.index(a) for a in re.findall(r"'(\w+)'", axes)]
    ids = np.arange(int(np.prod(sizes))).reshape(sizes)
    rest = [i for i in range(len(sizes)) if i not in over]
    size = int(np.prod([sizes[i] for i in over]))
    return [tuple(sorted(int(x) for x in r)) for r in ids.transpose(rest + over).reshape(-1, size)]


INSTRUCTION = re.compile(r"(?:ROOT )?%?([\w.\-]+) = ")
"""An instruction line's start (compiled HLO prints ``%name``, lowered HLO ``name``)."""


def dataflow(lines) -> dict[str, set[str]]:
    """``{instruction: its operand instructions}`` (control predecessors included) of
    instruction lines, in either HLO text style."""
    defs = {}
    for line in lines:
        m = INSTRUCTION.match(line.strip())
        if m:
            rhs = re.sub(r'(metadata=\{[^}]*\}|"[^"]*")', "", line.strip()[m.end() :])
            # %-style: operands are the %names; bare style: names not followed by "("
            # (which are opcodes).
            token = r"%([\w.\-]+)" if "%" in line else r"(?<![\w.\-])([\w.\-]+)(?![\w.\-(])"
            defs[m.group(1)] = re.findall(token, rhs)
    return {name: {o for o in ops if o in defs and o != name} for name, ops in defs.items()}


def ancestors(graph: dict[str, set[str]], name: str) -> set[str]:
    """Every instruction ``name`` depends on (transitively), itself excluded."""
    seen, todo = set(), list(graph[name])
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += graph[n]
    return seen


def jaxpr_eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from jaxpr_eqns(inner)
