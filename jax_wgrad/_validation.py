"""Small argument checks shared by the config classes (Megatron-style messages)."""

from __future__ import annotations

__all__ = ["check_positive", "check_recompute"]


def check_positive(name: str, value: int) -> None:
    """Raises ``ValueError`` unless ``value`` is an int >= 1 (bools are not ints here)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_recompute(granularity, method, num_layers) -> None:
    """Megatron's rules and wording (``TransformerConfig.__post_init__``) for
    ``recompute_granularity`` (``None``, ``"full"``, ``"selective"``), ``recompute_method``
    (``"uniform"`` / ``"block"``, required with ``"full"``, refused otherwise) and
    ``recompute_num_layers`` (a positive int, required with ``"full"``, refused otherwise)."""
    if granularity not in (None, "full", "selective"):
        raise ValueError(
            f'When using recompute_granuarlity: {granularity} must be "full" or "selective".'
        )
    if method is not None:
        if method not in ("block", "uniform"):
            raise ValueError(f'recompute_method: {method} must be "block" or "uniform".')
        if granularity != "full":
            raise ValueError(
                f"recompute_method ({method}) is only used with "
                f"recompute_granularity 'full' (got {granularity!r})"
            )
    elif granularity == "full":
        raise ValueError(
            f"Using recompute_granularity: {granularity} so recompute_method "
            'must be "block" or "uniform"'
        )
    if granularity == "full":
        if num_layers is None:
            raise ValueError(
                f"When using recompute_granularity: {granularity} "
                "recompute_num_layers must be between 1 and the layers per "
                "pipeline rank"
            )
        check_positive("recompute_num_layers", num_layers)
    elif num_layers is not None:
        raise ValueError(
            f"When using recompute_granularity: {granularity} "
            f"recompute_num_layers must be None (got {num_layers!r})"
        )
