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
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from parallelism import Topology
from recovery import (
    FailureSchedule,
    FitResult,
    Kill,
    KillPoint,
    RecoveryPolicy,
    SnapshotPolicy,
    Timeouts,
    Trainer,
)
from recovery.snapshots import COMPLETE, SnapshotFolder
from recovery.snapshots.checkpoint import step_path
from tests.jobs import make
from tests.test_recovery import assert_identical
from tests.workloads import SLOW_WRITES, mlp_spec, paced_stage, slow_disk_stage

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


# -- 2. a snapshot that cannot be written ---------------------------------------------------


def test_snapshots_that_cannot_be_written_are_skipped_and_the_job_trains_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three snapshots in a row fail -- step 2's writes on every worker (its folder is a
    file), the commits of steps 4 and 6 (COMPLETE.json is a directory) -- and each is
    skipped with a warning and a record; the run of them is reported; the job trains on,
    step 8's snapshot completes, and no temporary file is left."""
    for step, what in ((2, "writes"), (4, "commit"), (6, "commit")):
        _unwritable(tmp_path, step, what)
    policy = RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=None, durable_every=2))
    controller, _ = make(mlp_spec(), TOP, policy=policy, snapshot_dir=str(tmp_path), steps=8)
    try:
        with caplog.at_level(logging.WARNING, logger="checkfree"):
            controller.run(8)  # as Trainer.fit: the writes in flight land at the end
    finally:
        controller.shutdown()
    skipped = controller.persistence.skipped
    assert [(s.step, s.in_a_row) for s in skipped] == [(2, 1), (4, 2), (6, 3)], skipped
    assert "is a directory" in skipped[1].error.lower() and "rank" in skipped[0].error
    assert SnapshotFolder(tmp_path).steps() == [8]
    assert controller.ledger.durable_steps == [8]
    assert _temp_files(tmp_path) == []
    warned = [r.getMessage() for r in caplog.records if "step 6" in r.getMessage()]
    assert any("3 durable snapshots in a row" in m for m in warned), warned


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(300)
def test_a_failed_commit_on_ray_leaves_the_last_complete_snapshot_the_rollback_point(
    tmp_path: Path,
) -> None:
    """On Ray: the commits of steps 4 and 6 fail (EISDIR on COMPLETE.json); the job trains
    on; when a whole stage dies at step 7 it rolls back to step 2, the last complete
    snapshot, and ends bit-identical to a run that never failed."""
    snapshots = tmp_path / "snapshots"
    for step in (4, 6):
        _unwritable(snapshots, step, "commit")
    spec = mlp_spec()
    clean = Trainer(spec, topology=TOP).fit(9)
    policy = RecoveryPolicy(
        snapshots=SnapshotPolicy(peer_every=None, durable_every=2, dir=snapshots)
    )
    dies = [
        Kill(step=7, stage=1, replica=0),
        Kill(step=7, stage=1, replica=1, at=KillPoint.MID_PIPELINE),
    ]
    result: FitResult = Trainer(
        spec, topology=TOP, policy=policy, failures=FailureSchedule(dies), run_dir=tmp_path / "run"
    ).fit(9)
    assert_identical(result, clean)
    (event,) = result.events
    assert event.tier == "durable" and event.lost_steps == 7 - 2, event
    assert 4 in [s["step"] for s in result.skipped_snapshots]
    assert _temp_files(snapshots) == []
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["skipped_snapshots"] == len(result.skipped_snapshots)


# -- 3. a folder another job holds ----------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def _holder(folder: Path) -> subprocess.Popen[bytes]:
    """Another job, in another process, training with durable snapshots in ``folder``."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.folder_job", str(folder)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _wait_for(path: Path, job: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if job.poll() is not None:
            err = job.stderr.read().decode()[-3000:] if job.stderr else ""
            raise AssertionError(f"the holding job ended: {err}")
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_a_folder_held_by_a_job_is_refused_until_its_holder_is_killed(tmp_path: Path) -> None:
    """A job trains with durable snapshots in a folder; a second job given that folder is
    refused at its start, before any worker of its own starts, naming the folder and the
    holder (its pid and host); once the holder is killed (SIGKILL: the kernel drops its
    lock with it), a new job takes the folder and resumes from the holder's snapshots."""
    folder = tmp_path / "snapshots"
    holder = _holder(folder)
    try:
        _wait_for(step_path(folder, 1) / COMPLETE, holder)
        spec = mlp_spec(build_stage=paced_stage)
        with pytest.raises(RuntimeError, match="in use by another job") as refused:
            make(spec, Topology(2, 1), policy=_EVERY_STEP, snapshot_dir=str(folder))
        text = str(refused.value)
        assert str(folder) in text and f"pid {holder.pid}" in text and socket.gethostname() in text
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert holder.returncode == -signal.SIGKILL
    controller, _ = make(spec, Topology(2, 1), policy=_EVERY_STEP, snapshot_dir=str(folder))
    try:
        assert controller.resumed_from is not None and controller.resumed_from >= 1
        controller.run(controller.step + 2)
    finally:
        controller.shutdown()


_EVERY_STEP = RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=None, durable_every=1))


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(300)
def test_two_jobs_on_ray_never_share_a_run_or_snapshot_folder(tmp_path: Path) -> None:
    """Job A trains on Ray (its durable writes slow, so that it lives a while). Job B,
    given A's snapshot folder with a run folder of its own, and then A's run folder, is
    refused at once, naming the folder and A's process; A ends untouched, every snapshot it
    committed intact; then B takes the folders and resumes from A's last snapshot."""
    snapshots, run_a, run_b = tmp_path / "snapshots", tmp_path / "a", tmp_path / "b"
    _slow(snapshots, 3.0, [2, 4])
    policy = RecoveryPolicy(
        snapshots=SnapshotPolicy(peer_every=None, durable_every=2, keep_durable=5, dir=snapshots)
    )
    spec = mlp_spec(build_stage=slow_disk_stage)

    def trainer(run: Path) -> Trainer:
        return Trainer(spec, topology=Topology(2, 1), policy=policy, run_dir=run)

    results: list[FitResult | BaseException] = []

    def job_a() -> None:
        try:
            results.append(trainer(run_a).fit(4))
        except BaseException as exc:
            results.append(exc)

    a = threading.Thread(target=job_a)
    a.start()
    try:
        _wait_for_file(run_a / "metrics.jsonl", a)
        for run, folder in ((run_b, snapshots), (run_a, run_a)):
            with pytest.raises(RuntimeError, match="in use by another job") as refused:
                trainer(run).fit(6)
            text = str(refused.value)
            assert str(folder) in text and f"pid {os.getpid()}" in text, text
    finally:
        a.join(timeout=200)
    (first,) = results
    assert isinstance(first, FitResult), first
    assert first.events == [] and SnapshotFolder(snapshots).steps() == [4, 2]
    assert SnapshotFolder(snapshots).verify(4, 2) == []
    assert not run_b.exists()  # a refused job leaves no folder behind
    (snapshots / SLOW_WRITES).unlink()
    second = trainer(run_b).fit(6)
    assert [e.cause for e in second.events] == ["driver restarted"]
    assert "step 4" in second.events[0].detail


def _wait_for_file(path: Path, job: threading.Thread, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert job.is_alive(), "job A ended before job B could try its folders"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)
