"""Spawned process groups for the tests: one per key, run once per session.

Spawning costs seconds and a case milliseconds, so each module runs all its cases inside
one group and its tests assert on what the group reported. A group that failed or hung is
cached too: every test that needs it reports the same failure instead of spawning (and
waiting) again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ctxpar.launch import run_local

_groups: dict[str, tuple[bool, Any]] = {}


def results(key: str, fn: Callable[..., Any], nproc: int, **kwargs) -> list[Any]:
    """``run_local(fn, nproc, **kwargs)``'s per-rank results, computed once for ``key``."""
    if key not in _groups:
        try:
            _groups[key] = (True, run_local(fn, nproc, **kwargs))
        except Exception as e:  # noqa: BLE001  re-raised by every test that asks
            _groups[key] = (False, e)
    ok, value = _groups[key]
    if not ok:
        raise value
    return value
