"""A worker keeps the memory it freed ([Note: a worker keeps its freed memory] in
recovery/worker/memory.py): a block allocated again after being freed faults in no fresh
pages, and a parked worker gives the memory back. Each case runs in a process of its own:
malloc's settings are process-wide."""

from __future__ import annotations

import subprocess
import sys

import pytest

from recovery.worker import memory

_PROBE = """
import resource, sys, torch
from recovery.worker.memory import keep_freed_memory, release_freed_memory
if sys.argv[1] != "default":
    assert keep_freed_memory()
n, count = 26 << 20, 8  # a state's worth of tensors: the 100 MB job's AdamW moments
def faults_of_a_state():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.empty(n, dtype=torch.uint8).fill_(1) for _ in range(count)]
    del tensors  # allocated, touched, freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_a_state()
if sys.argv[1] == "released":
    release_freed_memory()
print(faults_of_a_state(), n * count // resource.getpagesize())
"""


def _faults(mode: str) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    faults, pages = out.stdout.split()
    return int(faults), int(pages)


pytestmark = pytest.mark.skipif(memory._libc() is None, reason="not glibc's malloc")


def test_a_state_freed_and_allocated_again_faults_in_few_fresh_pages() -> None:
    """Most of it lands in pages the process kept (an aligned block may not fit the hole
    its predecessor left between small allocations: then that one tensor faults)."""
    faults, pages = _faults("kept")
    assert faults < pages // 4, (faults, pages)


def test_without_it_every_page_faults_again() -> None:
    """What the setting is for: malloc's default maps and unmaps such blocks each time."""
    faults, pages = _faults("default")
    assert faults > pages // 2, (faults, pages)


def test_a_parked_worker_gives_the_memory_back() -> None:
    faults, pages = _faults("released")
    assert faults > pages // 2, (faults, pages)
