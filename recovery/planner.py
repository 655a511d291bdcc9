"""The recovery planner: a pure function from what was lost and what survives to a plan.

``plan(topology, lost, redundancy, policy) -> RecoveryPlan`` chooses, for every lost unit,
the first allowed source that exists in the recovery hierarchy (docs/DESIGN.md):

1. ``replica_copy``: a live replica of the same stage at the highest committed step (exact);
   where the state is sharded (ZeRO-1 optimizer shards, embedding-table shards), each
   lost shard comes from the ring neighbour that mirrors it instead (``shard_mirror``);
2. ``neighbor_average`` (CheckFree): a lost intermediate stage whose two neighbouring stages
   have live replicas is rebuilt as their gradient-norm-weighted average (approximate);
3. ``edge_copy`` (CheckFree+): a lost first/last stage is rebuilt from its swap partner,
   which has been trained to stand in for it (approximate);
4. ``rollback``: every worker restores the newest snapshot that exists for all of them --
   the peer-memory tier if the holders survived, else the durable tier (exact: the replay
   is deterministic, but the steps since the snapshot are redone).

The runtime only executes plans; it decides nothing the planner did not decide.
Invariants, property-tested in tests/test_planner.py:

- every lost worker gets exactly one action; a live worker gets one only in a plan that
  restores everyone (``rollback``, ``restart``);
- every source is alive, is not itself being rebuilt by the same plan, and is not one
  whose state already arrived corrupted in this recovery (``untrusted``);
- ``rollback`` is chosen if and only if some lost unit has no other allowed source, and
  its step has a live copy of every worker's state;
- ``RedundancyExhausted`` is raised if and only if some unit has no allowed source at all;
- an ``exact_only`` policy never yields an approximate action.

``corruption_plan`` is the plan for a fingerprint vote's verdict ([Note: fingerprint vote]
in recovery/integrity/fingerprint_vote.py): the odd replicas rebuilt from the majority, or
everyone rolled back to a snapshot taken when the replicas last agreed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from parallelism.topology import Topology
from recovery.errors import RedundancyExhausted
from recovery.integrity.fingerprint_vote import Verdict, can_vote
from recovery.names import APPROXIMATE, Mode, Strategy, Tier
from recovery.policy import RecoveryPolicy


@dataclass(frozen=True)
class Redundancy:
    """What survives a failure."""

    alive: Mapping[int, int]
    """Rank -> the number of steps that live worker has committed."""
    checkpoint_steps: tuple[int, ...] = ()
    """Steps at which a complete checkpoint exists (``restart`` only)."""
    peer_own: Mapping[int, Collection[int]] = field(default_factory=dict)
    """Rank -> snapshot steps of its own state that it keeps in memory."""
    peer_held: Mapping[int, Mapping[int, Collection[int]]] = field(default_factory=dict)
    """Holder rank -> ward rank -> snapshot steps of the ward's state the holder keeps."""
    durable_steps: tuple[int, ...] = ()
    """Steps with an intact, complete durable snapshot."""
    mirror_holder: Mapping[int, int] = field(default_factory=dict)
    """Rank -> the rank that mirrors its shard, for jobs whose state is sharded (ZeRO-1,
    embedding tables): such a worker can only come back from its mirror (or a rollback).
    Empty: nothing is sharded."""
    mirror_stale: Mapping[int, bool] = field(default_factory=dict)
    """Rank -> whether some rows of its mirrored (embedding) shard are not current: a
    restore from that mirror is partial. Missing: the mirror is exact."""
    pls: float = 0.0
    """The job's portion of lost samples if every partial restore of this failure is
    accepted (see recovery/strategies/embedding.py)."""
    untrusted: frozenset[int] = frozenset()
    """Live ranks whose state arrived corrupted at a receiver during this recovery (see
    [Note: checked transfers] in recovery/transport/process_group.py): never a source
    again in it."""
    stand_ins: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """Rank -> the ranks whose snapshots restore it too: the other replicas of its stage,
    where replicas hold bit-identical state (not when they hold different shards). Empty:
    a rank comes back from its own snapshot only."""


@dataclass(frozen=True)
class RecoveryAction:
    """Rebuild (or restore) worker ``rank`` with ``strategy`` from ``sources`` (global ranks).

    ``sources`` is empty where the worker restores from something it holds itself (its
    own peer snapshot) or from the durable tier.
    """

    rank: int
    strategy: Strategy
    sources: tuple[int, ...] = ()
    copy_of: int | None = None
    """A rollback from another replica's snapshot: that replica's rank (its state is this
    one's, bit for bit; see `Redundancy.stand_ins`). None: the worker's own snapshot."""


@dataclass(frozen=True)
class RecoveryPlan:
    """What to do: one action per rebuilt worker, and the step training resumes at."""

    actions: tuple[RecoveryAction, ...]
    resume_step: int
    lost: tuple[int, ...] = ()
    tier: Tier | None = None
    """For rollbacks: ``peer`` or ``durable``."""
    reason: str = ""
    """For rollbacks: why nothing less would do."""

    @property
    def strategy(self) -> str:
        """The strategies used, e.g. ``"replica_copy"`` or ``"neighbor_average+replica_copy"``."""
        return "+".join(sorted({a.strategy for a in self.actions})) or "none"

    @property
    def exact(self) -> bool:
        return not any(a.strategy in APPROXIMATE for a in self.actions)

    def describe(self, topology: Topology) -> str:
        tier = f" from the {self.tier} tier" if self.tier else ""
        lines = [f"recovery plan: resume at step {self.resume_step}{tier}"]
        if self.reason:
            lines.append(f"  because {self.reason}")
        for a in self.actions:
            src = ", ".join(str(topology.worker(s)) for s in a.sources) or "-"
            lines.append(f"  {topology.worker(a.rank)} <- {a.strategy} from {src}")
        return "\n".join(lines)


def plan(
    topology: Topology,
    lost: Collection[int],
    redundancy: Redundancy,
    policy: RecoveryPolicy,
    *,
    rollback_all: bool = False,
) -> RecoveryPlan:
    """Plan the recovery of the ``lost`` ranks.

    ``rollback_all`` asks for a rollback whatever was lost (a numerical fault: the live
    state itself is suspect).

    Raises:
        ValueError: if ``lost`` and ``redundancy.alive`` overlap or do not cover the job.
        RedundancyExhausted: naming each unit that has no allowed source, and the plan that
            could not be made.
    """
    lost_set = set(lost)
    alive = dict(redundancy.alive)
    everyone = set(range(topology.world_size))
    if lost_set & alive.keys():
        raise ValueError(f"ranks {sorted(lost_set & alive.keys())} are both lost and alive")
    if lost_set | alive.keys() != everyone:
        raise ValueError(
            f"ranks {sorted(everyone - lost_set - alive.keys())} are neither lost nor alive"
        )
    if not lost_set and not rollback_all:
        return RecoveryPlan(actions=(), resume_step=max(alive.values(), default=0))
    if policy.strategy == Mode.RESTART:
        return _restart(topology, lost_set, redundancy)

    step = max(alive.values(), default=0)
    current = {rank for rank, s in alive.items() if s == step} - redundancy.untrusted
    actions: list[RecoveryAction] = []
    unplanned: list[str] = []
    if not rollback_all:
        dead_stages = {
            s for s in range(topology.stages) if not set(topology.stage_group(s)) & current
        }
        for stage in range(topology.stages):
            group = topology.stage_group(stage)
            targets = sorted(r for r in group if r in lost_set)
            if not targets:
                continue
            if redundancy.mirror_holder:
                stage_actions = _from_mirrors(targets, redundancy, current, policy)
            else:
                stage_actions = _exact(topology, stage, targets, current, policy) or _approximate(
                    topology, stage, targets, current, dead_stages, policy
                )
            if stage_actions:
                actions.extend(stage_actions)
            elif redundancy.mirror_holder:
                unplanned.append(_why_mirror(topology, targets, redundancy, current, policy))
            else:
                distrusted = [r for r in topology.stage_group(stage) if r in redundancy.untrusted]
                unplanned.append(_why(topology, stage, targets, dead_stages, policy, distrusted))
    if not unplanned and not rollback_all:
        return RecoveryPlan(actions=tuple(actions), resume_step=step, lost=tuple(sorted(lost_set)))

    reason = (
        "the live state is suspect (a numerical fault, or an interrupted rollback)"
        if rollback_all
        else "; ".join(unplanned)
    )
    if not policy.allows(Strategy.ROLLBACK):
        raise RedundancyExhausted(
            f"no allowed source: {reason}. Rollback is not allowed by the policy."
        )
    return _rollback(topology, lost_set, redundancy, reason)


def _exact(
    topology: Topology, stage: int, targets: list[int], current: set[int], policy: RecoveryPolicy
) -> list[RecoveryAction]:
    sources = sorted(r for r in topology.stage_group(stage) if r in current)
    if not sources or not policy.allows(Strategy.REPLICA_COPY):
        return []
    # Spread the copies over the live replicas so no single source serialises them.
    return [
        RecoveryAction(rank=t, strategy=Strategy.REPLICA_COPY, sources=(sources[i % len(sources)],))
        for i, t in enumerate(targets)
    ]


def _partial_allowed(redundancy: Redundancy, policy: RecoveryPolicy) -> bool:
    """Whether stale rows may come back stale (CPR) rather than force a rollback."""
    from recovery.strategies.embedding import decide

    if policy.exact_only or not policy.allows(Strategy.EMBEDDING_PARTIAL):
        return False
    return (
        decide(policy.mirrors.embedding, pls=redundancy.pls, budget=policy.mirrors.pls_budget)
        == Strategy.EMBEDDING_PARTIAL
    )


def _from_mirrors(
    targets: list[int], redundancy: Redundancy, current: set[int], policy: RecoveryPolicy
) -> list[RecoveryAction]:
    """Each lost shard from the live, current worker that mirrors it: ``shard_mirror`` if
    the mirror is exact, ``embedding_partial`` if some rows are stale and the policy
    accepts that; [] if any target cannot come back this way."""
    holders = redundancy.mirror_holder
    actions = []
    for t in targets:
        if holders.get(t) not in current:
            return []
        if redundancy.mirror_stale.get(t, False):
            if not _partial_allowed(redundancy, policy):
                return []
            actions.append(
                RecoveryAction(rank=t, strategy=Strategy.EMBEDDING_PARTIAL, sources=(holders[t],))
            )
        elif policy.allows(Strategy.SHARD_MIRROR):
            actions.append(
                RecoveryAction(rank=t, strategy=Strategy.SHARD_MIRROR, sources=(holders[t],))
            )
        else:
            return []
    return actions


def _why_mirror(
    topology: Topology,
    targets: list[int],
    redundancy: Redundancy,
    current: set[int],
    policy: RecoveryPolicy,
) -> str:
    holders = redundancy.mirror_holder
    gone = [t for t in targets if holders.get(t) not in current]
    if gone:
        return "; ".join(
            f"the shard of {topology.worker(t)} is lost with its mirror on "
            f"{topology.worker(holders[t]) if t in holders else 'nobody'}"
            for t in gone
        )
    stale = [str(topology.worker(t)) for t in targets if redundancy.mirror_stale.get(t, False)]
    if stale and not _partial_allowed(redundancy, policy):
        why = (
            f"a portion of lost samples of {redundancy.pls:.4f} exceeds mirrors.pls_budget "
            f"{policy.mirrors.pls_budget}"
            if policy.mirrors.embedding == "partial" and not policy.exact_only
            else f"the policy (embedding={policy.mirrors.embedding!r}) demands exact rows"
        )
        return f"the mirrors of {', '.join(stale)} hold stale rows and {why}"
    return f"the policy does not allow {Strategy.SHARD_MIRROR}"


def _live_replica(topology: Topology, stage: int, current: set[int], index: int) -> int | None:
    live = sorted(r for r in topology.stage_group(stage) if r in current)
    return live[index % len(live)] if live else None


def _approximate(
    topology: Topology,
    stage: int,
    targets: list[int],
    current: set[int],
    dead_stages: set[int],
    policy: RecoveryPolicy,
) -> list[RecoveryAction]:
    """CheckFree(+) for a stage with no live replica; [] if not allowed or not possible.

    Every lost replica of the stage computes the same rebuild from the same sources (it is
    deterministic), so all replicas end identical without copying from each other.
    """
    if policy.exact_only or policy.approximate is None:
        return []
    last = topology.stages - 1
    if 0 < stage < last and policy.allows(Strategy.NEIGHBOR_AVERAGE):
        if stage - 1 in dead_stages or stage + 1 in dead_stages:
            return []  # adjacent lost stages: averaging needs both neighbours
        actions = []
        for i, t in enumerate(targets):
            prev = _live_replica(topology, stage - 1, current, i)
            nxt = _live_replica(topology, stage + 1, current, i)
            assert prev is not None and nxt is not None
            actions.append(
                RecoveryAction(rank=t, strategy=Strategy.NEIGHBOR_AVERAGE, sources=(prev, nxt))
            )
        return actions
    if (
        stage in (0, last)
        and policy.approximate == "checkfree+"
        and policy.allows(Strategy.EDGE_COPY)
    ):
        if topology.stages < 4:
            return []
        partner = 1 if stage == 0 else last - 1
        if partner in dead_stages:
            return []
        sources = sorted(r for r in topology.stage_group(partner) if r in current)
        return [
            RecoveryAction(
                rank=t, strategy=Strategy.EDGE_COPY, sources=(sources[i % len(sources)],)
            )
            for i, t in enumerate(targets)
        ]
    return []


def _why(
    topology: Topology,
    stage: int,
    targets: list[int],
    dead_stages: set[int],
    policy: RecoveryPolicy,
    distrusted: Collection[int] = (),
) -> str:
    lost = ", ".join(str(topology.worker(r)) for r in targets)
    text = f"stage {stage} lost all {topology.replicas} replica(s) ({lost})"
    if distrusted:
        names = ", ".join(str(topology.worker(r)) for r in distrusted)
        text = (
            f"stage {stage} has no trusted live replica for {lost} (the state of {names} "
            "arrived corrupted)"
        )
    if policy.exact_only or policy.approximate is None:
        return text + " and the policy allows no approximate rebuild"
    if stage in (0, topology.stages - 1) and policy.approximate != "checkfree+":
        return text + "; CheckFree cannot rebuild a first or last stage (CheckFree+ can)"
    neighbours = sorted({stage - 1, stage + 1} & dead_stages)
    if neighbours:
        return text + f" and neighbouring stage(s) {neighbours} are lost too"
    return text + " and no approximate rebuild applies"


def _rollback(
    topology: Topology, lost: set[int], redundancy: Redundancy, reason: str
) -> RecoveryPlan:
    """Everyone restores the newest snapshot that exists for every worker."""
    from recovery.snapshots import peer_rollback_step

    alive = set(redundancy.alive)
    untrusted = redundancy.untrusted
    holding = {h: wards for h, wards in redundancy.peer_held.items() if h not in untrusted}
    own = {r: set(s) for r, s in redundancy.peer_own.items()}
    # A replica whose live state arrived corrupted stands in for nobody in this recovery.
    stand_ins = {
        r: tuple(o for o in others if o not in untrusted)
        for r, others in redundancy.stand_ins.items()
    }
    peer = peer_rollback_step(
        alive,
        {h: {w: set(s) for w, s in wards.items()} for h, wards in holding.items()},
        own,
        topology.world_size,
        stand_ins,
    )
    durable = max(redundancy.durable_steps, default=None)
    if peer is None and durable is None:
        raise RedundancyExhausted(
            f"no allowed source: {reason}, and no snapshot survives for every worker "
            "(enable snapshots.peer_every / snapshots.durable_every, or keep a worker's "
            "snapshot buddy alive)."
        )
    if peer is not None and (durable is None or peer >= durable):
        actions = []
        for rank in range(topology.world_size):
            if rank in alive and peer in redundancy.peer_own.get(rank, ()):
                actions.append(RecoveryAction(rank=rank, strategy=Strategy.ROLLBACK))
                continue
            actions.append(_snapshot_source(rank, peer, alive, holding, own, stand_ins))
        return RecoveryPlan(
            tuple(actions),
            resume_step=peer,
            lost=tuple(sorted(lost)),
            tier=Tier.PEER,
            reason=reason,
        )
    assert durable is not None
    actions = [
        RecoveryAction(rank=r, strategy=Strategy.ROLLBACK) for r in range(topology.world_size)
    ]
    return RecoveryPlan(
        tuple(actions),
        resume_step=durable,
        lost=tuple(sorted(lost)),
        tier=Tier.DURABLE,
        reason=reason,
    )


def _snapshot_source(
    rank: int,
    step: int,
    alive: set[int],
    holding: Mapping[int, Mapping[int, Collection[int]]],
    own: Mapping[int, Collection[int]],
    stand_ins: Mapping[int, tuple[int, ...]],
) -> RecoveryAction:
    """Where ``rank`` (without its own copy) gets the snapshot of ``step`` from: its buddy's
    copy of it, else a stand-in's (a replica of its stage: a live one's own copy, or its
    buddy's copy of it). `peer_rollback_step` chose ``step`` so that one exists."""
    for copy in (rank, *stand_ins.get(rank, ())):
        holders = sorted(
            h for h, wards in holding.items() if h in alive and step in wards.get(copy, ())
        )
        if copy != rank and copy in alive and step in own.get(copy, ()):
            holders.insert(0, copy)
        if holders:
            return RecoveryAction(
                rank=rank,
                strategy=Strategy.ROLLBACK,
                sources=(holders[0],),
                copy_of=None if copy == rank else copy,
            )
    raise AssertionError(f"planner invariant: a snapshot of step {step} for rank {rank}")


def _restart(topology: Topology, lost: set[int], redundancy: Redundancy) -> RecoveryPlan:
    """Everyone restarts from the newest complete checkpoint (step 0: the initial state)."""
    resume = max(redundancy.checkpoint_steps, default=0)
    actions = tuple(
        RecoveryAction(rank=r, strategy=Strategy.RESTART) for r in range(topology.world_size)
    )
    return RecoveryPlan(actions=actions, resume_step=resume, lost=tuple(sorted(lost)))


def corruption_plan(
    topology: Topology,
    verdict: Verdict,
    *,
    step: int,
    verified: int,
    lost: Collection[int],
    redundancy: Redundancy,
    policy: RecoveryPolicy,
) -> RecoveryPlan:
    """The recovery from a mismatch found at ``step`` (last agreeing check at ``verified``).

    ``lost``: the workers taken out of the job (the suspects, when `can_vote`; more when a
    recovery was interrupted). Either each suspect is rebuilt from its stage's majority
    (``replica_vote``, resume at ``step``), or everyone rolls back to the newest snapshot
    at or before ``verified``.

    Raises:
        RedundancyExhausted: if a rollback is needed and no snapshot at or before
            ``verified`` survives for every worker (or the policy forbids rollback).
    """
    lost_set = set(lost)
    if can_vote(verdict, step, verified, policy) and lost_set == set(verdict.suspects):
        actions: list[RecoveryAction] = []
        for rank in verdict.suspects:
            stage = topology.worker(rank).stage
            sources = [
                r
                for r in verdict.majority[stage]
                if redundancy.alive.get(r) == step
                and r not in lost_set
                and r not in redundancy.untrusted
            ]
            if not sources:
                break
            actions.append(
                RecoveryAction(
                    rank=rank,
                    strategy=Strategy.REPLICA_VOTE,
                    sources=(sources[len(actions) % len(sources)],),
                )
            )
        else:
            return RecoveryPlan(tuple(actions), resume_step=step, lost=tuple(sorted(lost_set)))
    return plan(topology, lost_set, clean_before(redundancy, verified), policy, rollback_all=True)


def clean_before(redundancy: Redundancy, verified: int) -> Redundancy:
    """``redundancy`` without the snapshots newer than ``verified`` (they may hold a
    corrupted state, or one trained on corrupted gradients)."""
    return dataclasses.replace(
        redundancy,
        peer_own={
            r: [s for s in steps if s <= verified] for r, steps in redundancy.peer_own.items()
        },
        peer_held={
            h: {w: [s for s in steps if s <= verified] for w, steps in wards.items()}
            for h, wards in redundancy.peer_held.items()
        },
        durable_steps=tuple(s for s in redundancy.durable_steps if s <= verified),
        checkpoint_steps=tuple(s for s in redundancy.checkpoint_steps if s <= verified),
    )
