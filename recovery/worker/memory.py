"""A worker process keeps the memory it has touched, so a recovery writes into warm pages.

[Note: a worker keeps its freed memory]
glibc's malloc serves a large allocation (at least ``M_MMAP_THRESHOLD``, 128 KiB to start
with, raised as large blocks are freed, to 32 MiB at most) with a fresh ``mmap`` and
unmaps it when freed, and it hands the freed top of its heap back to the kernel past
``M_TRIM_THRESHOLD``. Every such allocation then starts as pages that fault in on first
touch: measured on the 2-core machine, ~0.45 ms per MB, against ~0.06 ms per MB to
write memory the process already has. A replacement's state arrives in optimizer
moments it allocates on receipt (two thirds of an AdamW worker's bytes): a hot spare had
touched as much memory in its warm-up step and given it back, and a 315 MB transfer spent
most of its time in page faults (the transfer phase of a warm-spare recovery of the
`bench.py peers` 100 MB job: 0.17-0.21 s; 0.06-0.08 s with the memory kept).

So a worker raises both thresholds once, at start (`keep_freed_memory`): blocks up to
``KEEP_BELOW`` come from the heap and freed memory stays in the process for the next
allocation, as a GPU framework's caching allocator keeps device memory. (Not every
block: an aligned request may not fit the hole its predecessor left between small
allocations, and then that tensor faults in fresh pages -- one in eight or none, in
tests/test_memory.py.) A worker's footprint is then its peak, not its current use; a
worker parked for another job gives the memory back (`release_freed_memory`). Elsewhere
than glibc both are no-ops.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

__all__ = ["KEEP_BELOW", "keep_freed_memory", "release_freed_memory"]

log = logging.getLogger("checkfree")

KEEP_BELOW = 1 << 30
"""Allocations below this size (1 GiB) come from the heap and stay with the process when
freed; larger ones are mapped and unmapped as before (a huge embedding table's worth)."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


@functools.cache
def _libc() -> Any:
    """glibc, or None (another C library, another system)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Keep this process's freed memory for reuse (see [Note: a worker keeps its freed
    memory]). Returns whether malloc took both settings."""
    libc = _libc()
    if libc is None:
        return False
    trim = libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    mmap = libc.mallopt(_M_MMAP_THRESHOLD, KEEP_BELOW)
    if not (trim and mmap):
        log.debug("malloc refused to keep freed memory (trim %s, mmap %s)", trim, mmap)
    return bool(trim and mmap)


def release_freed_memory() -> None:
    """Hand the freed memory this process keeps back to the kernel (a parked worker)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
