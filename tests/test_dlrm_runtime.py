"""Row-sharded embedding tables on the Ray runtime: shard mirrors, partial recovery, policy."""

from __future__ import annotations

import dataclasses
import functools
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from parallelism import Topology
from parallelism.workloads.clicks import ClickDataset, read_criteo
from parallelism.workloads.dlrm import dlrm_spec
from recovery import FitResult, MirrorPolicy, RecoveryPolicy, SnapshotPolicy, Trainer, TrainSpec
from recovery.errors import RedundancyExhausted
from recovery.faults import FailureSchedule, Kill, KillPoint
from tests.test_dlrm import MIRROR_CHAIN

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_local")]

TOPOLOGY = Topology(1, 4)
STEPS = 6
EVERY_STEP = RecoveryPolicy(mirrors=MirrorPolicy(every=1))
HOT_ONLY = RecoveryPolicy(mirrors=MirrorPolicy(every=4, hot_rows=3, pls_budget=1.0))


@functools.cache
def spec() -> TrainSpec:
    return dlrm_spec(preset="tiny", batch_size=16, seed=3)


@functools.cache
def oracle(steps: int) -> FitResult:
    return Trainer(spec(), topology=TOPOLOGY, policy=EVERY_STEP).fit(steps)


def fit(policy: RecoveryPolicy, *faults: Kill, steps: int = STEPS, **kwargs) -> FitResult:  # type: ignore[no-untyped-def]
    return Trainer(
        spec(), topology=TOPOLOGY, policy=policy, failures=FailureSchedule(list(faults)), **kwargs
    ).fit(steps)


def model(result: FitResult, replica: int) -> dict[str, torch.Tensor]:
    return result.state(0, replica)


@pytest.mark.parametrize(
    "at, spares", [(KillPoint.MID_PIPELINE, 0), (KillPoint.AFTER_COMMIT, 1)], ids=str
)
def test_mirroring_every_step_recovers_bit_exact(at: KillPoint, spares: int) -> None:
    result = fit(
        RecoveryPolicy(mirrors=MirrorPolicy(every=1), hot_spares=spares),
        Kill(step=3, stage=0, replica=2, at=at),
    )
    expected = oracle(STEPS)
    assert result.losses == expected.losses
    for r in range(TOPOLOGY.replicas):
        for key, value in model(expected, r).items():
            assert torch.equal(model(result, r)[key], value), (r, key)
        assert torch.equal(
            result.optimizer_state(0, r)["state"][0]["exp_avg"],
            expected.optimizer_state(0, r)["state"][0]["exp_avg"],
        )
    (event,) = result.events
    assert event.strategy == "shard_mirror" and event.lost_steps == 0
    assert event.embedding is not None and event.embedding["rows_stale"] == 0
    assert event.embedding["lost_samples"] == 0 and event.embedding["pls_job"] == 0
    assert event.actions[0]["warm"] is bool(spares)


@pytest.mark.slow  # on threads in the default run: tests/test_dlrm.py
def test_mirrors_stay_exact_through_a_chain_of_recoveries() -> None:
    """After a recovery only the replacement's mirror is re-seeded; every later restore,
    from any holder (an old one, or a replacement), is still exact."""
    result = fit(EVERY_STEP, *MIRROR_CHAIN)
    expected = oracle(STEPS)
    assert [e.strategy for e in result.events] == ["shard_mirror"] * 4
    for r in range(TOPOLOGY.replicas):
        for key, value in model(expected, r).items():
            assert torch.equal(model(result, r)[key], value), (r, key)


def test_partial_recovery_rewrites_only_the_lost_shard() -> None:
    """Killed after the last commit, so the final state is the recovery's own work: the
    survivors are untouched, the lost shard's rows are exact or equal to the last full
    mirror (after 4 steps), and nobody rolled back."""
    for _ in range(3):  # the vote can die with the worker, when the step is run again
        result = fit(HOT_ONLY, Kill(step=STEPS - 1, stage=0, replica=1, at=KillPoint.AFTER_COMMIT))
        if result.events[0].step == STEPS:  # (see test_controller's test of each kill point)
            break
    now, then = oracle(STEPS), oracle(4)
    for r in (0, 2, 3):
        for key, value in model(now, r).items():
            assert torch.equal(model(result, r)[key], value), (r, key)
    got, exact, stale = (
        model(result, 1)["shard.weight"],
        model(now, 1)["shard.weight"],
        model(then, 1)["shard.weight"],
    )
    is_exact = (got == exact).all(dim=1)
    is_stale = (got == stale).all(dim=1) & ~is_exact
    assert bool((is_exact | is_stale).all())
    (event,) = result.events
    assert event.strategy == "embedding_partial" and event.lost_steps == 0
    assert event.embedding is not None
    assert event.embedding["rows_stale"] == int(is_stale.sum()) > 0
    assert event.embedding["rows_exact"] == int(is_exact.sum())
    for key in ("dense.top.0.weight", "dense.bottom.0.bias"):  # dense part from a live replica
        assert torch.equal(model(result, 1)[key], model(now, 1)[key])
    # PLS: the lost lookups over 4 features, over the samples trained (6 steps x 4 x 16).
    samples = STEPS * TOPOLOGY.replicas * 16
    assert event.embedding["pls_job"] == pytest.approx(event.embedding["lost_samples"] / samples)
    assert event.embedding["pls_event"] == event.embedding["pls_job"]  # the only event
    assert result.mirrors["mirror_memory_bytes"] > result.mirrors["shard_bytes"] > 0
    assert result.mirrors["update_bytes_per_step"] > 0


def test_exact_policy_rolls_back_when_rows_are_stale() -> None:
    policy = RecoveryPolicy(
        mirrors=MirrorPolicy(every=100, hot_rows=3, embedding="exact"),
        snapshots=SnapshotPolicy(peer_every=2),
    )
    result = fit(policy, Kill(step=3, stage=0, replica=0, at=KillPoint.MID_PIPELINE))
    (event,) = result.events
    assert event.strategy == "rollback" and event.tier == "peer" and event.lost_steps == 1
    assert "demands exact rows" in event.detail
    assert result.losses == oracle(STEPS).losses  # the replay is deterministic


def test_partial_recovery_beyond_the_pls_budget_rolls_back() -> None:
    policy = RecoveryPolicy(
        mirrors=MirrorPolicy(every=100, hot_rows=0, pls_budget=1e-6),
        snapshots=SnapshotPolicy(peer_every=2),
    )
    result = fit(policy, Kill(step=3, stage=0, replica=3, at=KillPoint.MID_PIPELINE))
    (event,) = result.events
    assert event.strategy == "rollback" and "exceeds mirrors.pls_budget" in event.detail


def test_losing_a_shard_with_its_mirror_and_no_snapshot_is_reported() -> None:
    # Replica 0's buddy on a one-node ring is replica 1: both copies of shard 0 die.
    faults = [Kill(step=2, stage=0, replica=r, at=KillPoint.MID_PIPELINE) for r in (0, 1)]
    with pytest.raises(RedundancyExhausted, match="lost with its mirror"):
        fit(RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=None)), *faults)


def test_tables_too_small_or_a_pipeline_are_refused_before_workers_start() -> None:
    with pytest.raises(ValueError, match="fewer than the 16 shards"):
        Trainer(spec(), topology=Topology(1, 16)).fit(1)
    with pytest.raises(ValueError, match="use 1 stage"):
        Trainer(spec(), topology=Topology(2, 2)).fit(1)
    with pytest.raises(ValueError, match="over Gloo"):
        Trainer(spec(), topology=TOPOLOGY, backend="nccl").fit(1)


def _tiny_criteo(path: Path, lines: int) -> Path:
    """A Criteo-format file for the tiny preset: a label, 3 integers and 4 hashed ids."""
    rng = np.random.default_rng(lines)
    path.write_text(
        "".join(
            "\t".join(
                [str(rng.integers(0, 2)), *map(str, rng.integers(0, 500, 3))]
                + [f"{v:x}" for v in rng.integers(0, 2**32, 4)]
            )
            + "\n"
            for _ in range(lines)
        )
    )
    return path


def test_a_criteo_file_travels_as_a_path_and_recovers_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dlrm_spec(data=...) carries the file's recipe, not its samples (the pickled
    spec's size does not grow with the file); the workers map the parsed samples, checked
    by fingerprint, and train bit for bit as on the same samples shipped in memory, through
    a recovery."""
    monkeypatch.setenv("CHECKFREE_CACHE_DIR", str(tmp_path / "cache"))
    path = _tiny_criteo(tmp_path / "clicks.tsv", 400)
    from_file = dlrm_spec(preset="tiny", data=path, batch_size=16, seed=3)
    larger = dlrm_spec(
        preset="tiny", data=_tiny_criteo(tmp_path / "large.tsv", 20_000), batch_size=16, seed=3
    )
    sizes = [len(pickle.dumps(s)) for s in (from_file, larger)]
    assert sizes[0] < 4096 and abs(sizes[1] - sizes[0]) < 16, sizes  # digits of the count
    inline = ClickDataset(
        read_criteo(path, (40, 30, 20, 12), dense_features=3), batch_size=16, seed=3
    )
    assert len(pickle.dumps(inline)) > 400 * (4 + 3 * 4 + 4 * 8)  # what used to travel
    oracle_spec = dataclasses.replace(from_file, batches=inline, val_batches=inline.validation)
    expected = Trainer(oracle_spec, topology=TOPOLOGY, policy=EVERY_STEP).fit(4)
    result = Trainer(
        from_file,
        topology=TOPOLOGY,
        policy=EVERY_STEP,
        failures=FailureSchedule([Kill(step=2, stage=0, replica=1)]),
    ).fit(4)
    assert result.losses == expected.losses and len(result.events) == 1
    for r in range(TOPOLOGY.replicas):
        for key, value in model(expected, r).items():
            assert torch.equal(model(result, r)[key], value), (r, key)
