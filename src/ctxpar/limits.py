"""Bounds on counts, seeds and real numbers a user passes, checked the same way everywhere."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import typing

MAX_COUNT = 2**31 - 1  # shapes, lengths, batches, degrees: keeps every product well inside float range
MAX_SEED = 2**32 - 1


def check_token_range(tokens, vocab: int, who: str, where: str = "") -> None:
    """Refuse token ids (a tensor) outside ``vocab`` rows of an embedding, naming ``who`` got
    them (and ``where``): checked before a forward, where every rank of the group can learn
    of it, not as an IndexError on the one rank whose shard holds one."""
    if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab:
        outside = tokens[(tokens < 0) | (tokens >= vocab)].unique()  # sorted
        listed = ", ".join(str(int(t)) for t in outside[:4]) + (f" and {len(outside) - 4} more" if len(outside) > 4
                                                              else "")
        raise ValueError(f"{who} got token ids from {int(tokens.min())} to {int(tokens.max())}{where}, outside its "
                         f"vocabulary of {vocab} (0..{vocab - 1}): the id{'s' if len(outside) > 1 else ''} {listed}")


def whole(value) -> int | None:
    """A Python or numpy integer as an int; None for anything else (a bool, a float, a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def plain_values(config, owner: str | None = None) -> None:
    """Make a frozen dataclass config hold plain Python values, refusing a value not of its
    field's type: numpy's integers and floats become int and float (they passed every
    check, then failed in JSON or torch's seeding after the run), a path-like becomes a
    str; a float count, a number as a flag or text as a number are refused.

    ``owner`` None: a command's config, whose refusals name the field's flag. Else an API
    object's name (``"Hardware"``), which the refusals name with the field, and whose counts
    may be written as whole floats (``hbm_bytes=80e9``).
    """
    for name, kind, optional in _plain_fields(type(config)):
        value = getattr(config, name)
        if type(value) is kind or value is None and optional:  # the common case, first: configs are made often
            continue
        if kind is int and whole(value) is not None:
            value = whole(value)
        elif kind is int and owner and isinstance(value, float) and value.is_integer():
            value = int(value)
        elif kind is float and not isinstance(value, bool) and isinstance(value, numbers.Real):
            value = as_real(value)
        elif kind is str and isinstance(value, os.PathLike):
            value = os.fspath(value)
        else:
            named = f"{owner} {name}" if owner else "--" + name.replace("_", "-")
            raise ValueError(f"{named} must be {_KIND_NAMES[kind]}, got {value!r}")
        object.__setattr__(config, name, value)


@functools.cache
def _plain_fields(cls) -> tuple[tuple[str, type, bool], ...]:
    """(name, type, None allowed) of each field of dataclass ``cls`` typed int, float, str or
    bool, optionally None (annotations are evaluated once per class: configs are made often)."""
    hints = typing.get_type_hints(cls)
    found = []
    for field in dataclasses.fields(cls):
        kinds = [kind for kind in typing.get_args(hints[field.name]) if kind is not type(None)] or [hints[field.name]]
        if len(kinds) == 1 and kinds[0] in _KIND_NAMES:
            found.append((field.name, kinds[0], type(None) in typing.get_args(hints[field.name])))
    return tuple(found)


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "True or False"}


def check_count(field: str, value: int) -> None:
    """Refuse ``value`` unless an integer in 1..MAX_COUNT, naming the flag of ``field``
    (``head_dim``: --head-dim). A bool or a float is refused: ``True`` or ``2.0`` degrees
    would otherwise flow through the arithmetic as numbers."""
    if whole(value) is None:
        raise ValueError(f"--{field.replace('_', '-')} must be an integer, got {value!r}")
    if not 1 <= value <= MAX_COUNT:
        raise ValueError(f"--{field.replace('_', '-')} must be between 1 and {MAX_COUNT}, got {value}")


def check_splits(layout, length: int, flag: str = "--seq") -> None:
    """``layout.validate(length)``, its refusal naming the flag the length came from."""
    try:
        layout.validate(length)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def check_flag(name: str, value) -> None:
    """Refuse an API switch that is not a bool: ``"no"`` would read as True, ``""`` as False."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_seed(seed: int, flag: str = "--seed") -> None:
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{flag} must be between 0 and {MAX_SEED}, got {seed}")


def as_real(value) -> float:
    """``value`` as a float for range checks: NaN for what is not a real number (a bool, a
    string, a tensor), inf for an int beyond float range (``float()`` would raise)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf
