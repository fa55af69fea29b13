"""Local ranks keep the memory they free (``launch._reuse_freed_memory``), unless told otherwise.

glibc's default serves a large block (above 128 KiB until larger ones have been freed)
with a fresh mapping and unmaps it when freed, and hands a heap's free top back to the OS:
either way the next call faults the pages in again. A local rank serves blocks up to
``REUSED_BLOCK_BYTES`` from its heap and keeps the heap at its peak. What it saves in
attention calls is measured in docs/benchmarks.md ("Freed memory kept"); here, where a
block lands and whether the heap shrinks once it is freed.
"""

from __future__ import annotations

import sys

import pytest
import torch

from ctxpar.launch import REUSED_BLOCK_BYTES, run_local

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap, read from /proc")

BLOCK_BYTES = REUSED_BLOCK_BYTES - 2**20  # above any threshold glibc's default would have reached in a fresh rank


def _heap() -> tuple[int, int]:
    """[start, end) of this process's brk heap, glibc's main arena."""
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith("[heap]"):
                start, end = line.split()[0].split("-")
                return int(start, 16), int(end, 16)
    return 0, 0


def where_a_large_block_goes(rank: int, world: int) -> dict:
    block = torch.empty(BLOCK_BYTES // 4)
    start, end = _heap()
    in_heap = start <= block.data_ptr() < end
    del block
    return dict(in_heap=in_heap, heap_kept=_heap()[1] >= end)


def test_a_local_rank_serves_large_blocks_from_its_heap_and_keeps_it() -> None:
    assert run_local(where_a_large_block_goes, 1)[0] == dict(in_heap=True, heap_kept=True)


def test_thresholds_from_the_environment_are_left_alone(monkeypatch) -> None:
    """MALLOC_MMAP_THRESHOLD_ at glibc's default, 128 KiB: the block gets its own mapping."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    assert run_local(where_a_large_block_goes, 1)[0]["in_heap"] is False
