"""Per-rank counters for what attention calls did: bytes moved, compute and wait time.

    with ctxpar.record() as rec:
        out = ctxpar.attention(q, k, v, layout="zigzag")
        out.sum().backward()
    rec.bytes_sent, rec.bytes_received, rec.compute_seconds, rec.wait_seconds

A record counts while it is open and can be opened again, its counts adding up: ``with
rec:`` once per step of a phase, or ``@rec`` on a function, counting every call.

Counters are process-wide (not thread-local) because autograd may run backward on
another thread. Timing on CUDA synchronises the current stream around each block while a
record is open, so only open one when measuring; ``record(timing=False)`` counts bytes and strategy choices
without timing anything (what a training loop can afford).
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ctxpar import heap


@dataclass(eq=False)  # open records are told apart by identity: two may hold equal counts
class Record(contextlib.ContextDecorator):
    bytes_sent: int = 0
    bytes_received: int = 0
    compute_seconds: float = 0.0  # local kernels and merges, wall clock
    compute_cpu_seconds: float = 0.0  # the same, CPU time (immune to time-sharing): see ``timed``
    wait_seconds: float = 0.0  # blocked on communication that compute did not hide
    collectives: int = 0  # communications posted (one ring step's send + receive counts once)
    waits: int = 0  # times this rank blocked until a communication completed: synchronisation points
    strategy_choices: list[tuple[str, str]] = field(default_factory=list)  # strategy="auto": (chosen, why) per call
    timing: bool = True  # compute and wait seconds counted (on CUDA: the stream synchronised around each block)

    def __enter__(self) -> Record:
        with _opening:  # one record decorating a function that threads call at once
            _open[self] = _open.get(self, 0) + 1  # opened inside itself (a recursing function): counted once
        return self

    def __exit__(self, *exc_info) -> None:
        with _opening:
            _open[self] -= 1
            if not _open[self]:
                del _open[self]


_open: dict[Record, int] = {}  # open records, in the order they were opened -> how many times each is open
_opening = threading.Lock()


def record(timing: bool = True) -> Record:
    """Count everything ctxpar does on this rank while the record is open (``with``, or as a
    decorator); without ``timing``, everything but the seconds, and the device is never
    synchronised for it."""
    if not isinstance(timing, bool):  # @ctxpar.record without parentheses passes the function
        raise ValueError(f"record's timing {timing!r} must be True or False; to count a function's calls, make the "
                         f"record first and decorate with it: rec = ctxpar.record(), then @rec (rec holds the counts)")
    return Record(timing=timing)


def note_strategy(strategy: str, why: str) -> None:
    """What ``strategy="auto"`` chose for one call, and why."""
    for rec in tuple(_open):  # a snapshot: another thread may open or close a record meanwhile
        rec.strategy_choices.append((strategy, why))


def add_traffic(sent: int, received: int) -> None:
    """One communication posted, moving these bytes out of and into this rank."""
    for rec in tuple(_open):
        rec.bytes_sent += sent
        rec.bytes_received += received
        rec.collectives += 1


@contextlib.contextmanager
def timed(counter: str, device: torch.device) -> Iterator[None]:
    """Add the time the block takes to ``counter`` ('compute' | 'wait').

    Wall time goes to ``<counter>_seconds``; for 'compute' the CPU time also goes to
    ``compute_cpu_seconds``: this thread's where torch computes on it alone (one thread, as
    every local rank of ``ctxpar demo``), so that the communication threads' work at the
    same time (gloo moving the next K/V over loopback) is not counted as compute; else the
    process's, which counts them too.
    """
    if not _open:  # nothing is recording: the common case, on every compute block and wait
        yield
        return
    recording = tuple(_open)
    timing = [rec for rec in recording if rec.timing]
    if counter == "wait":
        for rec in recording:
            rec.waits += 1
    if not timing:
        yield
        return
    # this rank's stream only: a device-wide synchronize waits for NCCL's streams too, and would
    # count a transfer still in flight as compute, hiding the ring's overlap while a record is open
    sync = torch.cuda.current_stream(device).synchronize if device.type == "cuda" else (lambda: None)
    cpu_clock = time.thread_time if torch.get_num_threads() == 1 else time.process_time
    sync()
    wall, cpu = time.perf_counter(), cpu_clock()
    try:
        yield
    finally:
        sync()
        wall, cpu = time.perf_counter() - wall, cpu_clock() - cpu
        for rec in timing:
            setattr(rec, f"{counter}_seconds", getattr(rec, f"{counter}_seconds") + wall)
            if counter == "compute":
                rec.compute_cpu_seconds += cpu


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what was measured): the CUDA allocator's peak on GPU, else the process's
    resident-set peak (which includes the Python runtime and torch itself)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_max_rss"


def current_memory(device: torch.device) -> int:
    """Bytes in use now: allocated CUDA memory, or the process's resident set once the
    heap's free memory is handed back (``heap.release_freed_memory``: a local rank keeps
    what it frees, and a peak measured from here must count what the step allocates; the
    next allocations fault those pages in again). Not a pure read on CPU, so call it where
    memory is about to be measured. ``peak_memory`` on CPU is the process's lifetime peak:
    growth from here means something only where nothing before peaked higher."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    heap.release_freed_memory()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
