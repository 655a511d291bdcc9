"""A re-run in the folder of an earlier job resumes only if it is the same job: another
model, optimizer or data is refused by name, before anything is loaded; a durable folder
some worker cannot see is refused at the start."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from parallelism import Topology
from recovery import RecoveryPolicy, SnapshotPolicy
from recovery.reference import differences
from recovery.snapshots.identity import describe, job_identity
from recovery.worker import StageWorker
from tests.jobs import drive, make
from tests.workloads import adamw, mlp_spec, regression_batches, relu_stage

TOP = Topology(2, 1)
POLICY = RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=None, durable_every=2))


def _run(spec, folder: Path, steps: int = 4):  # type: ignore[no-untyped-def]
    controller, _ = make(spec, TOP, policy=POLICY, snapshot_dir=str(folder), steps=steps)
    try:
        controller.run(steps)  # as Trainer.fit: the durable writes in flight land at the end
        controller.final_states = controller.states()  # type: ignore[attr-defined]
    finally:
        controller.shutdown()
    return controller


@pytest.mark.parametrize(
    ("changed", "part"),
    [
        ({"make_optimizer": functools.partial(adamw, lr=0.5)}, "optimizer"),
        ({"batches": functools.partial(regression_batches, size=16)}, "data"),
        ({"build_stage": relu_stage}, "model"),
        ({"microbatches": 2}, "microbatches"),
    ],
    ids=["lr", "data", "model", "microbatches"],
)
def test_another_job_in_the_same_folder_is_refused_naming_what_differs(
    tmp_path: Path, changed: dict[str, object], part: str
) -> None:
    _run(mlp_spec(), tmp_path)
    with pytest.raises(ValueError, match=rf"written by a different job \({part}: "):
        _run(mlp_spec(**changed), tmp_path, steps=6)


def test_the_same_job_resumes(tmp_path: Path) -> None:
    """It resumes from the newest snapshot and ends where the job run in one go ends: the
    same losses of the steps it ran, the same final state of every worker, bit for bit."""
    first = _run(mlp_spec(), tmp_path)
    again = _run(mlp_spec(), tmp_path, steps=6)
    assert first.step == 4 and again.resumed_from == 4 and again.step == 6
    whole, _ = make(mlp_spec(), TOP, steps=6)
    drive(whole)
    assert [r.loss for r in again.records if r.step >= 4] == [
        r.loss for r in whole.records if r.step >= 4
    ]
    found = differences(again.final_states, whole.final_states)  # type: ignore[attr-defined]
    assert not found, found[:5]


def test_the_identity_is_the_same_in_every_process_and_sees_inside_callbacks() -> None:
    spec = mlp_spec()
    assert job_identity(spec) == job_identity(mlp_spec())
    assert (
        "lr=0.5"
        in job_identity(mlp_spec(make_optimizer=functools.partial(adamw, lr=0.5)))["optimizer"]
    )
    a, b = torch.zeros(3), torch.zeros(3)
    b[1] = 1.0
    assert describe(a) != describe(b) and describe(a) == describe(torch.zeros(3))
    assert "0x" not in "".join(job_identity(spec).values())  # no object address


def test_a_durable_folder_a_worker_cannot_see_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = StageWorker.sees_file

    def sees_file(self: StageWorker, path: str, token: str) -> bool:  # blind on rank 1
        return False if self.rank == 1 else real(self, path, token)

    monkeypatch.setattr(StageWorker, "sees_file", sees_file)
    with pytest.raises(ValueError, match=r"worker \(1,0\) on node node-\d cannot see"):
        make(mlp_spec(), TOP, policy=POLICY, snapshot_dir=str(tmp_path))
    assert not list(tmp_path.glob(".shared-*"))  # the probe is cleaned up


def test_a_fresh_start_in_a_folder_with_snapshots_is_refused_before_any_worker_starts(
    tmp_path: Path,
) -> None:
    """A job told not to resume (``ControllerConfig(resume=False)``), given a folder that
    holds complete snapshots, would land its first snapshot on an old one and fail
    mid-run; it is refused at its start instead, before any worker starts, naming the
    folder and the two ways on."""
    from recovery.groups import ThreadWorkerGroup
    from recovery.runtime import Controller, ControllerConfig
    from recovery.runtime.layouts import layout_for

    _run(mlp_spec(), tmp_path)  # snapshots of steps 2 and 4
    group = ThreadWorkerGroup(layout_for(mlp_spec(), TOP, POLICY, 1).worker_cls)
    config = ControllerConfig(backend="gloo", snapshot_dir=str(tmp_path), resume=False)
    controller = Controller(mlp_spec(), TOP, config, policy=POLICY, group=group)
    try:
        with pytest.raises(ValueError, match="starts afresh") as refused:
            controller.start()
        assert group.started == 0
    finally:
        controller.shutdown()
    text = str(refused.value)
    assert str(tmp_path) in text and "steps 4, 2" in text
    assert "move the folder away" in text and "resume" in text
    # Given the folder back with resume on, the same job goes on from step 4.
    again = _run(mlp_spec(), tmp_path, steps=6)
    assert again.resumed_from == 4
