"""Elastic shrink and grow: training on without workers that cannot be replaced at once.

[Note: elastic shrink]
With ``RecoveryPolicy(elastic=True)`` a failure whose lost workers all have a live replica
of their stage does not wait for replacements that are not ready: no warm spare, so a cold
start would stall every survivor for seconds, or no room for one at all (a lost node, no
spare capacity). The job *shrinks*: the lost workers are left out ("missing"), the next
generation is formed over the others only, and training goes on at once.

The global batch does not change. A pipeline replica with a missing stage cannot run, so
each such *orphan* replica is adopted by a complete one (in turn, in replica order), whose
workers run the schedule once for their own microbatches and once for each adopted
replica's -- ``batches(step, r, R)`` is a pure function, and each share is seeded as its
own worker would seed it -- keeping the shares' gradients apart and adding them in share
order. The orphan replica's live workers run nothing but take part in their stage's
all-reduce with a zero gradient and apply the averaged update, so they stay exact and a
grow needs only the missing workers. The average is over the job's full replica count. So
every step is the failure-free step: bit for bit with two replicas (a sum of two numbers
is the same in either order, and adding a zero changes nothing); with three or more, the
additions run in another order than Gloo's ring, a rounding difference.

Meanwhile replacements are asked for as spares (placed wherever Ray finds room, warming
up in the background). At a step boundary, once a missing worker has a ready spare the job
*grows*: everyone leaves the shrunk generation, the spares take the missing ranks they
can, each is copied from a live replica of its stage (exact), and the next generation
forms -- the full one, or one still without those whose spare is not ready yet. Lost
workers with a ready spare come back at once in the recovery that shrinks for the others.
Both are `RecoveryEvent`s (strategies ``shrink`` and ``grow``; ``grow+shrink`` and
``replica_copy+shrink`` when some come back and some stay out).

Only what a shrink cannot lose is shrunk: every lost worker must be rebuildable from a
live replica (a plan of replica copies, nobody else restored), at least one pipeline must
stay complete, and the state must be replicated stages (no ZeRO-1 shards, sharded
tables or CheckFree+'s tied (de)embedding, whose groups span the missing). Otherwise the
recovery waits for replacements as without ``elastic``. While shrunk no snapshot is
taken (the missing workers' share of one would be missing); a failure then recovers from
live replicas, or rolls back to a snapshot taken before the shrink.
"""

from __future__ import annotations

from collections.abc import Collection

from parallelism.topology import Topology
from recovery.names import Strategy
from recovery.planner import RecoveryAction, RecoveryPlan

__all__ = ["complete_replicas", "grow_plan", "shares", "shrink_plan", "shrinkable"]


def complete_replicas(topology: Topology, missing: Collection[int]) -> list[int]:
    """The pipeline replicas none of whose stages is missing, in replica order."""
    return [
        r
        for r in range(topology.replicas)
        if not any(rank in missing for rank in topology.pipeline(r))
    ]


def shares(topology: Topology, missing: Collection[int]) -> dict[int, tuple[int, ...]]:
    """Each present rank's shares in a generation without ``missing``: the replicas whose
    microbatches it computes, its own first, then the orphans its pipeline adopts (orphan
    ``i`` goes to complete replica ``i mod len(complete)``); ``()`` for a live worker of
    an orphan replica. Empty without ``missing`` (every worker computes its own share).

    Raises:
        ValueError: if no pipeline is complete.
    """
    if not missing:
        return {}
    complete = complete_replicas(topology, missing)
    if not complete:
        raise ValueError("no pipeline replica is complete: nothing can run the steps")
    orphans = [r for r in range(topology.replicas) if r not in complete]
    adopted: dict[int, list[int]] = {r: [r] for r in complete}
    for i, orphan in enumerate(orphans):
        adopted[complete[i % len(complete)]].append(orphan)
    return {
        rank: tuple(adopted.get(topology.worker(rank).replica, ()))
        for rank in range(topology.world_size)
        if rank not in missing
    }


def shrinkable(topology: Topology, plan: RecoveryPlan, lost: Collection[int]) -> bool:
    """Whether the job can train on without ``lost``: the plan only copies the lost from
    live replicas (no rollback, no approximate rebuild) and some pipeline stays complete."""
    if not lost or not plan.actions:
        return False
    copies = (Strategy.REPLICA_COPY, Strategy.GROW)
    if any(a.strategy not in copies or a.rank not in lost for a in plan.actions):
        return False
    return bool(complete_replicas(topology, lost))


def shrink_plan(plan: RecoveryPlan, left_out: Collection[int]) -> RecoveryPlan:
    """``plan`` with the workers in ``left_out`` left out instead of rebuilt."""
    actions = tuple(
        RecoveryAction(a.rank, Strategy.SHRINK) if a.rank in left_out else a for a in plan.actions
    )
    return RecoveryPlan(
        actions=actions, resume_step=plan.resume_step, lost=plan.lost, tier=plan.tier
    )


def grow_plan(plan: RecoveryPlan) -> RecoveryPlan:
    """A replica-copy plan for workers a shrink left out, named for what it is: a grow."""
    actions = tuple(
        RecoveryAction(a.rank, Strategy.GROW, a.sources)
        if a.strategy == Strategy.REPLICA_COPY
        else a
        for a in plan.actions
    )
    return RecoveryPlan(
        actions=actions,
        resume_step=plan.resume_step,
        lost=plan.lost,
        tier=plan.tier,
        reason=plan.reason,
    )
