"""Bounds on counts and seeds given on a command line, checked the same way by every command."""

from __future__ import annotations

import numbers

MAX_COUNT = 2**31 - 1  # shapes, lengths, batches, degrees: keeps every product well inside float range
MAX_SEED = 2**32 - 1


def check_count(field: str, value: int) -> None:
    """Refuse ``value`` unless an integer in 1..MAX_COUNT, naming the flag of ``field``
    (``head_dim``: --head-dim). A bool or a float is refused: ``True`` or ``2.0`` degrees
    would otherwise flow through the arithmetic as numbers."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"--{field.replace('_', '-')} must be an integer, got {value!r}")
    if not 1 <= value <= MAX_COUNT:
        raise ValueError(f"--{field.replace('_', '-')} must be between 1 and {MAX_COUNT}, got {value}")


def check_seed(seed: int, flag: str = "--seed") -> None:
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{flag} must be between 0 and {MAX_SEED}, got {seed}")
