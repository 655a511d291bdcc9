"""ZeRO-1 with mirrored shards: partition, equivalence with unsharded training, recovery."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from parallelism import Topology
from parallelism.zero import partition
from recovery import FitResult, RecoveryPolicy, SnapshotPolicy, Trainer
from recovery.faults import FailureSchedule, Kill, KillPoint
from tests.workloads import mlp_spec, tiny_llama

STEPS = 6


def test_partition_is_balanced_deterministic_and_complete() -> None:
    sizes = [100, 10, 10, 60, 40, 5, 5]
    owner = partition(sizes, 3)
    assert owner == partition(sizes, 3)
    loads = [sum(s for s, o in zip(sizes, owner, strict=True) if o == p) for p in range(3)]
    assert sorted(loads) == [65, 65, 100] and set(owner) == {0, 1, 2}


def test_partition_rejects_more_parts_than_parameters() -> None:
    with pytest.raises(ValueError, match="every replica must own at least one"):
        partition([3, 4], 3)
    with pytest.raises(ValueError, match="positive integer"):
        partition([3, 4], 0)


def test_bad_combinations_are_refused_before_any_worker_starts() -> None:
    with pytest.raises(ValueError, match="at least 2 replicas"):
        mlp_spec(shard_optimizer=True).check(Topology(2, 1))
    with pytest.raises(ValueError, match="CheckFree"):
        dataclasses.replace(mlp_spec(), routes="swapped", shard_optimizer=True)


def zero_llama() -> object:
    return dataclasses.replace(tiny_llama(), shard_optimizer=True)


@pytest.fixture(scope="module")
def zero_oracle() -> FitResult:
    from recovery.groups.ray_env import connect

    connect()
    return Trainer(zero_llama(), topology=Topology(2, 3)).fit(STEPS)  # type: ignore[arg-type]


def assert_same_state(result: FitResult, oracle: FitResult) -> None:
    assert result.losses == oracle.losses
    for (s, r), state in oracle.states.items():
        for k, v in state["model"].items():
            assert torch.equal(result.state(s, r)[k], v), f"worker ({s},{r}) {k}"
        for idx, entry in state["optimizer"]["state"].items():
            for key, value in entry.items():
                got = result.optimizer_state(s, r)["state"][idx][key]
                assert torch.equal(got, value), (s, r, idx, key)


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_zero1_trains_like_unsharded_adamw(zero_oracle: FitResult) -> None:
    """Sharding the optimizer changes where AdamW runs, not what it computes."""
    plain = Trainer(tiny_llama(), topology=Topology(2, 3)).fit(STEPS)
    assert zero_oracle.losses == pytest.approx(plain.losses, rel=1e-6)
    for (s, r), state in plain.states.items():
        for k, v in state["model"].items():
            torch.testing.assert_close(zero_oracle.state(s, r)[k], v, rtol=1e-5, atol=1e-6)
    # Each replica keeps optimizer state for its own parameters only.
    sizes = [len(zero_oracle.optimizer_state(0, r)["state"]) for r in range(3)]
    assert sum(sizes) == len(plain.optimizer_state(0, 0)["state"]) and min(sizes) >= 1


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("at", [KillPoint.MID_PIPELINE, KillPoint.AFTER_COMMIT])
def test_losing_one_replica_restores_its_shard_from_the_mirror_bit_exact(
    zero_oracle: FitResult, at: KillPoint
) -> None:
    faults = FailureSchedule([Kill(step=3, stage=1, replica=0, at=at)])
    result = Trainer(zero_llama(), topology=Topology(2, 3), failures=faults).fit(STEPS)  # type: ignore[arg-type]
    assert_same_state(result, zero_oracle)
    (event,) = result.events
    assert event.strategy == "shard_mirror" and event.lost_steps == 0
    assert event.actions[0]["sources"] == [(1, 1)]  # replica 1 mirrors replica 0's shard


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_losing_a_replica_and_its_mirror_rolls_back(zero_oracle: FitResult) -> None:
    faults = FailureSchedule(
        [Kill(step=5, stage=0, replica=r, at=KillPoint.MID_PIPELINE) for r in (0, 1)]
    )
    policy = RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=2))
    result = Trainer(zero_llama(), topology=Topology(2, 3), policy=policy, failures=faults).fit(  # type: ignore[arg-type]
        STEPS
    )
    (event,) = result.events
    assert event.strategy == "rollback" and event.tier == "peer" and event.lost_steps == 1
    assert "lost with its mirror" in event.detail
    # Replaying from the snapshot is deterministic: the same state as never failing.
    assert_same_state(result, zero_oracle)


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_zero1_refuses_approximate_recovery() -> None:
    spec = dataclasses.replace(mlp_spec(), shard_optimizer=True)
    with pytest.raises(ValueError, match="approximate"):
        Trainer(spec, topology=Topology(3, 2), policy=RecoveryPolicy(approximate="checkfree")).fit(
            2
        )
