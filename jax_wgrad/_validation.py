"""Small argument checks shared by the config classes (Megatron-style messages)."""

from __future__ import annotations

__all__ = ["check_positive"]


def check_positive(name: str, value: int) -> None:
    """Raises ``ValueError`` unless ``value`` is an int >= 1 (bools are not ints here)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
