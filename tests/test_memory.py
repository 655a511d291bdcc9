"""A worker keeps the memory it freed ([Note: a worker keeps its freed memory] in
recovery/worker/memory.py): a block allocated again after being freed faults in no fresh
pages, and a parked worker gives the memory back. Each case runs in a process of its own:
malloc's settings are process-wide."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from parallelism import Topology
from recovery import RecoveryPolicy, SnapshotPolicy, Trainer
from recovery.worker import memory
from tests.workloads import mlp_spec, regression_batches

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


def _wide_stage(stage: int, num_stages: int) -> torch.nn.Module:
    """Four 2.6 MB layers: AdamW's temporaries are blocks the size of each."""
    return torch.nn.Sequential(*[torch.nn.Linear(809, 809) for _ in range(4)])


def _wide_batches(step: int, replica: int, num_replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    return regression_batches(step, replica, num_replicas, width=809)


def _thread_counts(pid: int) -> dict[int, tuple[int, int]]:
    """``pid``'s threads: thread id -> (CPU ticks, minor faults)."""
    out: dict[int, tuple[int, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            fields = (task / "stat").read_text(encoding="ascii").rsplit(")", 1)[1].split()
            # utime + stime, and minflt (the 10th field)
            out[int(task.name)] = (int(fields[11]) + int(fields[12]), int(fields[7]))
    return out


def _step_thread_faults(
    before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]
) -> int:
    """Minor faults between two samples of the thread that ran most between them: a
    training worker's call thread, where its steps run (Ray's and Gloo's threads fault on
    their own schedule, more on a loaded machine, and are not what this measures)."""
    tid = max(after, key=lambda t: after[t][0] - before.get(t, (0, 0))[0])
    return after[tid][1] - before.get(tid, (0, 0))[1]


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local", "empty_pool")  # parked workers keep how they started
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_ray_workers_steady_steps_fault_in_almost_no_fresh_pages() -> None:
    """A Ray actor runs its calls on a thread of its own, whose arena's heaps glibc gave
    back whenever one emptied: AdamW's temporaries then faulted in pages every step.
    Measured on the step thread of this job on the 2-core machine, per step: 7-20 without
    the pad; with it 0.05-0.08 in workers holding their heap in huge pages (the job's
    own, started ahead: [Note: huge pages for a worker's heap]), 0.07-12 in workers
    without them."""
    spec = mlp_spec(build_stage=_wide_stage, batches=_wide_batches, microbatches=1)
    trainer = Trainer(
        spec,
        topology=Topology(1, 2),
        policy=RecoveryPolicy(hot_spares=0, snapshots=SnapshotPolicy(peer_every=None)),
        collect_states=False,
    )
    counts: list[tuple[int, list[dict[int, tuple[int, int]]]]] = []
    pids: list[int] = []

    def sample() -> None:  # at two steps of the run, each worker's faults so far
        for at in (20, 120):
            while trainer._training is None or trainer._training.step < at:
                time.sleep(0.005)
            controller = trainer._training
            pids[:] = [info.pid for info in controller.infos().values()]
            counts.append((controller.step, [_thread_counts(pid) for pid in pids]))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    trainer.fit(150)
    sampler.join(timeout=10)
    (s0, before), (s1, after) = counts
    per_step = [_step_thread_faults(a, b) / (s1 - s0) for a, b in zip(before, after, strict=True)]
    huge = (
        _thp_for_madvised_memory()
        and _GLIBC_HUGETLB
        and all(
            memory.HUGE_PAGES in _environ(pid).get("GLIBC_TUNABLES", "").split(":") for pid in pids
        )
    )
    if not huge:  # 0.07-12 with the pad against 7-20 without: no bound tells them apart
        pytest.skip(
            "workers without huge pages: the steady faults with and without the pad overlap"
        )
    assert max(per_step) < 2, per_step


# -- huge pages ([Note: huge pages for a worker's heap]) -----------------------------------


def test_the_huge_page_tunable_is_added_to_the_callers_and_can_be_turned_off() -> None:
    assert memory.huge_page_env({}) == {"GLIBC_TUNABLES": memory.HUGE_PAGES}
    mine = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert memory.huge_page_env(mine) == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{memory.HUGE_PAGES}"
    }
    assert memory.huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {}
    assert memory.huge_page_env({"CHECKFREE_HUGE_PAGES": "0"}) == {}


_GLIBC_HUGETLB = tuple(int(p) for p in (platform.libc_ver()[1] or "0.0").split(".")[:2]) >= (2, 35)
"""Whether this glibc knows ``glibc.malloc.hugetlb``."""


def _thp_for_madvised_memory() -> bool:
    with contextlib.suppress(OSError):
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(encoding="ascii")
        return "[never]" not in mode
    return False


_HUGE_PROBE = """
import torch
state = [torch.empty(16 << 20, dtype=torch.uint8).fill_(1) for _ in range(4)]
for line in open("/proc/self/smaps_rollup"):
    if line.startswith("AnonHugePages:"):
        print(int(line.split()[1]) << 10)
"""


@pytest.mark.skipif(not _thp_for_madvised_memory(), reason="transparent huge pages are off")
@pytest.mark.skipif(not _GLIBC_HUGETLB, reason="glibc.malloc.hugetlb needs glibc 2.35")
def test_a_process_started_with_it_holds_its_heap_in_huge_pages() -> None:
    def huge_bytes(env: dict[str, str]) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _HUGE_PROBE],
            capture_output=True,
            text=True,
            timeout=120,
            env={k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | env,
        )
        assert out.returncode == 0, out.stderr
        return int(out.stdout)

    assert huge_bytes(memory.huge_page_env({})) >= 32 << 20  # of the 64 MB allocated
    if "[madvise]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        assert huge_bytes({}) == 0  # what it is for: the heap never asks by itself


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local", "empty_pool")  # parked workers keep how they started
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_started_ahead_get_the_tunable_and_a_recoverys_replacement_does_not() -> None:
    """Huge pages fault in fresh more slowly than small ones on some hosts, so a worker
    started on a recovery's critical path keeps malloc's default."""
    from recovery.groups.ray_group import RayWorkerGroup
    from tests.workloads import EchoWorker

    group = RayWorkerGroup(EchoWorker)
    node = group.nodes()[0]
    try:
        group.start({0: node, 1: node}, timeout=60, parked=True)  # the job's start
        group.add_spares([node], lambda: (EchoWorker.echo, (0,)))
        group.await_spares(60)
        group.start({1: node}, timeout=60)  # a replacement in a recovery, no spare taken
        tunables = {r: _environ(group.info(r).pid).get("GLIBC_TUNABLES", "") for r in (0, 1)}
        assert memory.HUGE_PAGES in tunables[0].split(":")
        assert memory.HUGE_PAGES not in tunables[1].split(":")
        group.start({1: node}, timeout=60, spares=True)  # this one takes the spare
        assert memory.HUGE_PAGES in _environ(group.info(1).pid)["GLIBC_TUNABLES"].split(":")
    finally:
        group.shutdown(clean=False)
