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

The trim threshold alone does not hold on a thread other than the main one, where a Ray
actor runs its calls: such a thread allocates from an arena of 64 MiB heaps of its own,
and glibc unmaps a heap of it whole as soon as the heap is empty, whatever the threshold
(``heap_trim``), so the optimizer's temporaries of every step faulted in fresh pages
again (measured on the `bench.py peers` 10 MB job: 16,000-20,000 faults a second on the
worker's call thread). ``M_TOP_PAD`` of a whole heap (``HEAP_PAD``) keeps such heaps: glibc
keeps an empty heap while the heap before it has less room to spare than the pad, which a
pad of a whole heap makes always. Measured on
the 100 MB job, the 2-core machine, medians of 40 steps, alternating runs: a step
0.25-0.27 s with the pad against 0.29-0.31 s without; in tests/test_memory.py's job,
10-20 pages faulted in a step against ~140 without.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

__all__ = ["HEAP_PAD", "KEEP_BELOW", "keep_freed_memory", "release_freed_memory"]

log = logging.getLogger("checkfree")

KEEP_BELOW = 1 << 30
"""Allocations below this size (1 GiB) come from the heap and stay with the process when
freed; larger ones are mapped and unmapped as before (a huge embedding table's worth)."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_TOP_PAD = -2

HEAP_PAD = 64 << 20
"""``M_TOP_PAD``: one thread-arena heap's most (glibc's ``HEAP_MAX_SIZE`` on 64-bit)."""


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


def keep_freed_memory(top_pad: int = HEAP_PAD) -> bool:
    """Keep this process's freed memory for reuse (see [Note: a worker keeps its freed
    memory]). ``top_pad`` 0 leaves glibc's pad as it is (a thread's empty heaps
    then go back). Returns whether malloc took the settings."""
    libc = _libc()
    if libc is None:
        return False
    took = {
        "trim": libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1),
        "mmap": libc.mallopt(_M_MMAP_THRESHOLD, KEEP_BELOW),
        "pad": libc.mallopt(_M_TOP_PAD, top_pad) if top_pad else 1,
    }
    if not all(took.values()):
        log.debug("malloc refused to keep freed memory (%s)", took)
    return all(took.values())


def release_freed_memory() -> None:
    """Hand the freed memory this process keeps back to the kernel (a parked worker)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
