"""State layouts: how a job's state is laid out over its workers, one class per kind.

The controller and the executor are the same for every job; what differs between a
pipeline of replicated stages, a pipeline whose optimizer is sharded over the replicas
(ZeRO-1), and a model whose embedding tables are row-sharded over every worker is held
here, behind one interface: which worker class runs it, what a worker is set up with,
which worker mirrors which shard, what a lost shard's mirror can give back (assessment),
how mirrors are seeded after a recovery, and what a partial restore costs (PLS). A new
kind of state is one more `StateLayout`, not a branch in the controller.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from parallelism.spec import TrainSpec
from parallelism.topology import Topology
from recovery.groups.group import WorkerGroup, require
from recovery.names import Strategy
from recovery.planner import RecoveryPlan, Redundancy
from recovery.policy import RecoveryPolicy
from recovery.runtime.ledger import RedundancyLedger
from recovery.strategies.pls import PLSLedger
from recovery.worker import StageWorker
from recovery.worker.table import TableWorker

__all__ = ["ReplicatedStages", "ShardedTables", "StateLayout", "Zero1Shards", "layout_for"]

log = logging.getLogger("checkfree")

_FROM_MIRRORS = (Strategy.SHARD_MIRROR, Strategy.EMBEDDING_PARTIAL)


class StateLayout:
    """One kind of job state laid out over the workers (see the module docstring)."""

    worker_cls: type[StageWorker] = StageWorker
    """The worker class that holds this kind of state."""
    mirrors_on_ring = False
    """Whether shard mirrors live on the buddy ring (which then follows the nodes)."""

    def __init__(
        self, spec: TrainSpec, topology: Topology, policy: RecoveryPolicy, samples_per_step: int
    ) -> None:
        self.spec = spec
        self.topology = topology
        self.policy = policy
        self.samples_per_step = samples_per_step
        """What `TrainSpec.check` returned: target elements (samples, tokens) per step."""

    def validate(self, backend: str, device: str | None = None) -> None:
        """Refuse, before any worker starts, a combination this layout cannot run
        (``device``: the compute device asked for, see parallelism/devices.py).

        Raises:
            ValueError: naming what does not combine.
        """

    def setup_args(self, rank: int, backend: str, device: str | None = None) -> tuple[Any, ...]:
        """The arguments of worker ``rank``'s ``setup`` call."""
        return (self.spec, self.topology, rank, backend, device)

    def mirror_holders(self, ring: Mapping[int, int]) -> dict[int, int]:
        """Rank -> the rank mirroring its shard; empty when nothing is sharded."""
        return {}

    def assess(
        self,
        group: WorkerGroup,
        lost: set[int],
        alive: dict[int, int],
        ring: Mapping[int, int],
        timeout: timedelta,
    ) -> dict[int, dict[str, int]]:
        """Ask each lost shard's live mirror holder what a restore would give (nothing is
        changed). A holder that dies meanwhile joins ``lost`` and leaves ``alive``."""
        return {}

    def pls(self, alive: Mapping[int, int], assessed: Mapping[int, dict[str, int]]) -> float:
        """The job's portion of lost samples if every restore assessed is accepted."""
        return 0.0

    def redundancy(
        self,
        ledger: RedundancyLedger,
        alive: Mapping[int, int],
        assessed: Mapping[int, dict[str, int]],
    ) -> Redundancy:
        """The planner's view of what survives among ``alive``, this layout's mirrors included."""
        return ledger.redundancy(
            alive,
            mirror_holder=self.mirror_holders(ledger.ring),
            mirror_stale={r: a["rows_stale"] > 0 for r, a in assessed.items()},
            pls=self.pls(alive, assessed),
            stand_ins=self.stand_ins(),
        )

    def stand_ins(self) -> dict[int, tuple[int, ...]]:
        """Rank -> the ranks whose snapshots restore it too (see `Redundancy.stand_ins`):
        none where every worker holds a state of its own (a shard)."""
        return {}

    def seed_mirrors(
        self,
        group: WorkerGroup,
        plan: RecoveryPlan | None,
        ring_before: Mapping[int, int],
        ring: Mapping[int, int],
        timeout: timedelta,
    ) -> int:
        """Seed the holders' mirrors (at the start: ``plan`` None; after a recovery).
        Returns bytes moved."""
        return 0

    def account(
        self,
        plan: RecoveryPlan,
        alive: Mapping[int, int],
        assessed: Mapping[int, dict[str, int]],
    ) -> dict[str, float] | None:
        """Book a finished recovery (partial restores); what the event reports, if any."""
        return None

    def states(self, group: WorkerGroup, timeout: timedelta) -> dict[tuple[int, int], Any]:
        """Every worker's state, keyed by (stage, replica), made current first.

        Raises:
            RecoveryInterrupted: if a worker is lost while its state is read.
        """
        self.before_states(group, timeout)
        got = require(group.call(StageWorker.state, timeout=timeout), "collect states")
        return {
            (self.topology.worker(rank).stage, self.topology.worker(rank).replica): state
            for rank, state in got.results.items()
        }

    def before_states(self, group: WorkerGroup, timeout: timedelta) -> None:
        """Make every worker's state current before it is read out (end of a job)."""

    def costs(self, group: WorkerGroup, timeout: timedelta) -> dict[str, float]:
        """What the redundancy costs per worker (mirror memory, traffic); empty: nothing."""
        return {}

    def _seed(
        self,
        group: WorkerGroup,
        plan: RecoveryPlan | None,
        holders: Mapping[int, int],
        targeted: bool,
        timeout: timedelta,
    ) -> int:
        """[Note: re-seeding mirrors]
        After a rollback (or the start) every mirror is re-seeded: the copies are from
        another timeline. After a recovery from mirrors (``shard_mirror``,
        ``embedding_partial``) on an unchanged ring only the replacements need one: every
        other mirror still matches its owner (a holder that restored a shard from its
        mirror holds exactly what it sent), so each replacement's ward sends it its shard.
        """
        flags: dict[int, tuple[bool, bool]] = {}
        ranks = None
        if targeted:
            assert plan is not None
            wards = {holder: ward for ward, holder in holders.items()}
            rebuilt = {a.rank for a in plan.actions}
            for rank in rebuilt:
                assert wards[rank] not in rebuilt, "planner invariant: the ward is alive"
                flags[wards[rank]] = (True, False)
                flags[rank] = (False, True)
            ranks = list(flags)
        sent = group.call(
            StageWorker.seed_mirror,
            ranks,
            (lambda r: flags[r]) if targeted else None,
            timeout=timeout,
        )
        require(sent, "seed the shard mirrors")
        return sum(int(v) for v in sent.results.values())


def _from_mirrors_only(plan: RecoveryPlan | None) -> bool:
    return (
        plan is not None
        and bool(plan.actions)
        and all(a.strategy in _FROM_MIRRORS for a in plan.actions)
    )


class ReplicatedStages(StateLayout):
    """Every replica of a stage holds the whole stage: a lost one is copied from a live one,
    and any replica's snapshot restores any other (they are bit-identical at every commit)."""

    def stand_ins(self) -> dict[int, tuple[int, ...]]:
        t = self.topology
        return {
            rank: tuple(r for r in t.stage_group(t.worker(rank).stage) if r != rank)
            for rank in range(t.world_size)
        }

    def validate(self, backend: str, device: str | None = None) -> None:
        if self.policy.fingerprint_every and self.topology.replicas < 2:
            raise ValueError(
                f"fingerprint_every={self.policy.fingerprint_every} needs two or more "
                f"replicas to compare, the job has {self.topology.replicas}"
            )
        if self.policy.elastic and self.topology.replicas < 2:
            raise ValueError(
                f"elastic=True needs two or more pipeline replicas (one to train on while "
                f"another is missing), the job has {self.topology.replicas}"
            )
        if self.policy.elastic and self.spec.shared_params is not None:
            raise ValueError(
                "elastic=True does not combine with parameters shared between stages "
                "(CheckFree+'s (de)embedding replicas): their group spans the missing "
                "workers; use approximate='checkfree' or elastic=False"
            )


class Zero1Shards(StateLayout):
    """ZeRO-1: each stage's optimizer sharded over its replicas; replica ``r``'s shard is
    mirrored on replica ``r+1`` of the same stage (a fixed ring, see parallelism/zero.py)."""

    def validate(self, backend: str, device: str | None = None) -> None:
        if self.policy.elastic:
            raise ValueError(
                "elastic=True does not combine with shard_optimizer (ZeRO-1): a missing "
                "replica's optimizer shard cannot be left out"
            )
        if self.policy.fingerprint_every:
            raise ValueError(
                "fingerprint_every does not combine with shard_optimizer (ZeRO-1): the "
                "replicas of a stage hold different optimizer shards, so they cannot vote"
            )
        if self.policy.approximate and not self.policy.exact_only:
            raise ValueError(
                "shard_optimizer (ZeRO-1) does not combine with approximate (CheckFree) "
                "recovery: a rebuilt stage has no optimizer shards to average"
            )

    def mirror_holders(self, ring: Mapping[int, int]) -> dict[int, int]:
        t = self.topology
        return {
            t.rank(s, r): t.rank(s, (r + 1) % t.replicas)
            for s in range(t.stages)
            for r in range(t.replicas)
        }

    def seed_mirrors(
        self,
        group: WorkerGroup,
        plan: RecoveryPlan | None,
        ring_before: Mapping[int, int],
        ring: Mapping[int, int],
        timeout: timedelta,
    ) -> int:
        targeted = _from_mirrors_only(plan)
        return self._seed(group, plan, self.mirror_holders(ring), targeted, timeout)

    def before_states(self, group: WorkerGroup, timeout: timedelta) -> None:
        # The parameters a replica does not own are a step behind until the next sync.
        synced = group.call(StageWorker.sync_params, timeout=timeout)
        require(synced, "sync parameters")


class ShardedTables(StateLayout):
    """Row-sharded embedding tables (`dlrm_spec`): every worker holds one shard of
    every table and a dense replica; each shard is mirrored on its ring buddy, and a lost
    shard comes back from the mirror, exact or partial (CPR). See recovery/worker/table.py."""

    worker_cls = TableWorker
    mirrors_on_ring = True

    def __init__(
        self, spec: TrainSpec, topology: Topology, policy: RecoveryPolicy, samples_per_step: int
    ) -> None:
        super().__init__(spec, topology, policy, samples_per_step)
        assert spec.tables is not None
        self.ledger = PLSLedger(
            lookups_per_sample=spec.tables.config.num_tables, samples_per_step=samples_per_step
        )

    def validate(self, backend: str, device: str | None = None) -> None:
        if self.policy.elastic:
            raise ValueError(
                "elastic=True does not combine with sharded embedding tables: every worker "
                "holds a shard nobody else trains"
            )
        if self.policy.fingerprint_every:
            raise ValueError(
                "fingerprint_every does not combine with sharded embedding tables: every "
                "worker holds a different shard, so there is nothing to vote on"
            )
        if backend != "gloo":
            raise ValueError(
                f"sharded embedding tables train on the CPU over Gloo, not {backend!r}"
            )
        if device not in (None, "cpu"):
            raise ValueError(
                f"sharded embedding tables (dlrm_spec) train on the CPU, not on "
                f"device {device!r}: leave device unset or 'cpu'"
            )

    def setup_args(self, rank: int, backend: str, device: str | None = None) -> tuple[Any, ...]:
        return (*super().setup_args(rank, backend, device), self.policy.mirrors.plan)

    def mirror_holders(self, ring: Mapping[int, int]) -> dict[int, int]:
        return dict(ring)

    def assess(
        self,
        group: WorkerGroup,
        lost: set[int],
        alive: dict[int, int],
        ring: Mapping[int, int],
        timeout: timedelta,
    ) -> dict[int, dict[str, int]]:
        step = max(alive.values(), default=0)
        answers: dict[int, dict[str, int]] = {}
        while True:
            holders = {
                r: ring[r] for r in lost if r not in answers and alive.get(ring.get(r, -1)) == step
            }
            got = group.gather(
                {r: group.submit(h, TableWorker.assess_mirror, r) for r, h in holders.items()},
                timeout,
            )
            answers.update(got.results)
            if not got.lost:
                return answers
            for ward in got.lost:  # the holder died meanwhile: lost too, and so is the mirror
                group.kill([holders[ward]])
                lost.add(holders[ward])
                alive.pop(holders[ward], None)

    def pls(self, alive: Mapping[int, int], assessed: Mapping[int, dict[str, int]]) -> float:
        if not assessed:
            return 0.0
        lost = sum(a["lost_lookups"] for a in assessed.values())
        return self.ledger.if_accepted(lost, committed=max(alive.values(), default=0))

    def seed_mirrors(
        self,
        group: WorkerGroup,
        plan: RecoveryPlan | None,
        ring_before: Mapping[int, int],
        ring: Mapping[int, int],
        timeout: timedelta,
    ) -> int:
        # The embedding ring follows the nodes and may have changed: then seed everyone.
        targeted = _from_mirrors_only(plan) and dict(ring_before) == dict(ring)
        return self._seed(group, plan, dict(ring), targeted, timeout)

    def account(
        self,
        plan: RecoveryPlan,
        alive: Mapping[int, int],
        assessed: Mapping[int, dict[str, int]],
    ) -> dict[str, float] | None:
        if plan.strategy in (Strategy.ROLLBACK, Strategy.RESTART):
            self.ledger.rolled_back(plan.resume_step)  # those steps' restores are gone too
            return None
        restored = {a.rank for a in plan.actions}
        used = {r: a for r, a in assessed.items() if r in restored}
        lookups = sum(a["lost_lookups"] for a in used.values())
        committed = max(alive.values(), default=0)
        event = self.ledger.accept(lookups, committed=committed, at=plan.resume_step)
        return {
            "rows_exact": sum(a["rows_exact"] for a in used.values()),
            "rows_stale": sum(a["rows_stale"] for a in used.values()),
            "lost_samples": event.lost_samples,
            "pls_event": event.pls_event,
            "pls_job": event.pls_job,
        }

    def costs(self, group: WorkerGroup, timeout: timedelta) -> dict[str, float]:
        got = group.call(TableWorker.mirror_costs, timeout=timeout)
        require(got, "collect mirror costs")
        costs = list(got.results.values())
        if not costs:
            return {}
        return {k: sum(c[k] for c in costs) / len(costs) for k in costs[0]}


def layout_for(
    spec: TrainSpec, topology: Topology, policy: RecoveryPolicy, samples_per_step: int
) -> StateLayout:
    """The layout of ``spec``'s state (``samples_per_step``: what `TrainSpec.check` gave)."""
    kind: type[StateLayout] = ReplicatedStages
    if spec.tables is not None:
        kind = ShardedTables
    elif spec.shard_optimizer:
        kind = Zero1Shards
    return kind(spec, topology, policy, samples_per_step)
