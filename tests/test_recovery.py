"""Exact recovery from live replicas on the Ray runtime: bit-identical to a run that never failed."""

from __future__ import annotations

import json

import pytest
import torch

from parallelism import Topology
from recovery import FitResult, RedundancyExhausted, Trainer
from recovery.errors import CallbackError
from recovery.faults import FailureSchedule, Hang, Kill, KillPoint
from recovery.policy import RecoveryPolicy, RestartBaseline, Timeouts
from tests.workloads import mlp_spec, tiny_llama

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_local")]

TOPOLOGY = Topology(4, 2)
STEPS = 6


@pytest.fixture(scope="module")
def uninterrupted() -> FitResult:
    from recovery.groups.ray_env import connect

    connect()
    return Trainer(tiny_llama(), topology=TOPOLOGY).fit(STEPS)


def assert_identical(result: FitResult, oracle: FitResult) -> None:
    """The oracle of exact recovery: same losses, bit-identical weights and optimizer state."""
    assert result.losses == oracle.losses
    for (s, r), state in oracle.states.items():
        for k, v in state["model"].items():
            assert torch.equal(result.state(s, r)[k], v), f"worker ({s},{r}) {k}"
        for idx, entry in state["optimizer"]["state"].items():
            for key, value in entry.items():
                assert torch.equal(result.optimizer_state(s, r)["state"][idx][key], value), (
                    s,
                    r,
                    idx,
                    key,
                )


def fit_with(faults: list, policy: RecoveryPolicy | None = None, **kwargs) -> FitResult:  # type: ignore[no-untyped-def]
    return Trainer(
        tiny_llama(), topology=TOPOLOGY, policy=policy, failures=FailureSchedule(faults), **kwargs
    ).fit(STEPS)


# Each point on threads in the default run (test_controller); here, real processes killed,
# at the points where a death meets a collective, and the rest in the slow run.
ON_RAY_BY_DEFAULT = (KillPoint.MID_PIPELINE, KillPoint.DURING_ALLREDUCE, KillPoint.AFTER_COMMIT)


@pytest.mark.parametrize(
    "index, at",
    [
        pytest.param(i, at, marks=() if at in ON_RAY_BY_DEFAULT else pytest.mark.slow)
        for i, at in enumerate(KillPoint)
    ],
)
def test_kill_at_every_point_of_a_step_is_exact(
    uninterrupted: FitResult, index: int, at: KillPoint
) -> None:
    stage, replica = index % 4, index % 2
    result = fit_with([Kill(step=2, stage=stage, replica=replica, at=at)])
    assert_identical(result, uninterrupted)
    (event,) = result.events
    assert event.lost == [(stage, replica)] and event.strategy == "replica_copy"
    assert event.actions == [
        {
            "worker": (stage, replica),
            "strategy": "replica_copy",
            "sources": [(stage, 1 - replica)],
            "warm": False,
        }
    ]
    # After the vote, step 2 is committed unless the dead worker's last bytes of it died
    # with its sockets (see test_controller's test of each kill point).
    before = {m["step"] for m in result.metrics if m["generation"] == 0}
    if at in (KillPoint.BEFORE_COMMIT, KillPoint.AFTER_COMMIT):
        assert event.step == (3 if 2 in before else 2)
    else:
        assert event.step == 2 and 2 not in before
    assert event.lost_steps == 0
    assert event.bytes_moved > 0 and 0 < event.seconds < result.wall_s
    assert set(event.breakdown) == {"detect", "replace", "reform", "transfer", "resume"}
    assert all(v >= 0 for v in event.breakdown.values())
    assert event.breakdown["replace"] > 0 and event.breakdown["transfer"] > 0  # it really ran


def test_two_workers_of_different_stages_in_the_same_step(uninterrupted: FitResult) -> None:
    faults = [
        Kill(step=3, stage=0, replica=1, at=KillPoint.MID_PIPELINE),
        Kill(step=3, stage=3, replica=0, at=KillPoint.DURING_ALLREDUCE),
    ]
    result = fit_with(faults)
    assert_identical(result, uninterrupted)
    (event,) = result.events
    assert sorted(event.lost) == [(0, 1), (3, 0)]
    assert sorted(tuple(a["sources"][0]) for a in event.actions) == [(0, 0), (3, 1)]


def test_a_death_in_the_last_commit_is_recovered_and_reported(uninterrupted: FitResult) -> None:
    result = fit_with([Kill(step=STEPS - 1, stage=0, replica=0, at=KillPoint.BEFORE_COMMIT)])
    assert_identical(result, uninterrupted)  # the final states include the rebuilt worker
    (event,) = result.events
    if event.step == STEPS:  # the survivors had the vote: nothing left to run
        assert event.breakdown["resume"] == 0.0
    else:  # the vote died with the worker (see above): the last step is run again
        assert event.step == STEPS - 1 and event.breakdown["resume"] > 0.0


def test_hung_worker_is_detected_by_the_timeout_and_replaced(uninterrupted: FitResult) -> None:
    policy = RecoveryPolicy(timeouts=Timeouts(hang=3.0))
    result = fit_with([Hang(step=2, stage=2, replica=1, at=KillPoint.MID_PIPELINE)], policy)
    assert_identical(result, uninterrupted)
    (event,) = result.events
    assert event.cause == "hung" and event.lost == [(2, 1)]
    assert 3.0 <= event.breakdown["detect"] < 30.0


def test_hot_spare_replaces_a_dead_worker(uninterrupted: FitResult) -> None:
    result = fit_with([Kill(step=4, stage=1, replica=1)], RecoveryPolicy(hot_spares=1))
    assert_identical(result, uninterrupted)
    (event,) = result.events
    assert event.actions[0]["warm"] is True


@pytest.mark.slow  # on threads in the default run: tests/test_controller.py
def test_restart_baseline_reloads_the_checkpoint_and_redoes_lost_steps(
    uninterrupted: FitResult, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    policy = RecoveryPolicy(
        strategy="restart",
        baseline=RestartBaseline(checkpoint_every=2, checkpoint_dir=str(tmp_path)),
    )
    result = fit_with([Kill(step=3, stage=2, replica=0, at=KillPoint.MID_PIPELINE)], policy)
    assert_identical(result, uninterrupted)  # the replay from step 2 is deterministic
    (event,) = result.events
    assert event.strategy == "restart" and event.lost_steps == 1  # step 2 committed, redone
    assert len(event.actions) == TOPOLOGY.world_size


def test_losing_every_replica_of_a_stage_exhausts_redundancy() -> None:
    faults = [Kill(step=1, stage=1, replica=0), Kill(step=1, stage=1, replica=1)]
    with pytest.raises(RedundancyExhausted, match="stage 1 lost all 2 replica"):
        fit_with(faults)


def test_user_errors_stop_the_job_instead_of_recovering() -> None:
    def broken_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise ArithmeticError("the loss is broken")

    with pytest.raises(
        CallbackError, match=r"loss_fn.* raised ArithmeticError: the loss is broken"
    ) as info:
        Trainer(mlp_spec(loss_fn=broken_loss), topology=Topology(2, 2)).fit(2)
    assert isinstance(info.value.__cause__, ArithmeticError)  # the user's own, chained


def test_events_are_written_and_plotted(tmp_path) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "run"
    result = Trainer(
        mlp_spec(),
        topology=Topology(2, 2),
        run_dir=run,
        failures=FailureSchedule([Kill(step=2, stage=1, replica=1)]),
    ).fit(4)
    lines = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert (
        len(lines) == 1 and lines[0]["lost"] == [[1, 1]] and lines[0]["strategy"] == "replica_copy"
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["recoveries"] == 1 and summary["lost_steps"] == 0
    assert result.events[0].time > 0
