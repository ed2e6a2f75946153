"""Helpers to check structural claims in compiled HLO text."""

import re


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
