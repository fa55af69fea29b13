"""A CPU rank's C heap (glibc): keep what it frees for reuse; hand it back before measuring.

An attention call allocates and frees MiBs of buffers (K/V in flight, packed all-to-all
chunks, accumulators, gradient shares). glibc's defaults serve a block above its mmap
threshold (128 KiB, raised to the largest mapped block freed so far, at most 32 MiB) with
a fresh mapping, unmapped when freed, and hand a heap's free top back to the OS once it
exceeds the trim threshold (twice the mmap threshold): either way the next call faults
the pages in again, a cost that changed from one call to the next and from one process
to the next, and that slowed gloo's transfers between local ranks 1.65x
(docs/benchmarks.md, "Freed memory kept"). ``keep_freed_memory`` fixes both thresholds,
as the local ranks ``ctxpar.launch.run_local`` starts do; the heap then stays at its
peak, as a GPU's caching allocator keeps its blocks, so ``release_freed_memory`` hands
the free part back where resident memory is about to be measured.
"""

from __future__ import annotations

import ctypes
import os

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (<malloc.h>)
# Blocks below this size are served from the heap, so that freeing them keeps them for the
# next allocation (glibc's largest mmap threshold on 64-bit; larger blocks still get their
# own mapping), and up to this much free heap is kept rather than handed back.
HEAP_BLOCK_BYTES = 32 * 2**20
KEPT_FREE_BYTES = 1 << 30
OFF_SWITCH = "CTXPAR_KEEP_FREED_MEMORY"  # 0, false, no or off: glibc's defaults in every local rank
# Each threshold: its parameter, its value here, and where the environment sets it instead
# (glibc reads both when the process starts).
_THRESHOLDS = {
    "mmap_threshold": (_M_MMAP_THRESHOLD, HEAP_BLOCK_BYTES, "MALLOC_MMAP_THRESHOLD_"),
    "trim_threshold": (_M_TRIM_THRESHOLD, KEPT_FREE_BYTES, "MALLOC_TRIM_THRESHOLD_"),
}


def on_glibc() -> bool:
    """Whether this process runs on glibc, whose ``mallopt`` parameters these are."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (AttributeError, ValueError, OSError):  # no confstr, or no such name: not glibc
        return False


def keep_freed_memory() -> tuple[str, ...]:
    """Fix glibc's mmap and trim thresholds at ``HEAP_BLOCK_BYTES`` and ``KEPT_FREE_BYTES``,
    each unless the environment sets it (``MALLOC_MMAP_THRESHOLD_`` /
    ``MALLOC_TRIM_THRESHOLD_``, or ``glibc.malloc.mmap_threshold`` / ``trim_threshold`` in
    ``GLIBC_TUNABLES``); the thresholds set, those glibc accepted (32-bit glibc refuses an
    mmap threshold above 512 KiB). Nothing off glibc, or where ``CTXPAR_KEEP_FREED_MEMORY``
    is 0, false, no or off (glibc's defaults: what ``benchmarks/heap.py`` compares with)."""
    if not on_glibc() or os.environ.get(OFF_SWITCH, "").strip().lower() in ("0", "false", "no", "off"):
        return ()
    mallopt = _libc().mallopt
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    kept = []
    for name, (parameter, value, variable) in _THRESHOLDS.items():
        if variable in os.environ or f"glibc.malloc.{name}" in tunables:
            continue
        if mallopt(parameter, value) == 1:
            kept.append(name)
    return tuple(kept)


def release_freed_memory() -> None:
    """Hand the heap's free memory back to the OS (glibc's ``malloc_trim``), so that the
    resident set counts what is in use, not what is kept for reuse. Nothing off glibc."""
    if on_glibc():
        _libc().malloc_trim(0)


def _libc() -> ctypes.CDLL:
    """The C library this process runs on."""
    return ctypes.CDLL(None)
