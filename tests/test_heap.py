"""Local ranks keep the memory they free (``ctxpar.heap``), each threshold unless the environment sets it.

glibc's default serves a large block (above 128 KiB until larger mapped ones have been
freed) with a fresh mapping, unmaps it when freed, and hands a heap's free top back to
the OS: either way the next call faults the pages in again. A local rank serves blocks
below ``HEAP_BLOCK_BYTES`` from its heap and keeps what it frees resident. What that
saves is measured in docs/benchmarks.md ("Freed memory kept"); here, where a block lands,
that freeing it leaves it resident, and that measuring hands it back.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from ctxpar import heap, profile
from ctxpar.launch import run_local

glibc_only = pytest.mark.skipif(not heap.on_glibc(), reason="glibc's heap and its thresholds")

BLOCK_BYTES = heap.HEAP_BLOCK_BYTES - 2**20  # above any threshold glibc's default reaches in a fresh rank
VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", heap.OFF_SWITCH)


def _heap() -> tuple[int, int]:
    """[start, end) of this process's brk heap, glibc's main arena: in pieces where the kernel lists
    it so (a forked rank's, the part its server had, then what the rank grew it by)."""
    with open("/proc/self/maps") as f:
        pieces = [[int(bound, 16) for bound in line.split()[0].split("-")] for line in f
                  if line.rstrip().endswith("[heap]")]
    return (pieces[0][0], pieces[-1][1]) if pieces else (0, 0)


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the resident set from /proc")
def test_memory_in_use_on_cpu_is_the_resident_set() -> None:
    """The process's resident set (VmRSS), not its address space (statm's first field, several
    times larger: a step's growth from it read -566 MiB)."""
    used = profile.current_memory(torch.device("cpu"))
    with open("/proc/self/status") as f:
        [resident_kib] = [int(line.split()[1]) for line in f if line.startswith("VmRSS:")]
    assert abs(used - resident_kib * 1024) < 0.1 * resident_kib * 1024


def where_a_large_block_goes(rank: int, world: int) -> dict:
    block = torch.ones(BLOCK_BYTES // 4)  # written: resident
    start, end = _heap()
    in_heap = start <= block.data_ptr() < end
    resident = _resident()
    del block
    kept = _resident() > resident - BLOCK_BYTES // 2
    profile.current_memory(torch.device("cpu"))  # measuring hands the free heap back
    return dict(in_heap=in_heap, kept=kept, released=_resident() < resident - BLOCK_BYTES // 2)


@glibc_only
def test_a_local_rank_serves_large_blocks_from_its_heap_keeps_them_and_measures_without_them() -> None:
    assert run_local(where_a_large_block_goes, 1)[0] == dict(in_heap=True, kept=True, released=True)


@glibc_only
def test_an_mmap_threshold_the_environment_sets_is_left_to_glibc(monkeypatch) -> None:
    """glibc's default, 128 KiB, from the environment: the block gets its own mapping, gone when freed."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    found = run_local(where_a_large_block_goes, 1)[0]
    assert (found["in_heap"], found["kept"]) == (False, False)


@pytest.mark.parametrize("environment, kept", [
    ({}, ("mmap_threshold", "trim_threshold")),
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, ("trim_threshold",)),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, ("mmap_threshold",)),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, ("mmap_threshold",)),
    ({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:glibc.malloc.mmap_threshold=131072"}, ("trim_threshold",)),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, ("mmap_threshold", "trim_threshold")),  # not a threshold
    ({"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "0"}, ()),
])
def test_each_threshold_the_environment_sets_is_left_alone(monkeypatch, environment, kept) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    asked = []

    class Libc:
        def mallopt(self, parameter: int, value: int) -> int:
            asked.append(parameter)
            return 1

    monkeypatch.setattr(heap, "on_glibc", lambda: True)
    monkeypatch.setattr(heap, "_libc", Libc)
    assert heap.keep_freed_memory() == kept
    assert asked == [heap._THRESHOLDS[name][0] for name in kept]


@pytest.mark.parametrize("value, kept", [("0", ()), (" Off", ()), ("false", ()), ("no", ()),
                                         ("1", ("mmap_threshold", "trim_threshold"))])
def test_the_off_switch_leaves_glibcs_defaults(monkeypatch, value: str, kept: tuple) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(heap.OFF_SWITCH, value)

    class Libc:
        def mallopt(self, parameter: int, value: int) -> int:
            return 1

    monkeypatch.setattr(heap, "on_glibc", lambda: True)
    monkeypatch.setattr(heap, "_libc", Libc if kept else lambda: pytest.fail("the C library was asked"))
    assert heap.keep_freed_memory() == kept


def test_a_threshold_glibc_refuses_is_not_reported_kept(monkeypatch) -> None:
    """32-bit glibc refuses an mmap threshold above 512 KiB."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)

    class Libc:
        def mallopt(self, parameter: int, value: int) -> int:
            return int(parameter != heap._THRESHOLDS["mmap_threshold"][0])

    monkeypatch.setattr(heap, "on_glibc", lambda: True)
    monkeypatch.setattr(heap, "_libc", Libc)
    assert heap.keep_freed_memory() == ("trim_threshold",)


def test_only_glibc_is_asked(monkeypatch) -> None:
    monkeypatch.setattr(heap, "on_glibc", lambda: False)
    monkeypatch.setattr(heap, "_libc", lambda: pytest.fail("the C library was asked"))
    assert heap.keep_freed_memory() == ()
    heap.release_freed_memory()
