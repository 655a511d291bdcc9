"""Tests of the row-sharded DLRM in `parallelism.workloads.dlrm`: layout, exchange, trainer,
metrics."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelism import Topology
from parallelism.comm import host_store
from parallelism.workloads.clicks import ClickBatch, ClickLogs
from parallelism.workloads.dlrm import (
    DLRM,
    DLRMConfig,
    DLRMWorker,
    InProcessDLRM,
    LocalGroup,
    ProcessGroupCollective,
    ShardLayout,
    dlrm_spec,
    init_table_rows,
    log_loss,
    roc_auc,
    route_lookups,
)
from recovery import Kill, KillPoint, MirrorPolicy, RecoveryPolicy
from recovery.reference import differences
from tests.jobs import drive, in_threads, make

TIMEOUT = datetime.timedelta(seconds=30)
TINY = DLRMConfig.preset("tiny")


def _logs(config: DLRMConfig = TINY, batch: int = 8, seed: int = 0) -> ClickLogs:
    return ClickLogs(
        config.table_rows, dense_features=config.dense_features, batch_size=batch, seed=seed
    )


# ---- config and layout -----------------------------------------------------------------


def test_config_validation_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match="embedding_dim"):
        DLRMConfig(table_rows=(4,), embedding_dim=0)
    with pytest.raises(ValueError, match=r"table_rows\[1\]"):
        DLRMConfig(table_rows=(4, -1))
    with pytest.raises(ValueError, match="at least one table"):
        DLRMConfig(table_rows=())
    with pytest.raises(ValueError, match="unknown DLRM preset"):
        DLRMConfig.preset("huge")
    small = DLRMConfig.preset("small")
    assert 100_000 <= small.embedding_rows <= 1_000_000
    assert TINY.interaction_dim == TINY.embedding_dim + 5 * 4 // 2


def test_layout_is_contiguous_balanced_and_covers_every_row_once() -> None:
    layout = ShardLayout((10, 7, 3), 3)
    assert layout.shard_rows(0) == ((0, 3), (0, 2), (0, 1))
    assert layout.shard_rows(2) == ((6, 10), (4, 7), (2, 3))
    for t, n in enumerate(layout.table_rows):
        rows = torch.arange(n)
        owners = layout.owner(t, rows)
        local = layout.local_index(t, rows)
        for shard in range(3):
            start, stop = layout.shard_rows(shard)[t]
            assert torch.equal(rows[owners == shard], torch.arange(start, stop))
            assert torch.equal(
                local[owners == shard], layout.offsets(shard)[t] + torch.arange(stop - start)
            )
    tables, rows = layout.global_rows(1)
    assert len(tables) == layout.shard_size(1) == 3 + 2 + 1


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.integers(1, 60), min_size=1, max_size=4),
    shards=st.integers(1, 6),
)
def test_layout_owner_matches_shard_rows(rows: list[int], shards: int) -> None:
    if min(rows) < shards:
        with pytest.raises(ValueError, match="fewer than"):
            ShardLayout(tuple(rows), shards)
        return
    layout = ShardLayout(tuple(rows), shards)
    for t, n in enumerate(rows):
        owners = layout.owner(t, torch.arange(n))
        sizes = torch.bincount(owners, minlength=shards)
        assert int(sizes.max() - sizes.min()) <= 1  # balanced
        assert torch.all(owners[1:] >= owners[:-1])  # contiguous
    assert sum(layout.shard_size(s) for s in range(shards)) == sum(rows)


def test_layout_rejects_small_tables_and_bad_ids() -> None:
    with pytest.raises(ValueError, match="table 1 has 2 rows, fewer than the 3 shards"):
        ShardLayout((5, 2), 3)
    layout = ShardLayout((5, 4), 2)
    with pytest.raises(ValueError, match="id 4 of table 1"):
        route_lookups(layout, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="int64"):
        route_lookups(layout, torch.tensor([[0.0, 1.0]]))
    with pytest.raises(ValueError, match="shard must be in"):
        layout.shard_rows(2)


def test_routing_requests_unique_rows_with_lookup_counts() -> None:
    layout = ShardLayout((4, 4), 2)
    sparse = torch.tensor([[0, 2], [3, 3], [0, 2]])
    routing = route_lookups(layout, sparse)
    # Shard 0 owns rows 0-1 of each table (local 0-1, 2-3); shard 1 rows 2-3 (local 0-1, 2-3).
    assert routing.requests[0].tolist() == [[0, 2]]  # table 0 row 0, twice
    assert routing.requests[1].tolist() == [[1, 1], [2, 2], [3, 1]]
    assert sum(int(r[:, 1].sum()) for r in routing.requests) == sparse.numel()
    flat = torch.cat(routing.requests)[:, 0]
    owners = torch.tensor([0, 1, 1, 1])
    keys = torch.stack([owners, flat], 1)[routing.inverse].view(3, 2, 2)
    for t in range(2):
        assert torch.equal(keys[:, t, 0], layout.owner(t, sparse[:, t]))
        assert torch.equal(keys[:, t, 1], layout.local_index(t, sparse[:, t]))


def test_init_does_not_depend_on_sharding() -> None:
    whole = init_table_rows(3, 0, 20_000, 0, 20_000, 4)
    part = init_table_rows(3, 0, 20_000, 8000, 17_000, 4)
    assert torch.equal(whole[8000:17_000], part)


# ---- training --------------------------------------------------------------------------


def test_sharded_training_matches_the_unsharded_reference() -> None:
    logs = _logs()
    sim = InProcessDLRM(TINY, workers=3, batches=logs)
    ref = DLRM(TINY)
    try:
        for step in range(6):
            loss, _ = sim.train_step(step)
            ref_loss = ref.train_step(ClickBatch.cat([logs(step, r, 3) for r in range(3)]))
            assert loss == pytest.approx(ref_loss, abs=1e-6)
        for table, expected in zip(sim.tables(), ref.tables, strict=True):
            torch.testing.assert_close(table, expected.detach(), rtol=0, atol=1e-6)
        for worker in sim.workers:
            for key, value in worker.dense.state_dict().items():
                torch.testing.assert_close(value, ref.dense.state_dict()[key], rtol=0, atol=1e-6)
        # Every dense replica is bit-identical (identical all-reduced gradients).
        states = [w.dense.state_dict() for w in sim.workers]
        assert all(torch.equal(s[k], states[0][k]) for s in states for k in s)
    finally:
        sim.close()


def test_rows_nobody_looks_up_stay_bit_identical() -> None:
    config = DLRMConfig(
        table_rows=(16, 16), embedding_dim=4, dense_features=2, bottom_mlp=(4,), top_mlp=(4,)
    )

    def batches(step: int, replica: int, num_replicas: int) -> ClickBatch:
        sparse = torch.tensor([[1, 2], [5, 9]]) + replica  # never rows >= 11 of either table
        return ClickBatch(dense=torch.ones(2, 2), sparse=sparse, labels=torch.tensor([1.0, 0.0]))

    sim = InProcessDLRM(config, workers=2, batches=batches)
    try:
        before = [w.shard.weight.detach().clone() for w in sim.workers]
        _, updates = sim.train_step(0)
        for worker, old, update in zip(sim.workers, before, updates, strict=True):
            touched = torch.zeros(worker.shard.num_rows, dtype=torch.bool)
            touched[update.rows] = True
            assert torch.equal(worker.shard.weight[~touched], old[~touched])
            assert not torch.equal(worker.shard.weight[touched], old[touched])
        assert sum(int(u.lookups.sum()) for u in updates) == 2 * 2 * 2
    finally:
        sim.close()


def test_training_is_deterministic_and_abandon_applies_nothing() -> None:
    logs = _logs()
    runs = []
    for abandon_first in (False, True):
        sim = InProcessDLRM(TINY, workers=2, batches=logs)
        try:
            if abandon_first:
                sim.run_step(0)
                sim.abandon()
            for step in range(4):
                sim.train_step(step)
            runs.append(sim.tables())
        finally:
            sim.close()
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_two_phase_misuse_is_an_error() -> None:
    layout = ShardLayout(TINY.table_rows, 1)
    worker = DLRMWorker(TINY, layout, 0)
    coll = LocalGroup(1, timeout=TIMEOUT).collective(0)
    with pytest.raises(RuntimeError, match="no step to commit"):
        worker.commit()
    worker.run_step(coll, _logs()(0, 0, 1))
    with pytest.raises(RuntimeError, match="uncommitted"):
        worker.run_step(coll, _logs()(1, 0, 1))
    bad = ClickBatch(
        dense=torch.zeros(2, 5), sparse=torch.zeros(2, 4, dtype=torch.int64), labels=torch.zeros(2)
    )
    worker.abandon()
    with pytest.raises(ValueError, match="dense features"):
        worker.run_step(coll, bad)


def test_shard_load_rejects_a_wrong_shape_without_writing() -> None:
    worker = DLRMWorker(TINY, ShardLayout(TINY.table_rows, 2), 0)
    before = worker.shard.weight.detach().clone()
    with pytest.raises(ValueError, match="shard 0 weight"):
        worker.shard.load(torch.zeros(3, 4), torch.zeros(3))
    with pytest.raises(ValueError, match="accumulator"):
        worker.shard.load(torch.zeros_like(before), torch.zeros(2))
    assert torch.equal(worker.shard.weight, before)


def test_a_failing_worker_wakes_its_peers_instead_of_hanging() -> None:
    def batches(step: int, replica: int, num_replicas: int) -> ClickBatch:
        if replica == 1:
            raise ValueError("bad data on worker 1")
        return _logs()(step, replica, num_replicas)

    sim = InProcessDLRM(TINY, workers=2, batches=_logs())
    sim.batches = batches
    try:
        with pytest.raises(ValueError, match="bad data"):
            sim.run_step(0)
        # A worker's own failure inside the collective section wakes the other one too.
        original = sim.workers[1].run_step
        sim.workers[1].run_step = lambda coll, batch: (_ for _ in ()).throw(RuntimeError("boom"))  # type: ignore[method-assign]
        sim.batches = _logs()
        with pytest.raises(RuntimeError, match="boom"):
            sim.run_step(0)
        sim.workers[1].run_step = original  # type: ignore[method-assign]
        sim.abandon()
        sim.train_step(0)  # the group is usable again
    finally:
        sim.close()


def test_process_group_collective_over_gloo_matches_the_local_group() -> None:
    world = 3
    logs = _logs()
    sim = InProcessDLRM(TINY, workers=world, batches=logs)
    try:
        expected = [sim.train_step(step)[0] for step in range(3)]
        expected_tables = sim.tables()
    finally:
        sim.close()
    store = host_store("127.0.0.1")
    layout = ShardLayout(TINY.table_rows, world)
    workers = [DLRMWorker(TINY, layout, r) for r in range(world)]
    barrier = threading.Barrier(world)

    def run(rank: int) -> list[float]:
        base = dist.TCPStore("127.0.0.1", store.port, None, False, TIMEOUT)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = TIMEOUT
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        group = dist.ProcessGroupGloo(dist.PrefixStore("dlrm", base), rank, world, opts)
        coll = ProcessGroupCollective(group, timeout=TIMEOUT)
        losses = []
        for step in range(3):
            stats = workers[rank].run_step(coll, logs(step, rank, world))
            losses.append(stats.loss_sum)
            barrier.wait(30)
            workers[rank].commit()
        return losses

    results = in_threads([lambda r=r: run(r) for r in range(world)])
    for r in results:
        assert not isinstance(r, BaseException), r
    for step in range(3):
        total = sum(results[r][step] for r in range(world)) / (world * 8)
        assert total == pytest.approx(expected[step], abs=1e-6)
    for t, table in enumerate(expected_tables):
        parts = []
        for w in workers:
            start, stop = layout.shard_rows(w.rank)[t]
            offset = layout.offsets(w.rank)[t]
            parts.append(w.shard.weight.detach()[offset : offset + stop - start])
        torch.testing.assert_close(torch.cat(parts), table, rtol=0, atol=1e-6)


# ---- metrics ---------------------------------------------------------------------------


def test_auc_matches_a_pairwise_count_with_ties() -> None:
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (60,), generator=gen).float()
    labels = (torch.rand(60, generator=gen) < 0.4).float()
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).float() + 0.5 * (pos[:, None] == neg[None, :]).float()
    assert roc_auc(scores, labels) == pytest.approx(float(wins.mean()))
    assert roc_auc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == 1.0
    with pytest.raises(ValueError, match="both positive and negative"):
        roc_auc(torch.zeros(3), torch.ones(3))
    assert log_loss(torch.zeros(4), torch.tensor([0.0, 1.0, 1.0, 0.0])) == pytest.approx(
        0.693147, abs=1e-6
    )


# -- shard mirrors through a chain of recoveries, on threads ------------------------------

MIRROR_CHAIN = (
    Kill(step=2, stage=0, replica=2),
    Kill(step=3, stage=0, replica=3),  # held by replica 0; its ward is the new 2
    Kill(step=4, stage=0, replica=2),  # held by the replacement of 3
    Kill(step=5, stage=0, replica=1, at=KillPoint.DURING_ALLREDUCE),
)
"""Kills of a 1x4 DLRM job whose restores come from every kind of holder (also run on Ray:
tests/test_dlrm_runtime.py)."""


def test_mirrors_stay_exact_through_a_chain_of_recoveries_on_threads() -> None:
    """After a recovery only the replacement's mirror is re-seeded; every later restore,
    from any holder (an old one, or a replacement), is still exact: every worker's whole
    state ends as the failure-free run's. (tests/test_dlrm_runtime.py runs the same chain
    on Ray, in the slow run.)"""
    spec = dlrm_spec(preset="tiny", batch_size=16, seed=3)
    top, steps, policy = Topology(1, 4), 6, RecoveryPolicy(mirrors=MirrorPolicy(every=1))
    clean, _ = make(spec, top, policy=policy, steps=steps)
    drive(clean)
    controller, _ = make(spec, top, *MIRROR_CHAIN, policy=policy, steps=steps)
    drive(controller)
    assert [(e.step, e.lost, e.strategy) for e in controller.events] == [
        (2, [(0, 2)], "shard_mirror"),
        (3, [(0, 3)], "shard_mirror"),
        (4, [(0, 2)], "shard_mirror"),
        (5, [(0, 1)], "shard_mirror"),
    ]  # every kill fired where it was meant to
    found = differences(controller.final_states, clean.final_states, where="states")  # type: ignore[attr-defined]
    assert not found, found[:10]
