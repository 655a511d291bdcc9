"""A rebuilt stage stays one stage: the mark of a CheckFree rebuild (its step and the
learning-rate scale its replicas train with, `recovery.state.Rebuild`) travels with its
state through a later replica copy, a rollback to a peer snapshot and a resume from a
durable one, so its replicas stay bit-identical (see [Note: one worker state]).

On the thread worker group, 3 stages x 2 replicas, CheckFree: stage 1 loses both replicas
at step 2 and is rebuilt from its neighbours; then something else happens to it. The
oracle is the run with only the rebuild: a copy and a rollback are exact, so every later
failure must end where that run ends, bit for bit -- a replica that trained at lr x1.0
beside one at x1.1 would not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parallelism import Topology
from recovery import Kill, RecoveryPolicy, SnapshotPolicy
from recovery.reference import differences
from recovery.runtime import Controller, Phase
from recovery.state import Progress, Rebuild
from recovery.trainer import final_trajectory
from tests.jobs import drive, make
from tests.workloads import mlp_spec

TOP = Topology(3, 2)
STEPS = 8
WIPE = [Kill(step=2, stage=1, replica=0), Kill(step=2, stage=1, replica=1)]
MARK = Rebuild(step=2, lr_scale=1.1, lr_scale_steps=None, rewarm_steps=0)


def _policy(**snapshots: object) -> RecoveryPolicy:
    return RecoveryPolicy(
        approximate="checkfree", snapshots=SnapshotPolicy(peer_every=2, **snapshots)
    )  # type: ignore[arg-type]


def _run(*faults: Kill, policy: RecoveryPolicy | None = None, **kwargs: object) -> Controller:
    controller, _ = make(
        mlp_spec(), TOP, *faults, policy=policy or _policy(), nodes=2, steps=STEPS, **kwargs
    )
    drive(controller)
    assert controller.phase is Phase.FINISHED, controller.error
    return controller


@pytest.fixture(scope="module")
def rebuilt() -> Controller:
    """The oracle: stage 1 rebuilt at step 2, nothing else."""
    job = _run(*WIPE)
    (event,) = job.events
    assert event.strategy == "neighbor_average" and event.step == 2
    return job


def _assert_one_stage(job: Controller, oracle: Controller) -> None:
    states = job.final_states  # type: ignore[attr-defined]
    for replica in range(TOP.replicas):
        assert Progress.from_dict(states[(1, replica)]["progress"]) == Progress(STEPS, MARK)
        assert Progress.from_dict(states[(0, replica)]["progress"]) == Progress(STEPS)
    assert final_trajectory(job.records) == final_trajectory(oracle.records)
    found = differences(states, oracle.final_states)  # type: ignore[attr-defined]
    assert not found, found[:5]


def test_the_rebuilt_stage_carries_its_mark_on_every_replica(rebuilt: Controller) -> None:
    for replica in range(TOP.replicas):
        progress = rebuilt.final_states[(1, replica)]["progress"]  # type: ignore[attr-defined]
        assert Progress.from_dict(progress) == Progress(STEPS, MARK)


@pytest.mark.parametrize(
    "later",
    [
        [Kill(step=4, stage=1, replica=0)],
        [Kill(step=4, stage=1, replica=1), Kill(step=4, stage=0, replica=0)],
    ],
    ids=["a copy", "a burst"],
)
def test_a_copy_of_a_rebuilt_stage_is_exact(rebuilt: Controller, later: list[Kill]) -> None:
    """A replica of the rebuilt stage lost later is copied from the other, mark included
    (it used to kill the job: the mark did not fit the wire header)."""
    job = _run(*WIPE, *later)
    assert [e.strategy for e in job.events] == ["neighbor_average", "replica_copy"]
    _assert_one_stage(job, rebuilt)


def test_a_rollback_after_a_rebuild_keeps_the_mark(rebuilt: Controller) -> None:
    """Stage 0 (an edge: no CheckFree rebuild) loses both replicas at step 5: everyone rolls
    back to the peer snapshot of step 4, taken after the rebuild, and replays."""
    job = _run(*WIPE, Kill(step=5, stage=0, replica=0), Kill(step=5, stage=0, replica=1))
    second = job.events[1]
    assert second.strategy == "rollback" and second.tier == "peer"
    assert second.step - second.lost_steps == 4
    _assert_one_stage(job, rebuilt)


def test_a_resume_after_a_rebuild_keeps_the_mark(rebuilt: Controller, tmp_path: Path) -> None:
    """The driver goes away after step 6 (durable snapshots every 2 steps); a new one in
    the same folder resumes from the newest snapshot and the job ends as if it never left."""
    policy = _policy(durable_every=2)
    first, _ = make(
        mlp_spec(), TOP, *WIPE, policy=policy, nodes=2, steps=STEPS, snapshot_dir=str(tmp_path)
    )
    try:
        while first.step < 7 and first.phase not in (Phase.FINISHED, Phase.FAILED):
            first.advance()
        first.persistence.flush()  # the writes in flight land, as a clean exit would leave them
    finally:
        first.shutdown()
    assert first.events and first.events[0].strategy == "neighbor_average"
    second, _ = make(
        mlp_spec(), TOP, policy=policy, nodes=2, steps=STEPS, snapshot_dir=str(tmp_path)
    )
    assert second.resumed_from is not None and second.resumed_from >= 4
    drive(second)
    assert second.phase is Phase.FINISHED, second.error
    states = second.final_states  # type: ignore[attr-defined]
    for replica in range(TOP.replicas):
        assert Progress.from_dict(states[(1, replica)]["progress"]) == Progress(STEPS, MARK)
    found = differences(states, rebuilt.final_states)  # type: ignore[attr-defined]
    assert not found, found[:5]
