"""The durable tier on a file system that is slow, fails, or is shared with another job.

Real file systems, no FUSE: a slow disk is a worker process whose writes sleep
(`tests.workloads.slow_disk_stage`, installed by the spec in the worker itself); a disk that
refuses a write is a folder where the file must go (``COMPLETE.json`` a directory: the
rename fails with ``EISDIR``, as root too) or a file where a folder must go; a folder in
use is one another job -- a real one, in this process or in a process killed with SIGKILL --
holds the lock of.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parallelism import Topology
from recovery import RecoveryPolicy, SnapshotPolicy, Timeouts, Trainer
from recovery.snapshots import COMPLETE, SnapshotFolder
from recovery.snapshots.checkpoint import step_path
from tests.workloads import SLOW_WRITES, mlp_spec, slow_disk_stage

TOP = Topology(2, 2)


def _slow(folder: Path, seconds: float, steps: list[int]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SLOW_WRITES).write_text(json.dumps({"seconds": seconds, "steps": steps}))


def _unwritable(folder: Path, step: int, what: str) -> None:
    """Make the write of ``step`` fail: its commit (``COMPLETE.json`` is a directory), or
    every worker's write (the step's folder is a file)."""
    folder.mkdir(parents=True, exist_ok=True)
    if what == "commit":
        (step_path(folder, step) / COMPLETE).mkdir(parents=True)
    else:
        step_path(folder, step).write_text("not a folder")


def _temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.name.endswith(".tmp")]


# -- 1. a slow disk ------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(300)
def test_a_slow_durable_write_does_not_get_a_healthy_worker_killed(tmp_path: Path) -> None:
    """Each worker's write of step 2 takes 8 s: longer than the hang timeout (3 s), well
    inside the save timeout (40 s). The write of step 4 waits for it, inside its call; no
    worker is taken for lost, and every snapshot completes."""
    snapshots = tmp_path / "snapshots"
    _slow(snapshots, 8.0, [2])
    policy = RecoveryPolicy(
        snapshots=SnapshotPolicy(peer_every=None, durable_every=2, keep_durable=5, dir=snapshots),
        timeouts=Timeouts(hang=3, save=40),
    )
    spec = mlp_spec(build_stage=slow_disk_stage)
    result = Trainer(spec, topology=Topology(2, 1), policy=policy, run_dir=tmp_path / "run").fit(6)
    assert result.events == []
    assert SnapshotFolder(snapshots).steps() == [6, 4, 2]
    assert SnapshotFolder(snapshots).verify(2, 2) == []
