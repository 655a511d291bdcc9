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

[Note: huge pages for a worker's heap]
A worker's memory is mostly its state, hundreds of MB in 4 KiB pages, and two things
walk it page by page: a same-host transfer, whose ``process_vm_readv`` pins the sender's
pages one at a time ([Note: same-host transfer] in recovery/transport/same_host.py), and a death,
where the kernel frees the whole address space before it closes the dead worker's
sockets -- so the survivors' "connection reset" comes only after that. Transparent huge
pages (2 MiB) make both cheaper, but where the kernel gives them only to memory that asks
(``/sys/kernel/mm/transparent_hugepage/enabled`` = ``madvise``, a common default) malloc's
heap never asks. glibc 2.35+ asks for every heap it maps when the tunable
``glibc.malloc.hugetlb=1`` is set, which it reads once, at process start: so the Ray
workers are started with it in ``GLIBC_TUNABLES`` (`huge_page_env`, added to what the
caller's environment has there). Elsewhere -- an older glibc, THP off, another C
library -- it changes nothing. Measured on the 2-core machine, the warm-spare recovery of
the `bench.py peers` 100 MB job (315 MB of state), alternating runs: detect 0.035-0.038 s
against 0.074-0.104 s, transfer 27-37 ms against 35-49 ms, kill to training again
0.31 s against 0.39-0.41 s; the steady step the same (0.172-0.177 s against
0.170-0.191 s). ``CHECKFREE_HUGE_PAGES=0`` in the driver's environment turns it off.

Only workers started ahead of need get it: the job's (at its start) and hot spares, which
fault their memory in before anyone waits for them. A replacement started in a recovery
keeps malloc's default: on the 2-core machine (a VM) a fresh huge page faults in slower
than its 512 small ones -- 315 MB allocated and touched in 230-550 ms against ~95 ms --
and a cold replacement's state lands in fresh memory (with the tunable, its recovery of
the 100 MB job took 2.76-2.82 s; without, 1.86-1.93 s, the survivors' faster detection
included). A worker parked by an earlier job keeps what it was started with.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "HEAP_PAD",
    "HUGE_PAGES",
    "KEEP_BELOW",
    "huge_page_env",
    "keep_freed_memory",
    "release_freed_memory",
]

log = logging.getLogger("checkfree")

KEEP_BELOW = 1 << 30
"""Allocations below this size (1 GiB) come from the heap and stay with the process when
freed; larger ones are mapped and unmapped as before (a huge embedding table's worth)."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_TOP_PAD = -2

HEAP_PAD = 64 << 20
"""``M_TOP_PAD``: one thread-arena heap's most (glibc's ``HEAP_MAX_SIZE`` on 64-bit)."""


HUGE_PAGES = "glibc.malloc.hugetlb=1"
"""The glibc tunable that makes malloc ask for transparent huge pages for its heaps."""


def huge_page_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment variables to start a worker process with so that its heap asks for
    huge pages (see [Note: huge pages for a worker's heap]): ``GLIBC_TUNABLES`` with
    `HUGE_PAGES` added to ``environ``'s, or nothing where ``environ`` turns it off
    (``CHECKFREE_HUGE_PAGES=0``) or sets ``glibc.malloc.hugetlb`` itself."""
    if environ.get("CHECKFREE_HUGE_PAGES", "1").strip().lower() in ("0", "false", "no", "off"):
        return {}
    tunables = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t]
    if any(t.split("=", 1)[0] == "glibc.malloc.hugetlb" for t in tunables):
        return {}
    return {"GLIBC_TUNABLES": ":".join([*tunables, HUGE_PAGES])}


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
