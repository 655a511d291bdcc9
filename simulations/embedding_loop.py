"""The embedding simulator's run: W in-process DLRM workers trained under a failure
schedule, each failure recovered by one `EmbeddingStrategy` and charged by the
`EmbeddingTimeModel`. See [Note: embedding simulator model] in `simulations.embedding`."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from parallelism.topology import Topology
from parallelism.workloads.dlrm import InProcessDLRM
from recovery.faults import FailureSchedule, Kill
from recovery.names import Strategy
from recovery.planner import RecoveryPlan, Redundancy, plan
from recovery.policy import MirrorPolicy, RecoveryPolicy, SnapshotPolicy
from recovery.strategies.embedding import (
    MFUTracker,
    ShardCopy,
    mirror_update,
    portion_of_lost_samples,
    restore_shard,
)
from simulations.costs import EmbeddingTimeModel
from simulations.embedding_config import EmbeddingSetup, EmbeddingStrategy
from simulations.embedding_results import EmbeddingEvent, EmbeddingRunResult
from simulations.policies import SimulatedPolicy

__all__ = ["run_embedding"]

_FULL_ROLLBACK = RecoveryPolicy(
    allowed=(Strategy.ROLLBACK,), snapshots=SnapshotPolicy(peer_every=None)
)
"""The ``rollback`` recovery: nothing but a rollback of every worker is allowed."""
_PARTIAL_STRATEGIES = {Strategy.SHARD_MIRROR, Strategy.EMBEDDING_PARTIAL}


@dataclass
class _Checkpoint:
    committed: int
    shards: list[ShardCopy]
    """Each shard's values at ``committed``; their bookkeeping counts lookups since."""
    dense: dict[str, Any]
    counts: list[torch.Tensor]


@dataclass
class _Run:
    setup: EmbeddingSetup
    strategy: EmbeddingStrategy
    times: EmbeddingTimeModel
    trainer: InProcessDLRM
    checkpoint_every: int
    trackers: list[MFUTracker]
    checkpoint: _Checkpoint
    mirrors: list[ShardCopy | None]
    committed: int = 0
    high_water: int = 0
    clock: float = 0.0
    lost: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(
            ("checkpoint", "failed_step", "recovery", "redo", "mirror"), 0.0
        )
    )
    accepted: list[tuple[int, float]] = field(default_factory=list)
    """(committed steps at the event, lost samples) of accepted partial recoveries."""
    events: list[EmbeddingEvent] = field(default_factory=list)
    mirror_bytes: float = 0.0
    mirror_steps: int = 0

    @property
    def world(self) -> int:
        return self.trainer.world_size

    def shard(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.trainer.workers[rank].shard
        return s.weight.detach(), s.accumulator

    def take_checkpoint(self) -> None:
        self.checkpoint = _Checkpoint(
            committed=self.committed,
            shards=[
                ShardCopy.take(
                    r, *self.shard(r), committed=self.committed, lookups=self.trackers[r].counts
                )
                for r in range(self.world)
            ],
            dense=self.trainer.workers[0].dense_state(),
            counts=[t.counts.clone() for t in self.trackers],
        )

    def seed_mirror(self, rank: int) -> float:
        """Re-seed the mirror of ``rank``'s shard with a full copy; returns bytes moved."""
        copy = ShardCopy.take(
            rank, *self.shard(rank), committed=self.committed, lookups=self.trackers[rank].counts
        )
        self.mirrors[rank] = copy
        return float(copy.weight.numel() * 4 + copy.accumulator.numel() * 4)

    def step(self) -> None:
        _, updates = self.trainer.train_step(self.committed)
        self.committed += 1
        self.clock += self.times.step_s
        if self.committed <= self.high_water:
            self.lost["redo"] += self.times.step_s
        plan = self.strategy.mirror
        step_bytes = 0
        for rank, update in enumerate(updates):
            self.trackers[rank].observe(update.rows, update.lookups)
            self.checkpoint.shards[rank].record(update.rows, update.lookups)
            mirror = self.mirrors[rank]
            if plan is not None and mirror is not None:
                weight, accumulator = self.shard(rank)
                message = mirror_update(
                    plan,
                    shard=rank,
                    committed=self.committed,
                    weight=weight,
                    accumulator=accumulator,
                    tracker=self.trackers[rank],
                    updated=update.rows,
                    lookups=update.lookups,
                )
                mirror.apply(message)
                step_bytes += message.nbytes
        if plan is not None:
            # Every owner sends at once, each over its own link: the slowest one stalls.
            seconds = self.times.transfer_s(step_bytes / self.world)
            self.clock += seconds
            self.lost["mirror"] += seconds
            self.mirror_bytes += step_bytes / self.world
            self.mirror_steps += 1
        if (
            self.strategy.recovery != SimulatedPolicy.NONE
            and self.committed % self.checkpoint_every == 0
            and self.committed < self.setup.steps
        ):
            self.take_checkpoint()
            self.clock += self.times.checkpoint_write_s
            self.lost["checkpoint"] += self.times.checkpoint_write_s

    def samples(self) -> int:
        return self.committed * self.world * self.setup.batch_size

    def fail(self, dead: Sequence[int]) -> None:
        self.clock += self.times.step_s  # the abandoned attempt
        self.lost["failed_step"] += self.times.step_s
        if self.strategy.recovery == Strategy.ROLLBACK:
            decision = self.plan(dead, _FULL_ROLLBACK, Redundancy(alive={}))
            assert decision.tier is not None
            self.rollback(dead)
        else:
            self.partial(dead)

    def plan(self, dead: Sequence[int], policy: RecoveryPolicy, found: Redundancy) -> RecoveryPlan:
        """The planner's decision (one stage, a replica per worker; ``found`` says what the
        mirrors hold), with every live worker current and the checkpoint durable."""
        gone = set(dead)
        redundancy = dataclasses.replace(
            found,
            alive={r: self.committed for r in range(self.world) if r not in gone},
            durable_steps=(self.checkpoint.committed,),
        )
        return plan(Topology(stages=1, replicas=self.world), gone, redundancy, policy)

    def rollback(self, dead: Sequence[int], event: EmbeddingEvent | None = None) -> None:
        ckpt = self.checkpoint
        downtime = self.times.detect_s + self.times.replace_s + self.times.checkpoint_load_s
        redo = self.committed - ckpt.committed
        self.high_water = max(self.high_water, self.committed)
        for rank in range(self.world):
            worker = self.trainer.new_worker(rank)
            worker.shard.load(ckpt.shards[rank].weight, ckpt.shards[rank].accumulator)
            worker.load_dense(ckpt.dense)
            self.trainer.workers[rank] = worker
            self.trackers[rank] = MFUTracker(worker.shard.num_rows, ckpt.counts[rank])
        self.committed = ckpt.committed
        self.accepted = [(c, s) for c, s in self.accepted if c < ckpt.committed]
        self.take_checkpoint()  # the same values; fresh bookkeeping from here
        for rank in range(self.world):
            if self.mirrors[rank] is not None:
                self.seed_mirror(rank)
        self.clock += downtime
        self.lost["recovery"] += downtime
        base = event or EmbeddingEvent(step=self.committed + redo, lost=tuple(dead), decision="")
        self.events.append(
            dataclasses.replace(
                base, decision=Strategy.ROLLBACK, downtime_s=downtime, redo_steps=redo
            )
        )

    def partial(self, dead: Sequence[int]) -> None:
        dead_set = set(dead)
        features = self.trainer.config.num_tables
        samples = self.samples()
        restored = {}
        from_mirror = exact = stale = 0
        lost_samples = 0.0
        durable = False
        for rank in sorted(dead_set):
            copies: list[ShardCopy] = []
            mirror = self.mirrors[rank]
            if mirror is not None and (rank + 1) % self.world not in dead_set:
                copies.append(mirror)
            copies.append(self.checkpoint.shards[rank])
            r = restore_shard(copies)
            restored[rank] = (r, copies)
            from_mirror += int((r.source == 0).sum()) if len(copies) == 2 else 0
            durable |= bool((r.source == len(copies) - 1).any())
            exact += r.rows_exact
            stale += r.rows_stale
            lost_samples += r.lost_lookups / features
        pls_event = portion_of_lost_samples(
            sum(r.lost_lookups for r, _ in restored.values()),
            lookups_per_sample=features,
            samples=samples,
        )
        pls_job = (sum(s for _, s in self.accepted) + lost_samples) / max(samples, 1)
        event = EmbeddingEvent(
            step=self.committed,
            lost=tuple(sorted(dead_set)),
            decision=SimulatedPolicy.PARTIAL,
            rows_exact=exact,
            rows_stale=stale,
            rows_from_mirror=from_mirror,
            lost_samples=lost_samples,
            pls_event=pls_event,
            pls_job=pls_job,
        )
        alive = [r for r in range(self.world) if r not in dead_set]
        # Each lost shard comes from its mirror's holder (the ring successor) where that
        # lives, else from a live worker's dense replica and the checkpoint's shard part;
        # stale rows make it partial, which the policy may refuse (then: roll back).
        successor = {r: (r + 1) % self.world for r in dead_set}
        found = Redundancy(
            alive={},
            mirror_holder={
                r: successor[r] if successor[r] not in dead_set or not alive else alive[0]
                for r in dead_set
            },
            mirror_stale={r: restored[r][0].rows_stale > 0 for r in dead_set},
            pls=pls_job,
        )
        policy = RecoveryPolicy(
            mirrors=MirrorPolicy(
                embedding=self.strategy.embedding, pls_budget=self.strategy.pls_budget
            ),
            snapshots=SnapshotPolicy(peer_every=None),
        )
        decision = self.plan(dead, policy, found)
        if decision.tier is not None:
            self.rollback(dead, event)
            return
        assert {a.strategy for a in decision.actions} <= _PARTIAL_STRATEGIES, decision
        dense = self.trainer.workers[alive[0]].dense_state()
        moved = 0.0
        for rank, (r, copies) in restored.items():
            worker = self.trainer.new_worker(rank)
            worker.load_dense(dense)
            worker.shard.load(r.weight, r.accumulator)
            self.trainer.workers[rank] = worker
            self.trackers[rank] = MFUTracker(worker.shard.num_rows, r.lookups)
            for c in copies:
                c.rebase(r)
            moved += sum(t.numel() * t.element_size() for t in dense["model"].values())
            moved += r.weight.numel() * 4 + r.accumulator.numel() * 4
        if self.strategy.mirror is not None:
            # Worker d held the mirror of shard d - 1: re-seed it from that shard's owner
            # (itself just restored if it died too). This also covers a dead successor.
            for rank in sorted(dead_set):
                moved += self.seed_mirror((rank - 1) % self.world)
        downtime = self.times.detect_s + self.times.replace_s + self.times.transfer_s(moved)
        if durable:
            downtime += self.times.checkpoint_load_s / self.world
        self.clock += downtime
        self.lost["recovery"] += downtime
        self.accepted.append((self.committed, lost_samples))
        self.events.append(dataclasses.replace(event, downtime_s=downtime))


def _digest(trainer: InProcessDLRM) -> str:
    h = hashlib.sha256()
    for worker in trainer.workers:
        h.update(worker.shard.weight.detach().numpy().tobytes())
        h.update(worker.shard.accumulator.numpy().tobytes())
    for value in trainer.workers[0].dense.state_dict().values():
        h.update(value.numpy().tobytes())
    return h.hexdigest()


def run_embedding(
    setup: EmbeddingSetup,
    strategy: EmbeddingStrategy,
    failures: FailureSchedule,
    times: EmbeddingTimeModel | None = None,
    *,
    progress: Callable[[int], None] | None = None,
) -> EmbeddingRunResult:
    """Train ``setup`` under ``failures`` with ``strategy``; see [Note: embedding simulator model].

    ``progress`` is called with the committed steps after every step (for a progress bar).

    Raises:
        ValueError: if a fault is not a ``Kill`` of a worker of the job within its steps.
    """
    times = times or EmbeddingTimeModel()
    kills: dict[int, list[int]] = {}
    for fault in failures:
        if not isinstance(fault, Kill) or fault.stage != 0 or fault.replica >= setup.workers:
            raise ValueError(
                f"{fault}: the embedding experiment kills workers as kill:step=K,stage=0,"
                f"replica=W with W < {setup.workers}"
            )
        if fault.step >= setup.steps:
            raise ValueError(f"{fault}: step {fault.step} is outside a run of {setup.steps} steps")
        kills.setdefault(fault.step, []).append(fault.replica)
    if strategy.recovery == SimulatedPolicy.NONE:
        kills = {}
    checkpoint_every = strategy.checkpoint_every or times.checkpoint_every(
        setup.steps, sum(len(v) for v in kills.values())
    )
    torch.set_num_threads(1)
    logs = setup.logs()
    heldout = logs.heldout(setup.heldout)
    trainer = InProcessDLRM(
        setup.config(),
        workers=setup.workers,
        batches=logs,
        seed=setup.seed,
        sparse_lr=setup.sparse_lr,
        dense_lr=setup.dense_lr,
    )
    try:
        trackers = [MFUTracker(w.shard.num_rows) for w in trainer.workers]
        run = _Run(
            setup=setup,
            strategy=strategy,
            times=times,
            trainer=trainer,
            checkpoint_every=checkpoint_every,
            trackers=trackers,
            checkpoint=_Checkpoint(0, [], {}, []),
            mirrors=[None] * setup.workers,
        )
        run.take_checkpoint()  # the initial state: free, every worker can rebuild it
        if strategy.mirror is not None:
            for rank in range(setup.workers):
                run.seed_mirror(rank)
        curve: list[tuple[int, float, float, float]] = []
        compute = 0.0
        fired: set[int] = set()
        auc, loss = trainer.evaluate(heldout)
        curve.append((0, 0.0, auc, loss))
        while run.committed < setup.steps:
            start = time.perf_counter()
            step = run.committed
            if step in kills and step not in fired:
                fired.add(step)
                run.fail(kills[step])
            else:
                run.step()
            compute += time.perf_counter() - start
            due = run.committed % setup.eval_every == 0 or run.committed == setup.steps
            if due and curve[-1][0] != run.committed:
                auc, loss = trainer.evaluate(heldout)
                curve.append((run.committed, run.clock, auc, loss))
            if progress is not None:
                progress(run.committed)
        auc, loss = trainer.evaluate(heldout)
        if curve[-1][0] != setup.steps:
            curve.append((setup.steps, run.clock, auc, loss))
        samples = run.samples()
        return EmbeddingRunResult(
            strategy=strategy.name,
            recovery=strategy.recovery,
            checkpoint_every=checkpoint_every
            if strategy.recovery != SimulatedPolicy.NONE
            else None,
            auc=auc,
            log_loss=loss,
            curve=curve,
            events=run.events,
            total_s=run.clock,
            lost=dict(run.lost),
            pls=sum(s for _, s in run.accepted) / samples,
            mirror_bytes_per_step=run.mirror_bytes / max(run.mirror_steps, 1),
            mirror_memory_bytes=sum(m.nbytes for m in run.mirrors if m is not None)
            // setup.workers,
            compute_s=compute,
            digest=_digest(trainer),
        )
    finally:
        trainer.close()
