"""Rollback when redundancy is exhausted: peer tier, durable tier, corruption, driver death, NaN."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from parallelism import Topology
from recovery import FitResult, RecoveryError, RedundancyExhausted, Trainer
from recovery.faults import Corrupt, FailureSchedule, Kill, KillPoint
from recovery.policy import RecoveryPolicy, SnapshotPolicy
from recovery.snapshots import buddies
from tests.test_recovery import assert_identical
from tests.workloads import tiny_llama

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_local")]

TOPOLOGY = Topology(4, 2)
STEPS = 10
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def uninterrupted() -> FitResult:
    from recovery.groups.ray_env import connect

    connect()
    return Trainer(tiny_llama(), topology=TOPOLOGY).fit(STEPS)


def fit(policy: RecoveryPolicy, faults: list, **kwargs) -> FitResult:  # type: ignore[no-untyped-def]
    return Trainer(
        tiny_llama(), topology=TOPOLOGY, policy=policy, failures=FailureSchedule(faults), **kwargs
    ).fit(STEPS)


def stage_group_dies(step: int, stage: int) -> list[Kill]:
    return [
        Kill(step=step, stage=stage, replica=0),
        Kill(step=step, stage=stage, replica=1, at=KillPoint.MID_PIPELINE),
    ]


def test_whole_stage_lost_rolls_back_to_the_peer_tier(uninterrupted: FitResult) -> None:
    result = fit(
        RecoveryPolicy(exact_only=True, snapshots=SnapshotPolicy(peer_every=3)),
        stage_group_dies(7, 2),
    )
    assert_identical(result, uninterrupted)  # the replay is deterministic
    (event,) = result.events
    assert event.strategy == "rollback" and event.tier == "peer"
    assert event.lost_steps == 7 - 6  # the distance to the snapshot of step 6
    assert len(event.actions) == TOPOLOGY.world_size  # everyone restores


def test_buddies_lost_too_falls_back_to_the_durable_tier(
    uninterrupted: FitResult, tmp_path: Path
) -> None:
    ring = buddies(TOPOLOGY, {r: "node" for r in range(TOPOLOGY.world_size)})
    doomed = {TOPOLOGY.rank(2, 0), TOPOLOGY.rank(2, 1)}
    doomed |= {ring[r] for r in doomed}  # and the buddies holding their peer snapshots
    faults = [
        Kill(step=7, stage=TOPOLOGY.worker(r).stage, replica=TOPOLOGY.worker(r).replica)
        for r in sorted(doomed)
    ]
    policy = RecoveryPolicy(
        exact_only=True, snapshots=SnapshotPolicy(peer_every=3, durable_every=2, dir=str(tmp_path))
    )
    result = fit(policy, faults)
    assert_identical(result, uninterrupted)
    (event,) = result.events
    assert event.tier == "durable" and event.lost_steps == 7 - 6


def test_no_snapshot_left_exhausts_redundancy() -> None:
    with pytest.raises(RedundancyExhausted, match="no snapshot survives"):
        fit(
            RecoveryPolicy(exact_only=True, snapshots=SnapshotPolicy(peer_every=None)),
            stage_group_dies(3, 1),
        )


def test_a_policy_that_forbids_rollback_says_which_plan_failed() -> None:
    policy = RecoveryPolicy(allowed=("replica_copy",), snapshots=SnapshotPolicy(peer_every=3))
    with pytest.raises(
        RedundancyExhausted, match=r"stage 1 lost all 2 replica.*Rollback is not allowed"
    ):
        fit(policy, stage_group_dies(4, 1))


def test_injected_nan_rolls_back_instead_of_poisoning_the_model(uninterrupted: FitResult) -> None:
    result = fit(
        RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=3)),
        [Corrupt(step=5, stage=1, replica=1)],
    )
    assert_identical(result, uninterrupted)
    (event,) = result.events
    assert event.cause == "numerical fault" and event.tier == "peer" and event.lost_steps == 5 - 3
    assert all(torch.isfinite(torch.tensor(result.losses)))


def _job(run_dir: Path, steps: int, out: Path) -> subprocess.Popen[bytes]:
    """tests/resume_job.py in a driver process of its own, connected to the session's Ray as
    another job (Ray ends a job's actors when its driver dies: the kill takes the workers
    with it, as it would take a local Ray the driver had started)."""
    import ray

    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
    }
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "resume_job.py"), str(run_dir), str(steps), str(out)],
        env=env,
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.mark.timeout(600)
def test_driver_killed_mid_run_resumes_bit_identical(tmp_path: Path) -> None:
    steps = 12
    # the same job as tests/resume_job.py, uninterrupted, here
    reference = Trainer(tiny_llama(), topology=Topology(2, 2)).fit(steps)

    run = tmp_path / "run"
    first = _job(run, steps, tmp_path / "never.pt")
    deadline = time.monotonic() + 300
    metrics = run / "metrics.jsonl"
    while time.monotonic() < deadline:  # kill the driver once a few durable snapshots exist
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 7:
            break
        assert first.poll() is None, "the job ended before it could be killed"
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    assert not (tmp_path / "never.pt").exists()

    second = _job(run, steps, tmp_path / "resumed.pt")
    assert second.wait(timeout=300) == 0, (
        second.stderr.read().decode()[-3000:] if second.stderr else ""
    )
    resumed_run = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert resumed_run["losses"] == reference.losses
    for key, state in reference.states.items():
        for name, value in state["model"].items():
            assert torch.equal(value, resumed_run["states"][key]["model"][name]), (key, name)
    resumed = [e for e in resumed_run["events"] if e["cause"] == "driver restarted"]
    assert len(resumed) == 1 and resumed[0]["tier"] == "durable"
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert events[-1]["cause"] == "driver restarted"
    if importlib.util.find_spec("tensorboard") is not None:
        # TensorBoard: both drivers' files in one folder, one loss point per step, the last
        # run's (see [Note: steps redone in TensorBoard]), and the resume as a recovery.
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2
        board = EventAccumulator(str(run / "tensorboard"))
        board.Reload()
        loss = [(e.step, e.value) for e in board.Scalars("train/loss")]
        assert [s for s, _ in loss] == list(range(steps))
        assert [v for _, v in loss] == pytest.approx(reference.losses, rel=1e-6)
        texts = [
            e.tensor_proto.string_val[0].decode() for e in board.Tensors("recoveries/text_summary")
        ]
        assert any(text.startswith("**driver restarted**") for text in texts), texts


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)


@pytest.mark.parametrize("damage", ["flipped byte", "missing file"])
def test_corrupted_durable_snapshot_is_detected_and_the_previous_one_used(
    uninterrupted: FitResult, tmp_path: Path, damage: str
) -> None:
    policy = RecoveryPolicy(
        snapshots=SnapshotPolicy(peer_every=None, durable_every=2, keep_durable=3)
    )
    Trainer(tiny_llama(), topology=TOPOLOGY, policy=policy, run_dir=tmp_path).fit(6)
    snaps = tmp_path / "snapshots"
    newest = snaps / "step_00000006" / "rank_0003"
    data = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    if damage == "flipped byte":
        _flip_a_byte(data)
    else:
        data.unlink()
    resumed = Trainer(tiny_llama(), topology=TOPOLOGY, policy=policy, run_dir=tmp_path).fit(STEPS)
    assert resumed.events[0].cause == "driver restarted"
    assert "step 4" in resumed.events[0].detail  # the one before the damaged snapshot of step 6
    assert_identical(resumed, uninterrupted)


def test_no_intact_durable_snapshot_is_a_clear_error(tmp_path: Path) -> None:
    policy = RecoveryPolicy(
        snapshots=SnapshotPolicy(peer_every=None, durable_every=2, keep_durable=1)
    )
    Trainer(tiny_llama(), topology=TOPOLOGY, policy=policy, run_dir=tmp_path).fit(4)
    for data in (tmp_path / "snapshots").glob("step_*/rank_*/*.distcp"):
        _flip_a_byte(data)
    with pytest.raises(RecoveryError, match="no intact durable snapshot"):
        Trainer(tiny_llama(), topology=TOPOLOGY, policy=policy, run_dir=tmp_path).fit(STEPS)
