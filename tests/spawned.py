"""Spawned process groups for the tests: one spawn per world size, run once per session.

Spawning costs seconds (each rank imports torch: 3 s for 4 ranks on a 2-core machine) and a
case milliseconds, so each module runs all its cases inside one batch, a function of (rank,
world) whose result its tests assert on. The modules declare their batches when pytest
imports them (``declare``); the first test that asks for a batch's results (``results``)
spawns one group for its world size and runs in it, one after another, every batch declared
for that world size, so that a run of the whole suite spawns once per world size, and a run
of one module's file only that module's batches (``-k`` selects tests, not the batches of the
modules collected). A group that failed or hung is cached too: every test that needs one of
its batches reports the same failure, naming the batch that raised, instead of spawning (and
waiting) again.
"""

from __future__ import annotations

import gc
import importlib
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ctxpar.launch import run_local


@dataclass(frozen=True)
class _Batch:
    module: str  # the batch's function, imported by name in the ranks: see _run_batches
    name: str
    world: int
    device_type: str | None
    timeout_s: float
    first: bool


_declared: dict[str, _Batch] = {}
_groups: dict[str, tuple[bool, Any]] = {}


def declare(key: str, fn: Callable[..., Any], world: int, *, timeout_s: float, device_type: str | None = None,
            first: bool = False) -> None:
    """Declare the batch ``key``: ``fn(rank, world)`` (module level, its result picklable) on
    ``world`` gloo ranks; with ``device_type``, ``fn(rank, world, device)`` on ``run_local``'s
    placement, in a group of its own device type. ``timeout_s`` bounds each of its collectives
    (the group takes the largest of its batches'); ``first``: it must run first in a fresh
    process (it checks what its first call imports), before any other batch's module is imported."""
    batch = _Batch(fn.__module__, fn.__qualname__, world, device_type, timeout_s, first)
    if _declared.setdefault(key, batch) != batch:
        raise ValueError(f"batch {key!r} declared twice, as {_declared[key]} and as {batch}")
    if first and any(_same_group(b, batch) and b.first and k != key for k, b in _declared.items()):
        raise ValueError(f"two batches on {world} ranks must run first in a fresh process: spawn them apart")


def _same_group(a: _Batch, b: _Batch) -> bool:
    return (a.world, a.device_type) == (b.world, b.device_type)


def results(key: str) -> list[Any]:
    """The per-rank results of the declared batch ``key``."""
    if key not in _groups:
        asked = _declared[key]
        keys = sorted((k for k, b in _declared.items() if _same_group(b, asked) and k not in _groups),
                      key=lambda k: not _declared[k].first)  # stable: the rest in the order declared
        batches = [(_declared[k].module, _declared[k].name) for k in keys]
        # gloo ranks get one thread each: the cases' ops are tiny, and OpenMP threads on a loaded machine spin at
        # every op's barrier (milliseconds per 2 x 32 matmul); on 2 or more ranks of 2 cores, one is the default
        threads = 1 if asked.device_type is None else None
        timeout_s = max(_declared[k].timeout_s for k in keys)
        try:
            per_rank = run_local(_run_batches, asked.world, (batches,), timeout_s=timeout_s, threads=threads,
                                 device_type=asked.device_type)
            for i, k in enumerate(keys):
                _groups[k] = (True, [ranks_results[i] for ranks_results in per_rank])
        except Exception as e:  # noqa: BLE001  re-raised by every test that asks
            for k in keys:
                _groups[k] = (False, e)
    ok, value = _groups[key]
    if not ok:  # chained, not re-raised: each raise would add its frames to the one exception's traceback
        raise RuntimeError(f"the spawned group running batch {key!r} failed") from value
    return value


def _run_batches(rank: int, world: int, batches: list[tuple[str, str]], *device) -> list[Any]:
    """Each batch's result on this rank, in order (``device``: run_local's, where the group has a
    device type); each batch's module imported only when its turn comes (a ``first`` batch sees
    a process that has imported none of the others). Each batch finds torch's random state and
    the warning filters as the process began, and none of the code torch.compile made for
    another, as it would in a process of its own. What a batch raises names it."""
    found, random_state = [], torch.random.get_rng_state()
    for module, name in batches:
        fn = importlib.import_module(module)
        gc.freeze()  # imports are never garbage: transformers' Trainer collects at every train() (0.3 s of them)
        for part in name.split("."):
            fn = getattr(fn, part)
        torch.random.set_rng_state(random_state)
        try:
            with warnings.catch_warnings():
                found.append(fn(rank, world, *device))
        except Exception as e:
            e.add_note(f"(raised by the spawned batch {module}.{name})")
            raise
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].reset()
    return found
