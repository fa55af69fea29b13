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

A run of the whole suite (every test collected, some reading groups and some not) spawns its
CPU groups in the background (``run_in_background``, called by conftest.py): one process runs
them, one after another, at a lower priority, while pytest runs the tests that read none, and
the tests that read them run last. On 2 cores the groups' ranks take the CPU that the other
tests, one after another, leave (their commands' and launchers' waits), instead of the two
taking turns. Other runs spawn the groups as their tests ask for them. The ranks' output of a
group run in the background is shown where that group fails.
"""

from __future__ import annotations

import functools
import gc
import importlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ctxpar import rank_server
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
        if _background is not None and key in _background.keys:
            keys, outcome = _background.outcome(key)
        else:
            keys = _group_of(key)
            outcome = _spawn(keys)
        for k, got in zip(keys, _per_batch(outcome, keys)):
            _groups[k] = got
    ok, value = _groups[key]
    if not ok:  # chained, not re-raised: each raise would add its frames to the one exception's traceback
        raise RuntimeError(f"the spawned group running batch {key!r} failed") from value
    return value


def _group_of(key: str) -> list[str]:
    """The batches not yet run of ``key``'s group: the ``first`` one first, the rest in the order declared."""
    asked = _declared[key]
    return sorted((k for k, b in _declared.items() if _same_group(b, asked) and k not in _groups),
                  key=lambda k: not _declared[k].first)


def _spawn(keys: list[str]) -> tuple[bool, Any]:
    """(True, each rank's list of the batches' results), or (False, the exception) of one group
    running ``keys``."""
    asked = _declared[keys[0]]
    batches = [(_declared[k].module, _declared[k].name) for k in keys]
    # gloo ranks get one thread each: the cases' ops are tiny, and OpenMP threads on a loaded machine spin at
    # every op's barrier (milliseconds per 2 x 32 matmul); on 2 or more ranks of 2 cores, one is the default
    threads = 1 if asked.device_type is None else None
    try:
        return True, run_local(_run_batches, asked.world, (batches,), threads=threads, device_type=asked.device_type,
                               timeout_s=max(_declared[k].timeout_s for k in keys))
    except Exception as e:  # noqa: BLE001  re-raised by every test that asks
        return False, e


def _per_batch(outcome: tuple[bool, Any], keys: list[str]) -> list[tuple[bool, Any]]:
    ok, value = outcome
    if not ok:
        return [outcome] * len(keys)
    return [(True, [ranks_results[i] for ranks_results in value]) for i in range(len(keys))]


@functools.cache
def reads_groups(module: ModuleType | None) -> bool:
    """Whether a test module reads spawned groups: it imports this module, or a module that
    imports it (as ``spawned``)."""
    this = sys.modules[__name__]
    return module is not None and any(m is this or getattr(m, "spawned", None) is this
                                      for m in vars(module).values() if isinstance(m, ModuleType))


class _Background:
    """A process that runs ``groups`` (lists of batch keys), one after another, each group's
    outcome pickled to ``folder``/<n>.pickle as it ends."""

    def __init__(self, groups: list[list[str]], folder: Path) -> None:
        self.groups, self.folder = groups, folder
        self.keys = {k for group in groups for k in group}
        (folder / "groups.pickle").write_bytes(pickle.dumps([[(k, _declared[k]) for k in g] for g in groups]))
        here = str(Path(__file__).parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-c", f"import spawned; spawned._run_groups({str(folder)!r})"]
        with open(folder / "log", "wb") as log:  # the ranks' output: shown where a group fails
            # stdin: a pipe only this process holds, whose end tells the runner that pytest is gone
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                            env=env)

    def outcome(self, key: str) -> tuple[list[str], tuple[bool, Any]]:
        """The batches of ``key``'s group and its outcome, waited for."""
        number, keys = next((n, group) for n, group in enumerate(self.groups) if key in group)
        path = self.folder / f"{number}.pickle"
        while not path.exists():
            if self.process.poll() is not None and not path.exists():
                error = RuntimeError(f"the background process running the spawned groups ended (status "
                                     f"{self.process.returncode}) before the group of {key!r}; its output:\n"
                                     f"{_tail(self.folder / 'log')}")
                return keys, (False, error)
            time.sleep(0.1)
        ok, value = pickle.loads(path.read_bytes())
        if not ok:
            value = RuntimeError(f"{value}\nthe ranks' output (of every group):\n{_tail(self.folder / 'log')}")
        return keys, (ok, value)

    def stop(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_background: _Background | None = None


def _tail(path: Path, chars: int = 20_000) -> str:
    return path.read_text(errors="replace")[-chars:]


def run_in_background(folder: Path) -> None:
    """Start running every declared CPU group that no test has read yet, largest first, in a
    process of its own: ``results`` then waits for the group's outcome there."""
    global _background
    first_of_each = {b.world: k for k, b in reversed(_declared.items()) if b.device_type is None and k not in _groups}
    groups = [_group_of(first_of_each[world]) for world in sorted(first_of_each, reverse=True)]
    if groups:
        _background = _Background(groups, folder)


def stop_background() -> None:
    """End the background process: its groups are done, or the session is cut short."""
    global _background
    if _background is not None:
        _background.stop()
        _background = None


def _run_groups(folder: str) -> None:
    """The background process: run each group of ``folder``/groups.pickle and pickle its outcome
    there; end with the pytest process (the end of stdin)."""
    def end_with_pytest() -> None:
        while os.read(0, 4096):  # unbuffered: a daemon thread in a buffered read aborts the interpreter's end
            pass
        os.kill(os.getpid(), signal.SIGTERM)  # its ranks are tied to it and end with it

    # the tests beside it run one after another, each waiting on the last: they are the run's critical path, and the
    # groups take the CPU they leave (their ranks inherit this)
    os.nice(10)
    rank_server.start_here()  # before anything runs: the ranks are forks of this process, not of a new interpreter
    threading.Thread(target=end_with_pytest, daemon=True).start()
    folder = Path(folder)
    groups = pickle.loads((folder / "groups.pickle").read_bytes())
    for number, group in enumerate(groups):
        _declared.update(group)
        ok, value = _spawn([k for k, _ in group])
        if not ok:  # its traceback, as text: an exception's frames do not survive pickling
            value = "".join(traceback.format_exception(value))
        partial = folder / f"{number}.partial"
        partial.write_bytes(pickle.dumps((ok, value)))
        partial.rename(folder / f"{number}.pickle")


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
