"""Tests of partial embedding recovery (`recovery.strategies.embedding`) and its experiment.

The oracles: a restore rewrites exactly the dead worker's shard; rows restored exact are
bit-identical to a run that never failed and stale rows equal the copy they came from;
with mirrors refreshed every step the whole job ends bit-identical to an uninterrupted
run; PLS equals a hand count.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelism.workloads.clicks import ClickBatch, ClickLogs
from parallelism.workloads.dlrm import DLRMConfig, InProcessDLRM
from recovery.faults import FailureSchedule, Hang, Kill
from recovery.names import Strategy
from recovery.strategies.embedding import (
    MFUTracker,
    MirrorPlan,
    RestoredShard,
    ShardCopy,
    decide,
    mirror_cost,
    mirror_update,
    mirror_update_before_commit,
    portion_of_lost_samples,
    restore_shard,
)
from simulations.embedding import (
    EmbeddingSetup,
    EmbeddingStrategy,
    EmbeddingTimeModel,
    default_strategies,
    failure_schedule,
    plot_results,
    results_table,
    run_embedding,
)

TINY = DLRMConfig.preset("tiny")


class _Job:
    """W in-process workers plus the bookkeeping a runtime keeps: MFU counters, each
    shard's mirror on its ring successor, and each shard's part of the last snapshot."""

    def __init__(
        self,
        *,
        plan: MirrorPlan | None,
        workers: int = 3,
        config: DLRMConfig = TINY,
        batches: object = None,
    ) -> None:
        logs = batches or ClickLogs(
            config.table_rows, dense_features=config.dense_features, batch_size=8, seed=2
        )
        self.sim = InProcessDLRM(config, workers=workers, batches=logs)  # type: ignore[arg-type]
        self.plan = plan
        self.committed = 0
        self.trackers = [MFUTracker(w.shard.num_rows) for w in self.sim.workers]
        self.snapshots = [self._copy(r) for r in range(workers)]
        self.mirrors = [self._copy(r) for r in range(workers)] if plan else []

    def _copy(self, rank: int) -> ShardCopy:
        shard = self.sim.workers[rank].shard
        return ShardCopy.take(
            rank,
            shard.weight,
            shard.accumulator,
            committed=self.committed,
            lookups=self.trackers[rank].counts,
        )

    def snapshot(self) -> None:
        self.snapshots = [self._copy(r) for r in range(self.sim.world_size)]

    def step(self) -> None:
        _, updates = self.sim.train_step(self.committed)
        self.committed += 1
        for rank, update in enumerate(updates):
            self.trackers[rank].observe(update.rows, update.lookups)
            self.snapshots[rank].record(update.rows, update.lookups)
            if self.plan is not None:
                shard = self.sim.workers[rank].shard
                message = mirror_update(
                    self.plan,
                    shard=rank,
                    committed=self.committed,
                    weight=shard.weight,
                    accumulator=shard.accumulator,
                    tracker=self.trackers[rank],
                    updated=update.rows,
                    lookups=update.lookups,
                )
                self.mirrors[rank].apply(message)

    def kill(self, rank: int) -> RestoredShard:
        """Worker ``rank`` dies; rebuild it: dense from a live replica, shard from copies."""
        copies = ([self.mirrors[rank]] if self.plan else []) + [self.snapshots[rank]]
        restored = restore_shard(copies)
        worker = self.sim.new_worker(rank)
        worker.load_dense(self.sim.workers[(rank + 1) % self.sim.world_size].dense_state())
        worker.shard.load(restored.weight, restored.accumulator)
        self.sim.workers[rank] = worker
        for copy in copies:
            copy.rebase(restored)
        self.trackers[rank] = MFUTracker(worker.shard.num_rows, restored.lookups)
        return restored

    def state(self) -> list[torch.Tensor]:
        out = []
        for w in self.sim.workers:
            out += [w.shard.weight.detach().clone(), w.shard.accumulator.clone()]
            out += [v.clone() for v in w.dense.state_dict().values()]
        return out


# ---- the restore oracles ---------------------------------------------------------------


def test_partial_recovery_rewrites_only_the_lost_shard() -> None:
    job = _Job(plan=MirrorPlan(hot_rows=6, mirror_every=1000))
    for _ in range(4):
        job.step()
    job.snapshot()
    snapshot = job.snapshots[1].clone()
    for _ in range(5):
        job.step()
    dead = 1
    lost_weight = job.sim.workers[dead].shard.weight.detach().clone()  # = no-failure state
    lost_acc = job.sim.workers[dead].shard.accumulator.clone()
    mirror = job.mirrors[dead].clone()
    others = {
        r: (w.shard.weight.detach().clone(), w.shard.accumulator.clone(), w.dense_state())
        for r, w in enumerate(job.sim.workers)
        if r != dead
    }
    restored = job.kill(dead)

    assert restored.rows_exact > 0 and restored.rows_stale > 0
    for r, (weight, acc, dense) in others.items():
        worker = job.sim.workers[r]
        assert torch.equal(worker.shard.weight, weight)
        assert torch.equal(worker.shard.accumulator, acc)
        for key, value in worker.dense.state_dict().items():
            assert torch.equal(value, dense["model"][key])
    new = job.sim.workers[dead].shard
    exact = restored.exact
    assert torch.equal(new.weight[exact], lost_weight[exact])
    assert torch.equal(new.accumulator[exact], lost_acc[exact])
    assert not torch.equal(new.weight[~exact], lost_weight[~exact])
    from_snapshot = restored.source == 1
    assert bool((from_snapshot & ~exact).any())
    assert torch.equal(new.weight[from_snapshot], snapshot.weight[from_snapshot])
    assert torch.equal(new.weight[~from_snapshot], mirror.weight[~from_snapshot])
    # The dense replica of the new worker is the live replicas', bit for bit.
    for key, value in job.sim.workers[dead].dense.state_dict().items():
        assert torch.equal(value, job.sim.workers[0].dense.state_dict()[key])
    job.step()  # training goes on from the restored state
    job.sim.close()


_CLEAN: list[list[torch.Tensor]] = []


def _clean_state(steps: int) -> list[torch.Tensor]:
    """The final state of a run that never failed (computed once)."""
    if not _CLEAN:
        clean = _Job(plan=MirrorPlan(hot_rows=0, mirror_every=1))
        for _ in range(steps):
            clean.step()
        _CLEAN.append(clean.state())
        clean.sim.close()
    return _CLEAN[0]


@settings(max_examples=4, deadline=None)
@given(kill_at=st.integers(0, 5), rank=st.integers(0, 2))
def test_mirroring_every_step_makes_recovery_bit_exact(kill_at: int, rank: int) -> None:
    steps = 6
    failed = _Job(plan=MirrorPlan(hot_rows=0, mirror_every=1))
    for _ in range(kill_at):
        failed.step()
    restored = failed.kill(rank)
    assert restored.rows_stale == 0 and restored.lost_lookups == 0
    assert decide("exact", pls=0.0, budget=0.0) == Strategy.EMBEDDING_PARTIAL
    while failed.committed < steps:
        failed.step()
    for a, b in zip(failed.state(), _clean_state(steps), strict=True):
        assert torch.equal(a, b)
    failed.sim.close()


def _hand_batches(step: int, replica: int, num_replicas: int) -> ClickBatch:
    ids = {
        (0, 0): [[0, 2], [3, 3]],
        (0, 1): [[2, 1], [0, 0]],
        (1, 0): [[1, 1], [2, 0]],
        (1, 1): [[3, 2], [3, 3]],
    }[(step, replica)]
    return ClickBatch(
        dense=torch.ones(2, 1), sparse=torch.tensor(ids), labels=torch.tensor([1.0, 0.0])
    )


@pytest.mark.parametrize(
    ("plan", "lost_per_row", "exact"),
    [
        # Snapshot at step 0 only: every lookup of shard 1's rows in steps 0 and 1 is lost.
        (None, [2, 3, 2, 2], [False, False, False, False]),
        # One hot row mirrored per step: after step 0 the tie goes to local row 0 (table 0,
        # row 2), so only its step-1 lookup is lost; after step 1 local row 1 (table 0,
        # row 3, 3 lookups) is the hottest and comes back exact.
        (MirrorPlan(hot_rows=1, mirror_every=1000), [1, 0, 2, 2], [False, True, False, False]),
    ],
)
def test_pls_matches_a_hand_count(
    plan: MirrorPlan | None, lost_per_row: list[int], exact: list[bool]
) -> None:
    # Tables of 4 rows over 2 shards: shard 1 owns rows 2-3 of each table, local rows
    # (t0 r2, t0 r3, t1 r2, t1 r3). Counting their lookups in _hand_batches:
    # step 0: t0r3 (w0), t1r2 (w0), t1r3 (w0), t0r2 (w1); step 1: t0r2 (w0), t0r3 x2
    # (w1), t1r2 (w1), t1r3 (w1): 2 + 3 + 2 + 2 = 9 lookups.
    config = DLRMConfig(
        table_rows=(4, 4), embedding_dim=2, dense_features=1, bottom_mlp=(2,), top_mlp=(2,)
    )
    job = _Job(plan=plan, workers=2, config=config, batches=_hand_batches)
    job.step()
    job.step()
    restored = job.kill(1)
    assert restored.lost.tolist() == lost_per_row
    assert restored.exact.tolist() == exact
    samples = 2 * 2 * 2  # committed steps x workers x batch
    pls = portion_of_lost_samples(restored.lost_lookups, lookups_per_sample=2, samples=samples)
    assert pls == pytest.approx(sum(lost_per_row) / 2 / samples)
    assert pls == (0.5625 if plan is None else 0.3125)
    # Rebased, the snapshot counts the updates the restored rows hold and it lacks.
    assert job.snapshots[1].pending.tolist() == [
        a - b for a, b in zip([2, 3, 2, 2], lost_per_row, strict=True)
    ]
    job.sim.close()


# ---- the pieces ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "plan",
    [
        MirrorPlan(hot_rows=5, mirror_every=3),
        MirrorPlan(hot_rows=5, mirror_every=7, hot_every=2),
        MirrorPlan(),
    ],
)
def test_the_update_sent_before_commit_is_the_one_after_it(plan: MirrorPlan) -> None:
    """The runtime sends a step's mirror update in phase one; it must carry exactly the
    bits `mirror_update` reads off the shard after the commit."""
    logs = ClickLogs(TINY.table_rows, dense_features=TINY.dense_features, batch_size=8, seed=4)
    trainer = InProcessDLRM(TINY, workers=3, batches=logs)
    trackers = [MFUTracker(w.shard.num_rows) for w in trainer.workers]
    hot_early: list[torch.Tensor | None] = [None] * 3
    hot_late: list[torch.Tensor | None] = [None] * 3
    for step in range(8):
        trainer.run_step(step)
        before = []
        for w, tracker in zip(trainer.workers, trackers, strict=True):
            pending = w.pending
            assert pending is not None
            rows, grads, lookups = pending
            before.append(
                mirror_update_before_commit(
                    plan,
                    shard=w.rank,
                    committed=step + 1,
                    weight=w.shard.weight,
                    accumulator=w.shard.accumulator,
                    counts=tracker.counts,
                    rows=rows,
                    grads=grads,
                    lookups=lookups,
                    lr=w.sparse_lr,
                    eps=w.eps,
                    hot=hot_early[w.rank],
                )
            )
            if not before[-1].full:
                hot_early[w.rank] = before[-1].rows
        updates = trainer.commit()
        for w, tracker, update, early in zip(
            trainer.workers, trackers, updates, before, strict=True
        ):
            tracker.observe(update.rows, update.lookups)
            late = mirror_update(
                plan,
                shard=w.rank,
                committed=step + 1,
                weight=w.shard.weight,
                accumulator=w.shard.accumulator,
                tracker=tracker,
                updated=update.rows,
                lookups=update.lookups,
                hot=hot_late[w.rank],
            )
            if not late.full:
                hot_late[w.rank] = late.rows
            assert early.full == late.full and early.committed == late.committed
            for name in ("updated", "lookups", "rows", "weight", "accumulator"):
                assert torch.equal(getattr(early, name), getattr(late, name)), (step, name)
    trainer.close()


def test_the_hot_set_is_chosen_again_every_hot_every_steps() -> None:
    tracker = MFUTracker(6, torch.tensor([5, 0, 9, 1, 7, 2]))
    plan = MirrorPlan(hot_rows=2, hot_every=3)
    last = torch.tensor([1, 3])
    assert plan.hot_set(tracker, 4, None).tolist() == [2, 4]  # nothing chosen yet
    assert plan.hot_set(tracker, 4, last).tolist() == [1, 3]  # kept between choices
    assert plan.hot_set(tracker, 6, last).tolist() == [2, 4]  # due: chosen again
    with pytest.raises(ValueError, match="hot_every"):
        MirrorPlan(hot_every=0)


def test_mfu_tracker_names_the_hottest_rows() -> None:
    tracker = MFUTracker(6)
    tracker.observe(torch.tensor([0, 2, 3, 5]), torch.tensor([4, 9, 4, 1]))
    assert tracker.hot(2).tolist() == [0, 2]  # 9, then the tie 4/4 goes to row 0
    assert tracker.hot(10).tolist() == [0, 2, 3, 5]  # never-used rows are never hot
    assert tracker.hot(0).tolist() == []
    with pytest.raises(ValueError, match="outside"):
        tracker.observe(torch.tensor([6]), torch.tensor([1]))
    with pytest.raises(ValueError, match="counts must be"):
        MFUTracker(3, torch.zeros(2, dtype=torch.int64))


def test_mirror_plan_and_cost_accounting() -> None:
    with pytest.raises(ValueError, match="hot_rows must be >= 0"):
        MirrorPlan(hot_rows=-1)
    with pytest.raises(ValueError, match="mirror_every"):
        MirrorPlan(mirror_every=0)
    plan = MirrorPlan(hot_rows=10, mirror_every=4)
    cost = mirror_cost(plan, num_rows=100, dim=8, updated_rows_per_step=20)
    row = 8 * 4 + 4
    assert cost.hot_bytes == 10 * (row + 8)
    assert cost.full_bytes == 100 * row
    assert cost.memory_bytes == 100 * (row + 24)
    assert cost.mean_bytes_per_step == pytest.approx((100 * row + 3 * 10 * (row + 8)) / 4 + 20 * 16)
    tracker = MFUTracker(100)
    tracker.observe(torch.arange(20), torch.ones(20, dtype=torch.int64))
    weight, acc = torch.zeros(100, 8), torch.zeros(100)
    args = {"shard": 0, "weight": weight, "accumulator": acc, "tracker": tracker}
    hot = mirror_update(plan, committed=5, updated=torch.arange(20), lookups=torch.ones(20), **args)
    full = mirror_update(
        plan, committed=8, updated=torch.arange(20), lookups=torch.ones(20), **args
    )
    assert not hot.full and hot.rows.numel() == 10 and hot.nbytes == cost.hot_bytes + 20 * 16
    assert full.full and full.nbytes == cost.full_bytes + 20 * 16


def test_shard_copy_bookkeeping() -> None:
    copy = ShardCopy.take(0, torch.zeros(4, 2), torch.zeros(4), committed=3)
    copy.record(torch.tensor([1, 2]), torch.tensor([2, 5]))
    copy.refresh(torch.tensor([2]), torch.ones(1, 2), torch.ones(1), committed=4)
    assert copy.pending.tolist() == [0, 2, 0, 0]
    assert copy.lookups.tolist() == [0, 2, 5, 0]
    assert copy.copied_at.tolist() == [3, 3, 4, 3]
    with pytest.raises(ValueError, match="do not match"):
        copy.refresh(torch.tensor([1]), torch.ones(2, 2), torch.ones(1), committed=5)
    assert copy.copied_at.tolist() == [3, 3, 4, 3]  # nothing written


def test_restore_takes_the_freshest_copy_and_touches_nothing() -> None:
    older = ShardCopy.take(2, torch.zeros(3, 2), torch.zeros(3), committed=1)
    newer = ShardCopy.take(2, torch.ones(3, 2), torch.ones(3), committed=1)
    newer.refresh(torch.tensor([1]), torch.full((1, 2), 7.0), torch.ones(1), committed=5)
    older.refresh(torch.tensor([2]), torch.full((1, 2), 9.0), torch.ones(1), committed=6)
    before = [newer.clone(), older.clone()]
    restored = restore_shard([newer, older])
    assert restored.source.tolist() == [0, 0, 1]  # tie on row 0: the first copy
    assert restored.weight[:, 0].tolist() == [1.0, 7.0, 9.0]
    assert restored.copied_at.tolist() == [1, 5, 6]
    for kept, copy in zip(before, (newer, older), strict=True):
        assert torch.equal(kept.weight, copy.weight) and torch.equal(kept.pending, copy.pending)
    with pytest.raises(ValueError, match="no surviving copy"):
        restore_shard([])
    with pytest.raises(ValueError, match="copies disagree"):
        restore_shard([newer, ShardCopy.take(1, torch.zeros(3, 2), torch.zeros(3), committed=0)])
    with pytest.raises(ValueError, match="update of shard 1 sent to the copy of 2"):
        older.apply(
            mirror_update(
                MirrorPlan(),
                shard=1,
                committed=2,
                weight=torch.zeros(3, 2),
                accumulator=torch.zeros(3),
                tracker=MFUTracker(3),
                updated=torch.tensor([0]),
                lookups=torch.tensor([1]),
            )
        )


def test_decide_policy() -> None:
    assert decide("partial", pls=0.01, budget=0.02) is Strategy.EMBEDDING_PARTIAL
    assert decide("partial", pls=0.03, budget=0.02) is Strategy.ROLLBACK
    assert decide("exact", pls=0.0, budget=0.5) is Strategy.EMBEDDING_PARTIAL
    assert decide("exact", pls=1e-9, budget=0.5) is Strategy.ROLLBACK
    with pytest.raises(ValueError, match="embedding must be one of"):
        decide("lossy", pls=0.0, budget=0.1)
    with pytest.raises(ValueError, match="budget"):
        decide("partial", pls=0.0, budget=2.0)
    with pytest.raises(ValueError, match="lookups_per_sample"):
        portion_of_lost_samples(1, lookups_per_sample=0, samples=1)


# ---- the experiment --------------------------------------------------------------------


def test_experiment_strategies_on_a_tiny_job(tmp_path: Path) -> None:
    setup = EmbeddingSetup(
        preset="tiny", workers=3, batch_size=16, steps=30, heldout=600, eval_every=10
    )
    failures = failure_schedule(steps=30, workers=3, failures=3, seed=1)
    assert len(failures) == 3 and len({f.step for f in failures}) == 3
    times = EmbeddingTimeModel()
    results = {
        s.name: run_embedding(setup, s, failures, times)
        for s in default_strategies(hot_rows=8, mirror_every=10, pls_budget=0.5)
    }
    none = results["no failures"]
    assert none.events == [] and none.lost_s == 0
    # Exact strategies end bit-identical to the run that never failed.
    assert results["full rollback"].digest == none.digest
    assert results["exact mirrors"].digest == none.digest
    assert results["full rollback"].rollbacks == 3
    assert all(e.decision == "partial" for e in results["exact mirrors"].events)
    mirrors = results["CPR + MFU mirrors"]
    assert [e.decision for e in mirrors.events] == ["partial"] * 3
    assert mirrors.lost_s < results["full rollback"].lost_s
    assert mirrors.mirror_bytes_per_step > 0
    table = results_table(list(results.values()))
    assert table.count("\n") == 1 + len(results) and "| exact mirrors |" in table
    plot_results(list(results.values()), str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_experiment_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="recovery must be one of"):
        EmbeddingStrategy(name="x", recovery="restart")
    with pytest.raises(ValueError, match="mirrors are used by 'partial'"):
        EmbeddingStrategy(name="x", recovery="rollback", mirror=MirrorPlan())
    with pytest.raises(ValueError, match="fewer than the 50 shards"):
        EmbeddingSetup(preset="tiny", workers=50)
    setup = EmbeddingSetup(preset="tiny", workers=2, batch_size=4, steps=5, heldout=100)
    strategy = EmbeddingStrategy(name="r", recovery="rollback")
    with pytest.raises(ValueError, match="kills workers"):
        run_embedding(setup, strategy, FailureSchedule([Hang(step=1, stage=0, replica=0)]))
    with pytest.raises(ValueError, match="outside a run"):
        run_embedding(setup, strategy, FailureSchedule([Kill(step=9, stage=0, replica=0)]))
